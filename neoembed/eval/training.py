"""Evaluation during training: a recipe's ``eval:`` block scored by the code of ``neoembed mteb``.

:class:`MtebEvaluator` is a sentence-transformers evaluator, so the unified trainer runs it every ``eval.steps``
(``eval_strategy="steps"``) and its scores reach ``metrics.jsonl``, every tracker of ``report_to`` and the
best-checkpoint logic (``keep_best``) as ``eval_<metric>``. Each evaluation is :func:`neoembed.eval.runner.run_mteb`
on the model being trained, with the same instructions, template, batch size and seed as ``neoembed mteb``: a score
logged at step N equals ``neoembed mteb --model OUTPUT/checkpoint-N --tasks ...`` on that checkpoint. The per-task
JSON of each evaluation is kept in ``OUTPUT/eval/step-N/``.
"""

from __future__ import annotations

import difflib
import logging
import math
import re
import shutil
from pathlib import Path

from sentence_transformers.sentence_transformer.evaluation import SentenceEvaluator

from neoembed.eval.runner import EvalConfig, run_mteb
from neoembed.recipe import resolve_recipe_path

__all__ = ["MtebEvaluator", "task_metric"]

logger = logging.getLogger(__name__)


def task_metric(entry: dict, metric: str) -> float:
    """``metric`` of one ``neoembed mteb`` task entry (``OUTPUT/<task>.json``): ``main_score`` is the task's main
    score; any other name is read from mteb's scores and averaged over splits and subsets, as mteb averages."""
    if metric == "main_score":
        return float(entry["main_score"])
    values = [s[metric] for rows in entry["mteb"]["scores"].values() for s in rows if metric in s]
    if not values:
        names = sorted({k for rows in entry["mteb"]["scores"].values() for s in rows for k in s})
        names = [n for n in names if n not in ("hf_subset", "languages", "mteb_version")]
        close = difflib.get_close_matches(metric, names, n=3, cutoff=0.8)
        shown = [n for n in names if not n.startswith("nauc_")]  # mteb's per-threshold AUC diagnostics: many
        raise ValueError(  # bad input (exit 2), found at the first evaluation
            f"eval.metric {metric!r} is not a score of task {entry['task']} ({entry['type']})"
            + (f"; did you mean {' or '.join(map(repr, close))}?" if close else "")
            + f" Its scores: {', '.join(shown)}"
            + (f" (and {len(names) - len(shown)} nauc_* ones)" if len(shown) < len(names) else "")
        )
    return sum(values) / len(values)


class MtebEvaluator(SentenceEvaluator):
    """Scores the model on ``settings.tasks`` (task folders, task cards or mteb task names; paths relative to
    ``recipe_dir``) with :func:`~neoembed.eval.runner.run_mteb`. Returns ``{metric: mean over tasks,
    "<task>_<metric>": per task}``; the trainer prefixes each key with ``eval_``."""

    def __init__(
        self, settings, recipe_dir: Path | None = None, extra_tasks: list[str] | tuple = (), compares: bool = False
    ):
        super().__init__()
        self.settings = settings
        self.compares = compares  # keep_best: each score is compared with an earlier one, on the same data only
        own = [_task_path(t, recipe_dir) for t in settings.tasks]
        self.task_names = _check_tasks(own, settings.metric)  # mteb's names: the scores are "<name>_<metric>"
        self.tasks = own + list(extra_tasks)  # + the holdout's (written when training starts)
        self.primary_metric = settings.metric

    def __call__(self, model, output_path: str | None = None, epoch: float = -1, steps: int = -1) -> dict:
        root = Path(output_path) if output_path is not None else Path("eval")
        out = root / f"step-{steps}"
        # this evaluator's own folder for the step: an evaluation run again (a resume's, after one that failed)
        # replaces it without the results folder's warning about clearing another model's scores
        shutil.rmtree(out, ignore_errors=True)
        cfg = EvalConfig(
            model=str(root.parent / f"checkpoint-{steps}"),  # where this state is saved, if save_steps allows
            output=out,
            tasks=self.tasks,
            instructions=self.settings.instructions,
            batch_size=self.settings.batch_size,
            overwrite=True,  # seed, precision, template: neoembed mteb's defaults, so the scores are its scores
        )
        was_training, rng = model.training, _rng_state()
        model.eval()
        try:  # run_mteb seeds every generator: the training's own streams are put back after it
            report = run_mteb(cfg, model=model)
        finally:
            model.train(was_training)
            _set_rng_state(rng)
        if report.failed:
            raise RuntimeError(
                f"evaluation at step {steps} failed: {report.failed} (details in {out}/failures)"
            )
        self._check_same_data(root, steps, report.scores)
        scores = {
            f"{name}_{self.primary_metric}": task_metric(e, self.primary_metric)
            for name, e in report.scores.items()
        }
        finite = [v for v in scores.values() if math.isfinite(v)]
        scores[self.primary_metric] = sum(finite) / len(finite) if finite else float("nan")
        return scores

    def _check_same_data(self, root: Path, step: int, entries: dict) -> None:
        """A task's local files edited in place since the run's last evaluation (between a kill and ``--resume``,
        say) make its scores before and after incomparable: with ``keep_best`` (``compares``) the evaluation
        fails (the run saves its steps and stops; put the files back and resume), else a warning says from which
        step on. The holdout's folders are rewritten at every start (``check_same_holdout`` checks them)."""
        from neoembed.eval.reuse import changed_data

        done = [int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit() and int(p.name[5:]) < step]
        if not done:
            return
        now = {name: e.get("data_fingerprint") for name, e in entries.items() if name in self.task_names}
        changed = changed_data(root / f"step-{max(done)}", now)
        if not changed:
            return
        said = (
            f"the data of eval task(s) {', '.join(changed)} changed since the evaluation at step {max(done)} (its "
            f"files were edited): scores from step {step} on do not compare with earlier ones"
        )
        if self.compares:
            raise ValueError(
                f"{said}, and keep_best compares them with the best so far. Put the task's files back as they "
                "were and continue with --resume, or start a new run in another output_dir"
            )
        logger.warning(said)


#: score names whose family is certain: ranking scores exist only for tasks that rank documents, correlations
#: only for tasks that score pairs; any other name is checked at the first evaluation (mteb names it per evaluator)
METRIC_FAMILIES = (
    (re.compile(r"(ndcg|map|recall|precision|mrr)_at_\d+"), "a ranking score", {"Retrieval", "Reranking"}),
    (re.compile(r"((cosine|manhattan|euclidean|dot)_)?(pearson|spearman)"), "a correlation", {"STS", "Summarization"}),
)  # fmt: skip


def _check_tasks(tasks: list[str], metric: str = "main_score") -> list[str]:
    """Every eval task resolves before training starts, not at the first evaluation after ``eval.steps`` steps
    (whose failure stops the run: its steps are saved, and a resume runs that evaluation first). A ``metric`` of
    a family the task's type has no score of (:data:`METRIC_FAMILIES`) is refused too. Returns the tasks'
    names."""
    from neoembed.eval.resolve import Unresolvable, resolve_tasks

    if not tasks:  # the holdout's alone (an empty list would resolve to the whole default benchmark)
        return []
    try:
        resolved = resolve_tasks(EvalConfig(model="-", output="-", tasks=tasks))
    except KeyError as e:  # mteb: an unknown task name
        said = str(e.args[0] if e.args else e).removeprefix("KeyError: ")
        paths = [t for t in tasks if not Path(t).exists() and ("/" in t or t.endswith((".yaml", ".yml")))]
        if paths:  # written as a path: mteb's "not found" would hide that the folder or card is missing
            raise ValueError(
                f"eval.tasks: {', '.join(paths)} is no task folder or task card (a relative path is looked up in the "
                "working directory, then the recipe's folder) and no mteb task name; docs/evaluation.md shows local "
                "task folders"
            ) from None
        raise ValueError(f"eval.tasks: {said}") from None
    for task, _ in resolved:
        if isinstance(task, Unresolvable):
            raise ValueError(f"eval.tasks: {task.metadata.name}: {task.error}")
        kind = task.metadata.type.removeprefix("Instruction")
        for pattern, family, types in METRIC_FAMILIES:
            if pattern.fullmatch(metric) and kind not in types and metric != task.metadata.main_score:
                raise ValueError(
                    f"eval.metric {metric!r} is {family}, which task {task.metadata.name} ({task.metadata.type}) "
                    f"does not have: use main_score (its main score is {task.metadata.main_score}), or a score of "
                    f"its type, or evaluate on tasks of the type {metric!r} belongs to ({', '.join(sorted(types))})"
                )
    _check_hub([t for t in tasks if not Path(t).exists()])
    return [task.metadata.name for task, _ in resolved]


def _check_hub(named: list[str]) -> None:
    """mteb task names read their data from the hub: an unreachable hub is said before training, not as a failed
    evaluation after the first ``eval.steps`` (``HF_HUB_OFFLINE`` set: mteb reads the local cache, so a task whose
    dataset is not there is said instead)."""
    from neoembed.data.cards import HubUnreachable, hub_offline_mode
    from neoembed.data.check import hub_unreachable_reason

    if named and hub_offline_mode():
        import mteb

        missing = [t.metadata.name for t in mteb.get_tasks(tasks=named) if not _cached(t.metadata.dataset["path"])]
        if missing:
            raise HubUnreachable(
                f"eval.tasks {missing}: HF_HUB_OFFLINE is set and their datasets are not in the local cache: "
                "connect to the network without HF_HUB_OFFLINE, or give the tasks as local task folders or cards "
                "(docs/evaluation.md)"
            )
        return
    if not named or (down := hub_unreachable_reason()) is None:
        return
    raise HubUnreachable(
        f"eval.tasks {named} read their data from the Hugging Face hub, which cannot be reached ({down}): "
        "connect to the network, give the tasks as local task folders or cards (docs/evaluation.md), or, if "
        "their datasets are in your local cache, set HF_HUB_OFFLINE=1"
    )


def _cached(repo: str) -> bool:
    """Whether hub dataset ``repo`` has files in the local caches (the hub's, or datasets' own)."""
    import datasets.config
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    hub = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="dataset")
    return hub.is_dir() or (Path(datasets.config.HF_DATASETS_CACHE) / repo.replace("/", "___")).is_dir()


def _task_path(task: str, recipe_dir: Path | None) -> str:
    """A task given as a path (a folder or a ``.yaml`` card) is resolved against the recipe's folder; an mteb
    task name stays as it is."""
    resolved = Path(resolve_recipe_path(task, recipe_dir))
    return str(resolved) if resolved.exists() else task


def _rng_state() -> tuple:
    import random

    import numpy as np
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])
    if state[3] is not None:
        torch.cuda.set_rng_state_all(state[3])
