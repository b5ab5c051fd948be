"""InfoNCE: hand computation, duplicate masking, cached == plain (loss and every gradient)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

import neoembed
from neoembed.losses import CachedInfoNCELoss, InfoNCELoss, duplicate_mask, info_nce, text_keys


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def test_info_nce_matches_hand_computation_with_hard_negatives():
    g = torch.Generator().manual_seed(0)
    q, p, n = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    tau = 0.07
    cands = torch.cat([p, n])
    expected = 0.0
    for i in range(2):
        logits = [_cos(q[i], c) / tau for c in cands]
        expected += -(logits[i] - math.log(sum(math.exp(x) for x in logits)))
    assert float(info_nce(q, cands, tau)) == pytest.approx(expected / 2, rel=1e-5)
    assert float(info_nce(q, cands, tau, reduction="sum")) == pytest.approx(expected, rel=1e-5)


def test_duplicate_positive_is_masked_out():
    g = torch.Generator().manual_seed(1)
    q, p = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    keys = torch.tensor([10, 20, 10])  # rows 0 and 2 share the same positive text
    mask = duplicate_mask(keys, keys)
    assert mask.tolist() == [[False, False, True], [False, False, False], [True, False, False]]
    tau = 0.1
    loss = float(info_nce(q, p, tau, mask))
    expected = 0.0
    for i in range(3):
        logits = {j: _cos(q[i], p[j]) / tau for j in range(3) if not mask[i, j]}
        expected += -(logits[i] - math.log(sum(math.exp(x) for x in logits.values())))
    assert loss == pytest.approx(expected / 3, rel=1e-5)


@pytest.fixture(scope="module")
def tiny(tiny_official):
    return neoembed.load(tiny_official)


BATCH = {
    "query": [
        "what is neobert",
        "capital of france",
        "how do cats purr",
        "what is neobert",
        "rain forms how",
    ],
    "positive": [
        "an encoder model",
        "paris",
        "vibrating vocal folds",
        "an encoder model",
        "condensing vapour",
    ],
    "negative": ["a decoder model", "lyon", "dogs bark loudly", "a car", "dry desert air"],
}


def _features(model, columns):
    return [model.tokenize(BATCH[c]) for c in columns]


def test_text_keys_identify_duplicates(tiny):
    keys = text_keys(tiny.tokenize(BATCH["positive"]))
    assert keys[0] == keys[3] and len(set(keys.tolist())) == 4


@pytest.mark.parametrize("columns", [("query", "positive"), ("query", "positive", "negative")])
@pytest.mark.parametrize("mini_batch_size", [1, 2, 5])
def test_cached_equals_plain_loss_and_gradients(tiny, columns, mini_batch_size):
    tiny.train()
    for m in tiny.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    labels = torch.zeros(5)
    plain = InfoNCELoss(tiny)
    tiny.zero_grad()
    loss_plain = plain(_features(tiny, columns), labels)
    loss_plain.backward()
    grads_plain = {n: p.grad.clone() for n, p in tiny.named_parameters() if p.grad is not None}
    cached = CachedInfoNCELoss(tiny, mini_batch_size=mini_batch_size)
    tiny.zero_grad()
    loss_cached = cached(_features(tiny, columns), labels)
    loss_cached.backward()
    assert loss_cached.item() == pytest.approx(loss_plain.item(), rel=1e-5)
    assert grads_plain
    for n, p in tiny.named_parameters():
        if n in grads_plain:
            torch.testing.assert_close(p.grad, grads_plain[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("cached", [False, True])
def test_a_batch_with_nothing_to_contrast_is_warned(tiny, cached):
    """Every query the same text, no hard negatives: each answer is a positive of every row, so the masks leave
    nothing to contrast and the loss is 0 whatever the model; the loss says so. A usual batch does not warn."""
    make = (lambda m: CachedInfoNCELoss(m, mini_batch_size=2)) if cached else InfoNCELoss
    same = {"query": ["what is neobert"] * 3, "positive": ["an encoder", "a model", "from a lab"]}
    with pytest.warns(UserWarning, match="no query of this batch kept a negative"):
        loss = make(tiny)([tiny.tokenize(same[c]) for c in ("query", "positive")], torch.zeros(3))
    assert loss.item() == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make(tiny)(_features(tiny, ("query", "positive")), torch.zeros(5)).item() > 0


def test_cached_pass_writes_each_column_into_one_buffer(tiny, monkeypatch):
    """The gradient-free pass hands the scoring each column's mini-batches as views of one buffer, which it
    reads in place (no copy of the batch's embeddings beside their gradients), and the loss is unchanged."""
    from neoembed import scoring

    seen = []
    runs = scoring._runs

    def record(segments):
        out = runs(segments)
        seen.append((len(segments), len(out)))
        return out

    monkeypatch.setattr(scoring, "_runs", record)
    columns = ("query", "positive", "negative")
    cached = CachedInfoNCELoss(tiny, mini_batch_size=2)
    loss = cached(_features(tiny, columns), torch.zeros(5))
    loss.backward()
    # queries: 3 mini-batches in one buffer; candidates: 6 mini-batches in two (positive, negative)
    assert seen == [(3, 1), (6, 2)]
    with torch.no_grad():
        plain = InfoNCELoss(tiny)(_features(tiny, columns), torch.zeros(5))
    assert loss.item() == pytest.approx(plain.item())


def test_masking_changes_the_loss_and_can_be_turned_off(tiny):
    cols = ("query", "positive")
    with torch.no_grad():
        masked = float(InfoNCELoss(tiny)(_features(tiny, cols), torch.zeros(5)))
        unmasked = float(InfoNCELoss(tiny, mask_duplicates=False)(_features(tiny, cols), torch.zeros(5)))
    assert masked < unmasked  # the duplicate positive no longer competes


def test_bad_arguments(tiny):
    with pytest.raises(ValueError, match="reduction"):
        InfoNCELoss(tiny, reduction="max")
    with pytest.raises(ValueError, match="temperature"):
        InfoNCELoss(tiny, temperature=0)
    for make in (InfoNCELoss, CachedInfoNCELoss):  # "no" is a true value: it switched the masking on
        with pytest.raises(TypeError, match="mask_duplicates takes True or False, not 'no'"):
            make(tiny, mask_duplicates="no")
    with pytest.raises(TypeError, match="group_by_length takes True or False, not 'no'"):
        InfoNCELoss(tiny, group_by_length="no")
    for make, flag in ((InfoNCELoss, "gather_across_devices"), (CachedInfoNCELoss, "gather_across_devices"),
                       (CachedInfoNCELoss, "show_progress_bar")):  # fmt: skip
        with pytest.raises(TypeError, match=f"{flag} takes True or False, not 'no'"):
            make(tiny, **{flag: "no"})
    # sentence-transformers' MNRL takes scale=20; a temperature of 20 scores every candidate almost alike
    with pytest.warns(UserWarning, match="did you mean temperature=0.05"):
        InfoNCELoss(tiny, temperature=20)
    for make in (InfoNCELoss, CachedInfoNCELoss):  # a short column shifts every row's pairing
        short = [tiny.tokenize(["a b", "c d", "e f"]), tiny.tokenize(["x y", "z w"])]
        with pytest.raises(ValueError, match=r"columns hold different numbers of texts \(3, 2, query column"):
            make(tiny)(short, torch.zeros(3))


def test_loss_registry_builds_from_a_recipe_and_fails_loudly(tiny):
    from neoembed.losses import LOSSES, build_loss, loss_class
    from neoembed.recipe import RecipeError, load_recipe
    from neoembed.train.recipe import UnifiedRecipe

    recipe = load_recipe(
        "tiny", UnifiedRecipe, ["temperature=0.05", "loss.name=cached_infonce", "loss.mini_batch_size=4"]
    )
    assert recipe.loss.name == "cached_infonce"
    plain = build_loss("infonce", tiny, recipe)
    cached = build_loss("cached_infonce", tiny, recipe)
    assert isinstance(plain, InfoNCELoss) and plain.tau == 0.05
    assert isinstance(cached, CachedInfoNCELoss) and cached.mini_batch_size == 4 and cached.tau == 0.05
    for name in LOSSES:  # CDE's two-stage step scores with the same InfoNCE
        assert loss_class(name).embedding_loss is info_nce
    with pytest.raises(ValueError, match=r"unknown loss 'triplet'; valid: \['cached_infonce', 'infonce'\]"):
        build_loss("triplet", tiny, recipe)
    with pytest.raises(RecipeError, match=r"unknown loss 'triplet'; valid"):
        load_recipe("tiny", UnifiedRecipe, ["loss.name=triplet"])
    assert load_recipe("tiny", UnifiedRecipe, []).loss.name == "infonce"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["loss=cached_infonce"],
            r"write loss: \{name: cached_infonce\} \(on the command line: loss.name=cached_infonce\)",
        ),
        (
            ["cache_mini_batch_size=4"],
            r"write loss: \{name: cached_infonce, mini_batch_size: 4\} \(on the command line: "
            r"loss.name=cached_infonce loss.mini_batch_size=4\)",
        ),
        (["loss.mini_batch_size=4"], r"loss.mini_batch_size is read by cached_infonce only, not by infonce"),
        (["loss.temperature=0.05"], r"unknown key 'loss.temperature'"),
    ],
)
def test_a_loss_key_is_refused_where_no_loss_reads_it(overrides, message):
    """The loss is a sub-config: its old top-level keys are refused with the new form, and an option of another
    loss is refused rather than silently ignored (cache_mini_batch_size under infonce was)."""
    from neoembed.recipe import RecipeError, load_recipe
    from neoembed.train.recipe import UnifiedRecipe

    with pytest.raises(RecipeError, match=message):
        load_recipe("tiny", UnifiedRecipe, overrides)


def test_length_groups_partition_the_rows_into_sorted_runs():
    from neoembed.losses import length_groups

    lengths = [128, 12, 90, 15, 128, 40, 14, 100]
    groups = length_groups(lengths, overhead=64)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    spans = [(min(lengths[i] for i in g), max(lengths[i] for i in g)) for g in groups]
    assert spans == sorted(spans) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert sum(len(g) * hi for g, (_, hi) in zip(groups, spans, strict=True)) < len(lengths) * max(lengths)
    assert length_groups(lengths, overhead=10**9) == [sorted(range(8), key=lambda i: lengths[i])]


def _length_groups_over_every_row(lengths: list[int], overhead: int) -> list[list[int]]:
    """The slow twin of ``length_groups``: the same programme over every sorted row, quadratic in the rows."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sorted_len = [lengths[i] for i in order]
    best, cut = [0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        for start in range(end):
            cost = best[start] + (end - start) * sorted_len[end - 1] + overhead
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(order)
    while end > 0:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]


def test_length_groups_over_distinct_lengths_equal_the_programme_over_every_row():
    """The fast path (cuts only between distinct lengths) returns the very groups of the row-by-row programme:
    random batches of many repeated lengths, short and long, small and large overheads."""
    import random

    from neoembed.losses import length_groups

    rng = random.Random(0)
    for trial in range(40):
        n = rng.choice([1, 2, 7, 64, 300])
        top = rng.choice([4, 32, 512])
        lengths = [rng.randint(1, top) for _ in range(n)]
        overhead = rng.choice([1, 16, 512, 10**6])
        assert length_groups(lengths, overhead) == _length_groups_over_every_row(lengths, overhead), trial


def test_length_grouped_encoding_equals_the_padded_batch(minilm_path, shared_dir):
    """A padded encoder (BERT): rows of very different lengths, encoded in length groups, give the loss and every
    gradient of the one padded batch, with fewer tokens through the model."""
    import gzip
    import json

    from sentence_transformers import SentenceTransformer

    with gzip.open(shared_dir / "data" / "eval" / "TrecQA" / "test.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f][:8]
    model = SentenceTransformer(str(minilm_path))
    model.max_seq_length = 96
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    columns = [
        [r["query"] for r in rows],
        [r["positive"][0] for r in rows],
        [r["negative"][-1] + " " + " ".join(r["negative"][:2]) * (i % 2) for i, r in enumerate(rows)],
    ]
    tokens = []
    model[0].register_forward_pre_hook(lambda mod, args: tokens.append(args[0]["input_ids"].numel()))
    results = {}
    for grouped in (False, True):
        tokens.clear()
        model.zero_grad()
        loss = InfoNCELoss(model, group_by_length=grouped)(
            [model.tokenize(c) for c in columns], torch.zeros(8)
        )
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[grouped] = (loss.item(), grads, sum(tokens), len(tokens))
    (plain, g_plain, tok_plain, calls_plain), (grouped, g_grouped, tok_grouped, calls_grouped) = (
        results.values()
    )
    assert calls_grouped > 1 and tok_grouped < 0.9 * tok_plain  # here 1,324 of 1,632 tokens
    assert grouped == pytest.approx(plain, rel=1e-5)
    assert g_plain.keys() == g_grouped.keys()
    # fp32 sums in another order: differences of ~1e-6 of the gradients' scale (seen: <= 2e-6); some gradients
    # are zero in exact arithmetic (a key bias under softmax), so the scale is the largest gradient's
    scale = max(float(g.abs().max()) for g in g_plain.values())
    for n in g_plain:
        assert float((g_grouped[n] - g_plain[n]).abs().max()) <= 1e-5 * scale, n


def test_a_padding_free_encoder_is_not_split_into_length_groups(tiny):
    """NeoBERT drops padding itself (padding-free by default), so a recipe's ``group_by_length`` builds a loss
    that encodes each column at once; the same encoder run padded is grouped. The plain forward leaves the
    caller's feature dicts as they were (the model adds its outputs to the dicts it is given)."""
    from neoembed.losses import build_loss
    from neoembed.recipe import load_recipe
    from neoembed.train.recipe import UnifiedRecipe

    recipe = load_recipe("tiny", UnifiedRecipe, [])
    config = tiny[0].auto_model.config
    assert recipe.group_by_length and config.drops_padding
    assert build_loss("infonce", tiny, recipe).group_by_length is False
    config.padding_free = False
    try:
        assert build_loss("infonce", tiny, recipe).group_by_length is True
    finally:
        config.padding_free = True
    features = _features(tiny, ("query", "positive", "negative"))
    keys = [set(f) for f in features]
    with torch.no_grad():
        first = float(build_loss("infonce", tiny, recipe)(features, torch.zeros(5)))
        again = float(build_loss("infonce", tiny, recipe)(features, torch.zeros(5)))
    assert [set(f) for f in features] == keys and first == again


def test_losses_set_attributes_through_the_module():
    """No ``object.__setattr__`` in the losses: their options are plain attributes, which torch's and
    sentence-transformers' attribute handling (the cached loss delegates only its wrapped loss's
    hyperparameters) lets through."""
    import neoembed.losses

    package = Path(neoembed.losses.__file__).parent
    offenders = [p.name for p in package.glob("*.py") if "object.__setattr__" in p.read_text()]
    assert offenders == []


@pytest.mark.parametrize("cls", [InfoNCELoss, CachedInfoNCELoss])
def test_a_call_leaves_no_state_on_the_loss(tiny, cls):
    """The batch's text keys travel with the call (the labels argument), and what false-negative masking drops
    goes to the tally the caller gave: two calls on different batches leave every attribute of the loss as it
    was (torch's own module bookkeeping aside), and the duplicate mask still applies."""
    from neoembed.losses import MaskTally

    tally = MaskTally()
    loss = cls(tiny, false_negatives={"margin": 0.02}, tally=tally)
    torch_own = set(vars(torch.nn.Module()))
    snapshot = lambda: {k: repr(v) for k, v in vars(loss).items() if k not in torch_own}  # noqa: E731
    before = snapshot()
    with torch.no_grad():
        first = float(loss(_features(tiny, ("query", "positive")), torch.zeros(5)))
        loss(_features(tiny, ("query", "positive", "negative")), torch.zeros(5))
        again = float(loss(_features(tiny, ("query", "positive")), torch.zeros(5)))
    assert snapshot() == before
    assert again == pytest.approx(first, rel=1e-6)
    assert tally.calls == 3 and tally.scored == 2 * 5 * 4 + 5 * 9  # every candidate but the own positive


def test_walk_one_column_batch_gets_the_losses_own_message(tiny):
    """L17: with duplicate masking on (the default) a one-column batch failed with an IndexError in the key
    builder, before the loss's own message."""
    for loss in (InfoNCELoss(tiny), CachedInfoNCELoss(tiny, mini_batch_size=2)):
        with pytest.raises(ValueError, match="query and a positive column, got 1"):
            loss(_features(tiny, ("query",)), torch.zeros(5))


def test_walk_nan_teacher_scores_are_refused_naming_the_batch_rows(tiny):
    """L18: NaN teacher scores made the loss NaN (and the weights with it); sentence-transformers' own check
    runs once per loss object, and Margin-MSE has none."""
    columns = ("query", "positive", "negative")
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4], [0.5, 0.5]])
    for name in ("kl", "margin_mse"):
        loss = InfoNCELoss(tiny, distillation={"loss": name})
        assert torch.isfinite(
            loss(_features(tiny, columns), scores)
        )  # the same loss object, first a clean batch
        bad = scores.clone()
        bad[3, 1] = float("nan")
        with pytest.raises(ValueError, match=r"batch row\(s\) \[3\] are NaN or infinite"):
            loss(_features(tiny, columns), bad)


def test_walk_loss_arguments_are_checked_when_the_loss_is_built(tiny):
    """L19-L22, L24: wrong values and types failed at the first forward, deep inside, or were taken silently
    (improved_contrastive="no" switched the improved loss on)."""
    for bad in (0, -4, 2.5):
        with pytest.raises(ValueError, match="mini_batch_size takes a positive whole number"):
            CachedInfoNCELoss(tiny, mini_batch_size=bad)
    with pytest.raises(TypeError, match="false_negatives takes a dict"):
        InfoNCELoss(tiny, false_negatives=0.1)
    with pytest.raises(TypeError, match="distillation takes a dict"):
        InfoNCELoss(tiny, distillation="kl")
    with pytest.raises(TypeError, match="improved_contrastive takes True or False"):
        InfoNCELoss(tiny, improved_contrastive="no")
    for bad in (float("nan"), float("inf"), 0.0):
        with pytest.raises(ValueError, match="temperature must be a positive finite number"):
            InfoNCELoss(tiny, temperature=bad)
    with pytest.raises(TypeError, match="temperature takes a number"):
        InfoNCELoss(tiny, temperature="0.07")
    with pytest.raises(ValueError, match="3 rows at offset 0 need at least 3 candidates, got 2"):
        info_nce(torch.randn(3, 8), torch.randn(2, 8), 0.05)
    from neoembed.losses import with_matryoshka

    as_list = with_matryoshka(
        tiny, InfoNCELoss(tiny), [32, 16]
    )  # the dims alone, as MatryoshkaLoss takes them
    assert list(as_list.matryoshka_dims) == [32, 16]


def test_walk_distillation_on_rows_without_negatives_is_refused(tiny):
    """Distilling over a positive alone computes 0 whatever the teacher says (a softmax over one candidate, a
    margin with no negative): refused instead of training on nothing."""
    for name in ("kl", "margin_mse"):
        loss = InfoNCELoss(tiny, distillation={"loss": name})
        with pytest.raises(ValueError, match="these rows have none"):
            loss(_features(tiny, ("query", "positive")), torch.ones(5, 1))


def test_cached_mini_batches_by_tokens_equal_the_plain_loss(tiny, monkeypatch):
    """sentence-transformers' ``mini_batch_num_tokens`` (mini-batches filled to a token budget, so that long
    documents take more, smaller ones) reaches its GradCache pass: the same loss and gradients as the plain
    loss, over more mini-batches than the row count gives; a recipe key of the cached loss only."""
    from neoembed.recipe import RecipeError, load_recipe
    from neoembed.train.recipe import UnifiedRecipe

    tiny.train()
    for m in tiny.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    columns, labels = ("query", "positive", "negative"), torch.zeros(5)
    tiny.zero_grad()
    plain = InfoNCELoss(tiny)(_features(tiny, columns), labels)
    plain.backward()
    want = {n: p.grad.clone() for n, p in tiny.named_parameters() if p.grad is not None}
    seen = []
    embed = CachedInfoNCELoss.embed_minibatch_iter

    def record(self, *args, ranges=None, **kwargs):
        seen.append(len(ranges))
        return embed(self, *args, ranges=ranges, **kwargs)

    monkeypatch.setattr(CachedInfoNCELoss, "embed_minibatch_iter", record)
    tiny.zero_grad()
    cached = CachedInfoNCELoss(tiny, mini_batch_size=5, mini_batch_num_tokens=12)
    loss = cached(_features(tiny, columns), labels)
    loss.backward()
    assert loss.item() == pytest.approx(plain.item(), rel=1e-5)
    assert max(seen) > 1  # 5 rows a mini-batch by count: one; by 12 tokens: several
    for n, p in tiny.named_parameters():
        if n in want:
            torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=n)
    recipe = load_recipe(
        "tiny", UnifiedRecipe, ["loss.name=cached_infonce", "loss.mini_batch_num_tokens=256"]
    )
    assert CachedInfoNCELoss.from_recipe(tiny, recipe).mini_batch_num_tokens == 256
    with pytest.raises(RecipeError, match="loss.mini_batch_num_tokens is read by cached_infonce only"):
        load_recipe("tiny", UnifiedRecipe, ["loss.mini_batch_num_tokens=256"])
    with pytest.raises(ValueError, match="mini_batch_num_tokens takes a positive whole number"):
        CachedInfoNCELoss(tiny, mini_batch_num_tokens=0)
