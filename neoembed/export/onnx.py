"""Export a sentence-transformers model (NeoBERT or any Hugging Face encoder) to ONNX, fp32 and dynamic int8.

The output is the saved sentence-transformers folder (modules.json, Pooling, Normalize, tokenizer, config,
weights) plus ``onnx/model.onnx`` (and ``onnx/model_qint8_<isa>.onnx``), where sentence-transformers' ONNX
backend looks. The graph maps ``input_ids`` / ``attention_mask`` (and ``token_type_ids`` where the tokenizer
makes them) to ``last_hidden_state`` with dynamic batch and length; Pooling and Normalize run as the saved
modules, as in sentence-transformers' own ONNX export.

NeoBERT is traced in its padded layout (``padding_free=False``): the padding-free layout reads the lengths on
the host, which a static graph cannot do. The exporter is torch's ``torch.export``-based one (``dynamo=True``):
the TorchScript exporter has no ONNX op for the rotary embedding's ``view_as_complex``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from neoembed.export.runtime import DEFAULT_FILE, ONNX_SUBFOLDER, OUTPUT_NAME
from neoembed.loading import load

FORMATS = ("onnx",)
QUANTIZATIONS = ("int8",)
EXPORT_RECORD = "export.json"


class ExportFolderError(ValueError):
    """OUT already holds something: an export is written into a new or empty folder only."""


def check_output(out: Path) -> None:
    """Refuse an OUT that holds anything (another export, a model, a run): exports never overwrite."""
    if out.exists() and not out.is_dir():
        raise ExportFolderError(f"OUT {out} is a file: choose a new folder")
    if out.exists() and any(out.iterdir()):
        other = "another export" if (out / ONNX_SUBFOLDER).exists() else "files"
        raise ExportFolderError(f"OUT {out} already holds {other}: choose a new or empty folder")


def isa_suffix() -> str:
    """sentence-transformers' int8 file suffix for this CPU (``avx512_vnni``, ``avx512``, ``avx2``, ``arm64``)."""
    import platform

    flags = _cpu_flags()
    if platform.machine().lower() in ("arm64", "aarch64"):
        return "arm64"
    for isa in ("avx512_vnni", "avx512f", "avx2"):
        if isa in flags:
            return isa.removesuffix("f")
    return "avx2"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {
        flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":")[1].split()
    }


class _Backbone(torch.nn.Module):
    """The Transformer module's model as a function of tensors to the last hidden state."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state


def _input_names(model) -> tuple[str, ...]:
    produced = set(model[0].tokenizer.model_input_names)
    return tuple(n for n in ("input_ids", "attention_mask", "token_type_ids") if n in produced)


def _example(names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(1000, 2000, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    return tuple(given[n] for n in names)


def export_graph(model, path: Path) -> tuple[str, ...]:
    """Write the model's Transformer module as an ONNX graph (dynamic batch and length); returns its inputs."""
    auto = model[0].auto_model.eval()
    config = auto.config
    padding_free = getattr(config, "padding_free", None)
    if padding_free is not None:
        config.padding_free = False
    names = _input_names(model)
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    try:
        with torch.no_grad():
            program = torch.onnx.export(
                _Backbone(auto),
                _example(names),
                dynamo=True,
                input_names=list(names),
                output_names=[OUTPUT_NAME],
                dynamic_shapes={name: {0: batch, 1: length} for name in names},
                optimize=True,
                verbose=False,
            )
    finally:
        if padding_free is not None:
            config.padding_free = padding_free
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path), external_data=False)
    return names


def quantize_int8(src: Path, dst: Path) -> None:
    """ONNX Runtime's dynamic int8 quantization: weights int8 with one scale per output channel, activations
    quantized at run time. sentence-transformers' ``export_dynamic_quantized_onnx_model`` defaults to one scale per
    tensor, which on the quickstart's fine-tuned all-MiniLM-L6-v2 lost 1.1 to 1.9 points on six of the eight local
    tasks; per channel kept every task within 0.5 (``benchmarks/onnx_int8_quality.py``)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True, reduce_range=False)


def export(
    model_path: str, out: str | Path, fmt: str = "onnx", quantize: str | None = None
) -> dict[str, Any]:
    """Export MODEL (anything :func:`neoembed.load` opens) to OUT; returns what was written (also in
    ``OUT/export.json``)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown --format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(f"unknown --quantize {quantize!r}: choose one of {', '.join(QUANTIZATIONS)}")
    out = Path(out)
    check_output(out)
    model = load(model_path, device="cpu")
    try:
        return _write(model, str(model_path), out, fmt, quantize)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # OUT was new or empty: leave no half export behind
        raise


def _write(model, model_path: str, out: Path, fmt: str, quantize: str | None) -> dict[str, Any]:
    model.save(str(out))
    graph = out / ONNX_SUBFOLDER / DEFAULT_FILE
    names = export_graph(model, graph)
    files = [f"{ONNX_SUBFOLDER}/{DEFAULT_FILE}"]
    if quantize == "int8":
        name = f"model_qint8_{isa_suffix()}.onnx"
        quantize_int8(graph, graph.with_name(name))
        files.append(f"{ONNX_SUBFOLDER}/{name}")
    record = {"model": model_path, "format": fmt, "quantize": quantize, "inputs": names, "files": files}
    (out / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record
