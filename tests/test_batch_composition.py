"""What a batch may hold: duplicate masking keyed on the text whatever the column's padding, and batches that
never hold a text twice for cards whose texts repeat (real TREC QA rows: one question, several answers)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from sentence_transformers.base.sampler import DefaultBatchSampler
from torch.utils.data import RandomSampler

import neoembed
from neoembed.data.sampler import NoDuplicatesBatchSampler, no_duplicate_batches, text_repeats
from neoembed.losses import CachedInfoNCELoss, InfoNCELoss, duplicate_mask, info_nce, text_keys


@pytest.fixture(scope="module")
def trecqa(shared_dir):
    path = shared_dir / "data/train/trecqa_pairs/train.jsonl.gz"
    return [json.loads(line) for line in gzip.open(path, "rt")]


@pytest.fixture(scope="module")
def tiny(tiny_official):
    model = neoembed.load(tiny_official)
    model.eval()
    return model


def _mined_batch(rows: list[dict], size: int = 6) -> dict[str, list[str]]:
    """Rows of distinct questions whose first row's hard negative is the third row's positive (what mining
    against a corpus holding every positive produces) and whose last row's negative is the second's."""
    picked, seen = [], set()
    for row in rows:
        if row["query"] not in seen and row.get("negative"):
            picked.append(row)
            seen.add(row["query"])
        if len(picked) == size:
            break
    batch = {c: [r[c] for r in picked] for c in ("query", "positive", "negative")}
    batch["negative"][0] = batch["positive"][2]
    batch["negative"][-1] = batch["positive"][1]
    return batch


def test_text_keys_equal_across_columns_of_other_widths(tiny, trecqa):
    batch = _mined_batch(trecqa)
    pos, neg = tiny.tokenize(batch["positive"]), tiny.tokenize(batch["negative"])
    assert pos["input_ids"].shape[1] != neg["input_ids"].shape[1]  # padded to different widths
    kp, kn = text_keys(pos), text_keys(neg)
    assert kn[0] == kp[2] and kn[-1] == kp[1]
    assert len(set(kp.tolist()) | set(kn.tolist())) == 2 * len(kp) - 2
    ids, mask = pos["input_ids"], pos["attention_mask"]  # the same rows, left-padded
    left = {
        "input_ids": torch.stack([_left_pad(r, m) for r, m in zip(ids, mask, strict=True)]),
        "attention_mask": torch.stack([_left_pad(m, m) for m in mask]),
    }
    assert torch.equal(text_keys(left), kp)


def _left_pad(row, mask):
    n = int(mask.sum())
    return torch.cat([row[n:], row[:n]])


def _hand_mask(batch: dict[str, list[str]]) -> torch.Tensor:
    cands = batch["positive"] + batch["negative"]
    b = len(batch["positive"])
    return torch.tensor(
        [[j != i and cands[j] == batch["positive"][i] for j in range(len(cands))] for i in range(b)]
    )


@pytest.mark.parametrize("cached", [False, True])
def test_a_mined_negative_that_is_another_rows_positive_is_masked(tiny, trecqa, cached):
    batch = _mined_batch(trecqa)
    features = [tiny.tokenize(batch[c]) for c in ("query", "positive", "negative")]
    loss_fn = CachedInfoNCELoss(tiny, mini_batch_size=2) if cached else InfoNCELoss(tiny)
    with torch.no_grad():
        loss = float(loss_fn(features, torch.zeros(len(batch["query"]))))
        q, p, n = (tiny(f)["sentence_embedding"] for f in features)
    mask = _hand_mask(batch)
    assert int(mask.sum()) == 2
    expected = float(info_nce(q, torch.cat([p, n]), loss_fn.tau, mask))
    unmasked = float(info_nce(q, torch.cat([p, n]), loss_fn.tau))
    assert loss == pytest.approx(expected, rel=1e-5) and loss != pytest.approx(unmasked, rel=1e-5)
    assert duplicate_mask(text_keys(features[1]), torch.cat([text_keys(f) for f in features[1:]])).equal(mask)


def _share_with_a_repeat(batches, rows) -> float:
    def repeats(batch):
        texts = [t for i in batch for t in rows[i].values()]
        return len(texts) != len(set(texts))

    return sum(map(repeats, batches)) / len(batches)


def test_batches_hold_no_question_twice_on_cards_whose_questions_repeat(trecqa):
    rows = [{"query": r["query"], "positive": r["positive"]} for r in trecqa]
    dataset = Dataset.from_list(rows)
    assert text_repeats(dataset)
    g = torch.Generator().manual_seed(0)
    plain = list(DefaultBatchSampler(RandomSampler(dataset, generator=g), batch_size=16, drop_last=True))
    assert (
        _share_with_a_repeat(plain, rows) > 0.9
    )  # a 16-row batch of TREC QA nearly always repeats a question
    kwargs = {"batch_size": 16, "drop_last": True, "seed": 0}
    sampler = no_duplicate_batches("auto", dataset, generator=torch.Generator(), **kwargs)
    assert isinstance(sampler, NoDuplicatesBatchSampler)
    batches = list(sampler)
    assert batches and _share_with_a_repeat(batches, rows) == 0.0
    assert all(len(b) == 16 for b in batches)
    assert batches == list(no_duplicate_batches("auto", dataset, generator=torch.Generator(), **kwargs))


def test_cards_without_repeats_keep_the_plain_sampler(trecqa):
    unique, seen = [], set()
    for r in trecqa:
        if not {r["query"], r["positive"]} & seen:
            unique.append({"query": r["query"], "positive": r["positive"]})
            seen |= {r["query"], r["positive"]}
    dataset = Dataset.from_list(unique)
    assert not text_repeats(dataset)
    assert no_duplicate_batches("auto", dataset, batch_size=4, drop_last=True) is None
    assert no_duplicate_batches(True, dataset, batch_size=4, drop_last=True) is not None
    repeated = Dataset.from_list([*unique, unique[0]])
    assert no_duplicate_batches("auto", repeated, batch_size=4, drop_last=True) is not None
    assert no_duplicate_batches(False, repeated, batch_size=4, drop_last=True) is None


def test_training_on_a_card_with_repeated_questions_uses_it(tmp_path, tiny_official, caplog):
    from neoembed.recipe import load_recipe
    from neoembed.train.recipe import UnifiedRecipe
    from neoembed.train.trainer import train

    repo_root = Path(__file__).resolve().parents[1]
    tiny_recipe = repo_root / "recipes/tiny.yaml"
    recipe = load_recipe(
        tiny_recipe,
        UnifiedRecipe,
        [
            f"model={tiny_official}",
            f"output_dir={tmp_path / 'run'}",
            f"card_dirs=[{repo_root / 'tests/data_cards'}]",
            "datasets=[{card: trecqa_pairs, max_rows: 96}]",
            "steps=2",
            "save_steps=100",
        ],
    )
    with caplog.at_level("INFO", logger="neoembed"):
        train(recipe, recipe_dir=tiny_recipe.parent)
    assert "card trecqa_pairs: a text repeats across rows, so no batch holds it twice" in caplog.text
