"""``neoembed mteb``: evaluate a model; ``neoembed mteb compare RUN…``: compare runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="MTEB evaluation (default suite: MTEB(eng, v1)); `neoembed mteb compare RUN...` compares runs.",
    invoke_without_command=True,
    no_args_is_help=False,
)


Instructions = Annotated[
    str,
    typer.Option(
        "--instructions",
        help="released (the NeoBERT evaluation config, default) | paper (Tables 8-9 as printed) | none | FILE",
    ),
]
QueryPrompt = Annotated[
    str,
    typer.Option(
        "--query-prompt",
        help="Where a task gives no instruction, the prompt before its queries (retrieval, reranking): saved (the "
        "model's own saved `query` prompt, default) | none | TEXT (that text, as written).",
    ),
]
Output = Annotated[
    Path | None,
    typer.Option(
        "--output",
        help="Results folder, one model's scores only (default results/<model name>-<hash of its path>).",
    ),
]
Overwrite = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Re-run tasks that already have results; for another model's results folder, replace them.",
    ),
]
CdeContext = Annotated[
    str,
    typer.Option(
        "--cde-context",
        help="CDE models: 'corpus' (a seeded sample of N texts of each task) or 'null' (the learned null context).",
    ),
]

EmbeddingPrecision = Annotated[
    str,
    typer.Option(
        "--embedding-precision",
        help="fp32 | int8 | binary: score quantized embeddings (mteb's CompressionWrapper).",
    ),
]
Rescore = Annotated[
    int | None,
    typer.Option(
        "--rescore",
        min=1,
        help="With int8|binary: retrieval/reranking take the N x 10 nearest quantized documents and rescore them "
        "with the float query (other task types: not applied, said in the summary).",
    ),
]
RescoreDocs = Annotated[
    str,
    typer.Option(
        "--rescore-docs",
        help="quantized (the codes, as sentence-transformers' semantic_search_faiss) | float (float documents).",
    ),
]

Backend = Annotated[
    str,
    typer.Option(
        "--backend",
        help="torch | onnx: a folder written by `neoembed export`, served by ONNX Runtime (CPU).",
    ),
]
OnnxFile = Annotated[
    str | None,
    typer.Option(
        "--onnx-file",
        help="With --backend onnx: the graph in the folder's onnx/ (default model.onnx), e.g. model_qint8_avx512_vnni.onnx.",
    ),
]
Quantize = Annotated[
    str | None,
    typer.Option(
        "--quantize",
        help="int8: the torch model's linear layers in dynamic int8 (CPU; see neoembed.export.torch_int8).",
    ),
]

ConfigFile = Annotated[
    Path | None,
    typer.Option(
        "--config", help="A YAML file of settings, one key per option (task_types, batch_size, ...)."
    ),
]
SetKeys = Annotated[
    list[str] | None,
    typer.Option("--set", help="key=value: one setting over the options and --config (repeatable)."),
]

MaxBatchTokens = Annotated[
    int | None,
    typer.Option(
        "--max-batch-tokens",
        min=1,
        help="Tokens per encoding batch, texts sorted by length (default 8192 on CPU, 65536 on CUDA).",
    ),
]


@app.callback()
def mteb_command(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option("--model", help="Model folder or hub id.")] = None,
    tasks: Annotated[
        str | None, typer.Option("--tasks", help="Comma-separated mteb task names or task cards.")
    ] = None,
    task_types: Annotated[str | None, typer.Option("--task-types", help="e.g. STS,Retrieval")] = None,
    benchmark: Annotated[str | None, typer.Option("--benchmark", help='Default "MTEB(eng, v1)".')] = None,
    precision: Annotated[
        str | None, typer.Option("--precision", help="fp16|bf16|fp32 (default fp16 on CUDA, fp32 on CPU).")
    ] = None,
    instructions: Instructions = "released",
    query_prompt: QueryPrompt = "saved",
    batch_size: Annotated[
        int, typer.Option("--batch-size", min=1, help="Texts per mteb data chunk (--max-batch-tokens sizes encoding).")
    ] = 32,
    max_batch_tokens: MaxBatchTokens = None,
    max_length: Annotated[
        int | None,
        typer.Option("--max-length", min=1, help="Tokens kept of each text (default: the model's max_seq_length)."),
    ] = None,
    truncate_dim: Annotated[
        int | None,
        typer.Option("--truncate-dim", min=1, help="Evaluate the first N dimensions (Matryoshka)."),
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="Serve task T from DIR/T/ (no hub).")
    ] = None,
    output: Output = None,
    overwrite: Overwrite = False,
    seed: Annotated[
        int,
        typer.Option(
            "--seed",
            min=0,
            help="Draws a CDE model's context sample. mteb's own subsampling (classification, clustering) keeps "
            "each task's seed, 42, as its published scores do.",
        ),
    ] = 42,
    device: Annotated[
        str | None, typer.Option("--device", help="cpu, cuda or cuda:N (default: cuda if available).")
    ] = None,
    cde_context: CdeContext = "corpus",
    embedding_precision: EmbeddingPrecision = "fp32",
    rescore: Rescore = None,
    rescore_docs: RescoreDocs = "quantized",
    backend: Backend = "torch",
    onnx_file: OnnxFile = None,
    quantize: Quantize = None,
    config: ConfigFile = None,
    set_: SetKeys = None,
) -> None:
    """Evaluate MODEL on MTEB tasks and write per-task JSON plus a Table-4 style summary.

    Settings, lowest first: defaults, --config, the options given, --set key=value (not one key both ways)."""
    parameters = dict(locals())  # the options as called, before any other name is bound here
    if ctx.invoked_subcommand is not None:
        return
    from neoembed.eval.config import MtebSettings
    from neoembed.recipe import command_settings, given_on_command_line

    options = {k: v for k, v in parameters.items() if k in MtebSettings.model_fields}
    given = given_on_command_line(ctx, options)
    settings = command_settings(MtebSettings, config, given, set_ or [])
    if settings.model is None:
        typer.echo(ctx.get_help())
        typer.echo("\nerror: --model is required (or model: in the --config file)", err=True)
        raise typer.Exit(2)
    _evaluate(settings)


def _evaluate(s) -> None:
    """The run of ``neoembed mteb`` with settings ``s`` (:class:`~neoembed.eval.config.MtebSettings`): every option
    checked before anything loads, the results folder claimed, then the tasks."""
    from neoembed.eval.config import EvalConfig
    from neoembed.runs import claim_results_dir, default_results_dir, output_lock

    _check_options(
        s.model, s.device, s.precision, s.embedding_precision, s.rescore, s.rescore_docs, s.backend, s.onnx_file,
        s.quantize,
    )  # fmt: skip
    out = s.output or default_results_dir(s.model)
    with output_lock(out, what="--output"):
        # another model's folder: refused before any import
        claim_results_dir(out, s.model, s.overwrite, write=False)
        if s.data_dir is None:  # with --data-dir, task names are folder names, checked by the runner
            _check_task_names(s.tasks)
        _run(EvalConfig(**s.model_dump(exclude={"output"}), output=out), out, s.model)


def _check_backend(backend: str, onnx_file: str | None, precision: str | None) -> None:
    if backend not in ("torch", "onnx"):
        raise typer.BadParameter(f"{backend!r}: choose torch or onnx", param_hint="--backend")
    if onnx_file is not None and backend != "onnx":
        raise typer.BadParameter("a graph file is for --backend onnx", param_hint="--onnx-file")
    if backend == "onnx" and precision not in (None, "fp32"):
        raise typer.BadParameter(
            "ONNX Runtime runs the exported graph as it is (fp32 or its int8 file): drop --precision",
            param_hint="--precision",
        )


def _check_options(
    model, device, precision, embedding_precision, rescore, rescore_docs, backend, onnx_file, quantize
) -> None:
    """Every option, checked before anything loads (a bad one exits 2)."""
    from neoembed.hub import check_model_source
    from neoembed.runs import check_device, check_weight_files

    _check_precisions(precision, embedding_precision, rescore, rescore_docs, backend, onnx_file)
    _check_quantize(quantize, backend, precision, device)
    check_device(device)
    check_model_source(model)  # offline or a typo: said at once, not after the imports and mteb's registry
    check_weight_files(model)


def _check_quantize(quantize: str | None, backend: str, precision: str | None, device: str | None) -> None:
    if quantize is None:
        return
    from neoembed.export.torch_int8 import QUANTIZE

    if quantize not in QUANTIZE:
        raise typer.BadParameter(f"{quantize!r}: choose {', '.join(QUANTIZE)}", param_hint="--quantize")
    if backend != "torch":
        raise typer.BadParameter(
            "an ONNX export chooses its int8 graph with --onnx-file model_qint8_<isa>.onnx",
            param_hint="--quantize",
        )
    if precision not in (None, "fp32"):
        raise typer.BadParameter(
            "int8 layers take fp32 activations: drop --precision", param_hint="--precision"
        )
    if device is not None and not device.startswith("cpu"):
        raise typer.BadParameter(f"int8 layers run on CPU, not {device}", param_hint="--device")


def _check_precisions(
    precision, embedding_precision: str, rescore: int | None, rescore_docs: str, backend: str, onnx_file
) -> None:
    from neoembed.eval.config import PRECISION_NAMES

    _check_backend(backend, onnx_file, precision)

    if precision is not None and precision not in PRECISION_NAMES:
        raise typer.BadParameter(
            f"{precision!r} is not one of {', '.join(PRECISION_NAMES)}", param_hint="--precision"
        )
    if embedding_precision not in ("fp32", "int8", "binary"):
        raise typer.BadParameter(
            f"{embedding_precision!r}: choose fp32, int8 or binary", param_hint="--embedding-precision"
        )
    if rescore_docs not in ("quantized", "float"):
        raise typer.BadParameter(f"{rescore_docs!r}: choose quantized or float", param_hint="--rescore-docs")
    if rescore is not None and embedding_precision == "fp32":
        raise typer.BadParameter(
            "rescoring needs quantized documents: add --embedding-precision int8 or binary",
            param_hint="--rescore",
        )


def _run(cfg, out: Path, model: str) -> None:
    from neoembed.eval.runner import run_mteb
    from neoembed.eval.summary import write_summary

    fresh = not out.exists()
    try:
        report = run_mteb(cfg)
    except Exception:  # bad input found inside the run (exit 2 in neoembed.cli.main): leave no folder behind
        if fresh:
            _remove_if_only_claimed(out)
        raise
    row = write_summary(out, model)
    typer.echo((out / "summary.md").read_text())
    if report.skipped:
        typer.echo(f"skipped (results exist; --overwrite to re-run): {', '.join(report.skipped)}")
    if row["n_tasks"]:
        tasks = f"{row['n_tasks']} task{'s' if row['n_tasks'] != 1 else ''}"
        typer.echo(f"results: {out}  (mean {100 * row['mean']:.2f} over {tasks})")
    if report.failed:
        typer.echo("FAILED tasks:", err=True)
        for name, why in report.failed.items():
            typer.echo(f"  {name}: {why}{_hub_hint(why)}", err=True)
        raise typer.Exit(1)


def _hub_hint(error: str) -> str:
    """Advice for a task whose data could not be fetched: the hub is the usual cause on an offline machine."""
    signs = (
        "huggingface.co",
        "connection",
        "offline",
        "resolve host",
        "hf_hub_offline",
        "localentrynotfound",
    )
    if any(sign in error.lower() for sign in signs):
        return (
            " (no hub access? serve the task from a local folder with --data-dir DIR, see docs/evaluation.md)"
        )
    return ""


def _check_task_names(tasks: list[str] | None) -> None:
    """Task names that are neither paths nor mteb tasks fail here, before the model loads, with close names."""
    if not tasks:
        return
    names = [t for t in tasks if not Path(t).exists() and Path(t).suffix not in (".yaml", ".yml")]
    if not names:
        return
    import difflib

    import mteb

    unknown = []
    for name in names:
        try:
            mteb.get_task(name)
        except Exception:  # mteb raises KeyError / ValueError for unknown names
            unknown.append(name)
    if unknown:
        known = {t.metadata.name for t in mteb.get_tasks()}
        hints = {n: difflib.get_close_matches(n, known, n=3) for n in unknown}
        raise typer.BadParameter(
            "; ".join(
                f"{n!r} is not an mteb task (close: {', '.join(h) or 'none'})" for n, h in hints.items()
            )
            + ". Give mteb task names, task card files or task folders (with --data-dir, folder names)",
            param_hint="--tasks",
        )


def _remove_if_only_claimed(out: Path) -> None:
    from neoembed.runs import MODEL_RECORD

    if out.is_dir() and {p.name for p in out.iterdir()} <= {MODEL_RECORD}:
        import shutil

        shutil.rmtree(out)


@app.command("compare")
def compare_command(
    runs: Annotated[list[Path], typer.Argument(help="Output folders of neoembed mteb runs.")],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Where to write compare.md/csv/png (default results/compare)."),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace a comparison already in the --out folder.")
    ] = False,
) -> None:
    """Print several runs side by side and draw a bar chart per task type."""
    from neoembed.eval.summary import COMPARE_FILES, compare_runs

    target = out or Path("results") / "compare"
    replaced = any((target / name).exists() for name in COMPARE_FILES)
    typer.echo(compare_runs(runs, target, overwrite=overwrite))
    typer.echo(
        f"{'replaced' if replaced else 'wrote'} {target / 'compare.png'} (and compare.md, compare.csv)"
    )
