"""The ``neoembed`` command line.

Each subcommand lives next to the code it drives and is attached here; heavy imports happen inside the
commands, so ``neoembed --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
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
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Also show debug lines and other libraries' info logs.")
    ] = False,
) -> None:
    """NeoBERT embeddings toolkit."""
    _console_logging(verbose)


def _console_logging(verbose: bool) -> None:
    """neoembed's own progress lines (rows kept per card, batch sizes, what a run decided) on stderr, plainly;
    other libraries at their warnings, each repeated warning shown once; ``--verbose`` shows everything."""
    import sys
    import warnings

    log = logging.getLogger("neoembed")
    _stderr_handler(log)
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        warnings.simplefilter("default")  # every warning, deprecations in libraries too, once per place
    else:
        warnings.filterwarnings("once")
        # as Python's default filters do outside __main__: deprecations are for the code that calls the library
        # (mteb's own reranking tasks warn on every run), not for a user of the command line
        for category in (DeprecationWarning, PendingDeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
        # torch's notice to sentence-transformers, whose gather_across_devices calls it: nothing a user can change
        warnings.filterwarnings("ignore", r"torch\.distributed\.nn\.functional\.all_gather is deprecated")
        warnings.formatwarning = _plain_own_warning
        # warnings become log records, so that one filter shows each once: the warnings module's "once" forgets
        # what it showed whenever a library enters warnings.catch_warnings (mteb does, at every task)
        logging.captureWarnings(True)
        _once_per_message(_stderr_handler(logging.getLogger("py.warnings")))
        _once_per_message(logging.lastResort)  # where other libraries' records go (no handler of their own)
        if not sys.stderr.isatty():
            _quiet_other_bars()
    if int(os.environ.get("RANK", "0") or 0) > 0 and not verbose:
        # another process of a multi-process launch: rank 0 says what the run does, once; errors still show
        log.setLevel(logging.ERROR)
        logging.lastResort.setLevel(logging.ERROR)  # other libraries' warnings (sentence-transformers' sampler)
        warnings.simplefilter("ignore")


_formatwarning = warnings.formatwarning


def _plain_own_warning(message, category, filename, lineno, line=None) -> str:
    """neoembed's own warnings as a plain "warning: ..." line: they are messages to the user, and the source line
    the warnings module adds (``--verbose`` keeps it) reads as a crash. Other libraries' keep their form."""
    from neoembed.progress import is_own_warning

    if is_own_warning(category, filename):
        return f"warning: {message}\n"
    return _formatwarning(message, category, filename, lineno, line)


class _Stderr(logging.StreamHandler):
    """Writes the bare message (a captured warning's own trailing newline dropped) to the current stderr (tests
    and notebooks swap it)."""

    def emit(self, record):
        import sys

        self.stream = sys.stderr
        super().emit(record)

    def format(self, record) -> str:
        return super().format(record).rstrip("\n")


def _stderr_handler(logger: logging.Logger) -> logging.Handler:
    """``logger``'s plain stderr handler, added once."""
    name = f"neoembed:{logger.name}"
    for handler in logger.handlers:
        if handler.get_name() == name:
            return handler
    handler = _Stderr()
    handler.set_name(name)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    return handler


class _OncePerMessage(logging.Filter):
    """Passes each (logger, first line of the message) once: libraries repeat the same notice at every task or
    evaluation of a run (mteb's deprecations, sentence-transformers' "Model prompts specified"), the first line
    being the same and the rest naming that task."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record) -> bool:
        key = (record.name, record.getMessage().split("\n", 1)[0])
        fresh = key not in self.seen
        self.seen.add(key)
        return fresh


def _once_per_message(handler) -> None:
    if handler is not None and not any(isinstance(f, _OncePerMessage) for f in handler.filters):
        handler.addFilter(_OncePerMessage())


def _quiet_other_bars() -> None:
    """Where stderr is not a terminal (CI, a scheduler's log), other libraries' bars (loading weights, generating
    dataset splits, downloads) write carriage-return redraws that pile into one line; neoembed's own long stages
    print whole lines there instead (``neoembed.progress``). A variable the user set is left as it is."""
    import os
    import sys

    # TQDM_DISABLE: the bars other libraries draw with tqdm itself (sentence-transformers' "Computing widget
    # examples" at every training start), read by tqdm when it is imported
    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
        os.environ.setdefault(var, "1")
    # the variables are read at import: libraries already imported (a notebook, a test) are told directly
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        if "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        if "transformers" in sys.modules:
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
    if os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1" and "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()


@app.command()
def convert(
    src: Annotated[str, typer.Argument(help="Checkpoint folder or hub id (official or neoembed layout).")],
    dst: Annotated[Path, typer.Argument(help="Output folder.")],
    to: Annotated[str, typer.Option("--to", help="Target layout: 'neoembed' or 'official'.")] = "neoembed",
    sentence: Annotated[
        bool,
        typer.Option("--sentence", help="Write a sentence-transformers folder (Transformer -> Pooling)."),
    ] = False,
    pooling: Annotated[
        str | None,
        typer.Option(
            "--pooling",
            help="Pooling for --sentence: mean or cls (default: mean; a sentence-transformers SRC keeps its own).",
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace the model in a non-empty DST (a model folder).")
    ] = False,
) -> None:
    """Convert a NeoBERT checkpoint between the official layout and the neoembed layout. DST must be a new or
    empty folder (or --overwrite a model folder)."""
    import shutil

    from neoembed.hub import check_model_source, resolve_packaged
    from neoembed.record import RUN_RECORD
    from neoembed.runs import (
        OutputDirError,
        check_output_flags,
        check_weight_files,
        output_lock,
        prepare_output_dir,
    )
    from neoembed.runs.folder import clear_folder

    src = resolve_packaged(src)
    if Path(src).exists() and Path(src).resolve() == dst.resolve():
        raise OutputDirError(f"convert: SRC and DST are the same folder ({dst}): choose a new DST")
    if pooling is not None and not sentence:
        raise ValueError("--pooling sets the pooling of a --sentence folder; a checkpoint has none: add --sentence")
    if sentence and to != "neoembed":
        raise ValueError(
            "--sentence writes a sentence-transformers folder (neoembed layout) and --to official a plain "
            "official checkpoint: choose one"
        )
    check_model_source(src)  # offline or a typo: said before torch and transformers import
    check_weight_files(src)
    from neoembed.modeling.convert import convert_checkpoint
    from neoembed.record import readable_weights

    folder = {"what": "DST", "clearable": (RUN_RECORD, "config.json"), "resumable": False}
    with output_lock(dst, what="DST"):
        check_output_flags(dst, overwrite=overwrite, resume=False, **folder)
        # written beside DST first: a SRC that fails to convert (or a full disk, a signal) leaves the model an
        # --overwrite would replace as it was
        where = Path(os.path.abspath(dst))  # "." has no name of its own: its folder's is the name, outside it
        staged = where.parent / f".{where.name}.converting"
        shutil.rmtree(staged, ignore_errors=True)
        try:
            if sentence:
                from neoembed.sentence import convert_to_sentence_transformer

                report = convert_to_sentence_transformer(src, staged, pooling=pooling)
            else:
                report = convert_checkpoint(src, staged, to=to)
            prepare_output_dir(dst, overwrite=overwrite, resume=False, **folder)
            dst.mkdir(parents=True, exist_ok=True)
            try:
                for entry in sorted(staged.iterdir()):
                    os.replace(entry, dst / entry.name)
            except BaseException:  # no half-moved DST that a rerun would refuse
                clear_folder(dst)
                raise
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        readable_weights(dst)
    typer.echo(report.replace(str(staged), str(dst)))  # the report names the folder it wrote
    if not sentence:
        _say_left_out(Path(src), dst)


def _say_left_out(src: Path, dst: Path) -> None:
    """What a plain checkpoint of a sentence-transformers folder ``src`` does not keep (its pooling when not the
    default mean, its saved prompts, its normalisation), said with the way back; nothing when it keeps all."""
    import json

    try:
        modules = json.loads((src / "modules.json").read_text())
        saved = json.loads((src / "config_sentence_transformers.json").read_text())
    except (OSError, ValueError):
        return
    kept_out = []
    for module in modules:
        if module.get("type", "").endswith("Pooling"):
            with contextlib.suppress(OSError, ValueError):
                config = json.loads((src / module.get("path", "") / "config.json").read_text())
                flags = [k[13:] for k, v in config.items() if k.startswith("pooling_mode_") and v]  # before ST 6
                mode = config.get("pooling_mode") or (flags[0] if flags else "mean")
                kept_out += [f"{mode.replace('_token', '')} pooling"] if mode not in ("mean", "mean_tokens") else []
        elif module.get("type", "").endswith("Normalize"):
            kept_out.append("normalisation")
    prompts = {k: v for k, v in (saved.get("prompts") or {}).items() if v}
    if prompts:
        kept_out.append(f"saved prompts ({', '.join(sorted(prompts))})")
    if kept_out:
        typer.echo(
            f"note: {src} is a sentence-transformers model; {dst} is a plain checkpoint without its "
            f"{', '.join(kept_out)}. `neoembed convert {dst} NEW --sentence"
            f"{' --pooling cls' if any('cls' in k for k in kept_out) else ''}` makes it one again (the prompts go "
            "back with neoembed.load(..., prompts=...))",
            err=True,
        )


# Subcommands of later components are attached below (train, mteb, pretrain, ppl, preprocess, data,
# quickstart, glue). Each module exposes a typer app or a command function with lazy heavy imports.
def _attach_optional() -> None:
    import importlib

    for module_name, attr, name in (
        ("neoembed.eval.cli", "app", "mteb"),
        ("neoembed.train.cli", "train_command", "train"),
        ("neoembed.data.cli", "app", "data"),
        ("neoembed.data.cli", "init_command", "init"),
        ("neoembed.mine.cli", "mine_command", "mine"),
        ("neoembed.mine.cli", "score_command", "score"),
        ("neoembed.export.cli", "export_command", "export"),
        ("neoembed.quickstart", "quickstart_command", "quickstart"),
        ("neoembed.pretrain.cli", "pretrain_command", "pretrain"),
        ("neoembed.pretrain.cli", "preprocess_command", "preprocess"),
        ("neoembed.pretrain.cli", "ppl_command", "ppl"),
        ("neoembed.glue.cli", "glue_command", "glue"),
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


BAD_INPUT_EXIT = 2


def _disk_full(e: BaseException) -> bool:
    """An error of a write to a full disk (or quota): an OSError's errno, or the text safetensors' own error
    carries from the OS."""
    import errno

    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e)


def _bad_input_types() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input (exit 2): neoembed's own derive from ValueError or OSError (recipes, cards,
    output folders, paths); a corrupt safetensors file raises safetensors' own error."""
    types: tuple[type[BaseException], ...] = (ValueError, OSError)
    try:
        from safetensors import SafetensorError

        types += (SafetensorError,)
    except ImportError:  # pragma: no cover - older safetensors
        pass
    return types


def _click_exceptions() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """Click's usage-error and abort classes: typer may carry its own copy of click (``typer._click``)."""
    import click

    usage: list[type[BaseException]] = [click.ClickException]
    aborts: list[type[BaseException]] = [click.Abort, *([typer.Abort] if hasattr(typer, "Abort") else [])]
    try:
        from typer._click import exceptions as vendored

        usage.append(vendored.ClickException)
    except (ImportError, AttributeError):
        pass
    return tuple(usage), tuple(aborts)


def _eof_message(e: BaseException) -> str:
    """An ``EOFError`` that reached the command line: a compressed file that ends early (a truncated ``.gz``
    read by a library that does not name it), not a Ctrl-C."""
    where = f" in {e.filename}" if getattr(e, "filename", None) else ""
    return (
        f"a data file ended before its end{where} ({e or 'EOFError'}): a truncated download or copy "
        "(check .gz files with gzip -t) - copy it again"
    )


class _Terminated(BaseException):
    """SIGTERM in a command without a handler of its own (train, score and export checkpoint or keep their work
    and say so): reported here with how the command continues, not as a silent exit."""


def _on_sigterm(signum, frame) -> None:
    raise _Terminated


#: what torch's collectives say when a peer process is gone (gloo's socket, NCCL's abort, the TCP store)
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "DistBackendError",
              "DistNetworkError", "NCCL communicator was aborted")  # fmt: skip


def _lost_peer(e: BaseException) -> str | None:
    """The collective's first line when ``e`` says another process of a multi-process launch is gone (killed,
    out of memory, crashed): this process's error is then a consequence, not a bug to report."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) < 2:
        return None
    text = f"{type(e).__name__}: {e}"
    if not any(s in text for s in _PEER_GONE):
        return None
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__


def _command() -> str:
    """The subcommand this process runs (``train``, ``mteb``, ...), from its command line."""
    return next((a for a in sys.argv[1:] if not a.startswith("-")), "")


def _how_to_continue() -> str:
    return CONTINUE.get(_command(), "rerun the command to start again")


#: how a command stopped by Ctrl-C or SIGTERM continues (one not named keeps nothing to continue from)
CONTINUE = {
    # a run aborted by a second Ctrl-C wrote no checkpoint of its own, but may hold earlier ones
    **dict.fromkeys(
        ("train", "pretrain", "glue"),
        "rerun with --resume to continue from its newest checkpoint, or with --overwrite if it wrote none",
    ),
    "mine": "continue with the same command and --resume",
    "score": "continue with the same command and --resume",
    "mteb": "rerun the same command: it reuses the tasks it finished",
    "preprocess": "rerun the same command: it resumes after the last shard it wrote",
}


def main() -> None:
    """Run the command line; the one place where errors become messages and exit codes.

    - 0: done; 1: a run that stopped early (NaN loss, out of memory, a checkpoint that could not be written), a
      failed evaluation task, or an unexpected error; 2: bad input (a usage error, a missing path, an unusable
      model folder, a recipe, card, data or output-folder error), reported before any model loads;
    - 130 / 143: interrupted by SIGINT (Ctrl-C) / SIGTERM after the checkpoint was written (``--resume``
      continues); a second Ctrl-C aborts at once with 130.

    Messages name the file, key or value and the fix; ``NEOEMBED_DEBUG=1`` shows the traceback."""
    import os

    from neoembed.runs import RunFinished, TrainingStopped

    usage, aborts = _click_exceptions()

    debug = os.environ.get("NEOEMBED_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")
    hint = "\n(NEOEMBED_DEBUG=1 shows the traceback)"
    import signal
    import threading

    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers can be set only there
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        code = app(standalone_mode=False)
    except _Terminated:
        typer.echo(f"stopped by SIGTERM: {_how_to_continue()}", err=True)
        raise SystemExit(143) from None
    except usage as e:  # usage errors (a bad option value): click's own message, exit 2
        e.show()
        raise SystemExit(e.exit_code) from None
    except (*aborts, KeyboardInterrupt) as e:
        if isinstance(e.__cause__ or e.__context__, EOFError):  # click turns any EOFError into Abort
            typer.echo(f"error: {_eof_message(e.__cause__ or e.__context__)}{hint}", err=True)
            raise SystemExit(BAD_INPUT_EXIT) from None
        typer.echo("interrupted (a second Ctrl-C aborts without a checkpoint)", err=True)
        raise SystemExit(130) from None
    except RunFinished as e:  # --resume with nothing left to run: done
        typer.echo(str(e))
        raise SystemExit(0) from None
    except TrainingStopped as e:
        if debug:
            raise
        from neoembed.runs import TrainingInterrupted, launched_main

        if launched_main() or not isinstance(e, TrainingInterrupted):  # every process stops at one checkpoint
            typer.echo(f"{e.label}: {e}", err=True)
        raise SystemExit(e.exit_code) from None
    except _bad_input_types() as e:
        if debug:
            raise
        if _disk_full(e):  # not bad input: the command stopped (exit 1), as a run's checkpoint write says
            then = f"then {CONTINUE[_command()]}" if _command() in CONTINUE else "or write to another folder"
            typer.echo(f"stopped: the disk is full ({e}): free space, {then}", err=True)
            raise SystemExit(1) from None
        typer.echo(f"error: {e}{hint}", err=True)
        raise SystemExit(BAD_INPUT_EXIT) from None
    except Exception as e:
        if debug:
            raise
        if (said := _lost_peer(e)) is not None:
            typer.echo(
                f"stopped: another process of this launch ended, so this one cannot go on ({said}); what ended it "
                f"(its error, a kill, memory) is in its own output. Then {_how_to_continue()}",
                err=True,
            )
            raise SystemExit(1) from None
        typer.echo(
            f"error: {type(e).__name__}: {e}{hint}; if the cause is not yours, please report it", err=True
        )
        raise SystemExit(1) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    if code == 130:  # typer turns a Ctrl-C that no command caught into exit 130, without a word
        typer.echo(f"interrupted by Ctrl-C: {_how_to_continue()}", err=True)
    raise SystemExit(code if isinstance(code, int) else 0)


def _ended(code: int):
    """A handler for a signal that comes after the command ended (while the interpreter shuts down: threads
    joined, exit callbacks run): the output is complete, so say so and exit with the command's own status."""
    import os
    import signal

    def handle(signum, frame):
        sys.stdout.flush()
        sys.stderr.write(f"{signal.Signals(signum).name} after the command ended: its output is complete\n")
        sys.stderr.flush()
        os._exit(code)

    return handle


def _ignore_late_signals() -> None:
    """The last exit callback: past it the interpreter puts back the default handlers, so that a signal while it
    frees the modules (seconds after a large model) would kill a finished command with 130 / 143 silently."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def entry() -> None:
    """The console script and ``python -m neoembed``: :func:`main`, then a Ctrl-C or SIGTERM during shutdown
    ends the process with the command's own exit status and a line saying so."""
    import atexit
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():  # signal handlers can be set only there
        return main()
    atexit.register(_ignore_late_signals)  # registered first, so it runs last
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _ended(code))
        raise


if __name__ == "__main__":
    entry()
