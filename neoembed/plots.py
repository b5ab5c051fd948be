"""Training curves: ``training_curves.png`` next to a run's ``metrics.jsonl`` (every trainer writes one)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["plot_training_curves", "read_metrics"]

# metrics.jsonl key -> (panel title, log-scale y)
PANELS = {
    "loss": ("loss", False),
    "masked_accuracy": ("masked-token accuracy", False),
    "learning_rate": ("learning rate", False),
    "grad_norm": ("gradient norm", True),
    "masked_fraction": ("masked fraction of the denominator", False),
}


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl file (a line cut short by a crash is skipped)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def plot_training_curves(metrics: str | Path, out: str | Path, title: str | None = None) -> Path | None:
    """One panel per known metric present in ``metrics`` (loss, accuracy, learning rate, grad norm…) against
    the step. Returns the PNG path, or None when there is nothing to plot. Never raises: a plot is a courtesy,
    not a reason to lose a finished run."""
    try:
        rows = [r for r in read_metrics(metrics) if "step" in r]
        scores = sorted({k for r in rows for k in r if k.startswith("eval_") and k != "eval_runtime"})
        keys = [  # the known panels, then the evaluation scores logged during training
            k
            for k in [*PANELS, *scores]
            if any(isinstance(r.get(k), int | float) and math.isfinite(r[k]) for r in rows)
        ]
        if not rows or not keys:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
        for ax, key in zip(axes[0], keys, strict=True):
            points = [
                (r["step"], r[key])
                for r in rows
                if isinstance(r.get(key), int | float) and math.isfinite(r[key])
            ]
            ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.2)
            label, log = PANELS.get(key, (key, False))
            if log and all(p[1] > 0 for p in points):
                ax.set_yscale("log")
            ax.set_title(label)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        out = Path(out)
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out
    except Exception as e:  # noqa: BLE001 - see docstring
        logger.warning("could not plot %s: %s", metrics, e)
        return None
