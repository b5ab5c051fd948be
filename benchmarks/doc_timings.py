"""How long the documented quick commands take on this machine: the measurement behind every time the docs quote
for a command (#44).

    python benchmarks/doc_timings.py            # every timed line of the docs, in page order (~10 min on 2 cores)
    python benchmarks/doc_timings.py --only 'neoembed train tiny'

A documented ``bash`` line is timed when its comment quotes a time on CPU (``# 25 s on 2 CPU cores: ...``), and so
is every line of the block under ``<!-- objective recipes`` in docs/training.md (its prose quotes their times).
Each page's lines run in order, as the user runs them, as fresh processes in a scratch copy of the checkout's
tracked files (``../shared`` beside it, like tests/test_docs_commands.py), with the console script of this Python.
Wall time, the median of ``--reps`` runs of the whole sequence; the record lists the command, the page, the
exit code, the median and every run.
Record: benchmarks/results/doc_timings_cpu.{json,md}; tests/test_docs_commands.py checks that every timed line of
the docs is in it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, SHARED, header, write_results  # noqa: E402

#: a comment that quotes a time on CPU: "# seconds on CPU", "# 25 s on 2 CPU cores", "# 2 min on CPU"
TIMED = re.compile(r"#.*\b(seconds|minutes|s|min)\b on (2 )?CPU")
OBJECTIVES = "<!-- objective recipes"


def _bash_blocks(text: str) -> list[tuple[int, list[str]]]:
    """``(offset, lines)`` of each ``bash`` block of a page."""
    return [(m.start(), m.group(1).splitlines()) for m in re.finditer(r"```bash\n(.*?)```", text, flags=re.S)]


def timed_lines(pages: list[Path] | None = None) -> list[tuple[str, str]]:
    """``(page, command)`` of every timed documented line, in page order; the command without its comment."""
    found = []
    for page in pages or sorted((REPO / "docs").glob("*.md")):
        text = page.read_text(encoding="utf8")
        marker = text.find(OBJECTIVES)
        for offset, lines in _bash_blocks(text):
            objectives = marker >= 0 and 0 <= offset - marker < 200
            for line in lines:
                command = line.split("  #")[0].split(" # ")[0].strip()
                if command and (objectives or TIMED.search(line)):
                    found.append((page.name, command))
    return found


def _once(lines: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Each command once (a second run into the same output folder would be refused), its pages joined."""
    pages: dict[str, list[str]] = {}
    for page, command in lines:
        pages.setdefault(command, []).append(page)
    return [(", ".join(p), command) for command, p in pages.items()]


def _scratch(root: Path) -> Path:
    """The checkout's tracked files under ``root/neoembed``, ``../shared`` beside it."""
    copy = root / "neoembed"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    (root / "shared").symlink_to(SHARED.resolve())
    return copy


def run(lines: list[tuple[str, str]]) -> list[dict]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="neoembed-doc-timings-") as tmp:
        cwd = _scratch(Path(tmp))
        for page, command in lines:
            start = time.perf_counter()
            r = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            rows.append(
                {"page": page, "command": command, "exit": r.returncode, "seconds": round(seconds, 1)}
            )
            print(f"{seconds:7.1f} s  exit {r.returncode}  {page}: {command}", flush=True)
            if r.returncode != 0:
                print(r.stderr[-2000:], file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", help="time only the documented lines that start with this")
    ap.add_argument("--reps", type=int, default=3, help="runs of the whole sequence, each in a fresh copy")
    args = ap.parse_args()
    lines = timed_lines()
    if args.only:
        lines = [(p, c) for p, c in lines if any(c.startswith(o) for o in args.only)]
    runs = [run(_once(lines)) for _ in range(args.reps)]
    rows = []
    for reps in zip(*runs, strict=True):  # one command's runs
        seconds = [r["seconds"] for r in reps]
        exit_code = max(r["exit"] for r in reps)
        rows.append({**reps[0], "exit": exit_code, "seconds": statistics.median(seconds), "runs": seconds})
    table = ["| page | command | exit | seconds (median) | runs |", "|---|---|---|---|---|"]
    table += [
        f"| {r['page']} | `{r['command']}` | {r['exit']} | {r['seconds']} | {', '.join(map(str, r['runs']))} |"
        for r in rows
    ]
    md = (
        "# Documented quick commands, wall time (CPU)\n\n"
        f"Medians of {args.reps} runs of the whole sequence, each in page order in a fresh copy, fresh processes.\n\n"
    )
    write_results("doc_timings_cpu", {"header": header(), "rows": rows}, md + "\n".join(table) + "\n")
    if any(r["exit"] for r in rows):
        sys.exit("some documented lines failed (above)")


if __name__ == "__main__":
    main()
