"""Metrics of a run: ``metrics.jsonl`` trimmed to the resumed step, trackers and their hyperparameters, the
progress line, the note of an early stop, and a report of a run whose loss and gradient stay at zero
(:class:`MetricsLog`)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neoembed.record import add_to_run_record, atomic_write_text
from neoembed.runs.trackers import check_mlflow_resume, check_mlflow_server, read_tracker_ids

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


DEGENERATE_ROWS = 20


# report_to name -> (the module it needs, the neoembed extra that installs it)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}


# the W&B / Trackio project of every neoembed run (WANDB_PROJECT / TRACKIO_PROJECT choose another); a run is named
# after its output folder
TRACKER_PROJECT = "neoembed"


def recipe_hyperparameters(recipe) -> dict[str, Any]:
    """The whole validated recipe as ``recipe.a.b`` keys (lists as JSON text), as trackers take hyperparameters;
    every trainer sends these same keys. The prefix keeps them apart from what transformers' integrations log
    under bare names (TrainingArguments, the model config: its ``max_length`` is not the recipe's)."""
    flat: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = (
                    value if isinstance(value, int | float | str | bool) else json.dumps(value)
                )

    walk(recipe.model_dump(mode="json"), "recipe.")
    return flat


def tensorboard_hparams(writer, values: dict) -> None:
    """``values`` in TensorBoard's HPARAMS tab, in the writer's own event file (``add_hparams`` would open a
    sub-run beside it)."""
    from torch.utils.tensorboard.summary import hparams

    for summary in hparams(values, {}):
        writer._get_file_writer().add_summary(summary)


class MissingTracker(ImportError, ValueError):
    """A tracker named in ``report_to`` whose package is not installed: bad input (exit 2, the install command),
    not a fault of neoembed's; still an ImportError for code that catches that."""


def check_trackers(report_to, output: Path | None = None, resume: bool = False) -> None:
    """Every tracker named in ``report_to`` is known and installed, and MLflow can write where it is pointed
    (a tracking server answers); with ``resume``, ``output``'s ``trackers.json`` is readable and the MLflow
    run it continues is in the current store: checked before any data or model loads, so a missing package
    or store costs seconds, not a run."""
    import importlib.util

    for name in report_to:
        if name not in TRACKERS:
            raise ValueError(f"report_to: unknown tracker {name!r}; valid: {', '.join(TRACKERS)}")
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise MissingTracker(
                f"report_to: [{name}] needs the {module} package, which is not installed: install neoembed's "
                f"[{extra}] extra (pip install -e '.[{extra}]' in the neoembed repository), or remove {name} from "
                "report_to"
            )
    if "mlflow" in report_to:  # once every package is known to be there
        check_mlflow_store()
    if resume and output is not None and any(name != "tensorboard" for name in report_to):
        read_tracker_ids(output)  # a damaged file is named, before the model loads
        if "mlflow" in report_to:
            check_mlflow_resume(output)


_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def check_mlflow_store() -> None:
    """The store MLflow will write to is one the installed client can open. mlflow 3.x defaults to a sqlite
    database, which the ``[mlflow]`` extra's client (mlflow-skinny: no sqlalchemy) cannot open, and from 3.10 a
    local folder store needs ``MLFLOW_ALLOW_FILE_STORE=true``; either used to fail only once the model had
    loaded, with mlflow's own message. A tracking server is asked once, without mlflow's retries: one that
    does not answer used to fail after minutes of them
    (:func:`~neoembed.runs.trackers.check_mlflow_server`)."""
    import importlib.util
    from urllib.parse import urlparse

    import mlflow

    uri = mlflow.get_tracking_uri()
    scheme = urlparse(uri).scheme.split("+")[0]
    given = "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "mlflow's default"
    server = "MLFLOW_TRACKING_URI=http://HOST:5000 (your tracking server)"
    if scheme in _DATABASE_SCHEMES and importlib.util.find_spec("sqlalchemy") is None:
        raise ValueError(
            f"report_to: [mlflow]: the tracking URI {uri} ({given}) is a database store, which this mlflow "
            f"client cannot open (mlflow-skinny, the neoembed[mlflow] extra, has no sqlalchemy): set {server}, "
            "or MLFLOW_TRACKING_URI=file:./mlruns with MLFLOW_ALLOW_FILE_STORE=true (a local folder), or "
            "pip install mlflow (the full package) to keep the database"
        )
    allow = getattr(mlflow.environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)  # mlflow >= 3.10
    if scheme in ("", "file") and allow is not None and not allow.get():
        raise ValueError(
            f"report_to: [mlflow]: the tracking URI {uri} ({given}) is a local folder store, which mlflow "
            f"{mlflow.__version__} writes only with MLFLOW_ALLOW_FILE_STORE=true: set it, or set {server}"
        )
    if scheme in ("http", "https"):
        check_mlflow_server(uri, given)


def note_early_stop(output: Path, step: int, patience: int, metric: str, best_step: int | None) -> None:
    """``keep_best.patience`` ended the run at ``step``: said on the console and in ``run_record.json``
    (``stopped_early``), the same for every trainer."""
    add_to_run_record(output, {"stopped_early": {"step": step, "patience": patience}})
    print(
        f"early stop at step {step}: {patience} evaluations without a better eval_{metric} than step "
        f"{best_step}'s",
        file=sys.stderr,
        flush=True,
    )


def progress_line(step: int, total: int, values: dict, steps_per_s: float) -> str:
    """The plain progress line a run prints per logging step where output is not a terminal (CI, a scheduler's
    log): step of total, the logged values, the rate and the time left."""
    import math
    import time

    left = (total - step) / steps_per_s if steps_per_s > 0 else float("nan")
    eta = time.strftime("%H:%M:%S", time.gmtime(left)) if math.isfinite(left) else "?"
    shown = "  ".join(f"{k} {v:.4g}" for k, v in values.items() if isinstance(v, int | float))
    return f"step {step}/{total} ({100 * step / max(total, 1):.0f}%)  {shown}  {steps_per_s:.2f} steps/s  left {eta}"


def tensorboard_tag(key: str) -> str:
    """A logged key's TensorBoard tag, as transformers' TensorBoard callback names them: evaluation scores under
    ``eval/`` (``eval_ndcg_at_10`` is ``eval/ndcg_at_10``), everything else under ``train/``."""
    return f"eval/{key[len('eval_'):]}" if key.startswith("eval_") else f"train/{key}"


class MetricsLog:
    """``metrics.jsonl`` (one JSON row per logging step) and, with ``report_to: [tensorboard]``, the numeric
    values of each row as TensorBoard scalars (:func:`tensorboard_tag`). Only the main process writes.

    It also watches the run: :data:`DEGENERATE_ROWS` logged rows in a row with loss 0 and gradient norm 0 mean the
    model learns nothing (duplicate rows, a query equal to its positive), and say so once."""

    def __init__(self, output: Path, report_to, main_process: bool):
        self.path = Path(output) / "metrics.jsonl"
        self.main = main_process
        self.writer = None
        self._tensorboard = None
        self._purge_step: int | None = None
        self.zero_rows, self.degenerate_warned = 0, False
        if "tensorboard" in report_to and main_process:
            try:  # checked now, opened at the first row (the run may still fail its checks)
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "report_to: [tensorboard] needs the tensorboard package: pip install tensorboard"
                ) from e
            self._tensorboard = SummaryWriter

    def truncate(self, step: int) -> None:
        """On resume: drop the rows logged after the checkpoint being resumed from (TensorBoard hides its events
        from that step on, the curves are redrawn from the trimmed rows)."""
        trim_metrics(self.path, step) if self.main else None
        self._purge_step = step + 1

    def write(self, row: dict) -> None:
        self.watch(row)
        if not self.main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self._open()
        if self.writer is not None:
            for key, value in row.items():
                if isinstance(value, int | float) and key != "step":
                    self.writer.add_scalar(tensorboard_tag(key), value, row["step"])

    def _open(self) -> None:
        if self._tensorboard is not None and self.writer is None and self.main:
            self.writer = self._tensorboard(
                str(self.path.parent / "tensorboard"), purge_step=self._purge_step
            )

    def hyperparameters(self, values: dict) -> None:
        """TensorBoard's HPARAMS tab for this run: ``values`` (flat ``a.b`` keys; a new run, not a resume)."""
        self._open()
        if self.writer is not None:
            tensorboard_hparams(self.writer, values)

    def watch(self, row: dict) -> None:
        zero = row.get("loss") == 0 and not row.get("grad_norm")
        self.zero_rows = self.zero_rows + 1 if zero else 0
        if self.zero_rows >= DEGENERATE_ROWS and not self.degenerate_warned:
            self.degenerate_warned = True
            logger.warning(
                "degenerate training: the loss and the gradient norm have been 0 for %d logged steps (up to step "
                "%s): the model learns nothing. Usual causes: duplicate rows (masked as false negatives, leaving "
                "no negative), or queries equal to their positives; check the data",
                self.zero_rows,
                row.get("step"),
            )

    def close(self, title: str | None = None) -> None:
        """Flush TensorBoard and draw ``training_curves.png`` beside the metrics."""
        from neoembed.plots import plot_training_curves

        if self.writer is not None:
            self.writer.close()
        if self.main and self.path.exists():
            plot_training_curves(self.path, self.path.parent / "training_curves.png", title=title)


def trim_metrics(path: Path, step: int) -> None:
    """Keep the rows of ``metrics.jsonl`` up to ``step`` (a resume continues after them); a torn last line (a
    kill during the write) is dropped."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if line and json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError):
            continue
    atomic_write_text(path, "".join(r + "\n" for r in kept))
