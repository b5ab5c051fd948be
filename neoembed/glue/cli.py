"""``neoembed glue TASK --model M``: fine-tune and score a GLUE task with the NeoBERT paper's protocol."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Task = Annotated[str, typer.Argument(help="GLUE task: CoLA, SST-2, MRPC, QQP, STS-B, MNLI, QNLI or RTE.")]
Overrides = Annotated[list[str] | None, typer.Argument(help="Recipe overrides, key=value (e.g. epochs=3).")]
Model = Annotated[
    str, typer.Option("--model", help="Encoder to fine-tune (folder or hub id); any HF encoder.")
]
RecipeOpt = Annotated[
    str | None,
    typer.Option("--recipe", help="Recipe (path or shipped name); default glue/<task>: Table 6's best."),
]
Out = Annotated[Path | None, typer.Option("--out", help="Output folder (default runs/glue/<task>).")]
DataDir = Annotated[
    Path | None,
    typer.Option("--data-dir", help="Local data in the nyu-mll/glue layout (offline); default: the hub."),
]
Carve = Annotated[
    str | None,
    typer.Option(
        "--carve", help="Divide this one labelled split of --data-dir into train 80% / validation 20%."
    ),
]
From = Annotated[
    str | None,
    typer.Option(
        "--from", help="Start from this checkpoint: a model, or a finished MNLI run or grid (its best)."
    ),
]
Grid = Annotated[bool, typer.Option("--grid", help="Run the paper's search (the recipe's grid); resumable.")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue the run(s) in --out.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace the glue run in a non-empty --out.")]


def glue_command(
    task: Task,
    overrides: Overrides = None,
    model: Model = "chandar-lab/NeoBERT",
    recipe: RecipeOpt = None,
    out: Out = None,
    data_dir: DataDir = None,
    carve: Carve = None,
    from_: From = None,
    grid: Grid = False,
    resume: Resume = False,
    overwrite: Overwrite = False,
) -> None:
    """Fine-tune MODEL on a GLUE task (Appendix C of the NeoBERT paper: 10 epochs, evaluation every
    min(500, len(dataloader) // 10) steps, early stopping after 15 evaluations without improvement) and print
    the validation score; --grid searches Table 6's grid. Results: OUT/results.json (or grid.md / grid.json)."""
    from neoembed.glue.tasks import get_task
    from neoembed.hub import check_model_source

    spec = get_task(task)
    if from_ is None:  # offline or a typo: said before torch and transformers import
        check_model_source(model)
    from neoembed.glue.run import GlueRecipe, check_same_kind_and_model, resolve_from
    from neoembed.hub import resolve_packaged
    from neoembed.recipe import load_recipe
    from neoembed.record import RUN_RECORD
    from neoembed.runs import (
        check_known_settings,
        check_trackers,
        output_lock,
        prepare_output_dir,
        resume_defaults,
        resume_settings,
    )

    settings = load_recipe(recipe or f"glue/{spec.name}", GlueRecipe, overrides or [])
    if get_task(settings.task) is not spec:
        raise ValueError(
            f"recipe is for task {settings.task!r}, not {spec.display}: pick the matching --recipe"
        )
    out = out or Path("runs") / "glue" / spec.name
    check_trackers(settings.report_to, out, resume)  # a missing tracker fails before the data or model load
    source = resolve_from(from_) if from_ else None
    backbone = source or resolve_packaged(model)
    _refuse_cde(backbone, model)
    # a second run (or resume) into this folder is refused before it touches it
    with output_lock(out, what="--out"):
        if resume and out.is_dir():  # the recipe's settings now; those derived from the rows when they load
            check_same_kind_and_model(out, backbone, grid)
            check_known_settings(out, resume_settings(settings), resume_defaults(settings))
        prepare_output_dir(
            out,
            overwrite=overwrite,
            resume=resume,
            checkpoints=False,
            clearable=(RUN_RECORD,),
            what="--out",
            inputs=(model, from_),
            command="glue",
        )
        _start(settings, spec, backbone, out, data_dir, carve, source, grid)


def _refuse_cde(backbone: str, model: str) -> None:
    from neoembed.cde.model import is_cde_folder  # torch: imported when a command runs, not for its --help

    if is_cde_folder(backbone):  # reads its modules.json: False for a hub id
        raise ValueError(
            f"--model {model} is a CDE model (two encoder stages and a corpus context): GLUE fine-tunes one encoder "
            "under a classifier; give an encoder (the model the CDE run started from, or any plain checkpoint)"
        )


def _start(settings, spec, backbone: str, out: Path, data_dir, carve, source: str | None, grid: bool) -> None:
    """The run in ``out`` (checked and locked): the run record, then the run(s) from ``backbone`` (``source``:
    the ``--from`` checkpoint it is, if any)."""
    from neoembed.glue.run import record
    from neoembed.runs.lock import launched_main

    if source is not None:  # --model is not used: say which model the run starts from
        typer.echo(f"starting from {source} (--from)", err=True)
    elif settings.transfer_from:
        typer.echo(
            f"note: the paper starts {spec.display} from the best {settings.transfer_from.upper()} "
            "checkpoint; pass --from to do the same",
            err=True,
        )
    data = {"data_dir": data_dir, "carve": carve}
    # the main process alone: another one's record could reach the folder before the main one has checked it
    main = launched_main()
    fresh = main and not out.exists()
    if main:
        out.mkdir(parents=True, exist_ok=True)
        record(out, settings, backbone, source, grid)
    try:
        _run(settings, spec, backbone, out, data, source, grid)
    except BaseException:
        # failed before anything but the record was written (data or model unreachable): leave no folder
        if fresh:
            _discard_unstarted(out)
        raise


def _run(settings, spec, backbone: str, out: Path, data: dict, source: str | None, grid: bool) -> None:
    from neoembed.glue.run import run_grid, run_one

    if grid:
        rows = run_grid(settings, spec, backbone, out, data, transfer=source is not None)
        best = max(rows, key=lambda r: r["score"])
        typer.echo(
            f"{spec.display} grid: best {best['score']:.2f} ({best['run']}); table in {out / 'grid.md'}"
        )
        return
    result = run_one(settings, spec, backbone, out, data, transfer=source is not None)
    details = ", ".join(
        f"{s} {m} {100 * v:.2f}" for s, ms in result["validation"].items() for m, v in ms.items()
    )
    typer.echo(f"{spec.display}: {result['score']:.2f} ({details}); written to {out / 'results.json'}")


def _discard_unstarted(out: Path) -> None:
    """Remove ``out`` if the run record is all it holds, so that a rerun is not refused as a used folder."""
    from neoembed.record import RUN_RECORD

    if [p.name for p in out.iterdir()] == [RUN_RECORD]:
        (out / RUN_RECORD).unlink()
        out.rmdir()
