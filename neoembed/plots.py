"""Training curves: ``training_curves.png`` next to a run's ``metrics.jsonl`` (every trainer writes one)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["plot_training_curves", "read_metrics", "training_curves_figure"]

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


#: up to this many points a curve marks each one (a run logged once or a few times shows its points, not nothing)
MARKED_POINTS = 50


def plot_training_curves(metrics: str | Path, out: str | Path, title: str | None = None) -> Path | None:
    """One panel per known metric present in ``metrics`` (loss, accuracy, learning rate, grad norm…) against
    the step. Returns the PNG path, or None when there is nothing to plot. Never raises: a plot is a courtesy,
    not a reason to lose a finished run."""
    try:
        fig = training_curves_figure(read_metrics(metrics), title)
        if fig is None:
            return None
        import matplotlib.pyplot as plt

        out = Path(out)
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out
    except Exception as e:  # noqa: BLE001 - see docstring
        logger.warning("could not plot %s: %s", metrics, e)
        return None


def training_curves_figure(rows: list[dict], title: str | None = None):
    """The figure of :func:`plot_training_curves` for metrics rows (None when no row has a known metric).

    Every run length shows something: a curve of few points marks each one (a run logged once is one dot, not an
    empty panel), and the step axis runs from 0 past the last step, in whole steps."""
    rows = [r for r in rows if "step" in r]
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
    from matplotlib.ticker import MaxNLocator

    last = max(r["step"] for r in rows)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        points = [
            (r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])
        ]
        ys = [p[1] for p in points]
        marker = "o" if len(points) <= MARKED_POINTS else None
        ax.plot([p[0] for p in points], ys, lw=1.2, marker=marker, ms=3.5)
        label, log = PANELS.get(key, (key, False))
        if log and min(ys) > 0 and max(ys) >= 10 * min(ys):  # a log axis only where values span a decade
            ax.set_yscale("log")
        ax.set_xlim(0, last + max(1, 0.03 * last))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
