"""``neoembed train RECIPE [key.sub=value ...] [--resume]``."""

from __future__ import annotations

from typing import Annotated

import typer


def train_command(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML path or shipped name (e.g. tiny, quickstart).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the last checkpoint.")] = False,
) -> None:
    """Train with a recipe (the unified contrastive recipe, or CDE when the recipe says kind: cde)."""
    from neoembed.cde.recipe import CDERecipe
    from neoembed.recipe import kind_union, load_recipe, resolve_named_file, resolve_recipe_path
    from neoembed.train.recipe import UnifiedRecipe

    stops: tuple[type[BaseException], ...] = ()  # the trainer's TrainingStopped, once imported
    try:
        path = resolve_named_file(recipe, "recipes")
        # the kind is read from the validated recipe, after the overrides (``kind=cde`` works)
        parsed = load_recipe(path, kind_union(UnifiedRecipe, CDERecipe), overrides or [])
        parsed = parsed.model_copy(update={"model": resolve_recipe_path(parsed.model, path.parent)})
        if isinstance(parsed, CDERecipe):
            from neoembed.cde.trainer import TrainingStopped, train_cde

            stops = (TrainingStopped,)
            out = train_cde(parsed, recipe_dir=path.parent, resume=resume)
        else:
            from neoembed.train.trainer import TrainingStopped, train

            stops = (TrainingStopped,)
            out = train(parsed, recipe_dir=path.parent, resume=resume)
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
