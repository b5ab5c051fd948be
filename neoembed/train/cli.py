"""``neoembed train RECIPE [key.sub=value ...] [--resume]``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def train_command(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML path or shipped name (e.g. tiny, quickstart).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the last checkpoint.")] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Print each dataset's rows, pi_i, steps, negatives, licence; load no model."
        ),
    ] = False,
) -> None:
    """Train with a recipe (the unified contrastive recipe, or CDE when the recipe says kind: cde)."""
    import yaml

    from neoembed.recipe import RecipeError, load_recipe, resolve_named_file

    stops: tuple[type[BaseException], ...] = ()  # the trainer's TrainingStopped, once imported
    try:
        path = resolve_named_file(recipe, "recipes")
        kind = (yaml.safe_load(path.read_text()) or {}).get("kind", "unified")
        if kind == "cde" and dry_run:
            raise RecipeError("--dry-run describes unified recipes (kind: unified); this recipe is kind: cde")
        if kind == "cde":
            from neoembed.cde.recipe import CDERecipe
            from neoembed.cde.trainer import TrainingStopped, train_cde

            stops = (TrainingStopped,)
            parsed = _resolve_model_path(load_recipe(path, CDERecipe, overrides or []), path.parent)
            out = train_cde(parsed, recipe_dir=path.parent, resume=resume)
        elif kind == "unified" and dry_run:
            from neoembed.data.plan import dry_run as describe
            from neoembed.train.recipe import UnifiedRecipe

            typer.echo(describe(load_recipe(path, UnifiedRecipe, overrides or []), path.parent))
            return
        elif kind == "unified":
            from neoembed.train.recipe import UnifiedRecipe
            from neoembed.train.trainer import TrainingStopped, train

            stops = (TrainingStopped,)
            parsed = _resolve_model_path(load_recipe(path, UnifiedRecipe, overrides or []), path.parent)
            out = train(parsed, recipe_dir=path.parent, resume=resume)
        else:
            raise RecipeError(f"unknown recipe kind {kind!r}; valid: 'unified', 'cde'")
    except Exception as e:  # a stopped run exits 1; bad recipes and cards reach neoembed.cli.main (exit 2)
        if isinstance(e, stops):
            typer.echo(f"training stopped: {e}", err=True)
            raise typer.Exit(1) from None
        raise
    _release_process_group()
    typer.echo(f"done: {out}")


def _release_process_group() -> None:
    """After a run that succeeded on every rank: meet, then tear torch.distributed down. A gloo group left to the
    interpreter's shutdown can abort a finished process ('terminate called without an active exception')."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _resolve_model_path(recipe, recipe_dir: Path):
    """A relative model path is looked up next to the recipe first, then in the working directory."""
    candidate = recipe_dir / recipe.model
    if not Path(recipe.model).is_absolute() and candidate.exists() and not Path(recipe.model).exists():
        return recipe.model_copy(update={"model": str(candidate.resolve())})
    return recipe
