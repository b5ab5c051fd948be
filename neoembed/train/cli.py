"""``neoembed train RECIPE [key.sub=value ...] [--resume | --overwrite] [--dry-run]``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def train_command(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML path or shipped name (e.g. tiny, quickstart).")],
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
    from neoembed.recipe import RecipeError, load_recipe, resolve_named_file

    path = resolve_named_file(recipe, "recipes")
    kind = _recipe_kind(path, overrides or [])
    if dry_run:
        if kind != "unified":
            raise RecipeError(f"--dry-run describes unified recipes (kind: unified); {path} is kind: {kind}")
        from neoembed.data.plan import dry_run as describe
        from neoembed.train.recipe import UnifiedRecipe

        typer.echo(describe(load_recipe(path, UnifiedRecipe, overrides or []), path.parent))
        return
    if kind == "cde":
        from neoembed.cde.recipe import CDERecipe
        from neoembed.cde.trainer import train_cde

        parsed = _resolve_model_path(load_recipe(path, CDERecipe, overrides or []), path.parent)
        out = train_cde(parsed, recipe_dir=path.parent, resume=resume, overwrite=overwrite)
    elif kind == "unified":
        from neoembed.train.recipe import UnifiedRecipe
        from neoembed.train.trainer import train

        parsed = _resolve_model_path(load_recipe(path, UnifiedRecipe, overrides or []), path.parent)
        out = train(parsed, recipe_dir=path.parent, resume=resume, overwrite=overwrite)
    else:
        raise RecipeError(f"{path}: unknown recipe kind {kind!r}; valid: 'unified', 'cde'")
    _release_process_group()
    typer.echo(f"done: {out}")


def _recipe_kind(path: Path, overrides: list[str]) -> str:
    """The recipe's ``kind`` (default unified); a file that is not a YAML mapping is a RecipeError naming it."""
    import yaml

    from neoembed.recipe import RecipeError

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise RecipeError(f"{path} is not valid YAML ({e}); fix the line it names") from None
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path} is not UTF-8 text ({e}): is it a recipe?") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            f"{path} must hold a mapping (key: value lines) at the top level, got a {type(data).__name__}"
        )
    kinds = [o.split("=", 1)[1].strip() for o in overrides if o.split("=", 1)[0].strip() == "kind"]
    return kinds[-1] if kinds else data.get("kind", "unified")


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
