"""Cards at scale (#39): the streamed build (batched maps into Arrow) against the row-by-row loop it replaced, the
prepared-card cache (hit, and missed when a file, the card or a setting changes), the duplicate checks on the
texts' hashes, and the power-law sampler over Table 7's row counts without a Python int per row."""

from __future__ import annotations

import json
import logging
import os
import random
import tracemalloc
from collections import Counter
from pathlib import Path

import datasets
import pytest
import torch
from sentence_transformers.base.sampler import DefaultBatchSampler
from torch.utils.data import ConcatDataset, RandomSampler

from neoembed.data import cards as cards_module
from neoembed.data import pairs as pairs_module
from neoembed.data.cards import (
    DataCardError,
    build_pairs_report,
    load_card,
    load_card_rows,
    prepare_card,
)
from neoembed.data.columns import _MISSING, _Spec
from neoembed.data.sampler import (
    PowerLawDatasetBatchSampler,
    compact_batches,
    duplicate_free_rows,
    text_hashes,
    text_repeats,
)
from neoembed.instructions import DEFAULT_TEMPLATE, format_with_instruction

REPO = Path(__file__).resolve().parents[1]
REAL = sorted((REPO / "tests" / "data_cards").glob("*.yaml"))  # the cards of ../shared/data/train/*


# ------------------------------------------------------------------------- the slow twin: the old row loop
def _row_loop(card, rows, max_negatives=None, with_instruction=True):
    """What build_pairs_report returned before it streamed: (columns, drop counts in order, k)."""
    cols, feats = rows.column_names, rows.features
    readers = {
        role: [_Spec(card, role, s, cols, feats) for s in ([v] if isinstance(v, str) else v)]
        for role, v in (("query", card.columns.query), ("positive", card.columns.positive))
    }
    negs = [_Spec(card, "negatives", s, cols, feats) for s in card.columns.negatives]
    score = _Spec(card, "scores", card.columns.scores, cols, feats) if card.columns.scores else None
    dropped, kept = {}, []
    for i, row in enumerate(rows):
        texts, reason = {}, None
        for role, specs in readers.items():
            parts = [s.text(row[s.steps[0]], i) for s in specs]
            if any(p is _MISSING for p in parts):
                reason = reason or f"{role} missing"
                continue
            texts[role] = " ".join(parts)
            if not texts[role].strip():
                reason = reason or f"{role} empty"
        row_negs = [t for s in negs for t in s.texts(row[s.steps[0]], i)[0]]
        if reason:
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        scores = (
            pairs_module._row_scores(card, score, row[score.steps[0]], i, len(row_negs)) if score else None
        )
        keep = [j for j, n in enumerate(row_negs) if n.strip()]
        scores = [scores[0]] + [scores[1 + j] for j in keep] if scores else None
        kept.append((texts["query"], texts["positive"], [row_negs[j] for j in keep], scores))
    capped = Counter(min(len(r[2]), max_negatives) if max_negatives is not None else len(r[2]) for r in kept)
    k = max(capped, key=lambda c: (capped[c], c)) if negs and capped else 0
    if short := sum(len(r[2]) < k for r in kept):
        dropped[f"fewer than {k} hard negatives"] = short
    kept = [r for r in kept if len(r[2]) >= k]
    instruction = card.instruction if with_instruction else None
    out = {"query": [format_with_instruction(instruction, r[0], DEFAULT_TEMPLATE) for r in kept]}
    out["positive"] = [r[1] for r in kept]
    out |= {f"negative_{j + 1}": [r[2][j] for r in kept] for j in range(k)}
    if score:
        out["label"] = [r[3][: 1 + k] for r in kept]
    return out, dropped, k


def _same_as_loop(card, rows, **kw):
    pairs, report = build_pairs_report(card, rows, warn=False, **kw)
    columns, dropped, k = _row_loop(card, rows, **kw)
    assert pairs.to_dict() == columns
    assert report.dropped == dropped and list(report.dropped) == list(dropped)  # the order of the reasons too
    assert (report.negatives_per_query, report.rows_kept, report.rows_read) == (k, len(pairs), len(rows))
    # what neoembed.runs.check_pairs counted over Python lists, counted in the map
    instruction = card.instruction if kw.get("with_instruction", True) else None
    as_query = [format_with_instruction(instruction, p, DEFAULT_TEMPLATE) for p in columns["positive"]]
    assert report.same_as_query == sum(q == p for q, p in zip(columns["query"], as_query, strict=True))
    assert report.distinct_pairs == len(set(zip(columns["query"], columns["positive"], strict=True)))
    return pairs, report


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.stem)
def test_streamed_build_equals_the_row_loop_on_the_real_cards(path):
    card, folder = load_card(path)
    rows = load_card_rows(card, folder).rows
    for kw in ({}, {"max_negatives": 0}, {"with_instruction": False}):
        _same_as_loop(card, rows, **kw)


def _synthetic(n: int = 2600) -> datasets.Dataset:
    """Rows with every drop reason, nulls among the negatives, uneven negative counts and scores."""
    rng = random.Random(0)
    rows = []
    for i in range(n):
        negatives = [f"neg {i}.{j}" if rng.random() > 0.1 else rng.choice([None, "  "]) for j in range(3)]
        negatives = negatives[: rng.choice([1, 2, 3, 3, 3])]
        rows.append(
            {
                "q": {"text": rng.choice([f"question {i}", f"question {i}", "", None])},
                "p": rng.choice([f"answer {i}", f"answer {i}", f"answer {i}", " ", None]),
                "n": negatives,
                "s": [1.0] + [0.5 + j for j, x in enumerate(negatives) if x is not None],
            }
        )
    return datasets.Dataset.from_list(rows)


def _card(tmp_path: Path, **extra):
    body = {
        "name": "synthetic",
        "source": {"local": {"path": "rows.jsonl", "format": "json"}},
        "columns": {"query": "q.text", "positive": "p", "negatives": ["n"], "scores": "s"},
        "instruction": "Find the answer.",
        "license": "cc0",
        "expected_loss": "unknown",
        **extra,
    }
    (tmp_path / "card.yaml").write_text(json.dumps(body))
    return load_card(tmp_path / "card.yaml")


def test_streamed_build_equals_the_row_loop_on_every_drop_reason(tmp_path):
    card, _ = _card(tmp_path)
    rows = _synthetic()
    pairs, report = _same_as_loop(card, rows)
    assert {"query missing", "query empty", "positive missing", "positive empty"} <= set(report.dropped)
    assert report.negatives_per_query == 3 and "fewer than 3 hard negatives" in report.dropped
    _same_as_loop(card, rows, max_negatives=2)
    _same_as_loop(card, rows.select(sorted(random.Random(1).sample(range(len(rows)), 700))))  # a sample


def test_a_bad_row_is_named_as_the_row_loop_names_it(tmp_path):
    """Errors come from the first bad row in row order, whichever spec (and batch) meets it first: here the
    scores, read last in a row, of index 1500, before the query label of index 1600 (both in the second batch);
    rows in memory are named by their number, counted from 1."""
    columns = {"query": "topic", "positive": "p", "negatives": ["n"], "scores": "s"}
    card, _ = _card(tmp_path, columns=columns, labels={"topic": ["world", "sports", "science"]})
    n = 2600
    rows = {"topic": [i % 3 for i in range(n)], "p": [f"answer {i}" for i in range(n)]}
    rows |= {"n": [[f"neg {i}"] for i in range(n)], "s": [[1.0, 0.5] for _ in range(n)]}
    rows["s"][1500] = [1.0]  # one number short
    rows["topic"][1600] = 7  # no such label
    errors = []
    for build in (build_pairs_report, _row_loop):
        with pytest.raises(DataCardError) as e:
            build(card, datasets.Dataset.from_dict(rows))
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "row 1501 has [1.0] in its scores column" in errors[0]  # counted from 1
    rows["s"][1500] = [1.0, 0.5]
    for build in (build_pairs_report, _row_loop):
        with pytest.raises(DataCardError, match="reaches a int in row 1601 .label 7 is outside the 3 names"):
            build(card, datasets.Dataset.from_dict(rows))


def test_the_batched_filter_keeps_the_rows_the_row_filter_kept(tmp_path):
    rng = random.Random(2)
    rows = [
        {"q": f"q{i}", "p": f"p{i}", "score": rng.choice([None, 1, 3.5, 4, 4.5, 9])} for i in range(25_000)
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    card, folder = _card(tmp_path, columns={"query": "q", "positive": "p"}, filter="score >= 4")
    loaded = load_card_rows(card, folder, max_rows=5000, seed=3)
    kept = [r for r in rows if r["score"] is not None and r["score"] >= 4]
    assert loaded.full_size == len(kept)
    sample = sorted(random.Random(3).sample(range(len(kept)), 5000))  # --max-rows: the same seeded sample
    assert loaded.rows["q"][:] == [kept[i]["q"] for i in sample]


# --------------------------------------------------------------------------------------------- the cache
def _write_rows(path: Path, n: int) -> None:
    rows = _synthetic(n).to_list()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_prepared_card_is_read_back_until_its_file_card_or_settings_change(tmp_path, monkeypatch):
    monkeypatch.setenv("NEOEMBED_CARD_CACHE", str(tmp_path / "cache"))
    card, folder = _card(tmp_path)
    _write_rows(tmp_path / "rows.jsonl", 1200)
    builds = []
    real = cards_module.load_card_rows
    monkeypatch.setattr(cards_module, "load_card_rows", lambda *a: builds.append(a) or real(*a))

    first, report = prepare_card(card, folder, warn=False)
    again, report_again = prepare_card(card, folder, warn=False)
    assert len(builds) == 1  # the second run read nothing but the cache
    assert again.to_dict() == first.to_dict() and report_again == report
    assert again.cache_files[0]["filename"].startswith(str(tmp_path / "cache"))
    columns, dropped, _ = _row_loop(card, load_card_rows(card, folder).rows)
    assert again.to_dict() == columns and report_again.dropped == dropped

    stat = (tmp_path / "rows.jsonl").stat()
    os.utime(tmp_path / "rows.jsonl", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched
    prepare_card(card, folder, warn=False)
    assert len(builds) == 2
    prepare_card(card, folder, max_negatives=1, warn=False)  # another setting
    assert len(builds) == 3
    prepare_card(card.model_copy(update={"instruction": "Other."}), folder, warn=False)  # another card
    assert len(builds) == 4
    _write_rows(tmp_path / "rows.jsonl", 1300)  # another size
    assert len(prepare_card(card, folder, warn=False)[0]) != len(first) and len(builds) == 5
    prepare_card(card, folder, max_negatives=1, warn=False)
    assert len(builds) == 6  # the entry of the old file is not read for the new one
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".partial")]


def test_a_cached_card_warns_as_the_first_run(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NEOEMBED_CARD_CACHE", str(tmp_path / "cache"))
    card, folder = _card(tmp_path)
    _write_rows(tmp_path / "rows.jsonl", 300)
    with caplog.at_level(logging.WARNING, logger="neoembed.data.cards"):
        prepare_card(card, folder)
        prepare_card(card, folder)
    hints = [r.getMessage() for r in caplog.records if "expected_loss: unknown, so" in r.getMessage()]
    assert len(hints) == 2 and hints[0] == hints[1]


def test_a_failed_build_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("NEOEMBED_CARD_CACHE", str(tmp_path / "cache"))
    card, folder = _card(tmp_path, expected_loss=0.0)
    _write_rows(tmp_path / "rows.jsonl", 300)
    for _ in range(2):  # the second run fails the same way: nothing was kept
        with pytest.raises(DataCardError, match="more than the card's expected_loss"):
            prepare_card(card, folder)
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".lock"]


# ---------------------------------------------------------------------------------- duplicates on hashes
def _old_text_repeats(dataset):
    seen = set()
    for column in [c for c in dataset.column_names if c != "label"]:
        for text in dataset[column]:
            if text in seen:
                return True
            seen.add(text)
    return False


def _old_duplicate_free_rows(dataset, limit):
    columns = [c for c in dataset.column_names if c != "label"]
    seen, count = set(), 0
    for row in zip(*(dataset[c] for c in columns), strict=True):
        if seen.isdisjoint(row):
            seen.update(row)
            count += 1
            if count >= limit:
                break
    return count


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.stem)
def test_duplicate_checks_on_hashes_equal_the_set_based_ones(path, tmp_path, monkeypatch):
    monkeypatch.setenv("NEOEMBED_CARD_CACHE", str(tmp_path / "cache"))
    card, folder = load_card(path)
    pairs, _ = prepare_card(card, folder, warn=False)
    in_memory = datasets.Dataset.from_dict(pairs.to_dict())
    columns = [c for c in pairs.column_names if c != "label"]
    assert (text_hashes(in_memory, columns) == text_hashes(pairs, columns)).all()
    assert pairs_module.hashed_repeats(text_hashes(pairs, columns), pairs, columns) == _old_text_repeats(
        pairs
    )
    # a prepared card's hashes, and its answer to "does a text repeat", are read back, not computed
    monkeypatch.setattr(cards_module, "text_hash", None)
    monkeypatch.setattr(cards_module, "hashed_repeats", None)
    assert text_repeats(pairs) == _old_text_repeats(pairs)
    for limit in (8, 64, 10_000):
        assert duplicate_free_rows(pairs, limit) == _old_duplicate_free_rows(pairs, limit)
    held_back = pairs.select(range(1, len(pairs), 2))  # a selection is hashed itself, not read from the file
    monkeypatch.undo()
    assert text_repeats(held_back) == _old_text_repeats(held_back)
    assert duplicate_free_rows(held_back, 64) == _old_duplicate_free_rows(held_back, 64)


def test_a_hash_collision_is_not_a_repeat(monkeypatch):
    rows = datasets.Dataset.from_dict({"query": ["a", "b"], "positive": ["c", "d"]})
    monkeypatch.setattr(cards_module, "text_hash", lambda text: 1 if text in ("a", "d") else ord(text))
    assert not text_repeats(rows)
    assert text_repeats(datasets.Dataset.from_dict({"query": ["a", "b"], "positive": ["c", "a"]}))


# ------------------------------------------------------------------------------- the sampler at Table 7's sizes
class _Rows:
    """A dataset of n rows that holds none (the sampler only counts them)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def _table7_sizes() -> list[int]:
    shipped = [load_card(p)[0] for p in sorted((REPO / "data_cards").glob("*.yaml"))]
    # cards that declare no size get 100k rows: the declared ones already sum to Table 7's 16.4M
    return [c.size or (c.schema_.num_rows if c.schema_ else None) or 100_000 for c in shipped]


def _samplers(sizes, batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        DefaultBatchSampler(
            RandomSampler(_Rows(n), generator=g), batch_size=batch, drop_last=True, generator=g
        )
        for n in sizes
    ]


def test_power_law_sampler_at_table7_sizes_holds_no_python_int_per_row():
    sizes = _table7_sizes()
    assert len(sizes) >= 23 and sum(sizes) > 16_000_000
    rows = [_Rows(n) for n in sizes]
    sampler = PowerLawDatasetBatchSampler(
        ConcatDataset(rows), _samplers(sizes, 64), alpha=0.5, num_steps=2000
    )
    tracemalloc.start()
    batches = list(sampler)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    drawn = set(sampler.history)
    assert len(batches) == 2000 and len(drawn) >= 20  # most datasets drawn, PAQ (7.3M rows) surely
    assert peak < 20 * 2**20, f"{peak / 2**20:.0f} MiB of Python objects (a list of ints per row: ~600 MiB)"


def test_compact_batches_are_the_batch_samplers_own():
    """Same batches, same order, and the shared generator left in the same state (it serves every dataset)."""
    for drop_last in (True, False):
        for n, batch in ((10, 3), (12, 3), (5, 8), (1000, 7)):
            g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
            plain = DefaultBatchSampler(
                RandomSampler(_Rows(n), generator=g1), batch_size=batch, drop_last=drop_last
            )
            compact = DefaultBatchSampler(
                RandomSampler(_Rows(n), generator=g2), batch_size=batch, drop_last=drop_last
            )
            assert [list(plain) for _ in range(3)] == [list(compact_batches(compact)) for _ in range(3)]
            assert torch.equal(g1.get_state(), g2.get_state())


def test_power_law_batches_are_those_of_the_batch_samplers_iterators(monkeypatch):
    """The sampler with compact batches draws what it drew with each batch sampler's own iterator (the old loop),
    restarts included: the generator is shared by every dataset, so any other draw order would show."""
    from neoembed.data import sampler as sampler_module

    sizes = [50, 300, 1200]
    rows = ConcatDataset([_Rows(n) for n in sizes])
    compact = PowerLawDatasetBatchSampler(rows, _samplers(sizes, 16), alpha=0.5, num_steps=300)
    compact_batches_ = list(compact)
    monkeypatch.setattr(sampler_module, "compact_batches", iter)
    plain = PowerLawDatasetBatchSampler(rows, _samplers(sizes, 16), alpha=0.5, num_steps=300)
    assert list(plain) == compact_batches_ and plain.history == compact.history
    assert plain.history.count(0) > 50 // 16  # the small dataset was restarted
