"""The paper's recipe on its real data: Table 7 verbatim, every card against its declared schema, rows shaped like
each dataset through the real loader, nothing dropped silently, `data check`, the dry run, sampling and qrels joins.

Tables 7-9 are parsed from the paper's text, quoted in tests/shared/paper/ from ../shared (tests/refresh_shared.py)."""

from __future__ import annotations

import ast
import gzip
import json
import re
from pathlib import Path

import datasets
import pytest
from typer.testing import CliRunner

from neoembed.card_schema import TrainingCard
from neoembed.data.cards import DataCardError, build_pairs_report, load_card, load_card_rows, prepare_card

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO / "tests" / "shared" / "paper" / "neobert-paper-tables-7-9.md"
SHIPPED = sorted((REPO / "data_cards").glob("*.yaml"))


# ----------------------------------------------------------------------------------------------- the paper
def _table(n: int) -> list[tuple[str, str]]:
    """Rows (name, instruction) of Table n, as printed (tab-separated lines after its caption)."""
    text = PAPER.read_text(encoding="utf8")
    rows = []
    for line in text[text.index(f"Table {n}:") :].splitlines()[1:]:
        if rows and (line.startswith(("Table ", "---", "#"))):
            break
        if "\t" in line and not line.startswith(("Dataset\t", "Task name\t")):
            name, instruction = line.split("\t", 1)
            rows.append((re.sub(r"\s*<sub>(\w+)</sub>", r"_\1", name.strip()), instruction.strip()))
    return rows


def test_every_card_instruction_is_its_table7_row_verbatim():
    table7 = dict(_table(7))
    assert len(table7) == 22 and table7["YAHOO_CLUST"].startswith("Identify the main topic")
    cards = [load_card(p)[0] for p in SHIPPED]
    for card in cards:
        assert card.paper_row in table7, f"{card.name}: paper_row {card.paper_row!r} is not a Table 7 row"
        assert card.instruction == table7[card.paper_row], card.name
    assert {c.paper_row for c in cards} == set(table7)  # every row of Table 7 is trained


def _expand_tables_8_9(mteb_names: list[str], cqa_subsets: list[str]) -> dict[str, str]:
    out = {}
    for name, instruction in _table(8) + _table(9):
        if name == "STS":  # the paper's STS row: every STS task of MTEB(eng, v1) without a row of its own
            out.update({n: instruction for n in mteb_names if re.fullmatch(r"STS\d+|STSBenchmark", n)})
        elif name.startswith("<dataset>"):
            suffix = name[len("<dataset>") :]
            for n in mteb_names:
                m = re.fullmatch(rf"(\w+?){suffix}", n)
                if m and n != "TwentyNewsgroupsClustering":
                    out[n] = instruction.replace("<dataset>", m.group(1))
        elif name.endswith("Class."):
            out[name.removesuffix("Class.") + "Classification"] = instruction
        elif name == "CQADupstackRetrieval":
            out.update({n: instruction for n in cqa_subsets})
        else:
            out[name] = instruction
    return out


def test_paper_set_is_tables_8_and_9_row_by_row_and_released_is_the_default():
    import mteb

    from neoembed.instructions import DEFAULT_INSTRUCTION_SET, load_instruction_set

    tasks = mteb.get_benchmark("MTEB(eng, v1)").tasks
    names = [t.metadata.name for t in tasks]
    cqa = next(t for t in tasks if t.metadata.name == "CQADupstackRetrieval").metadata.tasks  # its 12 subsets
    cqa = sorted(t.metadata.name for t in cqa)
    assert len(cqa) == 12
    label, paper = load_instruction_set("paper")
    assert paper == _expand_tables_8_9(names, cqa)
    assert set(paper) == (set(names) - {"CQADupstackRetrieval"}) | set(cqa)  # all of MTEB(eng, v1)
    assert paper["Banking77Classification"].startswith("Given a online")  # the paper's typos are kept
    assert paper["ArguAna"].endswith("refute the claim. Document")
    released = load_instruction_set("released")[1]
    assert DEFAULT_INSTRUCTION_SET == "released" and released != paper
    assert released["SciDocsRR"] != paper["SciDocsRR"] and released["MSMARCO"].endswith("Query:")
    for name in ("paper", "released"):
        source = json.loads((REPO / "neoembed" / f"instructions_{name}.json").read_text())["_source"]
        assert ("Tables 8-9" in source) if name == "paper" else ("released" in source)


# ----------------------------------------------------------------------------------------- shipped cards
def test_every_shipped_card_passes_the_offline_schema_check():
    assert len(SHIPPED) == 23
    for path in SHIPPED:
        card, _ = load_card(path)
        assert card.schema_ is not None and card.schema_problems() == [], (card.name, card.schema_problems())
        assert card.license and "https://" in card.notes, card.name  # the evidence is cited
        if card.source.hub.revision:  # pinned only to a commit hash quoted in the cited evidence
            assert (
                re.fullmatch(r"[0-9a-f]{40}", card.source.hub.revision)
                and card.source.hub.revision in card.notes
            )


def test_a_card_whose_paths_cannot_work_fails_the_schema_check():
    raw = load_card(REPO / "data_cards" / "qqp.yaml")[0].model_dump(by_alias=True)
    raw["columns"] = {"query": "set.question", "positive": "set.pos", "negatives": ["set.neg[0].text"]}
    problems = TrainingCard.model_validate(raw).schema_problems()
    assert any("'set' has no field 'question'" in p for p in problems)
    assert any("set.pos" in p and "not text" in p for p in problems)  # a list where text is needed
    assert any("set.neg[0].text" in p for p in problems)


def test_a_card_key_is_listed_and_read_as_documented_schema_not_its_field_name(tmp_path):
    """#43 walk, D17: a misspelt key listed the valid keys with `schema_`, the field's internal name, and a
    card with `schema_:` loaded; the documented key is `schema:`."""
    raw = load_card(REPO / "data_cards" / "qqp.yaml")[0].model_dump(by_alias=True, exclude_none=True)
    card = tmp_path / "c.yaml"
    card.write_text(json.dumps({**raw, "instuction": "a typo"}))
    with pytest.raises(DataCardError, match="unknown key 'instuction'") as e:
        load_card(card)
    valid = re.search(r"Valid keys here: (.*)", str(e.value)).group(1).split(", ")
    assert "schema" in valid and "instruction" in valid and "schema_" not in valid, e.value
    card.write_text(json.dumps({**{k: v for k, v in raw.items() if k != "schema"}, "schema_": raw["schema"]}))
    with pytest.raises(DataCardError, match="unknown key 'schema_'"):
        load_card(card)
    card.write_text(json.dumps({**raw, "schema": {**raw["schema"], "split_": "train"}}))
    with pytest.raises(DataCardError, match=r"unknown key 'schema.split_'. Valid keys here: config, feat"):
        load_card(card)
    card.write_text(json.dumps(raw))
    assert load_card(card)[0].schema_.features == raw["schema"]["features"]


def test_a_data_folders_own_card_is_named_as_one_with_the_command_that_writes_a_data_card(shared_dir, tmp_path):
    """``neoembed mine`` / ``train`` / ``data check`` on the ``card.yaml`` beside a folder's rows listed every key
    as unknown, with no word on what the file is; the command the error gives writes a card that loads."""
    from neoembed.data.starter import write_starter

    folder = shared_dir / "data" / "train" / "trecqa_pairs"
    with pytest.raises(DataCardError, match="describes a data folder") as e:
        load_card(folder / "card.yaml")
    assert f"neoembed init {folder / 'train.jsonl.gz'} --out DIR" in str(e.value)
    card, _ = load_card(write_starter(folder / "train.jsonl.gz", tmp_path).card)
    assert card.columns.query == "query" and card.columns.negatives == ["negative"]


def _features(t) -> datasets.Features | object:
    """A compact declared type as a ``datasets`` feature."""
    if isinstance(t, dict) and "class_label" in t:
        return datasets.ClassLabel(names=t["class_label"])
    if isinstance(t, dict):
        return {k: _features(v) for k, v in t.items()}
    if isinstance(t, list):
        return datasets.List(_features(t[0]))
    return datasets.Value(t)


def _value(t, i: int, name: str, optional_gone: bool):
    """A value of declared type ``t`` for row i: real-looking text, a label id, nested lists and structs."""
    if isinstance(t, dict) and "class_label" in t:
        return i % len(t["class_label"])
    if isinstance(t, dict):
        return {k: _value(v, i, k, optional_gone) for k, v in t.items()}
    if isinstance(t, list):
        return [_value(t[0], i * 3 + j, name, optional_gone) for j in range(3)]
    if t in ("string", "large_string"):
        return f"The {name} of example {i}: the Colombian army said a helicopter crashed near Bogota."
    return float(i) / 10 + 4.5 if t.startswith("float") else i


def _rows_like(card: TrainingCard, n: int = 12) -> datasets.Dataset:
    """Rows shaped like the card's declared schema; features the card does not read are null in every third row."""
    used = {re.split(r"[.\[]", s)[0] for _, s in card.columns.specs()} | (
        {card.filter.split()[0]} if card.filter else set()
    )
    rows = []
    for i in range(n):
        rows.append(
            {
                k: None if (k not in used and i % 3 == 0) else _value(t, i, k, False)
                for k, t in card.schema_.features.items()
            }
        )
    return datasets.Dataset.from_list(rows, features=datasets.Features(_features(card.schema_.features)))


@pytest.mark.parametrize("path", [p for p in SHIPPED if "join:" not in p.read_text()], ids=lambda p: p.stem)
def test_rows_shaped_like_each_dataset_give_queries_positives_and_negatives(path):
    card, _ = load_card(path)
    pairs, report = build_pairs_report(card, _rows_like(card))
    assert report.dropped == {} and len(pairs) == 12
    instruction = card.instruction + " "
    assert all(q.startswith(instruction) and len(q) > len(instruction) for q in pairs["query"])
    assert all(p.strip() for p in pairs["positive"])
    expected_negatives = sum(1 if not s.endswith("neg") else 3 for s in card.columns.negatives)
    assert report.negatives_per_query == expected_negatives, card.name
    assert pairs.column_names == ["query", "positive"] + [
        f"negative_{j + 1}" for j in range(expected_negatives)
    ]


@pytest.mark.parametrize("path", [p for p in SHIPPED if "join:" in p.read_text()], ids=lambda p: p.stem)
def test_qrels_cards_join_rows_shaped_like_their_dataset(tmp_path, path):
    """FEVER and MS MARCO: qrels as declared (query-id, corpus-id, score), joined with a corpus and queries in the
    same layout, read from a local folder in place of the hub."""
    card, _ = load_card(path)
    assert set(card.schema_.features) == {"query-id", "corpus-id", "score"}
    _mteb_folder(tmp_path / card.name, n_docs=60, n_queries=8)
    local = card.model_copy(update={"source": type(card.source)(local={"path": card.name, "format": "mteb"})})
    pairs, report = prepare_card(local.model_copy(update={"expected_loss": 0.25}), tmp_path)
    assert len(pairs) == 8 and report.full_size == 10
    assert pairs["query"][0] == card.instruction + " which river is number 0?"
    assert pairs["positive"][1] == "Title 7 Passage number 7 about rivers."


def test_clustering_cards_train_text_to_its_category_name():
    yahoo, _ = load_card(REPO / "data_cards" / "yahoo_clustering.yaml")
    pairs, _ = build_pairs_report(yahoo, _rows_like(yahoo))
    topics = yahoo.schema_.features["topic"]["class_label"]
    assert pairs["positive"][:3] == topics[:3]  # the ClassLabel id read as the topic's name
    assert (
        "question_title of example 0" in pairs["query"][0] and "best_answer of example 0" in pairs["query"][0]
    )
    med, _ = load_card(REPO / "data_cards" / "medmcqa_clustering.yaml")
    rows = datasets.Dataset.from_list(
        [
            {"question": "Which nerve supplies the deltoid muscle?", "subject_name": "Anatomy", "exp": None},
            {
                "question": "Drug of choice for absence seizures?",
                "subject_name": "Pharmacology",
                "exp": "Ethosuximide.",
            },
        ]
    )
    pairs, _ = build_pairs_report(med, rows)
    assert pairs["positive"] == ["Anatomy", "Pharmacology"]


def test_pubmedqa_trains_all_20_hard_negatives_at_the_released_batch_size():
    """The official code feeds every query's negative_1 ... negative_20 each step, target_bsz // 22 queries."""
    from neoembed.recipe import load_recipe
    from neoembed.train.recipe import UnifiedRecipe

    card, _ = load_card(REPO / "data_cards" / "pubmedqa.yaml")
    declared = [f for f in card.schema_.features if f.startswith("negative_")]
    assert card.columns.negatives == declared == [f"negative_{i}" for i in range(1, 21)]
    pairs, report = build_pairs_report(card, _rows_like(card, 6))
    assert report.negatives_per_query == 20 and pairs.column_names[-1] == "negative_20"
    recipe = load_recipe(REPO / "recipes" / "neobert-unified.yaml", UnifiedRecipe, [])
    entry = next(e for e in recipe.datasets if e.card == "pubmedqa")
    assert recipe.dataset_batch_size(entry, report.negatives_per_query) == recipe.batch_texts // 22 == 5
    assert entry.batch_size is None and entry.max_negatives is None


# ------------------------------------------------------------------------------------- nothing silent
def _card(tmp_path, rows, columns, **extra) -> tuple[TrainingCard, Path]:
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    raw = {"name": "probe", "source": {"local": {"path": "d.jsonl"}}, "columns": columns, **extra}
    (tmp_path / "c.yaml").write_text(json.dumps(raw))
    return load_card(tmp_path / "c.yaml")


QUESTIONS = [
    ("how old is the sun", "about 4.6 billion years", "it is very hot"),
    ("what is rain", "water falling from clouds", "a kind of snow"),
    ("who wrote hamlet", "william shakespeare", "christopher marlowe"),
    ("where is lima", "the capital of peru", "a city in chile"),
]


def _qa_rows(n: int = 64) -> list[dict]:
    return [
        {
            "q": f"{q} ({i})",
            "a": a,
            "meta": {"neg": [n_]},
            "negs": [n_, "an unrelated sentence"],
            "label": i % 2,
        }
        for i, (q, a, n_) in enumerate(QUESTIONS[i % 4] for i in range(n))
    ]


def test_a_negatives_spec_that_matches_nothing_is_an_error(tmp_path):
    card, folder = _card(
        tmp_path, _qa_rows(), {"query": "q", "positive": "a", "negatives": ["meta.negatives"]}
    )
    with pytest.raises(
        DataCardError, match=r"negatives spec 'meta.negatives' matched nothing in any of the 64 rows"
    ):
        prepare_card(card, folder)
    card, folder = _card(tmp_path, _qa_rows(), {"query": "q", "positive": "a", "negatives": ["negs[5]"]})
    with pytest.raises(DataCardError, match=r"'negs\[5\]' matched nothing"):
        prepare_card(card, folder)


def test_one_row_without_its_negative_keeps_the_others_negatives_and_is_counted(tmp_path):
    rows = _qa_rows()
    rows[17]["meta"] = {"neg": []}
    card, folder = _card(tmp_path, rows, {"query": "q", "positive": "a", "negatives": ["meta.neg"]})
    with pytest.raises(DataCardError, match=r"63 of 64 rows kept \(dropped: fewer than 1 hard negatives: 1"):
        prepare_card(card, folder)  # expected_loss 0: losing one row is an error that says how to allow it
    card, folder = _card(
        tmp_path, rows, {"query": "q", "positive": "a", "negatives": ["meta.neg"]}, expected_loss=0.02
    )
    pairs, report = prepare_card(card, folder)
    assert report.negatives_per_query == 1 and len(pairs) == 63 and pairs["negative_1"][0] == "it is very hot"
    assert report.dropped == {"fewer than 1 hard negatives": 1}
    pairs, report = prepare_card(card, folder, max_negatives=0)  # or keep every row, without negatives
    assert len(pairs) == 64 and pairs.column_names == ["query", "positive"] and report.dropped == {}


def test_data_check_notes_repeated_pairs_queries_equal_to_positives_and_a_wrong_size(tmp_path):
    """#43 walk, B6, B7, B14: every row twice, 20 queries equal to their positive, and a card declaring 500 rows
    over 64 passed `neoembed data check` without a word (training warns only when most pairs are degenerate;
    a local card's size is replaced by the count). Each is now a NOTE with its numbers; a clean card has none."""
    rows = _qa_rows(32)
    _card(tmp_path, rows + rows, {"query": "q", "positive": "a"})
    r = _check(str(tmp_path / "c.yaml"), "--sample", "0", offline=True)
    assert r.exit_code == 0 and "NOTE: 32 of 64 pairs repeat another pair" in r.output, r.output
    same = [dict(row, a=row["q"]) if i < 5 else row for i, row in enumerate(rows)]
    _card(tmp_path, same, {"query": "q", "positive": "a"}, size=500)
    r = _check(str(tmp_path / "c.yaml"), "--sample", "0", offline=True)
    assert "NOTE: 5 of 32 pairs have the query equal to its positive" in r.output, r.output
    assert "the card declares size: 500, its data holds 32 rows" in r.output
    _card(tmp_path, rows, {"query": "q", "positive": "a"}, size=32)
    r = _check(str(tmp_path / "c.yaml"), "--sample", "0", offline=True)
    assert r.exit_code == 0 and "NOTE" not in r.output, r.output


def test_a_cut_off_json_line_is_named_once_without_the_readers_log_line(tmp_path, caplog):
    """#43 walk, B16: a JSONL whose last line is cut off was named with its line and fix, but after the JSON
    reader's own log line ("Failed to load JSON from file ... ArrowInvalid ...")."""
    _card(tmp_path, _qa_rows(8), {"query": "q", "positive": "a"})
    with (tmp_path / "d.jsonl").open("a") as f:
        f.write('{"q": "cut", "a": "of')
    r = _check(str(tmp_path / "c.yaml"), offline=True)
    assert r.exit_code == 1 and "line 9: not a JSON object" in r.output, r.output
    logged = r.output + caplog.text  # the reader logs on its own logger (the console prints it; pytest keeps it)
    assert "Failed to load JSON" not in logged and "ArrowInvalid" not in logged, logged


def _local_card(tmp_path: Path, data: str, fmt: str) -> Path:
    """A card reading the local file ``data`` (in tmp_path) as ``fmt``, with query and positive columns."""
    card = tmp_path / "c.yaml"
    raw = {"name": "probe", "source": {"local": {"path": data, "format": fmt}}, "expected_loss": "unknown"}
    card.write_text(json.dumps({**raw, "columns": {"query": "query", "positive": "positive"}}))
    return card


def _cut_parquet(path: Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"query": [f"q {i}" for i in range(200)], "positive": ["p"] * 200}), path)
    path.write_bytes(path.read_bytes()[:1500])
    return path.name


@pytest.mark.parametrize(
    ("make", "fmt", "expect"),
    [
        (lambda d: (d / "h.csv").write_text("query,positive\n") and "h.csv", "csv", "h.csv: has a header"),
        (lambda d: _cut_parquet(d / "t.parquet"), "parquet", "t.parquet: is not a readable parquet file"),
    ],
    ids=["header-only-csv", "cut-parquet"],
)
def test_an_unreadable_csv_or_parquet_is_explained_in_its_own_format(tmp_path, caplog, make, fmt, expect):
    """#43 walk, D8/D9: every local file was explained as JSON lines, whatever the card's format: a CSV with a
    header and no rows was "line 1: not a JSON object", a cut-off parquet file "not UTF-8 text ... iconv"."""
    r = _check(str(_local_card(tmp_path, make(tmp_path), fmt)), offline=True)
    assert r.exit_code == 1 and expect in r.output, r.output
    assert "JSON" not in r.output and "UTF-8" not in r.output, r.output
    assert "Failed to read schema" not in r.output + caplog.text  # the parquet reader's own log line


def test_the_first_dropped_row_is_named_by_the_line_an_editor_shows(tmp_path):
    """#43 walk, D2: "positive missing: 1 (first: row 3)" counted rows from 0 without saying so, and the row
    was the JSON-lines file's line 4 (a blank line or a CSV header moves it further)."""
    lines = [json.dumps({"query": f"q {i}", "positive": None if i == 3 else f"p {i}"}) for i in range(8)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")  # row 3: line 5
    r = _check(str(_local_card(tmp_path, "d.jsonl", "json")), "--sample", "0", offline=True)
    assert r.exit_code == 0 and "positive missing: 1 (first: line 5)" in r.output, r.output
    from neoembed.data.errors import LINE_SCAN_ROWS, row_lines

    assert row_lines(tmp_path / "d.jsonl", "json", [3]) == {3: 5}
    assert row_lines(tmp_path / "d.jsonl", "json", [LINE_SCAN_ROWS]) is None  # millions of lines: not scanned
    rows = [f"q {i},{'' if i == 2 else f'p {i}'}" for i in range(8)]
    (tmp_path / "d.csv").write_text("\n".join(["query,positive", *rows]) + "\n")  # row 2: line 4
    r = _check(str(_local_card(tmp_path, "d.csv", "csv")), "--sample", "0", offline=True)
    assert r.exit_code == 0 and "positive missing: 1 (first: line 4)" in r.output, r.output
    r = _check(str(tmp_path / "c.yaml"), "--sample", "0", "--max-rows", "7", offline=True)  # rows of a sample
    assert r.exit_code == 0 and re.search(r"positive missing: 1 \(first: row \d\)", r.output), r.output
    # a row short of hard negatives is named too (walk P's P3: the only reason said without its first row)
    rows = [f"q {i},p {i}" + ("" if i == 5 else f",n {i}") for i in range(8)]
    (tmp_path / "n.csv").write_text("\n".join(["query,positive,negative", *rows]) + "\n")  # row 5: line 7
    card = json.loads(_local_card(tmp_path, "n.csv", "csv").read_text())
    card["columns"]["negatives"] = ["negative"]
    (tmp_path / "c.yaml").write_text(json.dumps(card))
    r = _check(str(tmp_path / "c.yaml"), "--sample", "0", offline=True)
    assert r.exit_code == 0 and "fewer than 1 hard negatives: 1 (first: line 7)" in r.output, r.output


def test_a_later_csv_row_wider_than_its_header_is_named_once_by_its_line(tmp_path, caplog):
    """#43 walk, D11: an unquoted comma in the CSV's second row: pandas' "Expected 2 fields in line 3, saw 3"
    went to the console as a log line, then the error said "line 1: not a JSON object"."""
    rows = "how are you,fine\nwhat time is it, please,noon\nwho,me\n"
    (tmp_path / "rag.csv").write_text("query,positive\n" + rows)
    r = _check(str(_local_card(tmp_path, "rag.csv", "csv")), offline=True)
    expect = "rag.csv, line 3: has 3 fields, the header 2: quote the fields that contain commas"
    assert r.exit_code == 1 and expect in r.output and "JSON" not in r.output, r.output
    assert "Expected 2 fields" not in r.output + caplog.text  # the CSV reader's own log line


def test_rows_without_negatives_beside_rows_with_three_get_a_hint_that_keeps_them(tmp_path):
    """#43 walk, B15: half the rows with 3 negatives, half with none: the error said "max_negatives: 2 or 0 keeps
    the rows with fewer hard negatives", but 2 drops the rows without any as 3 does (and then said "1 or 0")."""
    rows = _qa_rows()
    for i, row in enumerate(rows):
        row["meta"] = {"neg": [row["meta"]["neg"][0], "an unrelated sentence", "a third one"] if i % 2 else []}
    card, folder = _card(tmp_path, rows, {"query": "q", "positive": "a", "negatives": ["meta.neg"]})
    with pytest.raises(DataCardError) as error:
        prepare_card(card, folder)
    hint = "max_negatives: N in the recipe (datasets: [{card: probe, max_negatives: N}]) keeps the rows with"
    assert hint in str(error.value) and "N=0 every row (64)" in str(error.value), error.value
    with pytest.raises(DataCardError, match="32 of 64 rows kept"):  # what the old hint offered: still dropped
        prepare_card(card, folder, max_negatives=2)
    pairs, report = prepare_card(card, folder, max_negatives=0)
    assert len(pairs) == 64 and report.dropped == {}


def test_rows_short_of_negatives_are_counted_per_max_negatives_whatever_the_expected_loss(tmp_path):
    """#43 walk, D6: negatives lists of 0-3 items lost 30 of 40 rows ("fewer than 3 hard negatives") with no
    word of max_negatives when the card's expected_loss was `unknown`, which `neoembed init` writes: the hint
    came only with the error of a numeric expected_loss."""
    rows = [{"q": f"q {i}", "a": f"p {i}", "negs": [f"n {i} {j}" for j in range(i % 4)]} for i in range(40)]
    columns = {"query": "q", "positive": "a", "negatives": ["negs"]}
    counted = "at least N hard negatives: N=2 keeps 20, N=1 keeps 30, N=0 every row (40)"
    _card(tmp_path, rows, columns, expected_loss="unknown")
    r = _check(str(tmp_path / "c.yaml"), "--sample", "0", offline=True)
    assert r.exit_code == 0 and "10 of 40 rows kept" in r.output, r.output
    warning = next(line for line in r.output.splitlines() if "WARNING" in line)
    assert "max_negatives: N in the recipe" in warning and counted in warning, r.output
    _card(tmp_path, rows, columns, expected_loss=0.75)  # within the card's share: a note, not an error
    r = _check(str(tmp_path / "c.yaml"), "--sample", "0", offline=True)
    assert r.exit_code == 0 and "NOTE: max_negatives: N in the recipe" in r.output, r.output
    assert counted in r.output


@pytest.mark.parametrize(
    "spec, found",
    [("meta", "dict"), ("negs", "list"), ("label", "int")],
)
def test_a_path_reaching_a_non_text_value_names_card_spec_row_and_type(tmp_path, spec, found):
    card, folder = _card(tmp_path, _qa_rows(), {"query": "q", "positive": spec})
    with pytest.raises(
        DataCardError, match=rf"card probe: positive spec '{spec}' reaches a {found} in .*d.jsonl, line 1 "
    ):
        prepare_card(card, folder)


def test_integer_labels_read_as_names_from_the_cards_labels_map(tmp_path):
    card, folder = _card(
        tmp_path,
        _qa_rows(8),
        {"query": "q", "positive": "label"},
        labels={"label": ["Science", "Literature"]},
    )
    pairs, _ = prepare_card(card, folder)
    assert pairs["positive"][:2] == ["Science", "Literature"]


def test_a_wrong_nested_path_names_the_spec(tmp_path):
    card, folder = _card(tmp_path, _qa_rows(), {"query": "q", "positive": "meta.answer"})
    with pytest.raises(
        DataCardError, match=r"positive spec 'meta.answer' matched nothing in any of the 64 rows"
    ):
        prepare_card(card, folder)


def test_rows_dropped_for_missing_or_empty_text_are_counted_per_reason(tmp_path):
    rows = _qa_rows(40)
    rows[3]["q"], rows[5]["a"], rows[7]["a"] = None, "   ", ""
    del rows[9]["q"]
    card, folder = _card(tmp_path, rows, {"query": "q", "positive": "a"}, expected_loss=0.1)
    pairs, report = prepare_card(card, folder)
    assert report.dropped == {"query missing": 2, "positive empty": 2} and len(pairs) == 36
    assert report.as_dict()["loss"] == pytest.approx(0.1)
    card, folder = _card(tmp_path, rows, {"query": "q", "positive": "a"}, expected_loss=0.05)
    # each reason names the first row it drops, by its line in the JSON-lines file (0-based rows 3 and 5)
    why = r"query missing: 2 \(first: line 4\), positive empty: 2 \(first: line 6\); 10.00% vs 5.00% expected"
    with pytest.raises(DataCardError, match=why):
        prepare_card(card, folder)


def _medmcqa_like(card: TrainingCard, n: int = 40, without_exp=(3, 11, 12, 30)) -> datasets.Dataset:
    """Rows shaped like medmcqa with its explanation (exp) null in some rows, as in the real dataset."""
    rows = _rows_like(card, n).to_list()
    for i in without_exp:
        rows[i]["exp"] = None
    return datasets.Dataset.from_list(rows, features=_rows_like(card, 1).features)


def test_an_unknown_expected_loss_counts_and_warns_but_never_stops_the_run(caplog):
    med, _ = load_card(REPO / "data_cards" / "medmcqa.yaml")
    assert med.expected_loss == "unknown" and "expected_loss is unknown" in med.notes
    rows = _medmcqa_like(med)
    with caplog.at_level("WARNING", logger="neoembed.data.cards"):
        pairs, report = build_pairs_report(med, rows)
    assert len(pairs) == 36 and report.dropped == {"positive missing": 4}
    record = report.as_dict()  # what the run record keeps for the card
    assert record["expected_loss"] == "unknown" and record["loss"] == pytest.approx(0.1)
    assert (
        "36 of 40 rows kept (dropped: positive missing: 4 (first: row 4); measured 10.00%, expected: unknown)"
        in record["line"]
    )
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "card medmcqa: expected_loss: unknown, so the run goes on" in warned[0]
    assert (
        "having dropped 4 of 40 rows (10.00%)" in warned[0]
        and "expected_loss: 0.1 in the card" in warned[0]
    )
    # a number keeps today's strict rule: the same card and rows with expected_loss 0 stop
    with pytest.raises(DataCardError, match=r"positive missing: 4 \(first: row 4\); 10.00% vs 0.00% expected.*or `unknown`"):
        build_pairs_report(med.model_copy(update={"expected_loss": 0.0}), rows)
    # no usable rows is still an error, unknown or not
    blank = datasets.Dataset.from_list([{**r, "exp": " "} for r in rows.to_list()], features=rows.features)
    with pytest.raises(DataCardError, match="no usable rows"):
        build_pairs_report(med, blank)


def test_an_unknown_expected_loss_is_written_in_the_training_data_report(tmp_path):
    from neoembed.train.recipe import UnifiedRecipe
    from neoembed.train.trainer import prepare_datasets

    rows = _qa_rows(40)
    for i in (2, 9, 21):
        rows[i]["a"] = None
    card, _ = _card(tmp_path, rows, {"query": "q", "positive": "a"}, expected_loss="unknown")
    recipe = UnifiedRecipe(
        model="unused", seed=0, datasets=[{"card": str(tmp_path / "c.yaml")}], batch_size=4
    )
    reports: dict = {}
    pairs, _, _ = prepare_datasets(recipe, tmp_path, reports)
    assert len(pairs["probe"]) == 37 and reports["probe"].dropped == {"positive missing": 3}
    assert "measured 7.50%, expected: unknown" in reports["probe"].as_dict()["line"]
    raw = json.loads((tmp_path / "c.yaml").read_text())
    raw["expected_loss"] = 0.0
    (tmp_path / "c.yaml").write_text(json.dumps(raw))
    with pytest.raises(DataCardError, match=r"37 of 40 rows kept .*7.50% vs 0.00% expected"):
        prepare_datasets(recipe, tmp_path, {})
    raw["expected_loss"] = None  # null is not "unknown": the strict default is never switched off by accident
    (tmp_path / "c.yaml").write_text(json.dumps(raw))
    with pytest.raises(DataCardError, match="expected_loss"):
        load_card(tmp_path / "c.yaml")


# --------------------------------------------------------------------------------- sampling and qrels joins
def test_max_rows_is_a_seeded_random_sample_and_pi_uses_the_full_size(tmp_path):
    from neoembed.data.sampler import PowerLawDatasetBatchSampler, dataset_probabilities

    card, folder = _card(tmp_path, _qa_rows(64), {"query": "q", "positive": "a"})
    a, b, c = (load_card_rows(card, folder, 10, seed) for seed in (0, 0, 1))
    assert a.full_size == 64 and a.sampled and len(a.rows) == 10
    assert a.rows["q"] == b.rows["q"] != c.rows["q"] and a.rows["q"] != [r["q"] for r in _qa_rows(10)]
    import torch
    from torch.utils.data import BatchSampler, ConcatDataset, SequentialSampler

    parts = [torch.arange(10), torch.arange(40)]  # 10 and 40 rows loaded, from datasets of 100 and 10,000
    samplers = [BatchSampler(SequentialSampler(d), 5, True) for d in parts]
    sampler = PowerLawDatasetBatchSampler(ConcatDataset(parts), samplers, alpha=0.5, full_sizes=[100, 10_000])
    assert sampler.probabilities == pytest.approx(dataset_probabilities([100, 10_000], 0.5))  # 1/11, 10/11
    assert sampler.sizes == [10, 40]  # the loaded rows still place each dataset's indices


def _mteb_folder(root: Path, n_docs: int = 300, n_queries: int = 40) -> Path:
    (root / "qrels").mkdir(parents=True)
    with gzip.open(root / "corpus.jsonl.gz", "wt") as f:
        for d in range(n_docs):
            f.write(
                json.dumps(
                    {"_id": f"doc{d}", "title": f"Title {d}", "text": f"Passage number {d} about rivers."}
                )
                + "\n"
            )
    with open(root / "queries.jsonl", "w") as f:
        for q in range(n_queries):
            f.write(json.dumps({"_id": f"q{q}", "text": f"which river is number {q}?"}) + "\n")
    lines = ["query-id\tcorpus-id\tscore"] + [f"q{q}\tdoc{q * 7}\t1" for q in range(n_queries)]
    lines += [
        "q0\tdoc1\t0",
        "q1\tdoc_missing\t1",
        "q_missing\tdoc2\t1",
    ]  # a non-relevant pair, two dangling ids
    (root / "qrels" / "train.tsv").write_text("\n".join(lines) + "\n")
    return root


def test_a_local_mteb_layout_folder_is_joined_reading_only_what_the_qrels_need(tmp_path):
    from neoembed.data import qrels

    folder = _mteb_folder(tmp_path / "mini")
    (tmp_path / "c.yaml").write_text(
        json.dumps(
            {
                "name": "mini",
                "source": {"local": {"path": "mini", "format": "mteb"}},
                "columns": {"query": "query", "positive": "positive"},
                "expected_loss": 0.05,
                "schema": {
                    "split": "train",
                    "features": {"query-id": "string", "corpus-id": "string", "score": "int64"},
                },
            }
        )
    )
    card, cfolder = load_card(tmp_path / "c.yaml")
    assert card.schema_problems() == []
    pairs, report = prepare_card(card, cfolder)
    assert report.full_size == 42 and report.dropped == {"positive missing": 1, "query missing": 1}
    assert len(pairs) == 40 and pairs["positive"][3] == "Title 21 Passage number 21 about rivers."
    assert pairs["query"][3].endswith("which river is number 3?")
    parsed = []
    real_loads = qrels.json.loads
    qrels_json = qrels.json

    class _Counting:
        @staticmethod
        def loads(s):
            parsed.append(s)
            return real_loads(s)

    qrels.json = _Counting
    try:
        rows, full, _ = qrels.join_local(folder, "train", None, max_rows=5, seed=0)
    finally:
        qrels.json = qrels_json
    assert full == 42 and len(rows["query"]) <= 5
    corpus_parsed = [p for p in parsed if '"title"' in p]
    assert len(corpus_parsed) <= 5  # only the sampled pairs' documents were parsed, not the 300


def test_the_lazy_corpus_reader_equals_parsing_every_line(tmp_path):
    """The fast path (a regex reads each line's _id; the line is parsed only if the join needs it) against json.loads
    of every line: same rows, including escaped, numeric and nested ids."""
    from neoembed.data import qrels

    docs = [
        {"_id": 'd"1', "title": "A quote", "text": "An id with an escaped quote."},
        {"_id": 7, "title": "", "text": "A numeric id."},
        {"title": "Key order", "text": 'Text that mentions "_id": "d9".', "_id": "d2"},
        {"_id": "d3", "meta": {"_id": "inner"}, "text": "A nested object with its own _id."},
        {"_id": "d4", "text": "Not asked for."},
    ]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    queries = [{"_id": "q", "text": "which document?"}]
    pairs = [("q", 'd"1'), ("q", "7"), ("q", "d2"), ("q", "d3"), ("q", "inner")]
    fast = qrels.join_pairs(pairs, qrels._stream([path]), queries)
    slow = qrels.join_pairs(pairs, [json.loads(line) for line in path.read_text().splitlines()], queries)
    assert fast == slow and len(fast[0]["positive"]) == 4 and fast[2] == {"positive missing": 1}


# ------------------------------------------------------------------------------------------ data check
def _check(*args, offline=False):
    from neoembed.cli import app

    env = {"HF_HUB_OFFLINE": "1" if offline else "0"}
    return CliRunner().invoke(app, ["data", "check", *args], env=env)


class _Builder:
    def __init__(self, features, splits):
        self.info = type("Info", (), {"features": features, "splits": splits})()


class ConnectError(Exception):
    """Stands in for the error httpx raises when no connection can be made (DNS, route, refused)."""


class _Session:
    """Stands in for huggingface_hub's HTTP session: answers (any status counts) or cannot connect."""

    def __init__(self, reachable: bool):
        self.reachable, self.heads = reachable, 0

    def head(self, url, timeout=None):
        self.heads += 1
        if not self.reachable:
            raise ConnectError("[Errno -2] Name or service not known")
        return type("Response", (), {"status_code": 200})()


def _hub(monkeypatch, reachable: bool) -> _Session:
    import huggingface_hub.utils

    session = _Session(reachable)
    monkeypatch.setattr(huggingface_hub.utils, "get_session", lambda: session)
    return session


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("size", -5, r"'size': Input should be greater than or equal to 1 \(got -5\)"),
        ("expected_loss", 1.5, r"'expected_loss': Value error, expected a share of the rows from 0 to 1, or 'unknown'"),
        ("expected_loss", "lots", r"'expected_loss': Value error, expected a share .* \(got 'lots'\)$"),
    ],
)
def test_a_card_value_out_of_range_is_one_error_naming_its_key(tmp_path, key, value, said):
    """Walk T, 25: `size: -5` passed (a NOTE at most); `expected_loss: 1.5` said two things in pydantic's words,
    one of them 'expected_loss.constrained-float'."""
    raw = load_card(REPO / "data_cards" / "qqp.yaml")[0].model_dump(by_alias=True, exclude_none=True)
    card = tmp_path / "c.yaml"
    card.write_text(json.dumps({**raw, key: value}))
    with pytest.raises(DataCardError, match=said) as e:
        load_card(card)
    assert str(e.value).count("\n  - ") == 1 and "constrained" not in str(e.value)


def test_a_card_not_found_names_the_folders_searched_in_full(tmp_path, monkeypatch):
    """Walk X, 23: run from inside mydata/, a recipe's `card_dirs: [mydata]` said "also searched: mydata",
    which reads as the folder the user stood in; the folder searched is named whole."""
    from neoembed.data.cards import find_card

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataCardError, match=re.escape(f"(also searched: {tmp_path / 'mydata'})")):
        find_card("pairs", ["mydata"])


def test_data_check_compares_the_declared_schema_with_the_live_features(monkeypatch):
    _hub(monkeypatch, reachable=True)
    card, _ = load_card(REPO / "data_cards" / "wikihow.yaml")
    split = type("Split", (), {"num_examples": 128543})()
    same = datasets.Features({"text": datasets.Value("string"), "summary": datasets.Value("string")})
    monkeypatch.setattr(datasets, "load_dataset_builder", lambda *a, **k: _Builder(same, {"train": split}))
    r = _check("wikihow", "--no-load")
    assert r.exit_code == 0 and "live features match the declared schema" in r.output, r.output
    differ = datasets.Features({"text": datasets.Value("string"), "headline": datasets.Value("string")})
    monkeypatch.setattr(
        datasets, "load_dataset_builder", lambda *a, **k: _Builder(differ, {"validation": split})
    )
    r = _check("wikihow", "--no-load")
    assert r.exit_code == 1
    assert "summary: declared (string) but not in the live dataset" in r.output
    assert "headline: in the live dataset (string) but not declared" in r.output
    assert "split 'train' not in the live dataset" in r.output


def test_data_check_tells_an_unreachable_hub_from_a_wrong_card(monkeypatch):
    _hub(monkeypatch, reachable=True)

    def unreachable(*a, **k):
        raise ConnectionError(
            "Couldn't reach 'sentence-transformers/wikihow' on the Hub (LocalEntryNotFoundError)"
        )

    def missing_config(*a, **k):
        raise ValueError("BuilderConfig 'pairs' not found. Available: ['pair']")

    monkeypatch.setattr(datasets, "load_dataset_builder", unreachable)
    r = _check("wikihow", "--no-load")
    assert (
        r.exit_code == 0
        and "hub unreachable (ConnectionError): checked against the declared schema only" in r.output
    )
    monkeypatch.setattr(datasets, "load_dataset_builder", missing_config)
    r = _check("wikihow", "--no-load")
    assert r.exit_code == 1 and "HUB ERROR" in r.output and "BuilderConfig 'pairs' not found" in r.output
    r = _check(*[p.stem for p in SHIPPED], offline=True)
    assert r.exit_code == 0 and r.output.count("paths match the declared schema") == 23


def test_an_unreachable_hub_costs_one_probe_per_run_not_retries_per_card(monkeypatch):
    hub_cards = ["wikihow", "gooaq", "pubmedqa", "triviaqa"]
    built = []

    def builder(*a, **k):  # what each card's live check calls; with the hub down it would retry for ~40 s
        built.append(a[0])
        raise ConnectionError(f"Couldn't reach {a[0]!r} on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset_builder", builder)
    session = _hub(monkeypatch, reachable=False)
    r = _check(*hub_cards, "--no-load")
    assert r.exit_code == 0, r.output
    assert session.heads == 1 and built == []  # one probe for the whole run; no card's requests were tried
    assert r.output.count("hub unreachable (ConnectError from https://huggingface.co") == len(hub_cards)
    assert r.output.count("checked against the declared schema only") == len(hub_cards)

    # the probe answers but the first card cannot connect: the later cards are not tried either
    session = _hub(monkeypatch, reachable=True)
    r = _check(*hub_cards, "--no-load")
    assert r.exit_code == 0 and session.heads == 1 and built == ["sentence-transformers/wikihow"], r.output
    assert r.output.count("found unreachable by an earlier card") == len(hub_cards) - 1

    # a reachable hub that rejects the card is still the card's fault
    def missing_repo(*a, **k):
        raise FileNotFoundError(f"Dataset {a[0]!r} doesn't exist on the Hub or cannot be accessed.")

    monkeypatch.setattr(datasets, "load_dataset_builder", missing_repo)
    r = _check("wikihow", "--no-load")
    assert r.exit_code == 1 and "HUB ERROR" in r.output and "doesn't exist on the Hub" in r.output


def test_training_without_network_costs_one_probe_and_names_the_hub_and_hf_hub_offline(monkeypatch, tmp_path):
    from neoembed.data.cards import HubUnreachable
    from neoembed.train.recipe import UnifiedRecipe
    from neoembed.train.trainer import prepare_datasets

    hub_cards = ["wikihow", "gooaq", "pubmedqa", "triviaqa"]
    loads, real_load = [], datasets.load_dataset

    def load_dataset(*a, **k):  # each hub card's load; with the hub down it would retry for ~50 s
        loads.append(a[0])
        raise ConnectionError(f"Couldn't reach {a[0]!r} on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    session = _hub(monkeypatch, reachable=False)
    recipe = UnifiedRecipe(model="unused", seed=0, datasets=[{"card": c} for c in hub_cards])
    with pytest.raises(HubUnreachable) as e:
        prepare_datasets(recipe, tmp_path)
    assert session.heads == 1 and loads == []  # one probe for the run; no card's load was tried
    message = str(e.value)
    assert "the Hugging Face hub (https://huggingface.co) cannot be reached (ConnectError" in message
    assert "4 dataset(s) of this run are on it: wikihow (sentence-transformers/wikihow), gooaq" in message
    assert "set HF_HUB_OFFLINE=1 to load them from there" in message

    # HF_HUB_OFFLINE set: no probe; the first card missing from the cache fails at once, the others are not tried
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def offline(*a, **k):
        loads.append(a[0])
        raise ConnectionError(f"Couldn't reach {a[0]!r} on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        HubUnreachable, match="HF_HUB_OFFLINE is set and the dataset is not in the local cache"
    ):
        prepare_datasets(recipe, tmp_path)
    assert session.heads == 1 and loads == ["sentence-transformers/wikihow"]

    # a recipe of local cards never asks the hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(datasets, "load_dataset", real_load)
    _card(tmp_path, _qa_rows(8), {"query": "q", "positive": "a"})
    local = UnifiedRecipe(model="unused", seed=0, datasets=[{"card": str(tmp_path / "c.yaml")}], batch_size=4)
    assert len(prepare_datasets(local, tmp_path)[0]["probe"]) == 8 and session.heads == 1


def test_data_check_reports_rows_dropped_per_reason(tmp_path):
    rows = _qa_rows(20)
    rows[2]["a"] = ""
    _card(tmp_path, rows, {"query": "q", "positive": "a"})
    r = _check(str(tmp_path / "c.yaml"), offline=True)
    assert r.exit_code == 1 and "19 of 20 rows kept (dropped: positive empty: 1" in r.output
    raw = json.loads((tmp_path / "c.yaml").read_text())
    raw["columns"]["positive"] = "a.text"
    (tmp_path / "c.yaml").write_text(json.dumps(raw))
    r = _check(str(tmp_path / "c.yaml"), offline=True)
    assert r.exit_code == 1 and f"reaches a str in {tmp_path / 'd.jsonl'}, line 1 (" in r.output


def test_a_row_that_does_not_match_its_card_is_named_as_a_user_finds_it(tmp_path):
    """A file's row by its line (a CSV row by the line it starts on, after a header and a two-line answer:
    index 2 on line 5); rows spread over a folder of files by their number, counted from 1."""
    body = 'topic,a\n0,"two lines\nof answer"\n1,an answer\n7,another answer\n'
    (tmp_path / "d.csv").write_text(body)
    source = {"local": {"path": "d.csv", "format": "csv"}}
    raw = {"name": "probe", "source": source, "columns": {"query": "topic", "positive": "a"}}
    raw["labels"] = {"topic": ["world", "sports"]}
    (tmp_path / "c.yaml").write_text(json.dumps(raw))
    r = _check(str(tmp_path / "c.yaml"), offline=True)
    assert r.exit_code == 1 and f"reaches a int in {tmp_path / 'd.csv'}, line 5 (label 7" in r.output, r.output
    assert "map integer labels" not in r.output  # the card has labels: 7 is past them
    (tmp_path / "d").mkdir()
    lines = body.splitlines(keepends=True)
    (tmp_path / "d" / "part0.csv").write_text("".join(lines[:3]))
    (tmp_path / "d" / "part1.csv").write_text("".join(lines[:1] + lines[3:]))
    raw["source"]["local"]["path"] = "d"
    (tmp_path / "c.yaml").write_text(json.dumps(raw))
    r = _check(str(tmp_path / "c.yaml"), offline=True)
    assert r.exit_code == 1 and "reaches a int in row 3 (label 7" in r.output, r.output


@pytest.mark.parametrize("missing", [None, float("nan")], ids=["null", "NaN"])  # NaN: pandas' missing text
def test_data_check_shows_an_unknown_expected_loss_and_how_to_pin_it(tmp_path, missing):
    rows = _qa_rows(20)
    rows[2]["a"] = missing
    _card(tmp_path, rows, {"query": "q", "positive": "a"}, expected_loss="unknown")
    r = _check(str(tmp_path / "c.yaml"), offline=True)
    assert r.exit_code == 0, r.output
    assert "expected_loss: unknown (no published share)" in r.output
    line = "19 of 20 rows kept (dropped: positive missing: 1 (first: line 3); measured 5.00%, expected: unknown)"
    assert line in r.output
    assert "pin the share with expected_loss: 0.05 in the card (its notes citing `neoembed data check`)" in r.output
    assert "data check probe" not in r.output  # the card's name is no command: `data check probe` fails


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_data_check_refuses_nan_teacher_score(tmp_path, monkeypatch, shared_dir, bad):
    """A NaN or infinite teacher score used to pass the check and stop training with "the loss became NaN ...
    lower the learning rate"; the check names the card's row, its scores column, and the file's line."""
    monkeypatch.setenv(
        "NEOEMBED_CARD_CACHE", str(tmp_path / "cache")
    )  # a cached clean build must not hide it
    with gzip.open(shared_dir / "data" / "train" / "trecqa_pairs" / "train.jsonl.gz", "rt") as f:
        rows = [r for r in map(json.loads, f) if r.get("negative")][:12]
    for i, r in enumerate(rows):
        r["teacher"] = {"scores": [0.9, bad if i == 7 else 0.1]}
    columns = {
        "query": "query",
        "positive": "positive",
        "negatives": ["negative"],
        "scores": "teacher.scores",
    }
    _card(tmp_path, rows, columns, expected_loss="unknown")
    r = _check(str(tmp_path / "c.yaml"), offline=True)
    assert r.exit_code == 1, r.output
    assert f"card probe: {tmp_path / 'd.jsonl'}, line 8 has a non-finite teacher score" in r.output
    assert "scores column 'teacher.scores'" in r.output
    rows[7]["teacher"]["scores"][1] = 0.1
    _card(tmp_path, rows, columns, expected_loss="unknown")
    r = _check(str(tmp_path / "c.yaml"), offline=True)
    assert r.exit_code == 0 and "12 of 12 rows kept" in r.output, r.output


# -------------------------------------------------------------------------------------------- dry run
def test_dry_run_of_the_papers_recipe_loads_no_model(monkeypatch):
    import neoembed
    from neoembed.cli import app

    def no_model(*a, **k):
        raise AssertionError("the dry run loaded a model")

    monkeypatch.setattr(neoembed, "load", no_model)

    r = CliRunner().invoke(app, ["train", "neobert-unified", "--dry-run"], env={"HF_HUB_OFFLINE": "1"})
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert "declared schemas" in lines[0] and "no model loaded" in lines[0]
    rows = [ln for ln in lines if " rows " in ln and "instruction:" in ln]
    assert len(rows) == 23
    pis = [float(m.group(1)) for ln in rows if (m := re.search(r" pi (\d\.\d+)", ln))]
    assert sum(pis) == pytest.approx(1.0, abs=1e-3)
    agnews = next(ln for ln in rows if ln.startswith("agnews "))
    assert (
        "1,157,745 (declared)" in agnews
        and "pinned" in agnews
        and "'Given a news title, retrieve relevant articles.'" in agnews
    )


# ---------------------------------------------------------------------------------------- one schema
def test_one_card_schema_module_for_training_corpus_and_dataset_cards():
    from neoembed import card_schema
    from neoembed.eval.task_cards import dataset_card_task
    from neoembed.pretrain.data import CorpusCard, load_corpus_card

    assert CorpusCard is card_schema.CorpusCard
    corpus, _ = load_corpus_card("refinedweb")
    assert (
        isinstance(corpus.source, card_schema.Source) and corpus.source.hub.id == "tiiuae/falcon-refinedweb"
    )
    name, task = dataset_card_task(REPO / "tests" / "shared" / "data" / "mteb" / "STS12")
    assert name == "STS12" and task.type == "STS"
    tree = ast.parse((REPO / "neoembed" / "card_schema.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    # the strict base of every config, neoembed.config, sits on floor 0 too (pydantic only)
    ours = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and "neoembed" in n.module}
    assert ours <= {"neoembed.config"}, ours
    lowest = {"__future__", "re", "typing", "pydantic", "yaml"}
    assert imported - {"neoembed"} <= lowest, imported  # the lowest floor


def test_join_reads_the_corpus_only_until_every_named_document_is_found():
    """A hub corpus is millions of rows: the join stops reading once the pairs' documents and queries are all
    found; a repeated id keeps its first row."""
    from neoembed.data.qrels import join_pairs

    def rows(items):
        for _id, text in items:
            yield {"_id": _id, "text": text}
        raise AssertionError("read past the last needed row")

    corpus = rows([("d1", "one"), ("d2", "two"), ("d1", "one again")])
    queries = rows([("q1", "first?"), ("q2", "second?")])
    joined, full, dropped = join_pairs([("q1", "d2"), ("q2", "d1")], corpus, queries)
    assert (
        joined == {"query": ["first?", "second?"], "positive": ["two", "one"]} and full == 2 and not dropped
    )


def test_a_drop_too_small_for_two_decimals_is_not_reported_as_0_00_percent():
    """37 rows of 1.2 million dropped, refused against expected_loss 0, read "0.00% vs 0.00% expected"."""
    from neoembed.data.pairs import DropReport

    report = DropReport("big", rows_read=1_200_000, rows_kept=1_199_963, dropped={"positive empty": 37})
    assert "(dropped: positive empty: 37; 0.0031% vs 0.00% expected)" in report.line()
    report.expected_loss = "unknown"
    assert "having dropped 37 of 1,200,000 rows (0.0031%)" in report.pin_hint()
    assert "measured 12.50%" in DropReport("small", 8, 7, {"query empty": 1}, expected_loss="unknown").line()


def test_a_data_file_replaced_with_the_same_size_and_time_is_read_anew(tmp_path):
    """datasets keys a local file by its path and modification time: a file replaced by another version with the
    same time (cp -p, rsync -a, tar x) gave the old rows to data check, training and mining (#43, walk P's B2)."""
    import os

    rows = [{"query": f"q{i}", "positive": f"AAAA {i}"} for i in range(4)]
    card, folder = _card(tmp_path, rows, {"query": "query", "positive": "positive"})
    data = tmp_path / "d.jsonl"
    assert load_card_rows(card, folder).rows["positive"][0] == "AAAA 0"
    new = tmp_path / "new.jsonl"  # the other version, written beside and moved in as rsync does
    new.write_text(data.read_text().replace("AAAA", "BBBB"))
    os.utime(new, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns))
    os.replace(new, data)
    assert load_card_rows(card, folder).rows["positive"] == [f"BBBB {i}" for i in range(4)]


def test_a_sample_text_cut_at_its_width_says_so(tmp_path):
    """`data check`'s sample cut texts at 80 characters without a mark: "...about caf" for "about café ☃",
    which reads as a broken character (walk P's P4)."""
    long = "x" * 75 + " about café ☃ 😀"
    (tmp_path / "d.jsonl").write_text(json.dumps({"query": long, "positive": "short"}) + "\n" * 2)
    r = _check(str(_local_card(tmp_path, "d.jsonl", "json")), "--sample", "1", offline=True)
    assert r.exit_code == 0 and f"query: {long[:80]!r}... | positive: 'short'" in r.output, r.output
