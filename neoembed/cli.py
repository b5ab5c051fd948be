"""The ``neoembed`` command line.

Each subcommand lives next to the code it drives and is attached here; heavy imports happen inside the
commands, so ``neoembed --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from neoembed._version import __version__

app = typer.Typer(
    name="neoembed",
    help="NeoBERT embeddings toolkit: convert, train, evaluate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"neoembed {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """NeoBERT embeddings toolkit."""


@app.command()
def convert(
    src: Annotated[str, typer.Argument(help="Checkpoint folder or hub id (official or neoembed layout).")],
    dst: Annotated[Path, typer.Argument(help="Output folder.")],
    to: Annotated[str, typer.Option("--to", help="Target layout: 'neoembed' or 'official'.")] = "neoembed",
    sentence: Annotated[
        bool,
        typer.Option("--sentence", help="Write a sentence-transformers folder (Transformer -> Pooling)."),
    ] = False,
    pooling: Annotated[str, typer.Option("--pooling", help="Pooling for --sentence: mean or cls.")] = "mean",
) -> None:
    """Convert a NeoBERT checkpoint between the official layout and the neoembed layout."""
    from neoembed.modeling.convert import convert_checkpoint

    if sentence:
        from neoembed.sentence import convert_to_sentence_transformer

        report = convert_to_sentence_transformer(src, dst, pooling=pooling)
    else:
        report = convert_checkpoint(src, dst, to=to)
    typer.echo(report)


# Subcommands of later components are attached below (train, mteb, pretrain, ppl, preprocess, data,
# quickstart). Each module exposes a typer app or a command function with lazy heavy imports.
def _attach_optional() -> None:
    import importlib

    for module_name, attr, name in (
        ("neoembed.eval.cli", "app", "mteb"),
        ("neoembed.train.cli", "train_command", "train"),
        ("neoembed.data.cli", "app", "data"),
        ("neoembed.quickstart", "quickstart_command", "quickstart"),
        ("neoembed.pretrain.cli", "pretrain_command", "pretrain"),
        ("neoembed.pretrain.cli", "preprocess_command", "preprocess"),
        ("neoembed.pretrain.cli", "ppl_command", "ppl"),
    ):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and (e.name == module_name or module_name.startswith(e.name + ".")):
                continue  # component not part of this build yet
            raise
        obj = getattr(module, attr)
        if isinstance(obj, typer.Typer):
            app.add_typer(obj, name=name)
        else:
            app.command(name=name)(obj)


_attach_optional()


def main() -> None:
    """Run the command line. Bad input (a missing path, an unusable model folder, a recipe, card or data error;
    neoembed's own errors derive from ValueError or OSError) ends with its message and exit code 2, not a
    traceback; ``NEOEMBED_DEBUG=1`` shows the traceback."""
    import os

    try:
        app()
    except (ValueError, OSError) as e:
        if os.environ.get("NEOEMBED_DEBUG"):
            raise
        typer.echo(f"error: {e}\n(NEOEMBED_DEBUG=1 shows the traceback)", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
