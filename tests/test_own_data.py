"""docs/own-data.md as a new user runs it: the page's shell commands, in order, in an empty folder, on a JSONL of
real pairs written from scratch (MSRP paraphrase pairs), with the tiny NeoBERT fixture standing in for the packaged
model so that it runs in seconds; then the trained model in plain sentence-transformers with its saved prompt."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "own-data.md"


def _page_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text(encoding="utf8"), flags=re.S)
    lines = [re.sub(r"\s+#.*$", "", line).strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("neoembed ")]


def _write_data(folder: Path, shared_dir: Path) -> None:
    rows = [json.loads(line) for line in gzip.open(shared_dir / "data/train/msrp_pairs/train.jsonl.gz", "rt")]
    with (folder / "pairs.jsonl").open("w") as f:
        for r in rows[:64]:
            f.write(json.dumps({"query": r["query"], "positive": r["positive"]}) + "\n")
    held = folder / "mydata" / "heldout"
    held.mkdir(parents=True)
    with (held / "test.jsonl").open("w") as f:
        for i, r in enumerate(rows[100:112]):
            others = [rows[100 + (i + j) % 12]["positive"] for j in (1, 2, 3)]
            f.write(json.dumps({"query": r["query"], "positive": [r["positive"]], "negative": others}) + "\n")
    (folder / "mydata" / "heldout-task.yaml").write_text("name: MyHeldout\ntype: Reranking\ndata: heldout\n")


def test_the_own_data_page_runs_as_written(tmp_path, shared_dir, tiny_official, run_neoembed):
    commands = _page_commands()
    assert [c.split()[1] for c in commands] == ["init", "data", "train", "train", "mteb"]
    _write_data(tmp_path, shared_dir)
    for command in commands:
        argv = command.replace("packaged:all-MiniLM-L6-v2", str(tiny_official)).split()
        if argv[1] == "train" and "--dry-run" not in argv:
            argv += ["steps=3"]
        r = run_neoembed(argv[1:], cwd=tmp_path)
        assert r.exit_code == 0, f"{command}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    card = (tmp_path / "mydata" / "pairs.yaml").read_text()
    assert "query: query" in card and "positive: positive" in card and "size: 64" in card
    scores = json.loads((tmp_path / "results" / "pairs" / "MyHeldout.json").read_text())
    assert 0.0 <= scores["main_score"] <= 1.0
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(tmp_path / "runs" / "pairs"), trust_remote_code=True)
    assert model.prompts["query"] == "Given a query, retrieve the passage that answers it. "
    assert model.encode_query(["a"]).shape == model.encode_document(["b"]).shape


def test_init_recognises_triplets_and_refuses_what_it_cannot_read(tmp_path):
    from neoembed.data.starter import guess_columns, write_starter

    assert guess_columns(["anchor", "answer", "neg_1", "neg_2", "id"]) == {
        "query": "anchor",
        "positive": "answer",
        "negatives": ["neg_1", "neg_2"],
    }
    with pytest.raises(ValueError, match="cannot tell the query and positive columns"):
        guess_columns(["a", "b"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1 is not a JSON object"):
        write_starter(bad, tmp_path)
    good = tmp_path / "t.jsonl"
    good.write_text(json.dumps({"query": "q", "positive": "p", "negative": "n"}) + "\n")
    starter = write_starter(good, tmp_path)
    assert starter.columns["negatives"] == ["negative"]
    with pytest.raises(FileExistsError, match="--overwrite"):
        write_starter(good, tmp_path)


def test_init_writes_commands_that_run_where_it_says(tmp_path, shared_dir, tiny_official, run_neoembed):
    """The card's and the recipe's comments name the commands to run and the folder to run them from (the one
    `neoembed init` ran in: card_dirs and output_dir are relative to it); each runs there as written, and so do the
    commands init prints. Every key of both files carries a comment."""
    _write_data(tmp_path, shared_dir)
    init = ["init", "pairs.jsonl", "--out", "mydata", "--model", str(tiny_official)]
    r = run_neoembed(init, cwd=tmp_path)
    assert r.exit_code == 0, r.stderr[-3000:]
    printed = [line.strip() for line in r.stdout.splitlines() if line.strip().startswith("neoembed ")]
    files = [(tmp_path / "mydata" / name).read_text() for name in ("pairs.yaml", "pairs-recipe.yaml")]
    said = r"^#.*?(neoembed (?:data|train) .+)$"
    written = [m for text in files for m in re.findall(said, text, flags=re.M)]
    assert all("from the folder you ran `neoembed init` in" in text for text in files)
    assert set(printed) <= set(written) and any("--dry-run" in c for c in written), (printed, written)
    for command in sorted(written, key=lambda c: "--dry-run" not in c):  # the dry run before the training
        r = run_neoembed(command.split()[1:], cwd=tmp_path)
        assert r.exit_code == 0, f"{command}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    dry_run = run_neoembed(written[1].split()[1:], cwd=tmp_path).stdout
    assert "pairs  rows 64 (counted)" in dry_run  # the card was found
    assert (tmp_path / "runs" / "pairs" / "model.safetensors").is_file()
    logged = (tmp_path / "runs" / "pairs" / "metrics.jsonl").read_text().splitlines()
    assert len(logged) >= 5, logged  # the default run's curves are curves, not one point per panel
    for text in files:
        keys = [line for line in text.splitlines() if re.match(r"^\s*-?\s*\{?\w+:", line)]
        parents = ("source:", "columns:", "datasets:", "instruction:")  # instruction: commented above
        bare = [k for k in keys if "#" not in k and not k.startswith(parents)]
        assert not bare, bare
