"""An output folder is never silently reused: a non-empty folder is an error unless the caller says ``resume``
(the folder's run must be this run: same recipe, up to the settings that do not change the trajectory) or
``overwrite`` (the folder is cleared)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neoembed.model_card import HUB_ID
from neoembed.record import FINISHED, RUN_RECORD
from neoembed.runs.checkpoints import (
    CHECKPOINT_MARKER,
    find_resume_checkpoint,
    list_checkpoints,
    verify_checkpoint,
)
from neoembed.runs.errors import OutputDirError, RunFinished
from neoembed.runs.lock import launched_main

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


RECORD = RUN_RECORD
# Recipe keys that say where and how often a run writes, not what it computes: a resume may change them. ``eval``
# (evaluation during training) restores every random stream after scoring, so it does not move the training either.
# GradCache's piece sizes (``loss.mini_batch_size``, CDE's ``chunk_size``) are memory settings: the same loss and
# gradients in other pieces (float rounding differs, and with dropout the draws each text gets), so a run that ran
# out of memory resumes with smaller pieces. ``keep_best.metric`` may change until a score has counted (a misspelt
# one fails the first evaluation, whose checkpoint a resume evaluates first): RunLoop.resume refuses it after.
NON_TRAJECTORY_KEYS = frozenset(
    {
        "output_dir",
        "save_steps",
        "save_total_limit",
        "logging_steps",
        "report_to",
        "clustering.cache_dir",
        "eval",
        "loss.mini_batch_size",
        "chunk_size",
        "keep_best.metric",
    }
)
#: trajectory settings whose values differ but train the same run: GradCache computes its plain loss's gradients
#: (tests/test_losses.py), so a run that ran out of memory resumes with ``loss.name=cached_infonce``, and back
SAME_TRAJECTORY: dict[str, dict[Any, Any]] = {"loss.name": {"cached_infonce": "infonce"}}
#: local paths whose contents are a setting of their own (pre-training's ``data.sources.N.shards``, the shards by
#: their bytes; the trainers' ``model_fingerprint``, the base model's weights and pipeline): where the same files
#: lie does not change the run, so a copy elsewhere resumes. A hub id is compared by name.
BY_CONTENT = frozenset({"data.sources.path", "model"})


def resume_settings(recipe: Any, per_process_batch: bool = False) -> dict[str, Any]:
    """The recipe's settings that decide a run's trajectory, flattened to ``a.b`` keys (compared on resume).

    ``per_process_batch``: the recipe's batch is each process's (the unified trainer's ``batch_size``, pre-training's
    micro-batch), so the process count (``WORLD_SIZE``) is a setting too: resuming on another count would change
    the global batch silently. Where the batch is global (CDE, GLUE) the count may change."""
    data = recipe.model_dump(mode="json") if hasattr(recipe, "model_dump") else dict(recipe)
    flat: dict[str, Any] = {}

    def walk(node, prefix):
        for key, value in node.items():
            name = f"{prefix}{key}"
            if name == "eval" and isinstance(value, dict) and value.get("holdout") is not None:
                flat["eval.holdout"] = value["holdout"]  # the held-out rows are taken out of training
            if name in NON_TRAJECTORY_KEYS:
                continue
            if isinstance(value, dict) and value:
                walk(value, name + ".")
            else:
                flat[name] = value

    walk(data, "")
    if per_process_batch:
        flat["processes"] = int(os.environ.get("WORLD_SIZE", "1"))
    return flat


def resume_defaults(recipe: Any, per_process_batch: bool = False) -> dict[str, Any]:
    """The defaults of the recipe's fields, flattened as :func:`resume_settings` flattens its values. A run
    recorded before a field existed ran with that field's default behaviour (fields are added with defaults that
    keep it), so on resume a key missing from the folder's run and at its default now is not a difference."""
    from pydantic import BaseModel
    from pydantic_core import to_jsonable_python

    flat: dict[str, Any] = {}

    def walk(model: BaseModel, prefix: str) -> None:
        for name, field in type(model).model_fields.items():
            value = getattr(model, name)
            if isinstance(value, BaseModel):
                walk(value, f"{prefix}{name}.")
            elif not field.is_required():
                flat[f"{prefix}{name}"] = to_jsonable_python(field.get_default(call_default_factory=True))

    if isinstance(recipe, BaseModel):
        walk(recipe, "")
    if per_process_batch:
        flat["processes"] = 1  # a run recorded before the count was: resumed on one process, nothing changed
    return flat




def check_known_settings(out: Path, settings: dict[str, Any], defaults: dict[str, Any] | None = None) -> None:
    """``--resume`` where the folder's run recorded settings the caller derives only later (GLUE's steps come from
    its rows): each of ``settings`` must equal the folder's run's (a key the folder's run predates passes at its
    ``defaults`` value), before a finished run is reported done or a run loads anything."""
    saved = _saved_settings(out)
    if saved is not None:
        _check_same_run(out, {k: v for k, v in saved.items() if k in settings}, settings, defaults)


def check_inputs_outside(out: Path, inputs, what: str) -> None:
    """Refuse an output folder that holds (or is) one of the local ``inputs`` a run reads: clearing it, or the
    run's own writes, would destroy them. Names that are not local paths (hub ids) pass."""
    for item in inputs:
        if item is None or not Path(item).exists():
            continue
        path, folder = Path(item).resolve(), out.resolve()
        if path == folder or folder in path.parents:
            raise OutputDirError(
                f"{what} {out} holds {item}, which this run reads: writing there (or --overwrite, which clears it) "
                f"would destroy it; choose a new {what}"
            )


def _describe(folder: Path, limit: int = 5) -> str:
    names = sorted(p.name for p in folder.iterdir())
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _held(folder: Path) -> str:
    """What ``folder`` holds, as a refusal says it: the run its record names (``pretrain``, ``glue``, ...: a
    GLUE command pointed at a pre-training folder reads which run it is), then its first files."""
    command = _recorded_command(folder)
    return (f"a {command} run: " if command else "") + _describe(folder)


def _recorded_command(folder: Path) -> str | None:
    """The command its run record names (``train``, ``train-cde``, ``pretrain``, ``glue``, ...), or None."""
    command = _from_record(folder, "command")
    return command if isinstance(command, str) and command else None


def _check_command(out: Path, command: str | None, what: str) -> None:
    """A folder holding another command's run (its record's ``command``; ``train-cde`` is ``neoembed train``'s) is
    neither resumed nor cleared by this one: ``glue --out PRETRAIN_RUN --overwrite`` deleted a pre-training run."""
    held = _recorded_command(out)
    if command and held and held.split("-")[0] != command.split("-")[0]:
        raise OutputDirError(
            f"{what} {out} holds a {held} run ({_describe(out)}), not a {command} run: choose a new {what} "
            "(a command resumes or replaces only its own runs; delete that folder yourself to reuse it)"
        )


def stopped_before_a_checkpoint(output: Path) -> bool:
    """A run folder whose run started (its record is there), never finished and holds no complete checkpoint:
    ``--resume`` has nothing to continue from (a SIGKILL, a second Ctrl-C or a full disk before the first save)."""
    if not (output / RECORD).is_file() or _from_record(output, FINISHED) is not None:
        return False
    return not any(verify_checkpoint(c) is None for c in list_checkpoints(output))


def _from_record(output: Path, key: str) -> Any:
    """``key`` of ``output``'s run record, or None (no record, unreadable, no such key)."""
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return json.loads((output / RECORD).read_text()).get(key)
    return None


def _finished(output: Path, saved: dict | None, settings: dict | None) -> int | None:
    """The step at which ``output``'s run saved its final model, where resuming it with ``settings`` has
    nothing left to run: the same ``steps`` (more would train on; None: a caller that checks before it knows its
    settings, as ``neoembed glue`` does), and every entry the final save put in the folder still there (one gone:
    the final model was removed, and the run goes on from its newest complete checkpoint)."""
    finished = _from_record(output, FINISHED)
    if not isinstance(finished, dict):
        return None
    if settings is not None and (saved or {}).get("steps") != settings.get("steps"):
        return None
    entries = finished.get("entries") or []
    return int(finished["step"]) if all((output / name).exists() for name in entries) else None


def recorded_settings(output: Path) -> dict[str, Any]:
    """The settings a resume of ``output`` compares with ({} where none were recorded)."""
    return _saved_settings(output) or {}


def _saved_settings(output: Path) -> dict[str, Any] | None:
    """The trajectory settings of the run that wrote ``output``: its run record, else its newest marker."""
    saved = _from_record(output, "resume_settings")
    if saved is not None:
        return saved
    for ckpt in reversed(list_checkpoints(output)):
        with contextlib.suppress(ValueError, OSError):
            saved = json.loads((ckpt / CHECKPOINT_MARKER).read_text()).get("resume_settings")
            if saved is not None:
                return saved
    return None


def _differences(saved: dict[str, Any], now: dict[str, Any], defaults: dict[str, Any]) -> list[str]:
    missing = "(not set)"
    # a section set on one side and null on the other (keep_best switched on) is one difference, not one per key
    sections = {k for one, other in ((saved, now), (now, saved)) for k in one
                if k not in other and any(o.startswith(k + ".") for o in other)}  # fmt: skip
    saved, now, defaults = (_gathered(d, sections) for d in (saved, now, defaults))
    # a key the folder's run predates is no difference while it is at its default now
    keys = sorted(k for k in set(saved) | set(now) if k in saved or now[k] != defaults.get(k, missing))
    # a run recorded before the base model's fingerprint was a setting compares the model by its path, as then
    by_content = BY_CONTENT if "model_fingerprint" in saved else BY_CONTENT - {"model"}
    return [line for k in keys for line in _differing(k, saved.get(k, missing), now.get(k, missing), by_content)]


#: what a hashed setting's value stands for, said beside a difference in it (the hashes themselves say nothing)
HASHED = {
    "data.": "the card's source, columns, filter, labels, instruction or size, or its data files differ",
    "model_fingerprint": "the model's weights, its configuration and tokenizer files (pipeline), or its commit",
    "splits.": "the split's files differ: by content, files of 32 MB or more by size and modification time",
}


def _differing(key: str, then: Any, now: Any, by_content: frozenset[str]) -> list[str]:
    """The lines that say how setting ``key`` differs ([] where it trains the same run). Two lists of mappings
    of one length (``datasets``) are compared item by item and key by key, each difference on its own line."""
    if isinstance(then, dict) and isinstance(now, dict) and then.get("revision", "") is None:
        # a commit not known as the run started (a hub id not in the cache yet) is the one the cache holds since
        now = {**now, "revision": None}
    if trajectory_value(key, then, by_content) == trajectory_value(key, now, by_content):
        return []
    if isinstance(then, list) and isinstance(now, list) and len(then) == len(now):
        if all(isinstance(item, dict) for item in then + now):
            return [
                line
                for i, (a, b) in enumerate(zip(then, now, strict=True))
                for field in dict.fromkeys([*a, *b])
                for line in _differing(
                    f"{key}.{i}.{field}", a.get(field, "(not set)"), b.get(field, "(not set)"), by_content
                )
            ]
    hint = next((f" ({said})" for prefix, said in HASHED.items() if key.startswith(prefix)), "")
    if "(not set)" in (then, now):  # a card trained on one side only: added or dropped, not changed
        hint = " (trained on in one run only)" if key.startswith("data.") else ""
    return [f"{key}: {json.dumps(then, default=str)} in the folder's run, {json.dumps(now, default=str)} now{hint}"]


def _gathered(flat: dict[str, Any], sections: set[str]) -> dict[str, Any]:
    """``flat`` with the ``section.*`` keys of each section gathered into one mapping under its name."""
    out = {k: v for k, v in flat.items() if not any(k.startswith(s + ".") for s in sections)}
    for section in sections:
        inner = {k[len(section) + 1 :]: v for k, v in flat.items() if k.startswith(section + ".")}
        if inner:
            out[section] = inner
    return out


def trajectory_value(key: str, value: Any, by_content: frozenset[str] = BY_CONTENT) -> Any:
    """``value`` of setting ``key`` as the run it trains (:data:`SAME_TRAJECTORY`); a local path as the folder or
    file it names (``models/base/`` and ``./models/base`` are one model), inside lists and mappings too (a
    source's ``path``, also as ``data.sources.0.path``); a path in :data:`BY_CONTENT` not at all."""
    key = ".".join(part for part in key.split(".") if not part.isdigit())  # a list item's key is the list's
    if isinstance(value, list):
        return [trajectory_value(key, v, by_content) for v in value]
    if isinstance(value, dict):
        return {k: trajectory_value(f"{key}.{k}", v, by_content) for k, v in value.items()}
    if not isinstance(value, str):
        return value
    if key in by_content and (os.path.exists(value) or not HUB_ID.fullmatch(value)):
        return "(compared by content)"
    if value not in SAME_TRAJECTORY.get(key, {}) and os.path.exists(value):
        return str(Path(value).resolve())
    return SAME_TRAJECTORY.get(key, {}).get(value, value)


def _check_steps(ckpt: Path, saved: dict | None, settings: dict | None) -> None:
    """``steps`` may change on resume (to extend a run: the schedule follows the new value from there), but a
    checkpoint past the new end cannot be resumed (at the end exactly, the resume only saves the final model: a
    run killed between its last checkpoint and its final save)."""
    if not settings or "steps" not in settings:
        return
    step = int(json.loads((ckpt / CHECKPOINT_MARKER).read_text())["step"])
    if step > settings["steps"]:
        raise OutputDirError(
            f"--resume: {ckpt} is at step {step}, past this run's steps={settings['steps']}: resume with "
            f"steps >= {step}, or start a new run in another output_dir"
        )
    if saved and saved.get("steps") not in (None, settings["steps"]):
        logger.warning(
            "--resume: steps %s in the folder's run, %s now: the learning-rate schedule is recomputed for %s steps, "
            "so from step %s the rate is the new schedule's (where the old one had decayed, it rises again)",
            saved["steps"], settings["steps"], settings["steps"], step + 1,
        )  # fmt: skip


def _check_same_run(out: Path, saved: dict | None, settings: dict | None, defaults: dict | None) -> None:
    """``--resume``: the folder's run must have had these ``settings`` (``steps`` may change:
    :func:`_check_steps`)."""
    if settings is None or saved is None:
        return
    diff = _differences(
        {k: v for k, v in saved.items() if k != "steps"},
        {k: v for k, v in settings.items() if k != "steps"},
        defaults or {},
    )
    if diff:
        kind = f" (a {command} run)" if (command := _recorded_command(out)) else ""
        raise OutputDirError(
            f"--resume: {out} holds a different run{kind}; the settings that change the trajectory differ:\n  - "
            + "\n  - ".join(diff)
            + "\nresume with the folder's settings, or start a new run in another output_dir "
            "(or --overwrite to replace this one)"
        )


def clear_folder(path: Path) -> None:
    """Empty ``path`` (kept itself): its files and links removed, its folders with what they hold."""
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def prepare_output_dir(
    path: str | Path,
    *,
    overwrite: bool,
    resume: bool,
    settings: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
    checkpoints: bool = True,
    what: str = "output_dir",
    main_process: bool | None = None,
    clearable: tuple[str, ...] = (RECORD,),
    inputs: tuple[str | Path, ...] = (),
    resumable: bool = True,
    command: str | None = None,
) -> Path | None:
    """Check (and with ``overwrite``, clear) an output folder before anything is loaded or written.

    - a missing or empty folder: a fresh run (``resume`` is then an error: there is nothing to continue);
    - a non-empty folder: an error unless ``resume`` or ``overwrite``. ``overwrite`` clears a folder that a
      neoembed command wrote (it holds one of the ``clearable`` files: a run record by default) and refuses any
      other;
    - ``resume``: the folder's run must have the same ``settings`` (see :func:`resume_settings`; differences are
      named; a key the folder's run predates passes at its value in ``defaults``, see :func:`resume_defaults`);
      with ``checkpoints``, returns the newest complete checkpoint (an error if there is none).

    Returns the checkpoint to resume from, or ``None``. Raises :class:`OutputDirError` (exit 2), or
    :class:`RunFinished` where the folder's run finished and ``settings`` ask for no more steps. Only the main
    process (``main_process``, default: the launch's, :func:`~neoembed.runs.lock.launched_main`) checks a fresh
    folder and clears: the others would find its first writes; with ``resume`` every process reads the checkpoint
    to load. ``inputs``: the local files or folders the run reads (its model, its card); a used folder that holds
    one of them is refused whatever the flags, as ``--overwrite`` would delete what the run is about to read.
    ``resumable``: False for a command without ``--resume``, whose refusal of a used folder does not offer it.
    ``command``: the run record's name of the caller's runs; a folder holding another command's run is refused."""
    if main_process is None:
        main_process = launched_main()
    out = Path(path)
    used = _check_flags(out, overwrite, resume, what)
    if used:
        _check_command(out, command, what)
    if resume:
        saved = _saved_settings(out)
        _check_same_run(out, saved, settings, defaults)
        if (finished := _finished(out, saved, settings)) is not None:
            early = _from_record(out, "stopped_early")
            raise RunFinished(out, finished, (settings or {}).get("steps"), early)
        if not checkpoints:
            return None
        ckpt = find_resume_checkpoint(out)
        _check_steps(ckpt, saved, settings)
        return ckpt
    if not main_process:  # the main process checks and clears: its first writes could look like a used folder
        return None
    if used:
        check_inputs_outside(out, inputs, what)
        _check_used(out, overwrite, what, clearable, checkpoints, resumable)
        logger.warning("--overwrite: clearing %s (%s)", out, _describe(out))
        clear_folder(out)
    return None


def check_output_flags(
    path: str | Path,
    *,
    overwrite: bool,
    resume: bool,
    what: str = "output_dir",
    clearable: tuple[str, ...] = (RECORD,),
    resumable: bool = True,
    command: str | None = None,
) -> None:
    """What :func:`prepare_output_dir` refuses without the run's settings (the flags against the folder: nothing
    to resume, a used folder without --resume or --overwrite, an --overwrite of a folder that is not neoembed's),
    for a trainer to say before it reads its data: the settings a resume compares include the data's
    fingerprints, and preparing a card of millions of rows takes minutes. Clears nothing; the main process only
    (the others would find its first writes)."""
    out = Path(path)
    used = _check_flags(out, overwrite, resume, what)
    if used:
        _check_command(out, command, what)
    if used and not resume and launched_main():
        _check_used(out, overwrite, what, clearable, resumable=resumable)


def _check_flags(out: Path, overwrite: bool, resume: bool, what: str) -> bool:
    """The flags against the folder's state; returns whether the folder is used (not missing, not empty)."""
    if resume and overwrite:
        raise OutputDirError("--resume and --overwrite exclude each other: continue the run, or replace it")
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{what} {out} is a file, not a folder: choose a folder path")
    if out.is_dir() and not os.access(out, os.W_OK | os.X_OK):
        raise OutputDirError(f"{what} {out} is not writable: choose another {what}, or make it writable")
    used = out.is_dir() and any(out.iterdir())
    if resume and not used:
        raise OutputDirError(
            f"--resume: {what} {out} {'is empty' if out.is_dir() else 'does not exist'}, there is no run to "
            "continue: start without --resume"
        )
    return used


def _check_used(
    out: Path,
    overwrite: bool,
    what: str,
    clearable: tuple[str, ...],
    checkpoints: bool = True,
    resumable: bool = True,
) -> None:
    """A used folder without --resume: an error, unless --overwrite and the folder is this command's. A command
    that resumes from checkpoints (``checkpoints``) says when there is none to resume from."""
    if not overwrite:
        if checkpoints and stopped_before_a_checkpoint(out):
            raise OutputDirError(
                f"{what} {out} holds a run stopped before its first checkpoint ({_describe(out)}): there is nothing "
                f"to resume; pass --overwrite to start it again, or choose a new {what}"
            )
        resume = "pass --resume to continue the run it holds, " if resumable else "pass "
        raise OutputDirError(
            f"{what} {out} is not empty (it holds {_held(out)}): {resume}--overwrite to replace it, or "
            f"choose a new {what}"
        )
    if not any((out / name).is_file() for name in clearable):
        raise OutputDirError(
            f"--overwrite: {out} holds {_describe(out)} but no {' or '.join(clearable)} (what this command "
            "writes), so it is not this command's folder; "
            f"neoembed clears only its own folders: choose a new {what}, or empty this one yourself"
        )
