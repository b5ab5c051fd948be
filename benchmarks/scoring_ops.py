"""Tensor operations of GradCache's scoring stage: neoembed's cached InfoNCE against sentence-transformers'
CachedMultipleNegativesRankingLoss, on the layout of the H200 run (#39, #42).

That run timed the cached loss alone at B = 65,536 queries with one hard negative, mini-batches of 1,024: 64
segments per column, and with the CPU chunk budget 1,024 chunks of rows. On a GPU every tensor operation is at
least one kernel launch, so the count of operations is what a launch-bound loss costs. This script reproduces
that structure at a size a CPU counts in seconds: B = 4,096 in mini-batches of 64 (64 segments per column) and
4 rows a chunk (1,024 chunks), d = 8. The count does not depend on d, so it equals the B = 65,536 count.
Operations are counted with a ``TorchDispatchMode`` over one ``calculate_loss(..., with_backward=True)``.

    python benchmarks/scoring_ops.py                      # this checkout
    python benchmarks/scoring_ops.py --commit fb64884^    # also neoembed at another commit (a temporary worktree)

Results: benchmarks/results/scoring_ops_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

B, D, MINI, CHUNK_ROWS = 4096, 8, 64, 4

CHILD = """
import json, sys, torch
from torch.utils._python_dispatch import TorchDispatchMode
sys.path.insert(0, {bench!r})
import scale
import neoembed.scoring as scoring

class Count(TorchDispatchMode):
    n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        Count.n += 1
        return func(*args, **(kwargs or {{}}))

scoring.CHUNK_ELEMENTS = {chunk_rows} * 2 * {b}  # rows a chunk x (positives + negatives)
torch.manual_seed(0)
columns = [torch.randn({b}, {d}) for _ in range(3)]
out = {{}}
for impl in ("neoembed", "st"):
    reps = [[m.requires_grad_() for m in c.clone().split({mini})] for c in columns]
    call = scale._loss_call(impl, "cached", reps, {mini})
    Count.n = 0
    with Count():
        call()
    out[impl] = Count.n
out["neoembed_file"] = scoring.__file__
print(json.dumps(out))
"""


def count(tree: Path) -> dict:
    """Operations of both losses with neoembed imported from ``tree``, in a fresh process."""
    code = CHILD.format(
        bench=str(Path(__file__).resolve().parent), b=B, d=D, mini=MINI, chunk_rows=CHUNK_ROWS
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # run from the tree: python -c puts the working directory first on sys.path
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=True
    )
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(out.pop("neoembed_file")).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"neoembed was not imported from {tree}")
    return out


def count_at(commit: str, repo: Path) -> dict:
    """:func:`count` with neoembed checked out at ``commit`` in a temporary git worktree."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), commit], check=True,
                       capture_output=True)  # fmt: skip
        try:
            return count(tree)
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commit", action="append", default=[], help="also count neoembed at this commit")
    args = p.parse_args()
    from _common import REPO, header, write_results

    rows = []
    for name in ["this checkout", *args.commit]:
        c = count(REPO) if name == "this checkout" else count_at(name, REPO)
        rows.append({"neoembed": name, "neoembed_ops": c["neoembed"], "st_ops": c["st"]})
        print(f"{name}: neoembed {c['neoembed']:,} operations, sentence-transformers {c['st']:,}", flush=True)
    settings = {
        "batch": B,
        "dim": D,
        "mini_batch": MINI,
        "rows_per_chunk": CHUNK_ROWS,
        "chunks": B // CHUNK_ROWS,
    }
    md = [
        f"Cached InfoNCE's scoring stage, one hard negative; {settings}: the segment and chunk structure of "
        "B = 65,536 in mini-batches of 1,024 on the CPU chunk budget.",
        "",
        "| neoembed from | neoembed operations | sentence-transformers operations | ratio |",
        "|---|---|---|---|",
        *[
            f"| {r['neoembed']} | {r['neoembed_ops']:,} | {r['st_ops']:,} | {r['neoembed_ops'] / r['st_ops']:.2f} |"
            for r in rows
        ],
    ]
    write_results(
        "scoring_ops_cpu", {"header": header(), "settings": settings, "rows": rows}, "\n".join(md) + "\n"
    )
    print("\n".join(md))


if __name__ == "__main__":
    main()
