"""Run-folder plumbing shared by neoembed's own training loops (pre-training and CDE; the unified trainer gets
the same from sentence-transformers): checkpoints, stop signals, metrics rows, optimizer parameter groups."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import signal
from pathlib import Path

from torch import nn

from neoembed.record import atomic_write_text

__all__ = [
    "MetricsLog",
    "StopSignal",
    "list_checkpoints",
    "param_groups",
    "prune_checkpoints",
    "publish_checkpoint",
    "refuse_to_overwrite",
]

logger = logging.getLogger(__name__)


def list_checkpoints(output: Path) -> list[Path]:
    """The complete ``checkpoint-N`` folders of a run, oldest first (``.partial`` ones are not complete)."""
    found = [p for p in output.glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def prune_checkpoints(output: Path, keep: int | None) -> None:
    """Delete all but the ``keep`` newest checkpoints (``None`` or 0 keeps all)."""
    if keep:
        for old in list_checkpoints(output)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def publish_checkpoint(partial: Path, target: Path, keep: int | None) -> None:
    """Make a fully written ``checkpoint-N.partial`` the checkpoint ``checkpoint-N`` (replacing an older one of
    that step), then keep the ``keep`` newest. A crash while writing leaves only the ``.partial`` folder."""
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)
    prune_checkpoints(target.parent, keep)


def refuse_to_overwrite(output: Path) -> None:
    """A fresh run must not mix its checkpoints with an earlier run's."""
    if list_checkpoints(output):
        raise FileExistsError(
            f"{output} already holds checkpoints: pass --resume to continue, or choose another output_dir"
        )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices and embeddings, not on norms and biases."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class StopSignal:
    """SIGTERM / Ctrl-C set a flag; the loop checkpoints after the current step. A second Ctrl-C aborts."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        logger.warning("%s received: checkpointing after this step, then stopping", self.received)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class MetricsLog:
    """``metrics.jsonl`` (one JSON row per logging step) and, with ``report_to: [tensorboard]``, the numeric
    values of each row as TensorBoard scalars under ``train/``. Only the main process writes."""

    def __init__(self, output: Path, report_to, main_process: bool):
        self.path = output / "metrics.jsonl"
        self.main = main_process
        self.writer = None
        self._tensorboard = None
        if "tensorboard" in report_to and main_process:
            try:  # checked now, opened at the first row (the run may still fail its checks)
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "report_to: [tensorboard] needs the tensorboard package: pip install tensorboard"
                ) from e
            self._tensorboard = SummaryWriter

    def truncate(self, step: int) -> None:
        """On resume: drop the rows logged after the checkpoint being resumed from."""
        if self.main and self.path.exists():
            rows = [r for r in self.path.read_text().splitlines() if r and json.loads(r)["step"] <= step]
            atomic_write_text(self.path, "".join(r + "\n" for r in rows))

    def write(self, row: dict) -> None:
        if not self.main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tensorboard is not None and self.writer is None:
            self.writer = self._tensorboard(str(self.path.parent / "tensorboard"))
        if self.writer is not None:
            for key, value in row.items():
                if isinstance(value, int | float) and key != "step":
                    self.writer.add_scalar(f"train/{key}", value, row["step"])

    def close(self, title: str | None = None) -> None:
        """Flush TensorBoard and draw ``training_curves.png`` beside the metrics."""
        from neoembed.plots import plot_training_curves

        if self.writer is not None:
            self.writer.close()
        if self.main and self.path.exists():
            plot_training_curves(self.path, self.path.parent / "training_curves.png", title=title)
