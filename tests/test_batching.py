"""Token-budget encoding batches (neoembed.batching): the same embeddings as count batches, in input order, on the
packaged all-MiniLM-L6-v2 and the tiny NeoBERT (padded and padding-free, packed to a fixed size); no batch over
the budget whatever the input order; ``--max-batch-tokens`` on ``neoembed mteb``, ``mine`` and ``score``."""

from __future__ import annotations

import gzip
import json
import random
import sys

import numpy as np
import pytest

import neoembed
from neoembed.batching import (
    MAX_BATCH_TOKENS_OPTION,
    check_max_batch_tokens,
    lean_encode,
    lean_supported,
    token_budget_batches,
    uses_packed_batches,
)

BUDGET = 2048  # several batches of each shape on these texts, all of them over 32 rows for the short texts


@pytest.fixture(scope="module")
def texts(shared_dir) -> list[str]:
    """60 MSRP sentences mixed 9:1 with long documents (concatenations, truncated at max_seq_length), plus a
    one-character text, shuffled."""
    with gzip.open(shared_dir / "data/train/msrp_pairs/train.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(30), f, strict=False)]
    short = [r[k] for r in rows for k in ("query", "positive")]
    docs = [" ".join(short[i : i + 12]) for i in range(0, 60, 10)][:6]
    out = short + docs + ["x"]
    random.Random(0).shuffle(out)
    return out


@pytest.fixture(scope="module")
def minilm(minilm_path):
    return neoembed.load("packaged:all-MiniLM-L6-v2", max_seq_length=128)


@pytest.fixture(scope="module")
def tiny(tiny_official):
    return neoembed.load(str(tiny_official), max_seq_length=128)


def _encode(model, texts, **kwargs):
    with pytest.warns(UserWarning, match="exceed max_seq_length"):  # the long documents are truncated
        return model.encode(texts, normalize_embeddings=True, **kwargs)


def _check_equal(model, texts, prompt=None):
    count = _encode(model, texts, batch_size=32, prompt=prompt)
    budget = _encode(model, texts, max_batch_tokens=BUDGET, prompt=prompt)
    assert budget.shape == count.shape and budget.dtype == np.float32
    np.testing.assert_allclose(budget, count, atol=2e-6, rtol=0)
    for i in (0, len(texts) // 2, len(texts) - 1):  # input order: row i is text i's embedding on its own
        alone = model.encode([texts[i]], normalize_embeddings=True, prompt=prompt)[0]
        np.testing.assert_allclose(budget[i], alone, atol=2e-6, rtol=0)


def test_minilm_token_budget_equals_count_batches(minilm, texts):
    assert lean_supported(minilm) and not uses_packed_batches(minilm)
    _check_equal(minilm, texts, prompt="query: ")


@pytest.mark.parametrize("padding_free", [True, False])
def test_neobert_token_budget_equals_count_batches(tiny, texts, padding_free):
    tiny[0].auto_model.config.padding_free = padding_free
    try:
        assert uses_packed_batches(tiny) == padding_free
        _check_equal(tiny, texts)
        _check_equal(tiny, texts, prompt="Represent the query for retrieval: ")
    finally:
        tiny[0].auto_model.config.padding_free = True


def test_packed_to_a_fixed_size_equals_count_batches(tiny, texts):
    """The CUDA layout (every batch exactly ``max_batch_tokens`` tokens, filler sequences dropped), run on CPU."""
    shapes = _input_shapes(tiny)
    with pytest.warns(UserWarning, match="exceed max_seq_length"):
        count = tiny.encode(texts, batch_size=32, convert_to_numpy=True)
    del shapes[:]
    with pytest.warns(UserWarning, match="exceed max_seq_length"):
        fixed = lean_encode(tiny, texts, max_batch_tokens=BUDGET, normalize=False, fixed_size=True).numpy()
    np.testing.assert_allclose(fixed, count, atol=1e-5, rtol=1e-5)
    assert shapes and all(s == (1, BUDGET) for s in shapes)


def test_other_pipelines_batch_through_their_own_preprocess(tiny_official, texts):
    """A model the lean path does not run (a Dense head after pooling) gets token-budget batches too."""
    from sentence_transformers.base.modules import Dense

    model = neoembed.load(str(tiny_official), max_seq_length=128)
    model.append(Dense(model.get_embedding_dimension(), 8))
    assert not lean_supported(model)
    count = _encode(model, texts, batch_size=32)
    shapes = _input_shapes(model)
    budget = _encode(model, texts, max_batch_tokens=BUDGET)
    np.testing.assert_allclose(budget, count, atol=2e-6, rtol=0)
    assert max(b * n for b, n in shapes) <= BUDGET and max(b for b, _ in shapes) > 32


def _input_shapes(model) -> list[tuple[int, ...]]:
    """The input_ids shape of every forward of ``model``'s Transformer module, recorded as they happen."""
    shapes: list[tuple[int, ...]] = []
    model[0].register_forward_pre_hook(lambda _m, args: shapes.append(tuple(args[0]["input_ids"].shape)))
    return shapes


@pytest.mark.parametrize("padding_free", [True, False])
def test_no_batch_exceeds_the_budget_whatever_the_order(tiny_official, texts, padding_free):
    model = neoembed.load(str(tiny_official), max_seq_length=128, padding_free=padding_free)
    shapes = _input_shapes(model)
    runs = []
    for order in (sorted(texts, key=len), sorted(texts, key=len, reverse=True), texts):
        del shapes[:]
        _encode(model, order, max_batch_tokens=BUDGET)
        runs.append(list(shapes))
    assert runs[0] == runs[1] == runs[2]  # the same batches, whatever order the texts came in
    if padding_free:  # packed (1, T): the summed lengths
        assert all(b == 1 and t <= BUDGET for b, t in runs[0])
    else:  # padded (B, L): rows x longest row
        assert all(b * n <= BUDGET for b, n in runs[0])
        assert max(b for b, _ in runs[0]) > 32  # short texts fill batches beyond count batches' 32
    assert len(runs[0]) < len(texts) / 32 + 4


@pytest.mark.parametrize("packed", [True, False])
def test_batches_cover_every_text_once_longest_first_and_full(packed):
    lengths = np.random.default_rng(0).integers(1, 512, size=1000)
    budget = 2048
    batches = token_budget_batches(lengths, budget, packed=packed)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(1000))
    assert (np.diff(lengths[flat]) <= 0).all()  # longest first
    cost = (lambda b: lengths[b].sum()) if packed else (lambda b: len(b) * lengths[b].max())
    assert all(cost(b) <= budget for b in batches)
    # filled: the next batch's first text would not have fit
    assert all(cost(np.append(b, nxt[0])) > budget for b, nxt in zip(batches, batches[1:], strict=False))


def test_a_text_longer_than_the_budget_and_non_positive_budgets_are_refused(tiny, texts):
    with pytest.raises(ValueError, match=MAX_BATCH_TOKENS_OPTION):
        token_budget_batches([10, 300], 200)
    with pytest.raises(ValueError, match="raise --max-batch-tokens"):
        _encode(tiny, texts, max_batch_tokens=64)  # the documents are 128 tokens
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="--max-batch-tokens"):
            check_max_batch_tokens(bad)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        tiny.encode(["a text"], max_batch_tokens=0)


COMMANDS = {
    "mteb": ["mteb", "--model", "MODEL", "--tasks", "STS16", "--data-dir", "DATA", "--output", "OUT"],
    "mine": ["mine", "CARD", "--model", "MODEL", "--out", "OUT"],
    "score": ["score", "CARD", "--teacher", "MODEL", "--out", "OUT"],
}
# where each command hands over its settings: replaced by a spy, so that parsing is all that runs
RUNS = {
    "mteb": "neoembed.eval.cli._run",
    "mine": "neoembed.mine.miner.mine_negatives",
    "score": "neoembed.mine.score.score_card",
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_cli_option_accepted_and_validated(command, tiny_official, tmp_path, monkeypatch, capsys):
    from neoembed.cli import main

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("config") or args[0])
        raise SystemExit(0)

    monkeypatch.setattr(RUNS[command], spy)
    places = {
        "MODEL": str(tiny_official),
        "DATA": str(tmp_path),
        "OUT": str(tmp_path / "out"),
        "CARD": "card.yaml",
    }
    argv = [places.get(a, a) for a in COMMANDS[command]]
    for value, code in (("0", 2), ("-3", 2), ("4096", 0)):
        monkeypatch.setattr(sys, "argv", ["neoembed", *argv, "--max-batch-tokens", value])
        with pytest.raises(SystemExit) as e:
            main()
        assert e.value.code == code, capsys.readouterr()
        if code:
            assert "--max-batch-tokens" in capsys.readouterr().err
    assert [c.max_batch_tokens for c in seen] == [4096]
