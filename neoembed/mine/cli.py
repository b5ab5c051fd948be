"""``neoembed mine CARD --model MODEL --out DIR``: hard negatives written as a data card."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def _opt(flag: str, help: str | None = None, panel: str | None = None, *aliases: str):
    return typer.Option(flag, *aliases, help=help, rich_help_panel=panel)


# the options, declared once here so that the command's signature stays readable
Card = Annotated[str, typer.Argument(help="Data card (path or shipped name) whose queries get negatives.")]
Model = Annotated[str, _opt("--model", "Embedding model (folder or hub id) used to mine.")]
Out = Annotated[Path, _opt("--out", "Output folder (must be empty unless --resume or --overwrite).")]
Corpus = Annotated[str | None, _opt("--corpus", "Another card whose documents join the card's positives.")]
CardDir = Annotated[list[str] | None, _opt("--card-dir", "Folder searched for card names (repeatable).")]
NumNegatives = Annotated[int, _opt("--num-negatives", "Hard negatives kept per query.", "Ranks", "-k")]
RangeMin = Annotated[int, _opt("--range-min", "Skip the most similar ranks (0 = top).", "Ranks")]
RangeMax = Annotated[int, _opt("--range-max", "Search depth: ranks below this.", "Ranks")]
MaxFraction = Annotated[
    float | None,
    _opt(
        "--max-fraction",
        "Keep scores <= pos - (1-f)*|pos| (0.95: NV-Retriever's TopK-PercPos); 1 disables.",
        "Filters",
    ),
]
Margin = Annotated[float | None, _opt("--margin", "Keep scores <= positive score - margin.", "Filters")]
MaxScore = Annotated[float | None, _opt("--max-score", "Keep scores <= this.", "Filters")]
DupThreshold = Annotated[
    float, _opt("--duplicate-threshold", "Cosine to a positive that marks a near-duplicate.", "Filters")
]
CrossEncoderPath = Annotated[
    str | None, _opt("--cross-encoder", "Rescore candidates with this cross-encoder.", "Filters")
]
Index = Annotated[str, _opt("--index", "flat (exact), ivf, hnsw, ivfpq, binary or int8.", "Index")]
Rescore = Annotated[
    int, _opt("--rescore", "binary/int8/ivfpq: rescore N x range-max nearest codes with float embeddings.", "Index")
]
NList = Annotated[int | None, _opt("--nlist", "ivf/ivfpq lists (default ~4 sqrt(N)).", "Index")]
NProbe = Annotated[int, _opt("--nprobe", "ivf/ivfpq lists searched.", "Index")]
PqM = Annotated[int, _opt("--pq-m", "ivfpq: bytes per document.", "Index")]
HnswM = Annotated[int, _opt("--hnsw-m", "hnsw: links per node.", "Index")]
EfSearch = Annotated[int, _opt("--ef-search", "hnsw: search breadth.", "Index")]
Gpu = Annotated[str, _opt("--gpu", "auto, on or off (faiss-gpu index).", "Index")]
ShardSize = Annotated[int, _opt("--shard-size", "Documents per embedding shard on disk.", "Run")]
BatchSize = Annotated[
    int,
    _opt(
        "--batch-size",
        "score: pairs per cross-encoder batch. mine: unused, warned (--max-batch-tokens sizes its batches).",
        "Run",
    ),
]
MaxLength = Annotated[int, _opt("--max-length", "Tokens kept of each text (longer ones are truncated).", "Run")]
MaxBatchTokens = Annotated[
    int | None,
    typer.Option(
        "--max-batch-tokens",
        min=1,
        help="Tokens per encoding batch, texts sorted by length (default 8192 on CPU, 65536 on CUDA).",
        rich_help_panel="Run",
    ),
]
MaxRows = Annotated[
    int | None,
    _opt(
        "--max-rows",
        "A seeded random sample of N of the card's rows, mined against their own positives only (easier "
        "negatives); add --corpus CARD (the same card) to search the whole card's.",
        "Run",
    ),
]
ScoreMaxRows = Annotated[int | None, _opt("--max-rows", "A seeded random sample of N of the card's rows.", "Run")]
Workers = Annotated[int, _opt("--workers", "Encoding processes (CPU) or GPUs.", "Run")]
Name = Annotated[str | None, _opt("--name", "Name of the written card.", "Run")]
Settings = Annotated[
    list[str] | None,
    typer.Argument(
        help="Settings as key=value (the keys of --config; num_negatives=3 range_max=50), over options and --config.",
        show_default=False,
    ),
]
ConfigFile = Annotated[
    Path | None,
    _opt("--config", "YAML of mining settings (num_negatives, index, ...); options and key=value override it.", "Run"),
]
Resume = Annotated[bool, _opt("--resume", "Continue an interrupted run in --out.", "Run")]
Overwrite = Annotated[bool, _opt("--overwrite", "Replace the run (mining or scoring) in a non-empty --out.", "Run")]


def mine_command(
    ctx: typer.Context,
    card: Card,
    model: Model,
    out: Out,
    settings: Settings = None,
    config: ConfigFile = None,
    corpus: Corpus = None,
    card_dir: CardDir = None,
    num_negatives: NumNegatives = 5,
    range_min: RangeMin = 0,
    range_max: RangeMax = 30,
    max_fraction: MaxFraction = 0.95,
    margin: Margin = None,
    max_score: MaxScore = None,
    duplicate_threshold: DupThreshold = 0.98,
    cross_encoder: CrossEncoderPath = None,
    index: Index = "flat",
    nlist: NList = None,
    nprobe: NProbe = 16,
    pq_m: PqM = 16,
    hnsw_m: HnswM = 32,
    ef_search: EfSearch = 128,
    rescore: Rescore = 4,
    gpu: Gpu = "auto",
    shard_size: ShardSize = 50_000,
    batch_size: BatchSize = 64,
    max_batch_tokens: MaxBatchTokens = None,
    max_length: MaxLength = 256,
    max_rows: MaxRows = None,
    workers: Workers = 1,
    name: Name = None,
    resume: Resume = False,
    overwrite: Overwrite = False,
) -> None:
    """Mine hard negatives for a card with faiss; write OUT/<name>.yaml (a training card) and OUT/<name>.jsonl.

    Settings, lowest first: defaults, --config, the options given, key=value (not one key both ways)."""
    flags = dict(
        num_negatives=num_negatives, range_min=range_min, range_max=range_max,
        max_fraction=max_fraction, margin=margin, max_score=max_score,
        duplicate_threshold=duplicate_threshold, cross_encoder=cross_encoder, index=index, nlist=nlist,
        nprobe=nprobe, pq_m=pq_m, hnsw_m=hnsw_m, ef_search=ef_search, rescore=rescore, gpu=gpu,
        shard_size=shard_size, batch_size=batch_size, max_batch_tokens=max_batch_tokens, max_length=max_length,
        max_rows=max_rows, workers=workers, name=name,
    )  # fmt: skip
    from neoembed.mine.miner import MineConfig, mine_negatives
    from neoembed.recipe import command_settings, given_on_command_line

    cfg = command_settings(MineConfig, config, given_on_command_line(ctx, flags), settings or [])
    from neoembed.runs import output_lock

    with output_lock(out, what="--out"):
        result = mine_negatives(
            card, model, out, corpus=corpus, config=cfg, resume=resume, overwrite=overwrite,
            card_dirs=card_dir or [],
        )  # fmt: skip
    c = result.counts
    said = "holds (nothing written)" if result.reused else "wrote"
    typer.echo(
        f"{said} {result.card} and {result.data.name}: {c['rows_written']} of {c['rows_in']} rows "
        f"({c['rows_dropped_too_few_negatives']} left out: fewer than {cfg.num_negatives} negatives)"
    )
    typer.echo("candidates: " + ", ".join(f"{k} {v}" for k, v in c["candidates"].items()))
    typer.echo(f"train on it: neoembed train RECIPE 'datasets=[{{card: {result.card}}}]'")


Teacher = Annotated[
    str, _opt("--teacher", "Cross-encoder or bi-encoder (folder or hub id) whose scores to add.")
]
Kind = Annotated[str, _opt("--kind", "auto (from the folder), cross-encoder or bi-encoder.")]
MaxNegatives = Annotated[
    int | None, _opt("--max-negatives", "Score at most this many negatives per row.", "Run")
]
ScoreShard = Annotated[int, _opt("--shard-size", "Rows per shard on disk (what --resume skips).", "Run")]


def score_command(
    card: Annotated[
        str, typer.Argument(help="Data card (path or shipped name) whose rows get teacher scores.")
    ],
    teacher: Teacher,
    out: Out,
    kind: Kind = "auto",
    card_dir: CardDir = None,
    batch_size: BatchSize = 64,
    max_batch_tokens: MaxBatchTokens = None,
    max_length: MaxLength = 512,
    max_rows: ScoreMaxRows = None,
    max_negatives: MaxNegatives = None,
    shard_size: ScoreShard = 10_000,
    name: Name = None,
    resume: Resume = False,
    overwrite: Overwrite = False,
) -> None:
    """Add a teacher's scores (positive, then each hard negative) to a card's rows: OUT/<name>.yaml + .jsonl."""
    from pydantic import ValidationError

    from neoembed.mine.score import ScoreConfig, score_card
    from neoembed.recipe import format_validation_error

    settings = dict(
        kind=kind, batch_size=batch_size, max_batch_tokens=max_batch_tokens, max_length=max_length, max_rows=max_rows, max_negatives=max_negatives,
        shard_size=shard_size, name=name,
    )  # fmt: skip
    try:
        config = ScoreConfig(**settings)
    except ValidationError as e:
        raise ValueError(format_validation_error(e, ScoreConfig, "neoembed score options")) from None
    from neoembed.runs import output_lock

    # a second scoring run (or resume) into this folder is refused before it touches it
    with output_lock(out, what="--out"):
        result = score_card(
            card, teacher, out, config=config, resume=resume, overwrite=overwrite, card_dirs=card_dir or []
        )
    said = "holds (nothing written)" if result.reused else "wrote"
    typer.echo(f"{said} {result.card} and {result.data.name}: {result.rows} rows scored by a {result.kind}")
    typer.echo(
        f"distil from it: neoembed train RECIPE 'datasets=[{{card: {result.card}}}]' distillation.loss=margin_mse"
    )
