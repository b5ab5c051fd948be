"""Summaries in the form of the paper's Table 4: one row per model, the mean main score per task type,
the overall mean over tasks, and how many tasks are covered (a partial suite is labelled so)."""

from __future__ import annotations

import csv
import io
import json
import logging
from collections import Counter
from pathlib import Path

from neoembed.eval.task_types import TASK_TYPES
from neoembed.record import RUN_RECORD, atomic_write_text

__all__ = ["MTEB_ENG_V1_TASKS_PER_TYPE", "compare_runs", "load_run", "summarize", "write_summary"]

logger = logging.getLogger(__name__)
TYPE_ORDER = tuple(TASK_TYPES)  # Table 4's column order
#: Task counts of MTEB(eng, v1) per type (56 tasks; CQADupstack counted once).
MTEB_ENG_V1_TASKS_PER_TYPE = {name: spec.mteb_eng_v1_tasks for name, spec in TASK_TYPES.items()}


def load_run(run_dir: str | Path) -> dict[str, dict]:
    """task name -> result entry, for the per-task JSON files of one ``neoembed mteb`` output folder."""
    run_dir = Path(run_dir)
    out = {}
    for f in sorted(run_dir.glob("*.json")):
        if f.name in (RUN_RECORD, "summary.json"):
            continue
        entry = json.loads(f.read_text())
        if "main_score" in entry and "type" in entry:
            out[entry["task"]] = entry
    return out


def summarize(results: dict[str, dict], model: str, full_suite: dict[str, int] | None = None) -> dict:
    """Per-type means, overall mean over tasks, task count, and whether the suite is partial."""
    by_type: dict[str, list[float]] = {}
    for entry in results.values():
        by_type.setdefault(entry["type"], []).append(float(entry["main_score"]))
    types = [t for t in TYPE_ORDER if t in by_type] + sorted(set(by_type) - set(TYPE_ORDER))
    scores = [s for v in by_type.values() for s in v]
    suite = full_suite or MTEB_ENG_V1_TASKS_PER_TYPE
    own = sorted(n for n, entry in results.items() if entry.get("own_task"))  # tasks of the user's own cards
    mteb_types = Counter(e["type"] for e in results.values() if not e.get("own_task"))
    # a suite is partial against MTEB(eng, v1); a run of own tasks alone is no part of it
    partial = len(results) > len(own) and any(mteb_types[t] < n for t, n in suite.items())
    return {
        "model": model,
        **{key: _setting(results, key) for key in COMPARED_SETTINGS},
        "cde_context": _cde_context(results),
        "query_prompt_label": _prompt_label(results),
        "query_prompt_setting": _prompt_setting(results),
        # tasks of a --rescore run that had no search to rescore (scored on the quantized embeddings alone)
        "rescore_not_applied": sorted(n for n, e in results.items() if e.get("rescore_applied") is False),
        # local data whose card says it is not the mteb task's: scores that do not compare with published ones
        "differs_from_mteb": {
            n: e["differs_from_mteb"] for n, e in sorted(results.items()) if e.get("differs_from_mteb")
        },
        "metrics": {n: e.get("main_score_name") for n, e in sorted(results.items())},  # each task's main score
        "sizes": {n: _size(e["texts_encoded"]) for n, e in sorted(results.items()) if e.get("texts_encoded")},
        # None where a result predates the record of its instruction
        "tasks_with_instruction": (
            sum(1 for e in results.values() if e.get("instruction"))
            if all("instruction" in e for e in results.values())
            else None
        ),
        "per_type": {t: sum(by_type[t]) / len(by_type[t]) for t in types},
        "tasks_per_type": {t: len(by_type[t]) for t in types},
        "mean": sum(scores) / len(scores) if scores else None,  # None: no task scored (JSON has no NaN)
        "n_tasks": len(scores),
        "own_tasks": own,
        "partial": partial,
    }


def _size(encoded: dict[str, int]) -> str:
    """What a score rests on: the queries a search scored, else every text encoded (an STS task's two
    sentences of each pair, a classification task's training and test texts)."""
    if encoded.get("query"):
        return f"{encoded['query']:,} quer{'y' if encoded['query'] == 1 else 'ies'}"
    total = sum(encoded.values())
    return f"{total:,} text{'' if total == 1 else 's'}"


#: Result settings that change scores: two runs are comparable only when each is the same in both.
COMPARED_SETTINGS = (
    "instructions",
    "precision",
    "query_prompt",
    "truncate_dim",
    "max_length",
    "backend",
    "embedding_precision",
    "rescore",
)
#: what a result file written before a setting was recorded ran with, where only one value existed then (before
#: --query-prompt, a task without instruction was scored with an empty query prompt)
SETTING_DEFAULTS = {"embedding_precision": "fp32", "rescore": "none", "backend": "torch", "query_prompt": ""}


def _shown(key: str, value) -> str:
    if key == "truncate_dim" and value is None:
        return "full"
    if key == "query_prompt" and value != "unrecorded":
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _setting(results: dict[str, dict], key: str) -> str:
    """One run's value of a setting over its tasks ("a + b" when its tasks were scored differently)."""
    values = sorted(
        {_shown(key, entry.get(key, SETTING_DEFAULTS.get(key, "unrecorded"))) for entry in results.values()}
    )
    return " + ".join(values) if values else "none"


def _cde_context(results: dict[str, dict]) -> str | None:
    """A CDE model's context over its tasks ("corpus, seed S" or "null"; "a + b" when they differ); None for a
    model that embeds without one."""
    values = {
        entry["cde_context"] + (f", seed {entry['cde_seed']}" if "cde_seed" in entry else "")
        for entry in results.values()
        if "cde_context" in entry
    }
    return " + ".join(sorted(values)) or None


def _prompt_text(entry: dict) -> str:
    return entry.get("query_prompt", SETTING_DEFAULTS["query_prompt"])


def _prompt_choices(results: dict[str, dict]) -> set[str]:
    """Every ``--query-prompt`` choice that scores a run's results as they were scored: the one text their
    queries got (as JSON), and ``saved`` too where that text is the model's saved prompt, as a result scored
    with ``saved`` shows (a folder holds one model's scores). Empty where its results got different texts.

    The one definition of a run's query prompt: the reuse check reuses a result under the text its queries
    got (``saved`` and ``none`` are one setting for a model that saved no prompt); the summary's first line
    and ``compare`` follow it, so a folder is never refused by its own comparison."""
    texts = {_prompt_text(entry) for entry in results.values()}
    if len(texts) != 1:
        return set()
    choices = {json.dumps(texts.pop(), ensure_ascii=False)}
    if any(entry.get("query_prompt_source") == "saved" for entry in results.values()):
        choices.add("saved")
    return choices


def _prompt_setting(results: dict[str, dict]) -> str:
    """The query prompt as a user would choose it to score every result of a run: ``saved`` where the
    model's saved prompt does (each model its own, which differs between a base model and its fine-tune by
    design), else the text (none: the empty one); where its results got different texts, their labels."""
    choices = _prompt_choices(results)
    if "saved" in choices:
        return "saved"
    return choices.pop() if choices else _prompt_label(results)


def _prompt_label(results: dict[str, dict]) -> str:
    """How a run's query prompt is named in a summary's first line: ``saved "<text>"`` where it is the
    model's saved prompt (``saved (none)`` where the model saved none), else ``none`` or the text; where its
    results got different texts, each one's."""
    choices = _prompt_choices(results)
    texts = choices - {"saved"}
    if texts or not results:
        return _text_label(json.loads(texts.pop()) if texts else "", "saved" in choices)
    labels = {_text_label(_prompt_text(e), e.get("query_prompt_source") == "saved") for e in results.values()}
    return " + ".join(sorted(labels))


def _text_label(text: str, saved: bool) -> str:
    if saved:  # a model that saved no query prompt: `saved ""` read as a prompt of quotes
        return f"saved {json.dumps(text, ensure_ascii=False)}" if text else "saved (none)"
    return "none" if text == "" else json.dumps(text, ensure_ascii=False)


def _settings_line(rows: list[dict]) -> str:
    """The header line every table carries: which instruction set and precision produced its scores."""
    said = {key: sorted({r.get(key, "unrecorded") for r in rows}) for key in COMPARED_SETTINGS}
    skipped = sorted({t for r in rows for t in r.get("rescore_not_applied", [])})
    note = (
        f" (rescoring applies to Retrieval and Reranking; not applied to {', '.join(skipped)})"
        if skipped
        else ""
    )
    prompts = sorted({r.get("query_prompt_label", "unrecorded") for r in rows})
    contexts = sorted({r["cde_context"] for r in rows if r.get("cde_context")})
    note += f" · CDE context: {', '.join(contexts)}" if contexts else ""
    none = " (`--instructions none` scores a model without task instructions)"
    hint = "" if said["instructions"] == ["none"] else none
    instructions = ", ".join(said["instructions"])
    if hint and all(r.get("tasks_with_instruction") == 0 for r in rows):  # the set named gave none of them one
        instructions, hint = f"{instructions} (none of these tasks has one)", ""
    return (
        f"Instructions: {instructions} · precision: {', '.join(said['precision'])} · "
        f"query prompt: {', '.join(prompts)} · dims: {', '.join(said['truncate_dim'])} · "
        f"max length: {', '.join(said['max_length'])} · backend: {', '.join(said['backend'])} · "
        f"embeddings: {', '.join(said['embedding_precision'])} · rescore: {', '.join(said['rescore'])}{note}{hint}\n\n"
    )


def _markdown(rows: list[dict]) -> str:
    if not rows or all(r["n_tasks"] == 0 for r in rows):
        return "No task produced a score: see the failures/ folder of the run for each task's error.\n"
    types = []
    for r in rows:
        types += [t for t in r["per_type"] if t not in types]
    shared = rows[0].get("shared_tasks")  # set by a comparison of runs that scored different tasks
    extra = [] if shared is None else [f"mean of the {shared} tasks all runs scored"]
    columns = [f"{t} ({max(r['tasks_per_type'].get(t, 0) for r in rows)})" for t in types]
    columns += ["mean", "tasks", *extra]
    head = "| model | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns) + "\n"
    lines = []
    for r in rows:
        cells = [f"{100 * r['per_type'][t]:.2f}" if t in r["per_type"] else "–" for t in types]
        own = len(r.get("own_tasks", []))
        mine = "" if not own else "own" if own == r["n_tasks"] else f"{own} own"
        said = [x for x in ("partial" if r["partial"] else "", mine) if x]
        label = f"{r['n_tasks']} ({'; '.join(said)})" if said else str(r["n_tasks"])
        cells += [f"{100 * r['mean']:.2f}", label]
        if extra:
            cells.append("–" if r["shared_mean"] is None else f"{100 * r['shared_mean']:.2f}")
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    note = (
        ""
        if shared is None
        else "The runs scored different tasks: each row's means cover its own tasks (the column counts are the "
        "most any run scored); the last column compares them on the same tasks.\n\n"
    )
    differs = {t: why for r in rows for t, why in r.get("differs_from_mteb", {}).items()}
    footnote = "".join(
        f"\nNot the mteb task's data: {t} ({why}): its score does not compare with published ones.\n"
        for t, why in sorted(differs.items())
    )
    return _settings_line(rows) + note + head + "\n".join(lines) + "\n" + footnote + _metrics_line(rows)


def _metrics_line(rows: list[dict]) -> str:
    """What the numbers are: each task's main score x 100, named per task (a handful) or counted per metric."""
    metrics = {t: m for r in rows for t, m in r.get("metrics", {}).items() if m}
    if not metrics:
        return ""
    if len(metrics) <= 6:
        sizes = {t: {r["sizes"][t] for r in rows if t in r.get("sizes", {})} for t in metrics}
        said = ", ".join(
            f"{t} {m}" + (f" over {next(iter(sizes[t]))}" if len(sizes[t]) == 1 else "")
            for t, m in sorted(metrics.items())
        )
    else:
        counts = Counter(metrics.values())
        said = ", ".join(
            f"{m} ({n} task{'s' * (n != 1)})" for m, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        )
        own = {t: r["sizes"][t] for r in rows for t in r.get("own_tasks", []) if t in r.get("sizes", {})}
        if own:  # a few dozen queries of one's own move a score by whole points: their number stays in sight
            said += "; own tasks: " + ", ".join(f"{t} over {size}" for t, size in sorted(own.items()))
    return f"\nScores are each task's main score x 100: {said}; a type's column is the mean of its tasks.\n"


def _csv(rows: list[dict]) -> str:
    types = []
    for r in rows:
        types += [t for t in r["per_type"] if t not in types]
    buf = io.StringIO()
    w = csv.writer(buf)
    shared = ["shared_mean"] if "shared_mean" in rows[0] else []  # see _add_shared_mean
    w.writerow(["model", *types, "mean", "n_tasks", "partial", *shared])
    for r in rows:
        cells = [
            r["model"],
            *[r["per_type"].get(t, "") for t in types],
            r["mean"],
            r["n_tasks"],
            r["partial"],
        ]
        w.writerow(cells + [r.get(k) for k in shared])
    return buf.getvalue()


def write_summary(run_dir: str | Path, model: str) -> dict:
    """Write summary.md / summary.csv / summary.json into the run folder; returns the summary row."""
    run_dir = Path(run_dir)
    row = summarize(load_run(run_dir), model)
    atomic_write_text(run_dir / "summary.json", json.dumps(row, indent=2) + "\n")
    atomic_write_text(run_dir / "summary.md", _markdown([row]))
    atomic_write_text(run_dir / "summary.csv", _csv([row]))
    return row


#: what a comparison writes into its folder
COMPARE_FILES = ("compare.md", "compare.csv", "compare.png")


def compare_runs(run_dirs: list[str | Path], out: str | Path | None = None, overwrite: bool = False) -> str:
    """Side-by-side table of several runs (markdown, returned) and, if ``out`` is given, a bar chart per task
    type (PNG) and the table as markdown/CSV there. A folder that holds a comparison already is refused (naming
    the models it compared) unless ``overwrite``."""
    if out is not None and not overwrite:
        _refuse_an_earlier_comparison(Path(out))
    seen: dict[Path, str] = {}
    for d in map(str, run_dirs):  # one folder twice would be two rows of one run, read as two models that agree
        if (key := Path(d).resolve()) in seen:
            raise ValueError(f"{d} is given twice (as {seen[key]} and {d}): name each results folder once")
        seen[key] = d
    rows = []
    for d in run_dirs:
        d = Path(d)
        results = load_run(d)
        if not results:
            raise FileNotFoundError(f"{d} holds no neoembed mteb results (<task>.json files)")
        model = next(iter(results.values())).get("model") or d.name
        rows.append({**summarize(results, model), "run": str(d), "tasks": results})
    _check_comparable(rows)
    _add_shared_mean(rows)
    if len({r["truncate_dim"] for r in rows}) > 1:  # a Matryoshka model at several widths: each row says its own
        for r in rows:
            dims = r["truncate_dim"]
            r["model"] = f"{r['model']} ({dims if dims == 'full' else f'{dims} dims'})"
    if len({r["model"] for r in rows}) < len(rows):  # the same model in several runs: name the runs
        for r in rows:
            r["model"] = f"{r['model']} [{Path(r['run']).name}]"
    table = _markdown(rows)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "compare.md", table)
        atomic_write_text(out / "compare.csv", _csv(rows))
        _plot(rows, out / "compare.png")
    return table


def _add_shared_mean(rows: list[dict]) -> None:
    """Runs that scored different tasks: their means cover different tasks, so each row also gets the mean over
    the tasks every run scored (``shared_mean``, None if there are none), and the table says so."""
    shared = set.intersection(*(set(r["tasks"]) for r in rows))
    if all(set(r["tasks"]) == shared for r in rows):
        return
    for r in rows:
        scores = [float(r["tasks"][t]["main_score"]) for t in shared]
        r["shared_tasks"] = len(shared)
        r["shared_mean"] = sum(scores) / len(scores) if scores else None
    logger.warning(
        "the runs scored different tasks (%s): their means cover different tasks; compare them by the mean over "
        "the %d tasks all of them scored",
        ", ".join(f"{Path(r['run']).name}: {len(r['tasks'])}" for r in rows),
        len(shared),
    )


def _refuse_an_earlier_comparison(out: Path) -> None:
    there = [name for name in COMPARE_FILES if (out / name).exists()]
    if not there:
        return
    try:
        with (out / "compare.csv").open(encoding="utf8") as f:
            models = ", ".join(row["model"] for row in csv.DictReader(f))
    except (OSError, KeyError, csv.Error):
        models = "unknown models"
    raise FileExistsError(
        f"{out} already holds a comparison ({', '.join(there)}; of {models}): pass --out DIR to keep it and write "
        "this one elsewhere, or --overwrite to replace it"
    )


#: settings two models' runs must share to be compared: those the user chooses. A model's own max length and the
#: text of its own saved query prompt belong to the model (a base model and its fine-tune differ in both), so the
#: table states them and the query prompt is compared by :func:`_check_prompts`; the width is what a Matryoshka
#: model is compared across, so each row names its own (one run scored at two widths is still refused)
ACROSS_MODELS = tuple(k for k in COMPARED_SETTINGS if k not in ("max_length", "query_prompt"))
PER_ROW = ("truncate_dim",)


def _check_comparable(rows: list[dict]) -> None:
    """Runs scored with different instruction sets or precisions are not compared: an instruction set alone moves
    all-MiniLM-L6-v2 by 7 points on STS13, more than most fine-tunes gain."""
    for key in ACROSS_MODELS:
        values = {r["run"]: r[key] for r in rows}
        mixed = {run: v for run, v in values.items() if " + " in v}
        if key in PER_ROW and mixed:  # another width per run is a row of its own; one run at two is no row
            runs = ", ".join(f"{run}: {v}" for run, v in mixed.items())
            raise ValueError(
                f"{runs}: the folder's results were scored at different {key} values, so its row would mix them. "
                f"Re-score it at one --{key.replace('_', '-')} (--overwrite), or keep each width in its own folder"
            )
        if (len(set(values.values())) > 1 and key not in PER_ROW) or mixed:
            runs = ", ".join(f"{run}: {v}" for run, v in values.items())
            flag = "--" + key.replace("_", "-")
            raise ValueError(
                f"these runs were scored with different {key} ({runs}): their scores are not comparable. "
                f"Re-run neoembed mteb with one {flag} for every model (--overwrite re-scores a folder)"
            )
    _check_prompts(rows)
    _check_data(rows)
    contexts = {r["run"]: r["cde_context"] for r in rows if r.get("cde_context")}  # CDE models among the runs
    if len(set(contexts.values())) > 1 or any(" + " in v for v in contexts.values()):
        runs = ", ".join(f"{run}: {v}" for run, v in contexts.items())
        raise ValueError(
            f"these CDE runs were scored with different contexts ({runs}): their scores are not comparable. "
            "Re-run neoembed mteb with one --cde-context (and --seed) for every CDE model"
        )


def _check_data(rows: list[dict]) -> None:
    """A local task scored on other data in another run (its fingerprint differs: the held-out file edited or cut
    between the runs) is not compared: the data alone can move a score more than a fine-tune does."""
    tasks = {t for r in rows for t in r["tasks"]}
    differ, runs = [], set()
    for task in sorted(tasks):
        prints = {r["run"]: r["tasks"][task].get("data_fingerprint") for r in rows if task in r["tasks"]}
        if len({json.dumps(v, sort_keys=True) for v in prints.values() if v is not None}) > 1:
            differ.append(task)
            runs.update(prints)
    if differ:  # every such task named at once: a rerun for the first would meet the next
        raise ValueError(
            f"task{'s' if len(differ) > 1 else ''} {', '.join(differ)} {'were' if len(differ) > 1 else 'was'} "
            f"scored on different data in these runs ({', '.join(sorted(runs))}: the data fingerprints differ): "
            "their scores are not comparable. Re-run neoembed mteb on the same data for every model "
            "(--overwrite re-scores a folder)"
        )


def _check_prompts(rows: list[dict]) -> None:
    """Runs compare when one ``--query-prompt`` choice scores every result of all of them
    (:func:`_prompt_choices`): ``saved`` (each model its own saved prompt), or one text all queries got."""
    if set.intersection(*(_prompt_choices(r["tasks"]) for r in rows)):
        return
    runs = ", ".join(f"{r['run']}: {r['query_prompt_label']}" for r in rows)
    raise ValueError(
        f"these runs were scored with different query_prompt_setting ({runs}): their scores are not "
        "comparable. Re-run neoembed mteb with one --query-prompt for every model (--overwrite re-scores a "
        "folder)"
    )


def _plot(rows: list[dict], path: Path) -> None:
    """One panel per task type (width by its number of tasks), one bar per run and task, each labelled with its
    score; the y axis starts at zero (a bar's height is its score: a zoomed axis made 0.3 points look large);
    runs are named by their folder in a legend below the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    types = []
    for r in rows:
        types += [t for t in r["per_type"] if t not in types]
    tasks_of = {
        t: sorted({name for r in rows for name, e in r["tasks"].items() if e["type"] == t}) for t in types
    }
    names = [Path(r["run"]).name for r in rows]
    if len(set(names)) < len(names):
        names = [r["model"] for r in rows]
    scores = [100 * e["main_score"] for r in rows for e in r["tasks"].values()]
    high = max(scores) * 1.15 + 1 if scores else 100.0  # room for the labels above the bars
    n_tasks = [len(tasks_of[t]) for t in types]
    fig, axes = plt.subplots(
        1,
        len(types),
        figsize=(max(5.0, 1.0 + 0.35 * len(rows) * sum(n_tasks) + 0.8 * len(types)), 4.2),
        squeeze=False,
        gridspec_kw={"width_ratios": n_tasks},
    )
    width = 0.8 / len(rows)
    for ax, t in zip(axes[0], types, strict=True):
        tasks = tasks_of[t]
        x = np.arange(len(tasks))
        for i, r in enumerate(rows):
            ys = [100 * r["tasks"][n]["main_score"] if n in r["tasks"] else np.nan for n in tasks]
            bars = ax.bar(x + i * width, ys, width, label=names[i], color=f"C{i}")
            ax.bar_label(bars, fmt="%.2f", fontsize=7, rotation=90, padding=2)
        ax.set_xticks(x + width * (len(rows) - 1) / 2, tasks, rotation=45, ha="right", fontsize=8)
        ax.set_ylim(0, high)
        ax.set_title(t)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("main score (x100)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(rows), 4), fontsize=8, frameon=False)
    rows_of_legend = -(-len(rows) // 4)
    fig.tight_layout(rect=(0, 0.06 * rows_of_legend + 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
