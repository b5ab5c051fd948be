"""Texts per step (``batch_texts``): the released NeoBERT rule, each dataset's queries per step = batch_texts //
(2 + its hard negatives per query), a dataset's own batch_size winning; the paper's recipe states it once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from neoembed.card_schema import resolve_spec_type
from neoembed.cli import app
from neoembed.data.cards import DataCardError, find_card, load_card
from neoembed.data.plan import plan
from neoembed.recipe import RecipeError, load_recipe
from neoembed.train.recipe import UnifiedRecipe

REPO = Path(__file__).resolve().parents[1]
FLAGSHIP = REPO / "recipes" / "neobert-unified.yaml"
PYDOC = REPO / "recipes" / "tiny" / "rows" / "pydoc_names.jsonl"


def _declared_negatives(card) -> int:
    """Hard negatives per query that the card's declared schema gives: one per spec, each reaching a string."""
    features = card.schema_.features
    assert all(resolve_spec_type(s, features) == "string" for s in card.columns.negatives), card.name
    return len(card.columns.negatives)


def test_the_papers_recipe_trains_128_texts_per_step_computed_from_its_cards():
    recipe = load_recipe(FLAGSHIP, UnifiedRecipe)
    assert recipe.batch_texts == 128
    explicit = {e.card: e.batch_size for e in recipe.datasets if e.batch_size is not None}
    assert explicit == {"allnli": 64}  # the released 64 queries (its table counts 2 texts for 3-text rows)
    rows = {r.name: r for r in plan(recipe, FLAGSHIP.parent)}
    assert len(rows) == len(recipe.datasets) == 23
    for entry in recipe.datasets:
        card, _ = load_card(find_card(entry.card, []))
        k = _declared_negatives(card)
        want = explicit.get(card.name, 128 // (2 + k))
        assert recipe.dataset_batch_size(entry, k) == rows[card.name].batch == want, card.name
        assert rows[card.name].texts == want * (2 + k), card.name
        if card.name not in explicit:
            assert 128 - (2 + k) < want * (2 + k) <= 128, card.name  # the budget, filled as far as rows fit
    assert rows["pubmedqa"].batch == 5 and rows["pubmedqa"].texts == 110  # 20 hard negatives
    assert rows["gooaq"].batch == 18 and rows["agnews"].batch == 64 and rows["qqp"].batch == 42


def test_the_dry_run_prints_each_datasets_queries_and_texts_per_step():
    r = CliRunner().invoke(app, ["train", "neobert-unified", "--dry-run"], env={"HF_HUB_OFFLINE": "1"})
    assert r.exit_code == 0, r.output
    line = {ln.split()[0]: ln for ln in r.output.splitlines()[1:] if " rows " in ln}
    assert "batch 5 (110 texts)" in line["pubmedqa"] and "negatives 20" in line["pubmedqa"]
    assert "batch 32 (128 texts)" in line["concurrentqa"] and "batch 64 (192 texts)" in line["allnli"]


def _recipe(**fields) -> UnifiedRecipe:
    return UnifiedRecipe.model_validate({"seed": 0, "model": "unused", **fields})


def test_a_datasets_own_batch_size_wins_and_recipes_without_batch_texts_are_unchanged():
    recipe = _recipe(datasets=[{"card": "a"}, {"card": "b", "batch_size": 3}], batch_texts=24)
    a, b = recipe.datasets
    assert [recipe.dataset_batch_size(a, k) for k in (0, 1, 4, 22)] == [12, 8, 4, 1]
    assert [recipe.dataset_batch_size(b, k) for k in (0, 1, 4, 22)] == [3, 3, 3, 3]
    assert recipe.dataset_batch_size(a, None) is None  # negatives known only once the rows are read
    for name in ("tiny", "quickstart"):  # batch_size queries for every dataset, as before
        shipped = load_recipe(name, UnifiedRecipe)
        assert shipped.batch_texts is None
        for e in shipped.datasets:
            assert shipped.dataset_batch_size(e, 5) == (e.batch_size or shipped.batch_size)


def test_batch_size_and_batch_texts_together_is_an_error_that_says_which_to_keep():
    with pytest.raises(RecipeError) as e:
        load_recipe(FLAGSHIP, UnifiedRecipe, ["batch_size=64"])
    assert str(e.value).endswith(
        "  - Value error, batch_size 64 (queries per step) and batch_texts 128 (texts per step) are both set; keep "
        "one: batch_texts=null gives every dataset batch_size queries, or batch_size=null (a dataset's own "
        "batch_size still wins)"
    )
    queries = load_recipe(FLAGSHIP, UnifiedRecipe, ["batch_texts=null", "batch_size=32"])
    assert {queries.dataset_batch_size(e, 20) for e in queries.datasets} == {32, 64}  # allnli keeps its own
    # and back (walk AD: `batch_size=null` was "Input should be a valid integer", so the tiny recipe's batch_size
    # could not give way to batch_texts from the command line)
    texts = load_recipe("tiny", UnifiedRecipe, ["batch_size=null", "batch_texts=48"])
    assert texts.batch_texts == 48 and "batch_size" not in texts.model_fields_set
    with pytest.raises(RecipeError, match="batch_size: null leaves no batch size: give batch_texts"):
        load_recipe("tiny", UnifiedRecipe, ["batch_size=null"])


def test_rows_wider_than_the_budget_are_an_error_naming_the_fix():
    recipe = _recipe(datasets=[{"card": "b"}], batch_texts=6)
    fix = "raise batch_texts to at least 7, set max_negatives: 4 for it, or give it its own batch_size"
    with pytest.raises(
        RecipeError, match=rf"dataset b: each row is 7 texts .* more than batch_texts 6: {fix}"
    ):
        recipe.dataset_batch_size(recipe.datasets[0], 5)
    assert recipe.dataset_batch_size(recipe.datasets[0], 4) == 1
    r = CliRunner().invoke(app, ["train", "neobert-unified", "batch_texts=12", "--dry-run"])
    # the dry run reads no rows: it fails on the 20 negatives the card declares
    assert isinstance(r.exception, RecipeError)
    assert str(r.exception).startswith("dataset pubmedqa: each row is 22 texts (query, positive, 20 hard")


def _local_card(folder: Path, name: str, negatives: int) -> Path:
    """A card over the tiny recipe's docstring pairs; row i's negatives are the positives of rows i+1, i+2, ..."""
    rows = [json.loads(line) for line in PYDOC.read_text().splitlines()][:40]
    names = [f"n{j}" for j in range(1, negatives + 1)]
    out = [
        {**row, **{n: rows[(i + j) % len(rows)]["positive"] for j, n in enumerate(names, 1)}}
        for i, row in enumerate(rows)
    ]
    (folder / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in out) + "\n")
    card = {
        "name": name,
        "source": {"local": {"path": f"{name}.jsonl"}},
        "columns": {"query": "query", "positive": "positive", "negatives": names},
        "instruction": "Given the name of a Python function, retrieve its description.",
    }
    (folder / f"{name}.yaml").write_text(json.dumps(card))
    return folder / f"{name}.yaml"


def test_training_sizes_each_dataset_by_the_negatives_its_rows_carry(tmp_path):
    from neoembed.train.trainer import prepare_datasets

    cards = {n: str(_local_card(tmp_path, n, k)) for n, k in [("pairs", 0), ("two", 2), ("three", 3)]}
    entries = [
        {"card": cards["pairs"]},
        {"card": cards["two"]},
        {"card": cards["three"], "max_negatives": 1},  # the rule reads the negatives trained, not declared
        {"card": cards["three"], "batch_size": 7},
    ]
    data, _, sizes = prepare_datasets(_recipe(datasets=entries[:3], batch_texts=16))
    assert [data[n].num_columns for n in ("pairs", "two", "three")] == [2, 4, 3]
    assert sizes == {"pairs": 8, "two": 4, "three": 5}
    _, _, sizes = prepare_datasets(_recipe(datasets=[entries[3]], batch_texts=16))
    assert sizes == {"three": 7}
    with pytest.raises(RecipeError, match="dataset .*three.yaml: each row is 5 texts"):
        prepare_datasets(_recipe(datasets=[{"card": cards["three"]}], batch_texts=4))
    with pytest.raises(DataCardError, match=r"batch size 50 is larger than the dataset \(40 usable rows\)"):
        prepare_datasets(_recipe(datasets=[{"card": cards["pairs"]}], batch_texts=100))


def test_the_model_card_states_the_texts_per_step(tmp_path):
    from neoembed.train.trainer import _model_card

    _model_card(load_recipe(FLAGSHIP, UnifiedRecipe), [], tmp_path)
    assert "128 texts per step (query, positive and hard negatives)" in (tmp_path / "README.md").read_text()
    _model_card(load_recipe("tiny", UnifiedRecipe), [], tmp_path)
    assert "batch size 16," in (tmp_path / "README.md").read_text()
    # walk AD: a dataset's own batch_size beside the rule was not said (the card read "48 texts per step" alone)
    _model_card(load_recipe(FLAGSHIP, UnifiedRecipe), [], tmp_path, batch_sizes={"msrp": 16, "sts2012": 8})
    said = "128 texts per step (query, positive and hard negatives) with queries per step msrp 16, sts2012 8,"
    assert said in (tmp_path / "README.md").read_text()


def _card_of_rows(tmp_path: Path, name: str, rows: list[dict], negatives: str, expected_loss: str) -> Path:
    """``rows`` (columns q, p and the negatives) as ``tmp_path/rows.jsonl`` under card ``name`` in
    ``tmp_path/cards``, which is returned."""
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cards = tmp_path / "cards"
    cards.mkdir()
    (cards / f"{name}.yaml").write_text(
        f"name: {name}\nsource:\n  local: {{path: ../rows.jsonl, format: json}}\n"
        f"columns: {{query: q, positive: p, negatives: {negatives}}}\nlicense: CC0-1.0\n"
        f"expected_loss: {expected_loss}\n"
    )
    return cards


def test_the_dry_run_counts_a_local_list_of_negatives_as_the_trainer_does(tmp_path):
    """A local card whose negatives are one list column, without a declared schema: the dry run counted it as
    one negative (and printed the batch of one); it now reads the rows' own list lengths, the count most rows
    carry, as the trainer does, and the batch that gives."""
    from neoembed.data.cards import load_card_rows
    from neoembed.data.pairs import build_pairs_report

    rows = [
        {
            "q": f"question {i}",
            "p": f"answer {i}",
            "negs": [f"wrong {i}.{j}" for j in range(3 if i < 7 else 2)],
        }
        for i in range(10)
    ]
    cards = _card_of_rows(tmp_path, "lists", rows, "[negs]", "0.3")
    card, folder = load_card(find_card("lists", [cards]))
    for cap, k in ((None, 3), (2, 2)):
        recipe = _recipe(
            datasets=[{"card": "lists", "max_negatives": cap}], batch_texts=20, card_dirs=[str(cards)]
        )
        (row,) = plan(recipe)
        _, report = build_pairs_report(card, load_card_rows(card, folder).rows, max_negatives=cap)
        assert report.negatives_per_query == k
        assert row.negatives.startswith(f"{k} (lists)")
        assert (row.batch, row.texts) == (20 // (2 + k), 20 // (2 + k) * (2 + k))


def test_the_dry_run_counts_the_negatives_of_the_rows_max_rows_keeps(tmp_path):
    """Half the rows with 2 negatives, half with 1: the dry run counted the whole card's (2: batch 11, 44 texts)
    where the run trains on the 15 rows max_rows keeps (1 per query, 33 texts; a verification walk's case)."""
    rows = [{"q": f"question {i}", "p": f"answer {i}", "n1": f"wrong {i}", "n2": f"other {i}" if i % 2 else None}
            for i in range(40)]  # fmt: skip
    cards = _card_of_rows(tmp_path, "neg", rows, "[n1, n2]", "unknown")
    recipe = _recipe(datasets=[{"card": "neg", "max_rows": 15}], batch_size=11, card_dirs=[str(cards)])
    from neoembed.data.cards import prepare_card

    (row,) = plan(recipe)
    card, folder = load_card(find_card("neg", [cards]))
    _, report = prepare_card(card, folder, 15, None, recipe.template, recipe.instructions, recipe.seed, warn=False)
    assert row.negatives == str(report.negatives_per_query) and row.texts == 11 * (2 + report.negatives_per_query)
