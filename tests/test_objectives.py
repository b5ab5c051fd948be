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
    MaskTally,
    MatryoshkaConfig,
    false_negative_mask,
    info_nce,
    with_matryoshka,
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
    everything = FalseNegativeConfig(margin=1.99)  # all but the positive (a margin of 2 is refused)
    assert false_negative_mask(q, docs, 2, everything).sum() == 3 * 5
    hard = false_negative_mask(q, docs, 2, FalseNegativeConfig(margin=1.99, scope="hard"))
    assert hard.nonzero().tolist() == [[0, 3], [1, 4], [2, 5]]
    in_batch = false_negative_mask(q, docs, 2, FalseNegativeConfig(margin=1.99, scope="in_batch"))
    assert (in_batch | hard).sum() == 15 and not (in_batch & hard).any()


def test_false_negative_loss_equals_infonce_with_the_mask_by_hand(tiny):
    config = FalseNegativeConfig(margin=0.02, mode="relative")
    tally = MaskTally()
    loss = InfoNCELoss(tiny, false_negatives=config, mask_duplicates=False, tally=tally)
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
    counts = tally.pop()
    assert counts["false_negatives_masked"] == int(mask.sum())
    assert counts["false_negative_fraction"] == pytest.approx(int(mask.sum()) / (5 * 9))
    assert tally.pop() == {}  # counted once, then reset


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


# ------------------------------------------------------------------------------------------------ Matryoshka
@pytest.fixture(scope="module")
def minilm(minilm_path):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_path), device="cpu")
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


MRL = {"dims": [384, 256, 128, 64], "weights": [1.0, 0.5, 0.5, 0.25]}


def test_matryoshka_equals_sentence_transformers_matryoshka_of_mnrl(minilm):
    """The packaged all-MiniLM-L6-v2: our Matryoshka InfoNCE, plain and GradCache, against sentence-transformers'
    MatryoshkaLoss(MultipleNegativesRankingLoss): the loss and every gradient."""
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

    reference = MatryoshkaLoss(
        minilm, MultipleNegativesRankingLoss(minilm, scale=1 / 0.05), MRL["dims"], MRL["weights"]
    )
    expected = _run(minilm, reference)
    plain = with_matryoshka(minilm, InfoNCELoss(minilm, temperature=0.05), MRL)
    cached = with_matryoshka(minilm, CachedInfoNCELoss(minilm, temperature=0.05, mini_batch_size=2), MRL)
    _assert_same(_run(minilm, plain), expected)
    _assert_same(_run(minilm, cached), expected)
    single = _run(minilm, InfoNCELoss(minilm, temperature=0.05))[0]
    assert abs(expected[0] - single) > 0.1  # the nested dimensions really add terms


def test_cached_matryoshka_encodes_each_mini_batch_twice_whatever_the_dims(tiny):
    """GradCache memory stays at one mini-batch: the loss over every dimension is computed from the cached
    embeddings, so the model runs as often as without Matryoshka (a no-grad pass and a replay per mini-batch)."""
    calls = []
    hook = tiny[0].register_forward_pre_hook(lambda mod, args: calls.append(torch.is_grad_enabled()))
    try:
        counts = []
        for mrl in (None, {"dims": [64, 32, 16, 8]}):
            calls.clear()
            loss = CachedInfoNCELoss(tiny, mini_batch_size=2)
            _run(tiny, loss if mrl is None else with_matryoshka(tiny, loss, mrl))
            counts.append((calls.count(False), calls.count(True)))
    finally:
        hook.remove()
    assert counts[0] == counts[1] == (9, 9)  # 3 columns x 3 mini-batches of 2, 2, 1 rows


@pytest.mark.parametrize("improved", [False, True])
def test_matryoshka_with_false_negatives_cached_equals_plain(tiny, improved):
    options = dict(false_negatives={"margin": 0.05}, improved_contrastive=improved)
    mrl = {"dims": [64, 16]}
    _assert_same(
        _run(tiny, with_matryoshka(tiny, CachedInfoNCELoss(tiny, mini_batch_size=3, **options), mrl)),
        _run(tiny, with_matryoshka(tiny, InfoNCELoss(tiny, **options), mrl)),
    )


def test_matryoshka_settings_fail_loudly(tiny):
    from neoembed.losses import build_loss
    from neoembed.recipe import RecipeError, load_recipe
    from neoembed.train.recipe import UnifiedRecipe

    with pytest.raises(RecipeError, match="one weight per dimension"):
        load_recipe("tiny", UnifiedRecipe, ["matryoshka.dims=[64,32]", "matryoshka.weights=[1]"])
    with pytest.raises(RecipeError, match="repeat"):
        load_recipe("tiny", UnifiedRecipe, ["matryoshka.dims=[64,64]"])
    recipe = load_recipe("tiny", UnifiedRecipe, ["matryoshka.dims=[128,32]"])
    with pytest.raises(ValueError, match=r"exceed the model's embedding dimension 64"):
        build_loss("infonce", tiny, recipe)
    with pytest.raises(ValueError, match=r"truncate_dim 65 is outside 1..64"):
        from neoembed.sentence import set_truncate_dim

        set_truncate_dim(tiny, 65)


def test_truncate_dim_of_the_wrong_type_names_the_key(tiny_official):
    """``truncate_dim="16"`` was a bare TypeError (a str compared with ints) and ``16.5`` was cut to 16 silently:
    both are errors naming the key, through ``neoembed.load`` too; whole numbers of any int type pass."""
    import numpy as np

    from neoembed.sentence import set_truncate_dim

    for bad in ("16", 16.5, 16.0, True):
        with pytest.raises(ValueError, match=rf"truncate_dim must be a whole number of dimensions.*{bad!r}"):
            neoembed.load(tiny_official, truncate_dim=bad)
    model = neoembed.load(tiny_official, truncate_dim=np.int64(16))
    assert model.encode(["a sentence"]).shape == (1, 16) and type(model.truncate_dim) is int
    set_truncate_dim(model, 8)
    assert model.encode(["a sentence"]).shape == (1, 8)


def test_encode_truncate_dim_outside_the_width_is_refused(tiny_official):
    """``encode(truncate_dim=-3)`` sliced three dimensions off the end, 0 gave empty embeddings and 8.5 a bare
    TypeError from a slice: each is an error naming the key; a model loaded truncated bounds it, and a refused
    ``set_truncate_dim`` leaves the model's truncation as it was."""
    from neoembed.sentence import set_truncate_dim

    model = neoembed.load(tiny_official)
    for bad, said in ((-3, "outside 1..64"), (0, "outside 1..64"), (65, "outside 1..64"), (8.5, "whole number")):
        with pytest.raises(ValueError, match=rf"truncate_dim.*{said}"):
            model.encode(["a sentence"], truncate_dim=bad)
        with pytest.raises(ValueError, match=rf"truncate_dim.*{said}"):
            model.encode([], truncate_dim=bad)
    assert model.encode(["a sentence"], truncate_dim=64).shape == (1, 64)
    set_truncate_dim(model, 16)
    with pytest.raises(ValueError, match=r"outside 1..16, the width this model was loaded with \(truncate_dim=16"):
        model.encode(["a sentence"], truncate_dim=32)
    with pytest.raises(ValueError, match="outside 1..64"):
        set_truncate_dim(model, 0)
    assert model.truncate_dim == 16 and model.encode(["a sentence"], truncate_dim=8).shape == (1, 8)


def test_matryoshka_recipe_trains_saves_and_reloads_truncated(tmp_path, tiny_official, small_sts):
    """A Matryoshka recipe with GradCache and false-negative masking: metrics count the masked negatives, the saved
    model records its dims, and it loads truncated in neoembed, in plain sentence-transformers and in
    ``neoembed mteb --truncate-dim``."""
    import json
    from pathlib import Path

    from neoembed.recipe import load_recipe
    from neoembed.sentence import matryoshka_dims
    from neoembed.train.recipe import UnifiedRecipe
    from neoembed.train.trainer import train

    tiny_recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"
    recipe = load_recipe(
        tiny_recipe,
        UnifiedRecipe,
        [
            f"model={tiny_official}",
            f"output_dir={tmp_path / 'run'}",
            "datasets=[{card: pydoc_names, max_rows: 32}]",
        ]
        + ["steps=3", "save_steps=100", "loss.name=cached_infonce", "loss.mini_batch_size=4"]
        + ["matryoshka.dims=[64,32,16]", "false_negatives.margin=0.1"],
    )
    out = train(recipe, recipe_dir=tiny_recipe.parent)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(0 <= r["false_negative_fraction"] <= 1 for r in rows)
    assert all("false_negatives_masked" in r for r in rows)
    assert matryoshka_dims(out) == [64, 32, 16]
    assert "Matryoshka dimensions 64, 32, 16" in (out / "README.md").read_text()
    assert neoembed.load(out, truncate_dim=16).encode(["a sentence"]).shape == (1, 16)
    from sentence_transformers import SentenceTransformer
    from typer.testing import CliRunner

    from neoembed.cli import app

    plain = SentenceTransformer(str(out), trust_remote_code=True, truncate_dim=32)
    assert plain.encode(["a sentence"]).shape == (1, 32)
    cli = ["mteb", "--model", str(out), "--data-dir", str(small_sts), "--instructions", "none"]
    run = CliRunner().invoke(app, [*cli, "--truncate-dim", "16", "--output", str(tmp_path / "mteb")])
    assert run.exit_code == 0, run.output
    assert json.loads((tmp_path / "mteb" / "summary.json").read_text())["n_tasks"] == 1
    recorded = json.loads((tmp_path / "mteb" / "run_record.json").read_text())["recipe"]
    assert recorded["truncate_dim"] == 16 and recorded["max_batch_tokens"] is None  # unset: null, not "None"
    # the score is the 16-d embeddings' (the lines above pass if the truncation is ignored: #43's bad case 1)
    short = json.loads((tmp_path / "mteb" / "STS16.json").read_text())
    assert short["embedding_dim"] == 16 and short["truncate_dim"] == 16
    run = CliRunner().invoke(app, [*cli, "--output", str(tmp_path / "mteb-full")])
    assert run.exit_code == 0, run.output
    full = json.loads((tmp_path / "mteb-full" / "STS16.json").read_text())
    assert full["embedding_dim"] == 64 and full["main_score"] != short["main_score"]


@pytest.fixture(scope="module")
def small_sts(shared_dir, tmp_path_factory):
    """The first 60 pairs of STS16 with its card: an evaluation in a second."""
    import gzip

    import yaml

    root = tmp_path_factory.mktemp("sts")
    src, dst = shared_dir / "data" / "mteb" / "STS16", root / "STS16"
    dst.mkdir()
    with gzip.open(src / "test.jsonl.gz", "rt") as f:
        rows = [next(f) for _ in range(60)]
    with gzip.open(dst / "test.jsonl.gz", "wt") as f:
        f.writelines(rows)
    card = yaml.safe_load((src / "card.yaml").read_text())
    card["splits"] = {"test": len(rows)}
    (dst / "card.yaml").write_text(yaml.safe_dump(card))
    return root


def test_cde_two_stage_gradcache_with_matryoshka_equals_full_backprop(tiny_official):
    """CDE's two-stage loss at nested dimensions: the chunked GradCache step gives full backpropagation's loss and
    gradients (the Matryoshka sum is computed once, on the cached embeddings)."""
    from neoembed.cde.gradcache import full_backprop_step, two_stage_gradcache_step
    from neoembed.cde.loss import cde_loss
    from neoembed.cde.model import ContextualSentenceTransformer

    torch.manual_seed(0)
    model = ContextualSentenceTransformer.from_backbone(str(tiny_official), n_context=4, n_soft_prompt=2)
    m = model.cde
    m.train()
    tok = lambda t: dict(m.tokenizer(t, padding=True, return_tensors="pt"))  # noqa: E731
    ctx = tok(BATCH["positive"][:4])
    queries, docs = tok(BATCH["query"][:3]), tok(BATCH["positive"][:3] + BATCH["negative"][:3])
    mrl = MatryoshkaConfig(dims=[64, 32, 8], weights=[1.0, 0.5, 0.25])

    def loss_fn(q, d):
        return mrl.loss(cde_loss, q, d, 0.5)

    results = []
    for step in (
        lambda: full_backprop_step(m, ctx, queries, docs, loss_fn),
        lambda: two_stage_gradcache_step(m, ctx, queries, docs, loss_fn, 2),
    ):
        m.zero_grad()
        loss = step()
        results.append(
            (float(loss), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        )
    _assert_same(results[1], results[0])


# ---------------------------------------------------------------------------------------------- distillation
TEACHER = torch.tensor(  # a teacher's scores of each query's positive, then its hard negative
    [[7.5, 1.0], [9.0, 6.5], [4.0, 4.5], [8.0, -2.0], [5.5, 3.0]]
)


def _run_labels(model, loss, labels, columns=("query", "positive", "negative")):
    model.zero_grad()
    value = loss(_features(model, columns), labels)
    value.backward()
    return value.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("cached", [False, True])
def test_margin_mse_equals_sentence_transformers(minilm, cached):
    from sentence_transformers.sentence_transformer.losses import MarginMSELoss
    from sentence_transformers.util import pairwise_cos_sim

    reference = _run_labels(minilm, MarginMSELoss(minilm, similarity_fct=pairwise_cos_sim), TEACHER)
    options = dict(distillation={"loss": "margin_mse", "infonce_weight": 0.0})
    ours = (
        CachedInfoNCELoss(minilm, mini_batch_size=2, **options) if cached else InfoNCELoss(minilm, **options)
    )
    _assert_same(_run_labels(minilm, ours, TEACHER), reference)


@pytest.mark.parametrize("cached", [False, True])
def test_kl_distillation_equals_sentence_transformers(minilm, cached):
    from sentence_transformers.sentence_transformer.losses import DistillKLDivLoss
    from sentence_transformers.util import pairwise_cos_sim

    st = DistillKLDivLoss(minilm, pairwise_cos_sim, student_temperature=0.5, teacher_temperature=2.0)
    reference = _run_labels(minilm, st, TEACHER)
    config = {"loss": "kl", "infonce_weight": 0.0, "student_temperature": 0.5, "teacher_temperature": 2.0}
    ours = (
        CachedInfoNCELoss(minilm, mini_batch_size=2, distillation=config)
        if cached
        else InfoNCELoss(minilm, distillation=config)
    )
    _assert_same(_run_labels(minilm, ours, TEACHER), reference)


def test_distillation_added_to_infonce_with_matryoshka_cached_equals_plain(tiny):
    options, mrl = dict(distillation={"loss": "kl", "weight": 0.5}), {"dims": [64, 16]}
    plain = _run_labels(tiny, with_matryoshka(tiny, InfoNCELoss(tiny, **options), mrl), TEACHER)
    cached = with_matryoshka(tiny, CachedInfoNCELoss(tiny, mini_batch_size=2, **options), mrl)
    _assert_same(_run_labels(tiny, cached, TEACHER), plain)
    with torch.no_grad():  # the sum of its two parts
        infonce = float(InfoNCELoss(tiny)(_features(tiny, ("query", "positive", "negative")), TEACHER))
    assert plain[0] != pytest.approx(infonce)


def test_rows_without_teacher_scores_are_a_clear_error(tiny):
    loss = InfoNCELoss(tiny, distillation={"loss": "margin_mse"})
    with pytest.raises(
        ValueError, match=r"teacher scores .* expected labels of shape \(5, 2\), got \(5,\).*neoembed score"
    ):
        loss(_features(tiny, ("query", "positive", "negative")), torch.zeros(5))
    with pytest.raises(ValueError, match=r"unknown distillation loss 'mse'; valid: \['kl', 'margin_mse'\]"):
        InfoNCELoss(tiny, distillation={"loss": "mse"})


@pytest.fixture(scope="module")
def mined(shared_dir, tiny_official, tmp_path_factory):
    """80 MSRP pairs with 2 hard negatives each, mined with the tiny fixture."""
    import gzip
    import json

    import yaml

    from neoembed.mine.miner import MineConfig, mine_negatives

    tmp_path = tmp_path_factory.mktemp("mined")
    with gzip.open(shared_dir / "data/train/msrp_pairs/train.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(80), f, strict=False)]
    src = tmp_path / "src"
    src.mkdir()
    (src / "pairs.jsonl").write_text(
        "".join(json.dumps({k: r[k] for k in ("query", "positive")}) + "\n" for r in rows)
    )
    card = {"name": "msrp80", "source": {"local": {"path": "pairs.jsonl", "format": "json"}}}
    card |= {"columns": {"query": "query", "positive": "positive"}, "license": "MSRP licence (research use)"}
    (src / "msrp80.yaml").write_text(yaml.safe_dump(card))
    config = MineConfig(num_negatives=2, range_max=12, shard_size=64, batch_size=32, max_length=64)
    result = mine_negatives(
        src / "msrp80.yaml", tiny_official, tmp_path / "mined", config=config, progress=False
    )
    return result


def test_mined_card_carries_the_scores_that_chose_its_negatives_and_trains_distilled(
    mined, tiny_official, tmp_path
):
    """``neoembed mine`` writes each row's scores (positive, then each negative: the bi-encoder's cosine here),
    the card declares them, ``neoembed data check`` reads them, a distillation recipe trains on them, and a row
    with a wrong score list fails the check naming the row."""
    import json
    import shutil
    from pathlib import Path

    from typer.testing import CliRunner

    from neoembed.cli import app
    from neoembed.data.cards import load_card
    from neoembed.recipe import load_recipe
    from neoembed.train.recipe import UnifiedRecipe
    from neoembed.train.trainer import train

    result = mined
    assert load_card(result.card)[0].columns.scores == "scores"
    written = [json.loads(line) for line in result.data.read_text().splitlines()]
    model = neoembed.load(tiny_official, max_seq_length=64)
    r = written[0]
    q, p, n1 = model.encode([r["query"], r["positive"], r["negative_1"]], normalize_embeddings=True)
    assert r["scores"][0] == pytest.approx(float(q @ p), abs=2e-4)
    assert r["scores"][1] == pytest.approx(float(q @ n1), abs=2e-4)
    assert all(len(w["scores"]) == 3 and w["scores"][1] >= w["scores"][2] for w in written)
    assert CliRunner().invoke(app, ["data", "check", str(result.card)]).exit_code == 0

    recipe = load_recipe(
        Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml",
        UnifiedRecipe,
        [
            f"model={tiny_official}",
            f"output_dir={tmp_path / 'run'}",
            f"datasets=[{{card: {result.card}, batch_size: 8}}]",
        ]
        + ["steps=2", "save_steps=100", "distillation.loss=margin_mse", "distillation.weight=0.5"],
    )
    out = train(recipe)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    card = (out / "README.md").read_text()  # what was optimised (#43, R16: the card said InfoNCE alone)
    assert "InfoNCE (cosine similarity, temperature 0.07) weighted 1.0, plus margin_mse distillation" in card
    assert "weight 0.5" in card and "batch size 8," in card

    broken = tmp_path / "broken"
    shutil.copytree(result.card.parent, broken, ignore=shutil.ignore_patterns(".*"))
    written[3]["scores"] = written[3]["scores"][:2]
    (broken / result.data.name).write_text("".join(json.dumps(w) + "\n" for w in written))
    check = CliRunner().invoke(app, ["data", "check", str(broken / result.card.name)])
    line = f"{broken / result.data.name}, line 4 has"  # the row's file line (its index is 3)
    assert check.exit_code != 0 and line in check.output and "neoembed score" in check.output, check.output


@pytest.fixture(scope="module")
def cross_encoder(tiny_official, tmp_path_factory):
    """A small cross-encoder built from the fixture: its backbone, CLS pooling, a seeded score head."""
    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Dense, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(0)
    backbone = Transformer(str(tiny_official), max_seq_length=64)
    head = Dense(64, 1, activation_function=None, module_output_name="scores")
    path = tmp_path_factory.mktemp("ce") / "ce"
    CrossEncoder(modules=[backbone, Pooling(64, "cls"), head], device="cpu").save(str(path))
    return path


def test_score_adds_cross_encoder_scores_and_resumes_after_an_interruption(
    mined, cross_encoder, tmp_path, monkeypatch
):
    import json

    from sentence_transformers import CrossEncoder

    import neoembed.mine.score as score_module
    from neoembed.data.cards import load_card
    from neoembed.mine.score import ScoreConfig, score_card

    config = ScoreConfig(shard_size=16, max_length=64)
    whole = score_card(mined.card, str(cross_encoder), tmp_path / "whole", config=config, progress=False)
    assert whole.kind == "cross-encoder" and whole.rows == len(mined.data.read_text().splitlines())
    assert (
        load_card(whole.card)[0].columns.scores == "scores" and not (tmp_path / "whole" / ".score").exists()
    )
    rows = [json.loads(line) for line in whole.data.read_text().splitlines()]
    ce = CrossEncoder(str(cross_encoder), max_length=64)
    for row in rows[:3]:
        expected = ce.predict([(row["query"], row[c]) for c in ("positive", "negative_1", "negative_2")])
        assert row["scores"] == pytest.approx(expected.tolist(), abs=2e-4)

    real, calls = score_module._score_shard, []

    def interrupted(*args):  # the third shard's scoring is killed
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(score_module, "_score_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        score_card(mined.card, str(cross_encoder), tmp_path / "resumed", config=config, progress=False)
    assert len(list((tmp_path / "resumed" / ".score").glob("scores-*.npy"))) == 2
    monkeypatch.setattr(score_module, "_score_shard", real)
    with pytest.raises(Exception, match="resume"):
        score_card(mined.card, str(cross_encoder), tmp_path / "resumed", config=config, progress=False)
    resumed = score_card(
        mined.card, str(cross_encoder), tmp_path / "resumed", config=config, resume=True, progress=False
    )
    assert resumed.data.read_bytes() == whole.data.read_bytes()


def test_score_with_a_bi_encoder_teacher_and_bad_input(mined, minilm_path, tmp_path):
    import json
    import subprocess
    import sys

    from neoembed.mine.score import ScoreConfig, score_card

    result = score_card(
        mined.card, str(minilm_path), tmp_path / "bi", ScoreConfig(max_rows=8), progress=False
    )
    assert result.kind == "bi-encoder"
    row = json.loads(result.data.read_text().splitlines()[0])
    teacher = neoembed.load(minilm_path)
    q, p = teacher.encode([row["query"], row["positive"]], normalize_embeddings=True)
    assert row["scores"][0] == pytest.approx(float(q @ p), abs=2e-4)
    cli = [sys.executable, "-m", "neoembed", "score", str(mined.card), "--teacher", str(minilm_path)]
    bad = subprocess.run(
        [*cli, "--out", str(tmp_path / "x"), "--kind", "llm"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "kind" in bad.stderr, bad.stderr[-1500:]


def test_case6_score_teacher_of_the_wrong_kind_refused(
    mined, minilm_path, cross_encoder, tiny_official, tmp_path
):
    """--kind cross-encoder with a bi-encoder scored every pair with a random head (0.507 each) and exited 0: a
    folder whose kind is not the one asked for is refused before it loads, naming the folder and what it is."""
    from neoembed.mine.score import ScoreConfig, score_card

    wrong = [
        (minilm_path, "cross-encoder", "is a bi-encoder, a sentence-transformers SentenceTransformer folder"),
        (tiny_official, "cross-encoder", "is a bi-encoder, an encoder checkpoint without a score head"),
        (cross_encoder, "bi-encoder", "is a cross-encoder, a sentence-transformers CrossEncoder folder"),
    ]
    for i, (teacher, kind, why) in enumerate(wrong):
        out = tmp_path / f"out{i}"
        with pytest.raises(ValueError, match="--teacher") as refused:
            score_card(mined.card, str(teacher), out, ScoreConfig(kind=kind), progress=False)
        assert f"{teacher} {why}" in str(refused.value) and f"not a {kind}" in str(refused.value)
        assert not out.exists()  # refused before anything was written or loaded
    # the right kind, named or found, still scores
    config = ScoreConfig(kind="cross-encoder", max_rows=4)
    scored = score_card(mined.card, str(cross_encoder), tmp_path / "ok", config, progress=False)
    assert scored.kind == "cross-encoder"


DDP_OBJECTIVES = """
import os, sys, torch, torch.distributed as dist
from accelerate import Accelerator
import neoembed
from neoembed.losses import CachedInfoNCELoss, InfoNCELoss, with_matryoshka
acc = Accelerator(cpu=True)
model = neoembed.load(sys.argv[1])
for m in model.modules():
    if isinstance(m, torch.nn.Dropout):
        m.p = 0.0
q = ["what is neobert", "capital of france", "how do cats purr", "why is the sky blue"]
p = ["an encoder model", "paris", "vibrating vocal folds", "rayleigh scattering"]
n = ["a decoder model", "lyon", "dogs bark loudly", "a red sunset"]
teacher = torch.tensor([[0.9, 0.2], [0.8, 0.6], [0.7, 0.1], [0.95, 0.3]])
world, rank = acc.num_processes, acc.process_index
sl = slice(rank * 4 // world, (rank + 1) * 4 // world)
g = {"gather_across_devices": world > 1}
fn = {"false_negatives": {"margin": 0.3}}
kd = {"distillation": {"loss": "margin_mse", "weight": 0.5}}
mrl = {"dims": [64, 16]}
losses = {
    "matryoshka_false_negatives": with_matryoshka(model, InfoNCELoss(model, **g, **fn), mrl),
    "improved_contrastive": with_matryoshka(model, InfoNCELoss(model, **g, **fn, improved_contrastive=True), mrl),
    "cached_matryoshka_false_negatives": with_matryoshka(
        model, CachedInfoNCELoss(model, mini_batch_size=1, **g, **fn), mrl
    ),
    "distillation_kl": InfoNCELoss(model, **g, distillation={"loss": "kl"}),
    "cached_distillation_matryoshka": with_matryoshka(
        model, CachedInfoNCELoss(model, mini_batch_size=1, **g, **kd), mrl
    ),
}
out = {"world": world}
for name, loss in losses.items():
    model.zero_grad()
    value = loss([model.tokenize(c[sl]) for c in (q, p, n)], teacher[sl])
    value.backward()
    grad = model[0].auto_model.encoder.weight.grad.clone()
    v = value.detach().clone()
    if world > 1:
        dist.all_reduce(grad)
        dist.all_reduce(v)
        grad, v = grad / world, v / world
    out[name] = (float(v), grad)
if rank == 0:
    torch.save(out, sys.argv[2])
acc.wait_for_everyone()
acc.end_training()
sys.stdout.flush(), sys.stderr.flush()
os._exit(0)  # results saved: skip interpreter teardown, where gloo's threads can abort (torch #190489)
"""


def test_two_processes_with_gathered_negatives_equal_one_for_every_objective(tmp_path, tiny_official):
    """Matryoshka, false-negative masking (its mask judged on the gathered candidates), the improved contrastive
    loss and distillation, plain and cached: two gloo processes that gather negatives give one process's loss and
    gradient on the whole batch (each process's loss is the mean over its rows, so their mean is the batch's)."""
    import subprocess

    from test_train import _LAUNCH_KW, _launch

    script = tmp_path / "ddp_objectives.py"
    script.write_text(DDP_OBJECTIVES)
    results = {}
    for world in (1, 2):
        target = tmp_path / f"{world}.pt"
        run = subprocess.run([*_launch(world), str(script), str(tiny_official), str(target)], **_LAUNCH_KW)
        assert run.returncode == 0, run.stderr[-3000:]
        results[world] = torch.load(target)
    one, two = results[1], results[2]
    assert (one.pop("world"), two.pop("world")) == (1, 2)  # really two processes
    assert one.keys() == two.keys() and len(one) == 5
    for name in one:
        assert two[name][0] == pytest.approx(one[name][0], rel=1e-5), name
        torch.testing.assert_close(two[name][1], one[name][1], rtol=1e-4, atol=1e-6, msg=name)


def test_the_registries_hold_one_entry_per_objective():
    """A recipe names a loss (InfoNCE, plain or cached) and adds objectives as options, each one config class; a
    distillation loss is one function and one entry. Nothing else is registered, so a new objective stays one
    class (or function), one entry, one test."""
    from neoembed.losses import (
        DISTILLATION_LOSSES,
        LOSSES,
        DistillationConfig,
        check_loss_name,
        kl_distillation,
        loss_class,
        margin_mse,
    )
    from neoembed.train.recipe import UnifiedRecipe

    assert {name: loss_class(name) for name in LOSSES} == {"infonce": InfoNCELoss, "cached_infonce": CachedInfoNCELoss}
    assert {name: entry.options for name, entry in LOSSES.items()} == {"infonce": (), "cached_infonce": ("mini_batch_size", "mini_batch_num_tokens")}
    assert DISTILLATION_LOSSES == {"margin_mse": margin_mse, "kl": kl_distillation}
    fields = UnifiedRecipe.model_fields
    options = {"matryoshka": MatryoshkaConfig, "false_negatives": FalseNegativeConfig}
    options["distillation"] = DistillationConfig
    for name, config in options.items():
        assert config in getattr(fields[name].annotation, "__args__", (fields[name].annotation,)), name
    with pytest.raises(ValueError, match="valid: \\['cached_infonce', 'infonce'\\]"):
        check_loss_name("matryoshka")


def test_the_objective_recipes_of_the_training_docs_run_as_written(tmp_path, monkeypatch):
    """Every command of docs/training.md's objective block runs (two steps each, outputs under tmp_path): a
    Matryoshka model that records its dims, a false-negative run that logs what it masked, and a distillation run
    on the scores ``neoembed mine`` wrote."""
    import json
    import re
    import shlex
    from pathlib import Path

    from typer.testing import CliRunner

    from neoembed.cli import app
    from neoembed.sentence import matryoshka_dims

    repo = Path(__file__).resolve().parents[1]
    page = (repo / "docs" / "training.md").read_text(encoding="utf8")
    block = re.search(r"<!-- objective recipes:.*?-->\n```bash\n(.*?)```", page, flags=re.S).group(1)
    lines = [line.replace("runs/", f"{tmp_path}/") for line in block.strip().splitlines()]
    assert [shlex.split(line)[1] for line in lines] == ["train", "train", "mine", "train"]
    monkeypatch.chdir(repo)
    for line in lines:
        args = shlex.split(line)[1:]
        args += ["steps=2", "save_steps=100"] if args[0] == "train" else []
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, (line, result.output, result.exception)
    assert matryoshka_dims(tmp_path / "tiny-mrl") == [32, 16, 8]
    logged = [json.loads(r) for r in (tmp_path / "tiny-fn" / "metrics.jsonl").read_text().splitlines()]
    assert logged and all(0.2 < r["false_negative_fraction"] < 0.99 for r in logged), logged  # training.md
    kd = json.loads((tmp_path / "tiny-kd" / "run_record.json").read_text())
    assert kd["recipe"]["distillation"]["loss"] == "kl"


@pytest.mark.parametrize("margin,mode", [(5.0, "absolute"), (2.0, "absolute"), (1.0, "relative")])
def test_case2_false_negative_margin_that_masks_every_negative_refused(margin, mode):
    """#43 case 2: false_negatives.margin=5 masked every negative (loss 0 at every step, exit 0, the saved
    model equal to the base): refused by the recipe, before any model loads, naming the key and the fix."""
    from neoembed.recipe import RecipeError, load_recipe
    from neoembed.train.recipe import UnifiedRecipe

    overrides = [f"false_negatives.margin={margin}", f"false_negatives.mode={mode}"]
    with pytest.raises(RecipeError, match=r"false_negatives.margin=.* masks every negative.*below"):
        load_recipe("tiny", UnifiedRecipe, overrides)
    with pytest.raises(ValueError, match="nothing trains"):
        FalseNegativeConfig(margin=margin, mode=mode)
    FalseNegativeConfig(margin=0.1, mode=mode)  # the usual margins pass


def test_case2_training_warns_when_masking_drops_nearly_every_negative(tmp_path, caplog):
    """A margin below the refusal can still mask almost everything on a given model: the logged row's
    warning names the fraction it saw."""
    from types import SimpleNamespace

    from neoembed.train.engine import unified_step

    counts = {"false_negatives_masked": 60.0, "false_negative_fraction": 1.0}
    acc = SimpleNamespace(num_processes=1, device="cpu", skip_first_batches=lambda loader, n: loader)
    tally = SimpleNamespace(pop=lambda: counts)
    _, row_fn = unified_step(acc, None, [], SimpleNamespace(history=[]), [], {}, 3, tally)
    with caplog.at_level("WARNING", logger="neoembed.train.engine"):
        row = row_fn({"loss": 0.0, "steps": 1, "samples": 4}, 1.0, None, 0.0)
    assert row["false_negative_fraction"] == 1.0
    assert "dropped 100.0% of the scored negatives up to step 3" in caplog.text
    assert "false_negatives.margin" in caplog.text


@pytest.mark.parametrize(
    "override,match",
    [
        ("distillation.weight=0", "distillation.weight=0 adds nothing"),
        ("distillation.weight=inf", "finite number"),
        ("distillation.student_temperature=nan", "finite number"),
        ("false_negatives.margin=nan", "finite number"),
        ("matryoshka.weights=[1,0]", r"matryoshka.weights \[1.0, 0.0\] has a weight <= 0"),
    ],
)
def test_objective_settings_that_train_nothing_or_are_not_numbers_refused(override, match):
    """#43 deliver 3 and 5: a zero-weight objective trains nothing while the record says it ran; NaN and inf
    validated (distillation.weight=inf did). Refused by load_recipe, before any model loads, naming the key."""
    from neoembed.recipe import RecipeError, load_recipe
    from neoembed.train.recipe import UnifiedRecipe

    extra = ["matryoshka.dims=[64,16]"] if override.startswith("matryoshka") else []
    with pytest.raises(RecipeError, match=match):
        load_recipe("tiny", UnifiedRecipe, [*extra, override])
