"""``neoembed mine CARD --model MODEL --out DIR``: hard negatives written as a data card."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

_RANK = "Ranks"
_FILTER = "Filters"
_INDEX = "Index"
_RUN = "Run"


def mine_command(
    card: Annotated[
        str, typer.Argument(help="Data card (path or shipped name) whose queries get negatives.")
    ],
    model: Annotated[str, typer.Option("--model", help="Embedding model (folder or hub id) used to mine.")],
    out: Annotated[Path, typer.Option("--out", help="Output folder (must be empty unless --resume).")],
    corpus: Annotated[
        str | None, typer.Option("--corpus", help="Another card whose documents join the card's positives.")
    ] = None,
    card_dir: Annotated[
        list[str] | None, typer.Option("--card-dir", help="Folder searched for card names (repeatable).")
    ] = None,
    num_negatives: Annotated[int, typer.Option("--num-negatives", "-k", rich_help_panel=_RANK)] = 5,
    range_min: Annotated[
        int, typer.Option("--range-min", help="Skip the most similar ranks (0 = top).", rich_help_panel=_RANK)
    ] = 0,
    range_max: Annotated[
        int, typer.Option("--range-max", help="Search depth: ranks below this.", rich_help_panel=_RANK)
    ] = 30,
    max_fraction: Annotated[
        float | None,
        typer.Option(
            "--max-fraction",
            help="Keep scores <= pos - (1-f)*|pos| (0.95: NV-Retriever's TopK-PercPos); 1 disables.",
            rich_help_panel=_FILTER,
        ),
    ] = 0.95,
    margin: Annotated[
        float | None,
        typer.Option("--margin", help="Keep scores <= positive score - margin.", rich_help_panel=_FILTER),
    ] = None,
    max_score: Annotated[
        float | None, typer.Option("--max-score", help="Keep scores <= this.", rich_help_panel=_FILTER)
    ] = None,
    duplicate_threshold: Annotated[
        float,
        typer.Option(
            "--duplicate-threshold",
            help="Cosine to a positive that marks a near-duplicate.",
            rich_help_panel=_FILTER,
        ),
    ] = 0.98,
    cross_encoder: Annotated[
        str | None,
        typer.Option(
            "--cross-encoder", help="Rescore candidates with this cross-encoder.", rich_help_panel=_FILTER
        ),
    ] = None,
    index: Annotated[
        str, typer.Option("--index", help="flat (exact), ivf, hnsw or ivfpq.", rich_help_panel=_INDEX)
    ] = "flat",
    nlist: Annotated[int | None, typer.Option("--nlist", rich_help_panel=_INDEX)] = None,
    nprobe: Annotated[int, typer.Option("--nprobe", rich_help_panel=_INDEX)] = 16,
    pq_m: Annotated[
        int, typer.Option("--pq-m", help="ivfpq: bytes per document.", rich_help_panel=_INDEX)
    ] = 16,
    hnsw_m: Annotated[int, typer.Option("--hnsw-m", rich_help_panel=_INDEX)] = 32,
    ef_search: Annotated[int, typer.Option("--ef-search", rich_help_panel=_INDEX)] = 128,
    gpu: Annotated[
        str, typer.Option("--gpu", help="auto, on or off (faiss-gpu index).", rich_help_panel=_INDEX)
    ] = "auto",
    shard_size: Annotated[
        int, typer.Option("--shard-size", help="Documents per embedding shard on disk.", rich_help_panel=_RUN)
    ] = 50_000,
    batch_size: Annotated[int, typer.Option("--batch-size", rich_help_panel=_RUN)] = 64,
    max_length: Annotated[int, typer.Option("--max-length", rich_help_panel=_RUN)] = 256,
    max_rows: Annotated[int | None, typer.Option("--max-rows", rich_help_panel=_RUN)] = None,
    workers: Annotated[
        int, typer.Option("--workers", help="Encoding processes (CPU) or GPUs.", rich_help_panel=_RUN)
    ] = 1,
    name: Annotated[
        str | None, typer.Option("--name", help="Name of the written card.", rich_help_panel=_RUN)
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue an interrupted run in --out.", rich_help_panel=_RUN)
    ] = False,
) -> None:
    """Mine hard negatives for a card with faiss; write OUT/<name>.yaml (a training card) and OUT/<name>.jsonl."""
    from pydantic import ValidationError

    from neoembed.mine.miner import MineConfig, mine_negatives
    from neoembed.recipe import format_validation_error

    settings = dict(
        num_negatives=num_negatives, range_min=range_min, range_max=range_max,
        max_fraction=None if max_fraction in (None, 1.0) else max_fraction, margin=margin, max_score=max_score,
        duplicate_threshold=duplicate_threshold, cross_encoder=cross_encoder, index=index, nlist=nlist,
        nprobe=nprobe, pq_m=pq_m, hnsw_m=hnsw_m, ef_search=ef_search, gpu=gpu, shard_size=shard_size,
        batch_size=batch_size, max_length=max_length, max_rows=max_rows, workers=workers, name=name,
    )  # fmt: skip
    try:
        config = MineConfig(**settings)
    except ValidationError as e:
        raise ValueError(format_validation_error(e, MineConfig, "neoembed mine options")) from None
    result = mine_negatives(
        card, model, out, corpus=corpus, config=config, resume=resume, card_dirs=card_dir or []
    )
    c = result.counts
    typer.echo(
        f"wrote {result.card} and {result.data.name}: {c['rows_written']} of {c['rows_in']} rows "
        f"({c['rows_dropped_too_few_negatives']} left out: fewer than {num_negatives} negatives)"
    )
    typer.echo("candidates: " + ", ".join(f"{k} {v}" for k, v in c["candidates"].items()))
    typer.echo(f"train on it: neoembed train RECIPE 'datasets=[{{card: {result.card}}}]'")
