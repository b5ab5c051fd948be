"""The README's main job, timed and recorded: ``neoembed quickstart`` end to end (data, nDCG@10 before, training,
nDCG@10 after), its wall time and its table.

    python benchmarks/quickstart.py              # packaged all-MiniLM-L6-v2, the recipe's 120 steps

Results: benchmarks/results/quickstart_<device>.{json,md} with the command, commit and hardware.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import header, write_results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--steps", type=int, default=None, help="override the recipe's steps (default: as shipped)"
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "quickstart"
        cmd = [sys.executable, "-m", "neoembed", "quickstart", "--output", str(out)]
        if args.steps is not None:
            cmd += ["--steps", str(args.steps)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        wall = time.perf_counter() - t0
        table = (out / "results" / "quickstart.md").read_text().strip()
    payload = {"header": header(), "wall_time_s": round(wall, 1), "steps": args.steps, "table": table}
    md = f"`neoembed quickstart` wall time: **{wall / 60:.1f} min** (data, evaluations, training, save)\n\n{table}\n"
    write_results("quickstart_cpu", payload, md)
    print(md)


if __name__ == "__main__":
    main()
