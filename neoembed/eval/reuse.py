"""Whether a results folder's finished tasks may stand for a new run of ``neoembed mteb``.

Every ``<task>.json`` records the settings that changed its score (:func:`neoembed.eval.runner.scoring_settings`:
instruction set, precision, backend, embedding precision and rescoring, truncate_dim, max length, the query prompt;
per task its instruction and the prompts mteb got). A folder holds one model's scores under one set of settings:
the summary averages every result in it and the run record describes them all. So a run whose settings differ
from any result already there is refused, naming each setting, before a task runs (and, where the setting is
known before the model loads, before it loads); with ``--overwrite`` those results are removed first and the
run's tasks re-scored. A result of an older neoembed that did not record a setting counts as scored with an
unknown value: it is never reused under any value.

A task served from local files also records their fingerprint (:func:`neoembed.eval.local_data.data_fingerprint`):
data are no setting of the folder but what the score was measured on, so a result whose task's files changed since
is not refused but stale: the task is scored again, with a warning saying why (:func:`changed_data`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from neoembed.runs import OutputDirError

__all__ = ["UNRECORDED", "changed_data", "check_reuse", "conflicts"]

logger = logging.getLogger(__name__)
UNRECORDED = "unrecorded"
#: the options that set each setting, as the refusal names them
FLAGS = {
    "instructions": "--instructions",
    "precision": "--precision",
    "backend": "--backend / --onnx-file / --quantize",
    "embedding_precision": "--embedding-precision",
    "rescore": "--rescore / --rescore-docs",
    "truncate_dim": "--truncate-dim",
    "max_length": "--max-length",
    "query_prompt": "--query-prompt",
    "cde_context": "--cde-context",
    "cde_seed": "--seed (it draws a CDE model's context sample)",
    "instruction": "the task's instruction (--instructions, or its card)",
    "prompts": "the task's prompts (--instructions, --query-prompt)",
}


def recorded(entry: dict, key: str):
    """What a result says of ``key``; a result written before neoembed recorded it says :data:`UNRECORDED`,
    except where only one value existed then."""
    from neoembed.eval.summary import SETTING_DEFAULTS

    return entry.get(key, SETTING_DEFAULTS.get(key, UNRECORDED))


def conflicts(output: Path, settings: dict, per_task: dict[str, dict]) -> dict[str, dict]:
    """task -> {setting: its recorded value} for every result in ``output`` that ``settings`` (and, for a task of
    this run, its ``per_task`` settings) do not match."""
    from neoembed.eval.summary import load_run

    found = {}
    results = load_run(output) if output.is_dir() else {}
    for name, entry in results.items():
        wanted = {**settings, **per_task.get(name, {})}
        differ = {key: recorded(entry, key) for key, value in wanted.items() if recorded(entry, key) != value}
        if differ:
            found[name] = differ
    return found


def changed_data(output: Path, fingerprints: dict[str, str | None]) -> dict[str, str | None]:
    """task -> the data fingerprint its result in ``output`` records, for each task of ``fingerprints`` (this run's:
    None for a hub task) whose result was scored on other data: other local files, local files where the task now
    reads the hub's or the other way round, or local files before neoembed recorded them (None)."""
    from neoembed.eval.summary import load_run

    results = load_run(output) if output.is_dir() else {}
    return {
        name: results[name].get("data_fingerprint")
        for name, now in fingerprints.items()
        if name in results and results[name].get("data_fingerprint") != now
    }


def check_reuse(output: Path, settings: dict, per_task: dict[str, dict], overwrite: bool) -> None:
    """Refuse a run whose ``settings`` differ from a result in ``output`` (``OutputDirError``, exit 2), naming each
    setting, the value the results hold and this run's; with ``overwrite``, remove those results instead."""
    found = conflicts(Path(output), settings, per_task)
    if not found:
        return
    if not overwrite:
        raise OutputDirError(_message(Path(output), settings, per_task, found))
    for name in found:
        (Path(output) / f"{name}.json").unlink(missing_ok=True)
    logger.warning(
        "--overwrite: removed the results of %s from %s, scored with other settings (%s)",
        ", ".join(found),
        output,
        "; ".join(f"{k} {_show(k, v)}" for k, v in next(iter(found.values())).items()),
    )


def _show(key: str, value) -> str:
    if value == UNRECORDED:
        return "unrecorded (written before neoembed recorded it)"
    if key == "truncate_dim" and value is None:
        return "none (every dimension)"
    if key in ("query_prompt", "instruction", "prompts"):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _message(output: Path, settings: dict, per_task: dict[str, dict], found: dict[str, dict]) -> str:
    lines = []
    for key in FLAGS:
        held: dict[str, list[str]] = {}
        for name, differ in found.items():
            if key in differ:
                held.setdefault(_show(key, differ[key]), []).append(name)
        if not held:
            continue
        first = next(iter(held.values()))[0]
        ours = _show(key, {**settings, **per_task.get(first, {})}[key])
        there = "; ".join(f"{value} ({', '.join(names)})" for value, names in held.items())
        lines.append(f"  {key} ({FLAGS[key]}): the results hold {there}; this run: {ours}")
    return (
        f"results folder {output} holds results scored with other settings, which this run would report as its "
        "own:\n"
        + "\n".join(lines)
        + "\nRun with the folder's settings to reuse them, choose another --output to "
        "keep both, or --overwrite to re-score (the results of other settings are removed)"
    )
