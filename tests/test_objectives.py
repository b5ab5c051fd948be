"""The objectives beyond plain InfoNCE (#25): false-negative masking, GTE's improved contrastive loss and
Matryoshka, each against its sentence-transformers counterpart or a hand computation; cached equals plain."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import neoembed
from neoembed.losses import (
    CachedInfoNCELoss,
    FalseNegativeConfig,
    InfoNCELoss,
    false_negative_mask,
    info_nce,
)

BATCH = {
    "query": [
        "what is neobert",
        "capital of france",
        "how do cats purr",
        "why is the sky blue",
        "rain forms how",
    ],
    "positive": [
        "an encoder model",
        "paris",
        "vibrating vocal folds",
        "rayleigh scattering",
        "condensing vapour",
    ],
    "negative": ["a decoder model", "lyon", "dogs bark loudly", "a red sunset", "dry desert air"],
}


@pytest.fixture(scope="module")
def tiny(tiny_official):
    model = neoembed.load(tiny_official)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def _features(model, columns):
    return [model.tokenize(BATCH[c]) for c in columns]


def _run(model, loss, columns=("query", "positive", "negative")):
    """Loss value and every parameter gradient of one step."""
    model.zero_grad()
    value = loss(_features(model, columns), torch.zeros(len(BATCH["query"])))
    value.backward()
    return value.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b, rel=1e-5):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert loss_a == pytest.approx(loss_b, rel=rel)
    assert grads_a and grads_a.keys() == grads_b.keys()
    scale = max(float(g.abs().max()) for g in grads_a.values())
    for n in grads_a:  # fp32 sums in another order: differences of ~1e-6 of the gradients' scale
        assert float((grads_a[n] - grads_b[n]).abs().max()) <= 1e-5 * scale, n


def test_false_negative_mask_by_hand_and_robust_to_negative_scores():
    # one query; cosine scores: positive -0.50, candidates -0.49 (closer than the positive), -0.52, -0.80
    q = torch.tensor([[1.0, 0.0]])
    cands = torch.tensor([[c, math.sqrt(1 - c * c)] for c in (-0.50, -0.49, -0.52, -0.80)])
    absolute = false_negative_mask(q, cands, 1, FalseNegativeConfig(margin=0.05, mode="absolute"))
    assert absolute.tolist() == [[False, True, True, False]]  # s > -0.55
    relative = false_negative_mask(q, cands, 1, FalseNegativeConfig(margin=0.05, mode="relative"))
    # s > -0.50 - 0.5 * 0.05 = -0.525: the closer negative is always dropped (the bug of ST PR #3821 kept it)
    assert relative.tolist() == [[False, True, True, False]]
    assert false_negative_mask(q, cands, 1, FalseNegativeConfig()).tolist() == [[False, True, False, False]]


def test_false_negative_scope_separates_in_batch_from_own_hard_negatives():
    torch.manual_seed(0)
    q, docs = torch.randn(3, 8), torch.randn(6, 8)  # 3 positives, then each query's hard negative
    everything = FalseNegativeConfig(margin=10.0)  # every candidate but the positive
    assert false_negative_mask(q, docs, 2, everything).sum() == 3 * 5
    hard = false_negative_mask(q, docs, 2, FalseNegativeConfig(margin=10.0, scope="hard"))
    assert hard.nonzero().tolist() == [[0, 3], [1, 4], [2, 5]]
    in_batch = false_negative_mask(q, docs, 2, FalseNegativeConfig(margin=10.0, scope="in_batch"))
    assert (in_batch | hard).sum() == 15 and not (in_batch & hard).any()


def test_false_negative_loss_equals_infonce_with_the_mask_by_hand(tiny):
    config = FalseNegativeConfig(margin=0.02, mode="relative")
    loss = InfoNCELoss(tiny, false_negatives=config, mask_duplicates=False)
    with torch.no_grad():
        value = loss(_features(tiny, ("query", "positive", "negative")), torch.zeros(5))
        q, p, n = (tiny.encode(BATCH[c], convert_to_tensor=True) for c in ("query", "positive", "negative"))
    cands = torch.cat([p, n])
    scores = F.normalize(q, dim=-1) @ F.normalize(cands, dim=-1).T
    mask = torch.zeros_like(scores, dtype=torch.bool)
    for i in range(5):
        for j in range(10):
            mask[i, j] = j != i and scores[i, j] > scores[i, i] - abs(scores[i, i]) * 0.02
    assert mask.any() and not mask.all()  # the tiny random model scores some negatives above the margin
    assert float(value) == pytest.approx(float(info_nce(q, cands, 0.07, mask)), rel=1e-4)
    counts = loss.pop_counts()
    assert counts["false_negatives_masked"] == int(mask.sum())
    assert counts["false_negative_fraction"] == pytest.approx(int(mask.sum()) / (5 * 9))
    assert loss.pop_counts() == {}  # counted once, then reset


@pytest.mark.parametrize("improved", [False, True])
def test_false_negative_masking_cached_equals_plain(tiny, improved):
    options = dict(false_negatives={"margin": 0.02}, improved_contrastive=improved, mask_duplicates=False)
    plain = _run(tiny, InfoNCELoss(tiny, **options))
    cached = _run(tiny, CachedInfoNCELoss(tiny, mini_batch_size=2, **options))
    _assert_same(cached, plain)


@pytest.mark.parametrize("columns", [("query", "positive"), ("query", "positive", "negative")])
def test_improved_contrastive_equals_sentence_transformers_gte_directions(tiny, columns):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    reference = MultipleNegativesRankingLoss(
        tiny,
        scale=1 / 0.05,
        directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
        partition_mode="joint",
    )
    ours = InfoNCELoss(tiny, temperature=0.05, mask_duplicates=False, improved_contrastive=True)
    _assert_same(_run(tiny, ours, columns), _run(tiny, reference, columns))
