"""The repository carries its test data (``tests/shared``, refreshed from ``../shared`` by ``tests/refresh_shared.py``),
so that a clone runs the suite alone: the copy is complete, has its licences beside it, stays small, and nothing in
the tests reaches for the folder beside the repository."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import yaml
from refresh_shared import main, paper_tables

REPO = Path(__file__).resolve().parents[1]
COPY = REPO / "tests" / "shared"
MAX_BYTES = 25_000_000  # every device run carries the working tree (#41)

PAPER = """# NeoBERT

## D.3 Task instructions

Table 7: Instructions for fine-tuning.

Dataset\tInstruction
AGNEWS\tGiven a news title, retrieve relevant articles.

Table 8: Instructions for evaluation.

Task name\tInstruction
SciFact\tGiven a scientific claim, retrieve documents that support or refute the claim .

---

Table 9: Instructions for evaluation.

Task name\tInstruction
ArguAna\tGiven a claim, find documents that refute the claim.

---

## E Context Length

Not a table of instructions.
"""


def _shared_folder(root: Path) -> Path:
    """A shared folder in the layout of ../shared, read-only as it is there."""
    files = {
        "data/README.md": "# data\n",
        "data/mteb/STS16/card.yaml": "name: STS16\nlicense: research use\n",
        "fixtures/neobert-tiny-official/README.md": "# tiny\n",
        "fixtures/neobert-tiny-official/config.json": "{}\n",
        "paper/neobert-paper.md": PAPER,
        "STYLE.md": "not test data\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    with gzip.open(root / "data/mteb/STS16/test.jsonl.gz", "wt") as f:
        f.write('{"sentence1": "a", "sentence2": "b", "score": 1.0}\n')
    for path in sorted(root.rglob("*"), reverse=True):
        path.chmod(0o555 if path.is_dir() else 0o444)
    return root


def test_refresh_copies_data_fixture_and_paper_tables_and_check_finds_stale_files(tmp_path, capsys):
    source = _shared_folder(tmp_path / "shared")
    target = tmp_path / "copy"
    (target / "data" / "old").mkdir(parents=True)
    (target / "data" / "old" / "gone.jsonl.gz").write_text("stale")
    (target / "README.md").write_text("the project's own\n")
    assert main(["--source", str(source), "--target", str(target)]) == 0
    copied = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert copied == [
        "README.md",
        "data/README.md",
        "data/mteb/STS16/card.yaml",
        "data/mteb/STS16/test.jsonl.gz",
        "fixtures/neobert-tiny-official/README.md",
        "fixtures/neobert-tiny-official/config.json",
        "paper/neobert-paper-tables-7-9.md",
    ]  # the stale file went; the paper's text and the notes did not come
    assert (target / "README.md").read_text() == "the project's own\n"
    tables = (target / "paper/neobert-paper-tables-7-9.md").read_text()
    assert "AGNEWS\t" in tables and "SciFact\t" in tables and tables.rstrip().endswith("refute the claim.")
    assert "Context Length" not in tables and "Task instructions" not in tables
    assert main(["--source", str(source), "--target", str(target)]) == 0  # read-only folders copied writable
    assert main(["--source", str(source), "--target", str(target), "--check"]) == 0
    (target / "data/mteb/STS16/card.yaml").write_text("name: STS16\n")
    (target / "fixtures/neobert-tiny-official/extra.bin").write_bytes(b"x")
    capsys.readouterr()
    assert main(["--source", str(source), "--target", str(target), "--check"]) == 1
    said = capsys.readouterr().err
    assert "data/mteb/STS16/card.yaml" in said and "extra.bin" in said and "refresh_shared.py" in said


def test_the_copy_has_a_card_with_a_licence_beside_every_data_file_and_stays_small():
    data_files = [p for p in (COPY / "data").rglob("*.jsonl.gz")]
    assert len(data_files) == 13  # data/README.md's table: 11 folders, two with two splits
    for path in data_files:
        card = yaml.safe_load((path.parent / "card.yaml").read_text())
        assert card["license"] and card["source"]["commit"], path
        assert path.stem.split(".")[0] in card["splits"], path  # the card describes this very file
    assert (
        "card.yaml" in (COPY / "data" / "README.md").read_text()
    )  # the data's own README says where each card is
    fixture = COPY / "fixtures" / "neobert-tiny-official"
    assert {"README.md", "config.json", "model.safetensors", "expected.safetensors", "tokenizer.json"} <= {
        p.name for p in fixture.iterdir()
    }
    size = sum(p.stat().st_size for p in COPY.rglob("*") if p.is_file())
    assert size <= MAX_BYTES, f"tests/shared holds {size:,} bytes (at most {MAX_BYTES:,}): carry less"


def test_the_paper_tables_are_a_quote_of_the_three_tables_only():
    quoted = (COPY / "paper" / "neobert-paper-tables-7-9.md").read_text(encoding="utf8")
    assert [int(n) for n in re.findall(r"^Table (\d+):", quoted, flags=re.M)] == [7, 8, 9]
    assert (
        paper_tables(quoted) == quoted
    )  # re-quoting the quote changes nothing: it starts and ends where it should
    assert "arXiv:2502.19587" in quoted


def test_no_test_reaches_for_the_folder_beside_the_repository():
    """Only the copy is read: a path through the repository's parent folder would fail on a clone."""
    beside = re.compile(r"REPO\.parent|parents\[2\]|\.\./\.\./\.\./shared")
    files = [*(REPO / "tests").glob("*.py"), *(REPO / "tests" / "data_cards").glob("*.yaml")]
    found = [
        f"{p.name}: {m.group(0)}"
        for p in files
        if p.name != "refresh_shared.py"
        for m in beside.finditer(p.read_text())
    ]
    assert files and not found, found
