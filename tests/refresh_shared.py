"""Refresh ``tests/shared/``, the repository's copy of what its tests read from ``../shared``.

``../shared`` (beside the repository) stays the source; the copy lets a clone run the test command alone:

    python tests/refresh_shared.py                  # copy from ../shared
    python tests/refresh_shared.py --source DIR     # copy from another checkout of the shared folder
    python tests/refresh_shared.py --check          # exit 1 and name each file that differs from the source

What is copied (``PARTS``): ``data/`` whole (gzip-JSONL, a ``card.yaml`` with source, commit and licence in each
folder, ``README.md``, ``anchors.yaml``) and ``fixtures/neobert-tiny-official/`` whole (its ``README.md`` is its card).
Of the paper, whose text stays in ``../shared``, only Tables 7-9 (the instruction strings that
``tests/test_data_cards.py`` compares the cards and instruction sets with) are quoted, into ``paper/``.
``tests/shared/README.md`` is this project's own and is left alone. Held-back evaluation data is not in
``../shared`` and never comes here.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
COPY = HERE / "shared"
SOURCE = HERE.parents[1] / "shared"
PARTS = ("data", "fixtures/neobert-tiny-official")
PAPER = "paper/neobert-paper.md"
TABLES = "paper/neobert-paper-tables-7-9.md"
TABLES_HEADER = """\
<!-- Tables 7, 8 and 9 of "NeoBERT: A Next-Generation BERT" (Le Breton, Fournier, Morris, El Mezouar, Chandar;
arXiv:2502.19587, Appendix D.3), quoted verbatim from ../shared/paper/neobert-paper.md by tests/refresh_shared.py so
that tests/test_data_cards.py can compare the data cards and instruction sets with them. The paper's full text is
not copied here; its licence is the one stated on its arXiv page. -->

"""


def paper_tables(paper: str) -> str:
    """Tables 7-9 of the paper's text, verbatim: from Table 7's caption to the separator or heading after Table 9."""
    start = paper.index("Table 7:")
    table9 = paper.index("Table 9:", start)
    ends = [i for marker in ("\n---", "\n#") if (i := paper.find(marker, table9)) >= 0]
    end = min(ends, default=len(paper))
    return TABLES_HEADER + paper[start:end].rstrip() + "\n"


def build(source: Path, target: Path) -> None:
    """Writes the copied parts of ``source`` under ``target``, replacing what was there (files left writable)."""
    missing = [p for p in (*PARTS, PAPER) if not (source / p).exists()]
    if missing:
        sys.exit(
            f"{source} lacks {', '.join(missing)}: point --source at the shared folder (the one with data/)"
        )
    for part in (*PARTS, Path(TABLES).parent):
        shutil.rmtree(target / part, ignore_errors=True)
    for part in PARTS:
        shutil.copytree(source / part, target / part, copy_function=shutil.copyfile)
        for folder in [target / part, *(p for p in (target / part).rglob("*") if p.is_dir())]:
            folder.chmod(0o755)  # the source's folders may be read-only: the next refresh must replace them
    (target / TABLES).parent.mkdir(parents=True, exist_ok=True)
    (target / TABLES).write_text(paper_tables((source / PAPER).read_text(encoding="utf8")), encoding="utf8")


def differences(left: Path, right: Path) -> list[str]:
    """Relative paths of the files that differ, or exist on one side only, between two trees."""
    files = {p.relative_to(root) for root in (left, right) for p in root.rglob("*") if p.is_file()}
    return sorted(
        str(f)
        for f in files
        if not (
            (left / f).is_file() and (right / f).is_file() and filecmp.cmp(left / f, right / f, shallow=False)
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=SOURCE, help="the shared folder (default: ../shared)")
    parser.add_argument("--target", type=Path, default=COPY, help="the copy (default: tests/shared)")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if the copy is stale")
    args = parser.parse_args(argv)
    if not args.check:
        build(args.source, args.target)
        print(f"refreshed {args.target} from {args.source}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(args.source, Path(tmp))
        stale = [d for d in differences(Path(tmp), args.target) if d != "README.md"]
    for name in stale:
        print(f"differs from {args.source}: {name}", file=sys.stderr)
    if stale:
        print("refresh it: python tests/refresh_shared.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
