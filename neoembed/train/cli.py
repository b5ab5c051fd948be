"""``neoembed train RECIPE [key.sub=value ...] [--resume | --overwrite] [--dry-run]``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def train_command(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML path or shipped name (e.g. tiny, cde-tiny).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides.")] = None,
    resume: Annotated[
        bool,
        typer.Option("--resume", help="Continue the run in output_dir from its newest complete checkpoint."),
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace the run in a non-empty output_dir.")
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Print each dataset's rows, pi_i, steps, negatives, licence; load no model."
        ),
    ] = False,
) -> None:
    """Train with a recipe (the unified contrastive recipe, or CDE when the recipe says kind: cde).

    Exit codes: 0 done, 1 stopped (NaN loss, out of memory, disk full), 2 bad input, 130 / 143 interrupted by
    Ctrl-C / SIGTERM after checkpointing (continue with --resume)."""
    from neoembed.recipe import RecipeError, kind_union, load_recipe, resolve_named_file, resolve_recipe_path

    path = resolve_named_file(recipe, "recipes")  # a missing recipe is refused before torch loads
    if recipe == "quickstart" and not any(o.startswith("datasets") for o in overrides or []):
        raise RecipeError(
            "the quickstart recipe trains on the card that `neoembed quickstart` builds from this Python's "
            "documentation: run `neoembed quickstart`, or give it your own card: "
            "neoembed train quickstart 'datasets=[{card: my_card.yaml}]'"
        )
    from neoembed.cde.recipe import CDERecipe
    from neoembed.hub import resolve_packaged
    from neoembed.train.recipe import UnifiedRecipe

    # the kind is read from the validated recipe, after the overrides (``kind=cde`` works)
    parsed = load_recipe(path, kind_union(UnifiedRecipe, CDERecipe), overrides or [])
    model = resolve_packaged(parsed.model) if parsed.model.startswith("packaged:") else parsed.model
    parsed = parsed.model_copy(update={"model": resolve_recipe_path(model, path.parent)})
    _warn_on_warmup(parsed)
    if dry_run:
        if not isinstance(parsed, UnifiedRecipe):
            raise RecipeError(
                f"--dry-run describes unified recipes (kind: unified); {path} is kind: {parsed.kind}"
            )
        from neoembed.data.plan import dry_run as describe

        parsed.check_matryoshka_width()
        typer.echo(describe(parsed, path.parent))
        _evaluator(parsed, path.parent)  # its tasks and keep_best's score, as the run checks them
        return
    from neoembed.hub import check_model_source
    from neoembed.runs import output_lock

    check_model_source(parsed.model)  # offline or a typo: said before torch and sentence-transformers import
    _refuse_adapter(parsed.model)
    with output_lock(parsed.output_dir):  # a second run into this folder is refused before it touches it
        evaluator = _evaluator(parsed, path.parent)
        if isinstance(parsed, CDERecipe):
            from neoembed.cde.trainer import train_cde

            out = train_cde(
                parsed, recipe_dir=path.parent, resume=resume, overwrite=overwrite, evaluator=evaluator
            )
        else:
            from neoembed.train.trainer import train

            out = train(
                parsed, recipe_dir=path.parent, resume=resume, overwrite=overwrite, evaluator=evaluator
            )
    _release_process_group()
    from neoembed.runs.lock import launched_main

    if launched_main():  # once per launch, not per process
        typer.echo(f"done: {out}")


def _warn_on_warmup(recipe) -> None:
    """A warm-up as long as the run trains below the recipe's learning rate to the end: said before anything
    loads (a valid recipe, which a short trial run with steps=N may well be)."""
    opt, steps = recipe.optimizer, recipe.steps
    if opt.warmup_steps >= steps:
        last = opt.lr * (steps - 1) / opt.warmup_steps  # the linear warm-up's rate at the last step
        typer.echo(
            f"warning: optimizer.warmup_steps {opt.warmup_steps} is not below steps {steps}: the learning rate "
            f"never reaches optimizer.lr {opt.lr:g} (the last step runs at {last:.2g}); lower warmup_steps",
            err=True,
        )


def _refuse_adapter(model: str) -> None:
    """A LoRA adapter saved alone (``RUN/adapter``) loads for inference over its frozen base; trained as ``model``
    it failed in autograd ("element 0 of tensors does not require grad") or was "not a model"."""
    from neoembed.recipe import RecipeError

    if (Path(model) / "adapter_config.json").is_file():
        raise RecipeError(
            f"model={model} is a LoRA adapter saved alone, which trains no further: train from the run's merged "
            "model (the adapter folder's parent), or from its base model with adapter: to train a new adapter"
        )


def _release_process_group() -> None:
    """After a run that succeeded on every rank: meet, then tear torch.distributed down. A gloo group left to the
    interpreter's shutdown can abort a finished process ('terminate called without an active exception')."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _evaluator(parsed, recipe_dir: Path):
    """The recipe's evaluation during training (None without ``eval:``), its tasks resolved and ``keep_best``'s
    score checked against what it will log. Evaluation sits above the trainers: it is handed to them."""
    if parsed.eval is None:
        return None
    from neoembed.eval.training import MtebEvaluator
    from neoembed.recipe import RecipeError, check_keep_best_scores
    from neoembed.train.holdout import holdout_task_names, holdout_task_paths

    compares = getattr(parsed, "keep_best", None) is not None
    evaluator = MtebEvaluator(parsed.eval, recipe_dir, holdout_task_paths(parsed, recipe_dir), compares=compares)
    held = holdout_task_names(parsed, recipe_dir)
    if clash := sorted(set(evaluator.task_names) & set(held)):  # results are kept by task name: one would be lost
        raise RecipeError(
            f"eval.tasks holds a task named {', '.join(clash)}, the name of eval.holdout's own task: rename that "
            "task's card (name:), or drop it from eval.tasks"
        )
    check_keep_best_scores(parsed, evaluator.task_names + held)
    return evaluator
