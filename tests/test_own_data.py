"""docs/own-data.md as a new user runs it: the page's shell commands, in order, in an empty folder, on a JSONL of
real pairs written from scratch (MSRP paraphrase pairs), with the tiny NeoBERT fixture standing in for the packaged
model so that it runs in seconds; then the trained model in plain sentence-transformers with its saved prompt."""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
import shlex
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
    assert [c.split()[1] for c in commands] == ["init", "data", "train", "train", "mteb", "mteb", "mteb"]
    _write_data(tmp_path, shared_dir)
    for command in commands:
        argv = command.replace("packaged:all-MiniLM-L6-v2", str(tiny_official)).split()
        if argv[1] == "train" and "--dry-run" not in argv:
            argv += ["steps=3"]
        r = run_neoembed(argv[1:], cwd=tmp_path)
        assert r.exit_code == 0, f"{command}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    card = (tmp_path / "mydata" / "pairs.yaml").read_text()
    assert "query: query" in card and "positive: positive" in card and "size: 64" in card
    for run in ("base", "pairs"):  # before and after, both scored
        scores = json.loads((tmp_path / "results" / run / "MyHeldout.json").read_text())
        assert 0.0 <= scores["main_score"] <= 1.0
    assert (tmp_path / "results" / "compare" / "compare.png").is_file()
    # the model card's loading code runs from where training ran (it named the folder alone: walk X)
    assert 'neoembed.load("runs/pairs")' in (tmp_path / "runs" / "pairs" / "README.md").read_text()
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
    good.write_text("".join(json.dumps({"query": q, "positive": "p", "negative": "n"}) + "\n" for q in "qr"))
    starter = write_starter(good, tmp_path)
    assert starter.columns["negatives"] == ["negative"]
    with pytest.raises(FileExistsError, match="--overwrite"):
        write_starter(good, tmp_path)


def test_init_writes_commands_that_run_where_it_says(tmp_path, shared_dir, tiny_official, run_neoembed):
    """The card's and the recipe's comments name the commands to run and the folder to run them from (the one
    `neoembed init` ran in: card_dirs and output_dir are relative to it); each runs there as written, and so do the
    commands init prints, quoted for the shell (the folder here has a space in its name). Every key of both files
    carries a comment."""
    _write_data(tmp_path, shared_dir)
    init = ["init", "pairs.jsonl", "--out", "my data", "--model", str(tiny_official)]
    r = run_neoembed(init, cwd=tmp_path)
    assert r.exit_code == 0, r.stderr[-3000:]
    printed = [line.strip() for line in r.stdout.splitlines() if line.strip().startswith("neoembed ")]
    files = [(tmp_path / "my data" / name).read_text() for name in ("pairs.yaml", "pairs-recipe.yaml")]
    said = r"^#.*?(neoembed (?:data|train) .+)$"
    written = [m for text in files for m in re.findall(said, text, flags=re.M)]
    assert all("from the folder you ran `neoembed init` in" in text for text in files)
    assert set(printed) <= set(written) and any("--dry-run" in c for c in written), (printed, written)
    for command in sorted(written, key=lambda c: "--dry-run" not in c):  # the dry run before the training
        r = run_neoembed(shlex.split(command)[1:], cwd=tmp_path)
        assert r.exit_code == 0, f"{command}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    dry_run = run_neoembed(shlex.split(written[1])[1:], cwd=tmp_path).stdout
    assert "pairs  rows 64 (counted)" in dry_run  # the card was found
    assert (tmp_path / "runs" / "pairs" / "model.safetensors").is_file()
    logged = (tmp_path / "runs" / "pairs" / "metrics.jsonl").read_text().splitlines()
    assert len(logged) >= 5, logged  # the default run's curves are curves, not one point per panel
    for text in files:
        keys = [line for line in text.splitlines() if re.match(r"^\s*-?\s*\{?\w+:", line)]
        parents = ("source:", "columns:", "datasets:", "instruction:")  # instruction: commented above
        bare = [k for k in keys if "#" not in k and not k.startswith(parents)]
        assert not bare, bare


def test_init_holdout_keeps_rows_out_and_prints_the_base_models_command(
    tmp_path, shared_dir, tiny_official, run_neoembed
):
    """#44 (walk X): own pairs without held-out rows needed `eval.holdout` typed into the train line by hand.
    `init --holdout N` writes it into the recipe (steps sized on the rows left to train on), and prints the command
    that scores the base model on the same held-out rows; the run scores them at its last step, and the fine-tuned
    model scored by `neoembed mteb` on the written task gives the logged score. Bad counts are refused."""
    from neoembed.data.starter import write_starter

    _write_data(tmp_path, shared_dir)
    with pytest.raises(ValueError, match=r"hold out 1 to 32 of the 64 rows .* \(at most half"):
        write_starter(tmp_path / "pairs.jsonl", tmp_path / "mydata", holdout=33)
    init = ["init", "pairs.jsonl", "--out", "mydata", "--model", str(tiny_official), "--holdout", "12"]
    r = run_neoembed(init, cwd=tmp_path)
    assert r.exit_code == 0, r.stderr[-3000:]
    recipe = (tmp_path / "mydata" / "pairs-recipe.yaml").read_text()
    assert "batch_size: 13" in recipe and "eval: {steps: 10, holdout: {rows: 12}}" in recipe  # 52 rows // 4
    base = [shlex.split(line.strip()) for line in r.stdout.splitlines() if line.strip().startswith("neoembed mteb")]
    assert len(base) == 1 and base[0][-1] == "results/base", r.stdout
    r = run_neoembed(["train", "mydata/pairs-recipe.yaml", "--dry-run"], cwd=tmp_path)
    assert "eval.holdout: 12 rows of every card held out, and every row sharing" in r.stdout  # walk AD
    r = run_neoembed(["train", "mydata/pairs-recipe.yaml"], cwd=tmp_path)
    assert r.exit_code == 0, r.stderr[-3000:]
    assert "eval.holdout takes 12 held-out rows out of training: 52 of its 64 rows train" in r.stderr + r.stdout
    record = json.loads((tmp_path / "runs" / "pairs" / "run_record.json").read_text())
    assert len(record["holdout"]["cards"]["pairs"]["indices"]) == 12
    logged = [json.loads(line) for line in (tmp_path / "runs/pairs/metrics.jsonl").read_text().splitlines()]
    score = next(row[k] for row in logged for k in row if k.startswith("eval_Holdout-pairs_"))
    for argv in (base[0], ["neoembed", "mteb", "--model", "runs/pairs", "--tasks", base[0][5], "--output", "r/p"]):
        r = run_neoembed(argv[1:], cwd=tmp_path)
        assert r.exit_code == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "r/p/Holdout-pairs.json").read_text())["main_score"] == pytest.approx(score)
    assert (tmp_path / "results/base/Holdout-pairs.json").is_file()


def test_init_card_passes_data_check_on_a_file_where_some_rows_lack_a_negative(tmp_path):
    """Own data mixes triplets and pairs: init's card must pass `neoembed data check` as written (it failed:
    expected_loss 0.0 against the rows without a hard negative), and the check reports the share dropped."""
    from typer.testing import CliRunner

    from neoembed.data.cli import app
    from neoembed.data.starter import write_starter

    rows = [
        {"query": f"q{i}", "positive": f"p{i}", **({"negative": f"n{i}"} if i % 10 != 1 else {})}
        for i in range(40)
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    starter = write_starter(tmp_path / "pairs.jsonl", tmp_path / "mydata")
    result = CliRunner().invoke(app, [str(starter.card)])  # the group's one command runs as the group
    assert result.exit_code == 0, result.output
    assert "36 of 40 rows kept" in result.output


def _msrp_rows(shared_dir: Path, n: int) -> list[dict]:
    rows = [json.loads(line) for line in gzip.open(shared_dir / "data/train/msrp_pairs/train.jsonl.gz", "rt")]
    return [{"query": r["query"], "positive": r["positive"]} for r in rows[:n]]


def test_init_reads_a_json_array(tmp_path, shared_dir, monkeypatch):
    """A JSON array of objects is a listed input format (the card's json loader reads it): init used to refuse it
    as "line 1 is not a JSON object"; the card it writes passes `neoembed data check` with every row."""
    from typer.testing import CliRunner

    from neoembed.cli import app
    from neoembed.data.starter import write_starter

    monkeypatch.setenv("NEOEMBED_CARD_CACHE", "off")
    (tmp_path / "pairs.json").write_text(json.dumps(_msrp_rows(shared_dir, 20), indent=2))
    starter = write_starter(tmp_path / "pairs.json", tmp_path / "mydata")
    assert starter.rows == 20 and starter.columns["query"] == "query"
    r = CliRunner().invoke(app, ["data", "check", str(starter.card)], env={"HF_HUB_OFFLINE": "1"})
    assert r.exit_code == 0 and "20 of 20 rows kept" in r.output, r.output
    (tmp_path / "broken.json").write_text('[\n  {"query": "a", "positive": "b"},\n  {"query": "c",\n]\n')
    with pytest.raises(ValueError, match=r"broken.json, line 4, column 1: not valid JSON"):
        write_starter(tmp_path / "broken.json", tmp_path / "mydata")


@pytest.mark.parametrize("name", ["pairs.jsonl", "pairs.jsonl.gz", "pairs.csv"])
def test_init_names_file_and_line_of_non_utf8_input(tmp_path, shared_dir, name):
    """A Latin-1 byte on line 3 used to give Python's "'utf-8' codec can't decode byte 0xe9 in position N",
    naming neither the file nor the line."""
    from neoembed.data.starter import write_starter

    rows = _msrp_rows(shared_dir, 5)
    rows[2]["query"] = "caf\u00e9 " + rows[2]["query"]
    if name.endswith(".csv"):  # a header line, then the rows: the third row is the file's fourth line
        out = io.StringIO()
        csv.DictWriter(out, ["query", "positive"], lineterminator="\n").writerows(
            [{"query": "query", "positive": "positive"}, *rows]
        )
        text, line = out.getvalue(), 4
    else:
        text, line = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), 3
    data = text.encode("latin-1")
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}, line {line}: not UTF-8 text \(byte 0xe9"):
        write_starter(path, tmp_path / "mydata")


def test_init_refuses_a_file_too_small_to_train_on(tmp_path, shared_dir):
    """A 1-row file used to get a recipe with batch_size 2: a batch the data cannot fill, and no other row to
    contrast with. Two rows are the least a contrastive batch needs, and the batch never exceeds the rows."""
    from neoembed.data.starter import write_starter

    rows = _msrp_rows(shared_dir, 2)
    (tmp_path / "one.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match=r"one.jsonl holds 1 row: contrastive training needs at least 2"):
        write_starter(tmp_path / "one.jsonl", tmp_path / "mydata")
    assert not (tmp_path / "mydata").exists()  # nothing half-written
    (tmp_path / "two.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = write_starter(tmp_path / "two.jsonl", tmp_path / "mydata").recipe.read_text()
    assert re.search(r"^batch_size: 2 ", recipe, flags=re.M)


def test_the_pages_measured_pairs_keep_342_of_348_rows(tmp_path, shared_dir, tiny_official, run_neoembed):
    """The page's "What to expect" says `data check` keeps 342 of its 348 TrecQA pairs (6 have no hard
    negative): the pairs written as the page says, its init and data check lines."""
    rows = [json.loads(line) for line in gzip.open(shared_dir / "data/train/trecqa_pairs/train.jsonl.gz", "rt")]
    with (tmp_path / "pairs.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps({k: r[k] for k in ("query", "positive", "negative") if k in r}) + "\n")
    r = run_neoembed(["init", "pairs.jsonl", "--out", "mydata", "--model", str(tiny_official)], cwd=tmp_path)
    assert r.exit_code == 0, r.stderr[-2000:]
    r = run_neoembed(["data", "check", "mydata/pairs.yaml"], cwd=tmp_path)
    assert "342 of 348 rows kept (dropped: fewer than 1 hard negatives: 6" in r.stdout + r.stderr, r.stdout
    assert "data check` keeps 342 of the 348: 6 have no hard negative" in PAGE.read_text(encoding="utf8")


@pytest.mark.parametrize(("rows", "steps", "warmup"), [(64, 10, 0), (700, 21, 2), (6400, 200, 20)])
def test_init_warms_up_over_two_steps_or_none(tmp_path, rows, steps, warmup):
    """transformers' linear warm-up starts at rate 0: a one-step warm-up would spend the only step it has on
    nothing and then jump to the full rate, so init writes none below two steps, a tenth of the run above."""
    import torch
    import yaml

    from neoembed.data.starter import write_starter
    from neoembed.loop import schedule
    from neoembed.recipe import OptimizerConfig

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"query": f"q{i}", "positive": f"p{i}"}) + "\n" for i in range(rows)))
    text = yaml.safe_load(write_starter(data, tmp_path).recipe.read_text())
    opt = OptimizerConfig.model_validate(text["optimizer"])
    assert (text["steps"], opt.warmup_steps) == (steps, warmup)
    sched = schedule(opt, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=opt.lr), text["steps"])
    rates = []
    for _ in range(3):  # the rates of the first three steps
        rates.append(sched.get_last_lr()[0])
        sched.step()
    assert rates == sorted(rates, reverse=not warmup) and (rates[0] > 0) == (not warmup), rates
