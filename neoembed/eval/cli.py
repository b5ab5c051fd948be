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


def _split(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


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
    instructions: Annotated[
        str,
        typer.Option(
            "--instructions",
            help="released (the NeoBERT evaluation config, default) | paper (Tables 8-9 as printed) | none | FILE",
        ),
    ] = "released",
    batch_size: Annotated[int, typer.Option("--batch-size")] = 32,
    max_length: Annotated[int | None, typer.Option("--max-length")] = None,
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="Serve task T from DIR/T/ (no hub).")
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", help="Results folder (default results/<model>).")
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Re-run tasks that already have results.")
    ] = False,
    seed: Annotated[int, typer.Option("--seed")] = 42,
    device: Annotated[str | None, typer.Option("--device")] = None,
    cde_context: Annotated[
        str,
        typer.Option(
            "--cde-context",
            help="CDE models: 'corpus' (a seeded sample of N texts of each task) or 'null' (the learned null context).",
        ),
    ] = "corpus",
) -> None:
    """Evaluate MODEL on MTEB tasks and write per-task JSON plus a Table-4 style summary."""
    if ctx.invoked_subcommand is not None:
        return
    if model is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(2)
    from neoembed.eval.runner import EvalConfig, run_mteb
    from neoembed.eval.summary import write_summary

    out = output or Path("results") / Path(model).name
    cfg = EvalConfig(
        model=model,
        output=out,
        tasks=_split(tasks),
        task_types=_split(task_types),
        benchmark=benchmark,
        precision=precision,
        instructions=instructions,
        batch_size=batch_size,
        max_length=max_length,
        data_dir=data_dir,
        overwrite=overwrite,
        seed=seed,
        cde_context=cde_context,
        device=device,
    )
    from neoembed.eval.local_data import LocalDataError
    from neoembed.recipe import RecipeError

    try:
        report = run_mteb(cfg)
    except (LocalDataError, RecipeError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    row = write_summary(out, model)
    typer.echo((out / "summary.md").read_text())
    if report.skipped:
        typer.echo(f"skipped (results exist; --overwrite to re-run): {', '.join(report.skipped)}")
    typer.echo(f"results: {out}  (mean {100 * row['mean']:.2f} over {row['n_tasks']} tasks)")
    if report.failed:
        typer.echo("FAILED tasks:", err=True)
        for name, why in report.failed.items():
            typer.echo(f"  {name}: {why}", err=True)
        raise typer.Exit(1)


@app.command("compare")
def compare_command(
    runs: Annotated[list[Path], typer.Argument(help="Output folders of neoembed mteb runs.")],
    out: Annotated[Path | None, typer.Option("--out", help="Where to write compare.md/csv/png.")] = None,
) -> None:
    """Print several runs side by side and draw a bar chart per task type."""
    from neoembed.eval.summary import compare_runs

    target = out or Path("results") / "compare"
    typer.echo(compare_runs(runs, target))
    typer.echo(f"wrote {target / 'compare.png'}")
