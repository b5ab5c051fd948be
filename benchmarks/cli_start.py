"""How long the command line takes to start (#41): medians of 5 after a warm-up, each a fresh process.

    python benchmarks/cli_start.py

Rows: ``neoembed --help``; ``neoembed train tiny --dry-run`` (a real command: recipe, cards, tokenizer, no
step), ``neoembed init missing.jsonl``, ``neoembed train missing.yaml`` and a recipe value that does not validate
(bad input, refused before torch loads), ``neoembed mteb``, ``convert``, ``train``, ``glue``, ``pretrain`` and
``preprocess`` with a model or tokenizer that is neither a folder nor reachable (offline: refused before torch
loads), and ``python -c 'import sentence_transformers'``, the floor of any command that builds a model; the
record gives the dry run's time above that floor. Results: benchmarks/results/cli_start_cpu.*
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import header, write_results  # noqa: E402

BIN = Path(sys.executable).parent


def _time(argv: list[str], cwd: str, reps: int = 5, exit_code: int = 0) -> list[float]:
    """Wall times of ``reps`` runs after a warm-up (file caches, .pyc); each must end with ``exit_code``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True)
        if r.returncode != exit_code:
            sys.exit(f"{' '.join(argv)}: exit {r.returncode}, expected {exit_code}\n{r.stderr[-2000:]}")
        times += [time.perf_counter() - t0] if i else []
    return times


#: (row, argv after ``neoembed``, expected exit); ``{cwd}`` is the scratch folder the commands run in
COMMANDS = (
    ("neoembed --help", ["--help"], 0),
    ("neoembed train tiny --dry-run", ["train", "tiny", "output_dir={cwd}/run", "--dry-run"], 0),
    # a mistyped path or value: refused (exit 2) before torch is imported
    ("neoembed init missing.jsonl", ["init", "missing.jsonl"], 2),
    ("neoembed train missing.yaml", ["train", "missing.yaml"], 2),
    ("neoembed train tiny steps=x", ["train", "tiny", "steps=x"], 2),
    # offline, a model or tokenizer no one can find: refused (exit 2) before torch, mteb's registry or the model
    ("neoembed mteb --model no-org/no-model --tasks STS12", ["mteb", "--model", "no-org/no-model", "--tasks", "STS12"], 2),
    ("neoembed mteb --model ./missing --tasks STS12", ["mteb", "--model", "./missing", "--tasks", "STS12"], 2),
    ("neoembed convert no-org/no-model out", ["convert", "no-org/no-model", "out"], 2),
    ("neoembed train tiny model=no-org/no-model", ["train", "tiny", "model=no-org/no-model"], 2),
    ("neoembed glue RTE --model no-org/no-model", ["glue", "RTE", "--model", "no-org/no-model"], 2),
    ("neoembed pretrain pretrain-tiny tokenizer=no-org/no-model", ["pretrain", "pretrain-tiny", "tokenizer=no-org/no-model"], 2),
    ("neoembed preprocess corpus.txt out --tokenizer no-org/no-model", ["preprocess", "corpus.txt", "out", "--tokenizer", "no-org/no-model"], 2),
)  # fmt: skip


def main() -> None:
    with tempfile.TemporaryDirectory() as cwd:
        (Path(cwd) / "corpus.txt").write_text("a document\n")
        rows = {
            row: _time([str(BIN / "neoembed"), *(a.format(cwd=cwd) for a in argv)], cwd, exit_code=code)
            for row, argv, code in COMMANDS
        }
        rows["python -c 'import sentence_transformers'"] = _time(
            [sys.executable, "-c", "import sentence_transformers"], cwd
        )
    medians = {k: statistics.median(v) for k, v in rows.items()}
    above = medians["neoembed train tiny --dry-run"] - medians["python -c 'import sentence_transformers'"]
    lines = ["| command | median (s) | runs (s) |", "|---|---|---|"]
    lines += [f"| `{k}` | {medians[k]:.2f} | {', '.join(f'{t:.2f}' for t in v)} |" for k, v in rows.items()]
    lines.append(
        f"\nThe dry run above `import sentence_transformers`: {above:.2f} s (target <= 2 s; `--help` <= 1.0 s)."
    )
    md = (
        "# Command-line start-up (CPU)\n\nMedians of 5 fresh processes after a warm-up.\n\n"
        + "\n".join(lines)
        + "\n"
    )
    paths = write_results(
        "cli_start_cpu", {"header": header(), "seconds": rows, "dry_run_above_floor": above}, md
    )
    print(md)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
