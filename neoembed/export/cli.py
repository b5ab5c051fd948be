"""``neoembed export MODEL OUT --format onnx [--quantize int8] [--overwrite]``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def export_command(
    model: Annotated[
        str, typer.Argument(help="Model to export (folder or hub id; anything neoembed.load opens).")
    ],
    out: Annotated[
        Path, typer.Argument(help="New or empty output folder (or a finished export, with --overwrite).")
    ],
    format: Annotated[str, typer.Option("--format", help="Export format: onnx.")] = "onnx",
    quantize: Annotated[
        str | None, typer.Option("--quantize", help="Also write a dynamic int8 graph (ONNX Runtime): int8.")
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace the finished export that OUT holds.")
    ] = False,
) -> None:
    """Export MODEL to OUT/onnx/model.onnx (+ model_qint8_<isa>.onnx) beside the sentence-transformers files."""
    from neoembed.export.onnx import FORMATS, QUANTIZATIONS, export
    from neoembed.runs import output_lock

    if format not in FORMATS:
        raise typer.BadParameter(f"{format!r}: choose one of {', '.join(FORMATS)}", param_hint="--format")
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise typer.BadParameter(
            f"{quantize!r}: choose one of {', '.join(QUANTIZATIONS)}", param_hint="--quantize"
        )
    with output_lock(out, what="OUT"):  # a second export into this folder is refused before it touches it
        record = export(model, out, fmt=format, quantize=quantize, overwrite=overwrite)
    typer.echo(f"wrote {', '.join(record['files'])} in {out}")
    if not record["packed"]:
        typer.echo(f"no packed graph for this model: {record['packed_not_written']}")
