"""Training curves show something for every run length: a run logged once draws a dot in each panel (not an
empty panel), and the step axis of a short run counts whole steps from 0."""

from __future__ import annotations

import json

import numpy as np
import pytest

from neoembed.plots import plot_training_curves, training_curves_figure

ROW = {"step": 10, "loss": 2.31, "learning_rate": 5e-5, "grad_norm": 3.2}


def _line_pixels(png) -> list[int]:
    """Per panel (the image cut in three columns), how many pixels have the curves' colour (matplotlib's C0)."""
    import matplotlib.image

    rgb = matplotlib.image.imread(png)[..., :3]
    c0 = np.array([0x1F, 0x77, 0xB4]) / 255
    near = np.abs(rgb - c0).max(axis=-1) < 0.1
    return [int(part.sum()) for part in np.array_split(near, 3, axis=1)]


def test_one_logged_row_draws_a_point_in_every_panel(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps(ROW) + "\n")
    png = plot_training_curves(metrics, tmp_path / "training_curves.png", title="one row")
    assert png is not None and all(n > 20 for n in _line_pixels(png)), _line_pixels(png)


@pytest.mark.parametrize("steps", [[10], [1, 2, 3, 4, 5, 6, 7, 8]])
def test_a_short_runs_step_axis_counts_whole_steps_from_zero(steps):
    import matplotlib.pyplot as plt

    fig = training_curves_figure([{**ROW, "step": s} for s in steps])
    for ax in fig.axes:
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert low == 0 and steps[-1] < high <= steps[-1] + 1
        assert all(float(t).is_integer() for t in ticks) and len(ticks) >= 3
        (line,) = ax.get_lines()
        assert line.get_marker() == "o" and list(line.get_xdata()) == steps
    plt.close(fig)


def test_a_long_run_draws_lines_and_nothing_plots_to_none(tmp_path):
    import matplotlib.pyplot as plt

    fig = training_curves_figure([{**ROW, "step": s} for s in range(10, 2010, 10)])
    assert all(line.get_marker() in (None, "None") for ax in fig.axes for line in ax.get_lines())
    assert fig.axes[0].get_xlim()[0] == 0 and fig.axes[0].get_xlim()[1] > 2000
    plt.close(fig)
    assert training_curves_figure([{"step": 1, "epoch": 0.5}]) is None


def _results(folder, scores: dict[str, float]) -> None:
    folder.mkdir(parents=True)
    for task, score in scores.items():
        entry = {"task": task, "type": "Reranking", "main_score": score, "model": folder.name}
        (folder / f"{task}.json").write_text(
            json.dumps({**entry, "instructions": "released", "precision": "fp32"})
        )


def test_compare_bars_start_at_zero_and_a_second_compare_overwrites_nothing(tmp_path, run_neoembed):
    """0.3 points look like 0.3 points: the bars' heights are in the ratio of their scores (on an axis from 75 the
    bars of 80.15 and 81.54 were in the ratio 0.79). A second comparison into the same folder is refused, naming
    what is there, until --overwrite, which says it replaced it."""
    from neoembed.eval.summary import compare_runs

    _results(tmp_path / "base", {"TrecQA": 0.8015})
    _results(tmp_path / "tuned", {"TrecQA": 0.8154})
    runs, out = [tmp_path / "base", tmp_path / "tuned"], tmp_path / "cmp"
    compare_runs(runs, out)
    import matplotlib.image

    rgb = matplotlib.image.imread(out / "compare.png")[..., :3]
    heights = []
    for colour in ([0x1F, 0x77, 0xB4], [0xFF, 0x7F, 0x0E]):  # C0 and C1: the two runs' bars
        near = np.abs(rgb - np.array(colour) / 255).max(axis=-1) < 0.05
        heights.append(near.sum(axis=0).max())  # the tallest column of the bar's colour: its height in pixels
    assert heights[0] / heights[1] == pytest.approx(0.8015 / 0.8154, abs=0.015), heights
    with pytest.raises(FileExistsError, match=r"already holds a comparison .*of base, tuned.*--overwrite"):
        compare_runs(runs[::-1], out)
    argv = ["mteb", "compare", *map(str, runs), "--out", str(out)]
    r = run_neoembed(argv)
    assert r.exit_code == 2 and "--overwrite" in r.stderr, r.stderr
    r = run_neoembed([*argv, "--overwrite"])
    assert r.exit_code == 0 and f"replaced {out / 'compare.png'}" in r.stdout, r.stdout + r.stderr
