"""Time of ``losses.length_groups`` (the programme over distinct lengths) against its slow twin over every row
(``tests/test_losses.py``), on random token lengths 5-128 with the default overhead; both return the same groups.

    python benchmarks/length_groups.py
Record: benchmarks/results/length_groups_cpu.{json,md}.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import header, write_results  # noqa: E402
from test_losses import _length_groups_over_every_row as every_row  # noqa: E402

from neoembed.losses import length_groups  # noqa: E402


def _median_seconds(fn, lengths: list[int], reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(lengths, 512)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    rng = random.Random(0)
    rows = []
    for n in (
        512,
        2048,
        8192,
    ):  # rows of a step: 2 x batch x columns (B = 256 and 1,024 with a hard negative)
        lengths = [rng.randint(5, 128) for _ in range(n)]
        same = length_groups(lengths, 512) == every_row(lengths, 512)
        rows.append({"rows": n, "every_row_s": _median_seconds(every_row, lengths),
                     "distinct_s": _median_seconds(length_groups, lengths), "same_groups": same})  # fmt: skip
        print(rows[-1], flush=True)
    md = ["| rows | over every row (s) | over distinct lengths (s) | same groups |", "|---|---|---|---|"]
    md += [
        f"| {r['rows']} | {r['every_row_s']:.3f} | {r['distinct_s']:.4f} | {r['same_groups']} |" for r in rows
    ]
    write_results("length_groups_cpu", {"header": header(), "rows": rows}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
