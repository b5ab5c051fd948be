"""The README's main job, timed and recorded: ``neoembed quickstart`` end to end (data, nDCG@10 before, training,
nDCG@10 after), its wall time and its table.

    python benchmarks/quickstart.py              # packaged all-MiniLM-L6-v2, the recipe's 120 steps

Results: benchmarks/results/quickstart_<device>.{json,md} with the command, commit and hardware.
"""

from __future__ import annotations

import argparse
import os
import re
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
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        run = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
        wall = time.perf_counter() - t0
        print(run.stdout)
        table = (out / "results" / "quickstart.md").read_text().strip()
    stages = next((line for line in run.stdout.splitlines() if line.startswith("stage timings:")), "")
    # the command times itself from its start; what comes before it (interpreter, `import neoembed` with torch and
    # transformers, the CLI) is the wall time it does not see
    total = re.search(r"total time (\d+) s", run.stdout)
    startup = round(wall - int(total.group(1))) if total else None
    load = {"before": round(load_before, 2), "after (1 min)": round(os.getloadavg()[0], 2)}
    payload = {
        "header": header(),
        "wall_time_s": round(wall, 1),
        "steps": args.steps,
        "stage_timings": stages,
        "startup_s": startup,
        "load_average": load,
        "table": table,
    }
    md = (
        f"`neoembed quickstart` wall time: **{wall:.0f} s ({wall / 60:.1f} min)** in an empty temporary folder "
        f"(data, evaluations, training, save)  \n{stages}; before the command (interpreter, `import neoembed`, CLI) "
        f"{startup} s  \nLoad average (1 min): {load}\n\n{table}\n"
    )
    write_results("quickstart_cpu", payload, md)
    print(md)


if __name__ == "__main__":
    main()
