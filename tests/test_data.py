"""Data cards: schema, shipped cards, nested column specs, filters, offline hub cards, `neoembed data check`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neoembed.data.cards import DataCardError, HubUnreachable, build_pairs, find_card, load_card, load_rows

REPO = Path(__file__).resolve().parents[1]


def test_every_shipped_card_validates():
    cards = sorted((REPO / "data_cards").glob("*.yaml"))
    assert len(cards) >= 22
    for path in cards:
        card, _ = load_card(path)
        assert card.instruction and card.license and card.source.hub is not None


def test_unknown_key_and_two_sources_are_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "name: x\nsource: {local: {path: a.jsonl}}\ncolumns: {query: q, positive: p}\nlicence: mit\n"
    )
    with pytest.raises(DataCardError, match="unknown key 'licence'.*license"):
        load_card(f)
    f.write_text("name: x\nsource: {local: {path: a}, hub: {id: b}}\ncolumns: {query: q, positive: p}\n")
    with pytest.raises(DataCardError, match="exactly one of 'hub' or 'local'"):
        load_card(f)
    f.write_text(
        "name: x\nsource: {local: {path: a}}\ncolumns: {query: q, positive: p}\nfilter: score is big\n"
    )
    with pytest.raises(DataCardError, match="filter"):
        load_card(f)


def test_nested_columns_filter_and_instruction(tmp_path):
    rows = [
        {
            "set": {
                "query": "how old is the sun",
                "pos": ["4.6 billion years"],
                "neg": ["very hot", "a star"],
            },
            "score": 5,
        },
        {"set": {"query": "what is rain", "pos": ["falling water"], "neg": ["snow", "sun"]}, "score": 1},
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "c.yaml").write_text(
        "name: nested\nsource: {local: {path: d.jsonl}}\n"
        "columns: {query: set.query, positive: 'set.pos[0]', negatives: [set.neg]}\n"
        "filter: score > 4\ninstruction: Answer it.\n"
    )
    card, folder = load_card(tmp_path / "c.yaml")
    pairs = build_pairs(card, load_rows(card, folder))
    assert pairs.column_names == ["query", "positive", "negative_1", "negative_2"]
    assert pairs[0] == {
        "query": "Answer it. how old is the sun",
        "positive": "4.6 billion years",
        "negative_1": "very hot",
        "negative_2": "a star",
    }
    assert len(pairs) == 1  # the filter kept score > 4 only
    # a filter that keeps nothing is named (walk case: "the dataset is empty", of a file with rows)
    (tmp_path / "c.yaml").write_text((tmp_path / "c.yaml").read_text().replace("score > 4", "score > 100"))
    card, folder = load_card(tmp_path / "c.yaml")
    with pytest.raises(DataCardError, match=r"its filter 'score > 100' keeps none of its 2 rows"):
        load_rows(card, folder)


def test_hub_card_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    card, folder = load_card(find_card("medmcqa"))
    assert not card.pinned
    with pytest.raises(
        HubUnreachable, match="hub is unreachable for hub dataset 'openlifescienceai/medmcqa'"
    ):
        load_rows(card, folder)


def test_cli_data_check():
    # in-process: a subprocess would pay its own torch import (~10 s); other tests run `python -m neoembed`
    from typer.testing import CliRunner

    from neoembed.cli import app

    card = str(REPO / "tests/data_cards/msrp_pairs.yaml")
    r = CliRunner().invoke(app, ["data", "check", card, "medmcqa"], env={"HF_HUB_OFFLINE": "1"})
    assert r.exit_code == 0, r.output
    assert "2696 rows" in r.stdout and "hub unreachable" in r.stdout and "revision unpinned" in r.stdout
