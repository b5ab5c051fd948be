"""CDE: the contextual model, contextual batching, false-negative filtering, two-stage GradCache, the trainer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

import neoembed
from neoembed.cde.batching import (
    ContextualBatches,
    cluster_pairs,
    false_negative_mask,
    random_batches,
    reduce_dimensions,
    teacher_embeddings,
)
from neoembed.cde.gradcache import full_backprop_step, two_stage_gradcache_step
from neoembed.cde.loss import cde_loss
from neoembed.cde.model import ContextMissingError, ContextualSentenceTransformer
from neoembed.cde.recipe import CDERecipe
from neoembed.cde.trainer import train_cde
from neoembed.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
CDE_TINY = REPO / "recipes" / "cde-tiny.yaml"
DOCS = [
    "the cat sat on the mat",
    "paris is the capital of france",
    "volcanoes erupt molten lava",
    "bread rises because of yeast",
    "chess openings control the centre",
    "rain forms when vapour condenses",
]
PROMPTS = {"query": "search_query: ", "document": "search_document: "}


@pytest.fixture(scope="module")
def cde(tiny_official):
    torch.manual_seed(0)
    model = ContextualSentenceTransformer.from_backbone(
        str(tiny_official), n_context=4, n_soft_prompt=2, prompts=PROMPTS
    )
    with torch.no_grad():  # a non-trivial output head (it starts at zero)
        for p in model.cde.output_mlp.parameters():
            p.normal_(0, 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def context(cde):
    return cde.encode_context(DOCS[:4])


# ------------------------------------------------------------------------------------------------ the model
def test_context_is_a_set_and_matters(cde, context):
    q = cde.encode(
        ["what do cats do"], prompt_name="query", dataset_embeddings=context, convert_to_tensor=True
    )
    for perm in ([3, 2, 1, 0], [1, 3, 0, 2]):
        qp = cde.encode(
            ["what do cats do"], prompt_name="query", dataset_embeddings=context[perm], convert_to_tensor=True
        )
        assert (qp - q).abs().max() <= 1e-5
    changed = context.clone()
    changed[2] = torch.randn(context.shape[1], generator=torch.Generator().manual_seed(0))
    qc = cde.encode(
        ["what do cats do"], prompt_name="query", dataset_embeddings=changed, convert_to_tensor=True
    )
    assert (qc - q).abs().max() > 1e-3


def test_text_outputs_do_not_depend_on_where_the_text_starts(cde, context):
    m = cde.cde
    f = m.preprocess(["what do cats do", "a longer question about bread and yeast"])
    with torch.no_grad():
        c = m.resolve_context(context, "cpu", torch.float32)
        a = m.embed_texts(f["input_ids"], f["attention_mask"], c)
        b = m.embed_texts(f["input_ids"], f["attention_mask"], c, position_offset=37)
    assert (a - b).abs().max() <= 1e-5


def test_context_in_token_budget_batches_equals_count_batches_in_input_order(cde):
    """A corpus sample mixes titles with long documents: batches filled to a token budget (longest first) give the
    rows of count batches, in input order; a budget below the longest document is refused."""
    docs = [d * (1 + i % 3) for i, d in enumerate(DOCS)]  # three lengths, interleaved
    by_count = cde.encode_context(docs, batch_size=2)
    lengths = [len(cde.cde.tokenizer(PROMPTS["document"] + d)["input_ids"]) for d in docs]
    by_tokens = cde.encode_context(docs, max_batch_tokens=2 * max(lengths))
    torch.testing.assert_close(by_tokens, by_count, atol=1e-5, rtol=0)
    batches = cde.cde._context_batches(docs, PROMPTS["document"], 32, 2 * max(lengths))
    assert sorted(i for b in batches for i in b) == list(range(len(docs))) and len(batches) > 1
    with pytest.raises(ValueError, match="below the longest context document"):
        cde.encode_context(docs, max_batch_tokens=max(lengths) - 1)


def test_absolute_position_backbone_keeps_the_set_property(minilm_path):
    torch.manual_seed(0)
    model = ContextualSentenceTransformer.from_backbone(str(minilm_path), n_context=3).eval()
    e = model.encode_context(DOCS[:3])
    a = model.encode(["cats"], dataset_embeddings=e, convert_to_tensor=True)
    b = model.encode(["cats"], dataset_embeddings=e[[2, 0, 1]], convert_to_tensor=True)
    assert (a - b).abs().max() <= 1e-5


def test_too_few_context_vectors_raise_more_are_truncated(cde, context, caplog):
    with pytest.raises(ContextMissingError, match="exactly 4 context vectors, got 3"):
        cde.encode(["x"], dataset_embeddings=context[:3])
    with pytest.raises(ContextMissingError, match="needs a context"):
        cde.encode(["x"])
    more = torch.cat([context, torch.randn(2, context.shape[1])])
    a = cde.encode(["x"], dataset_embeddings=more, convert_to_tensor=True)
    b = cde.encode(["x"], dataset_embeddings=context, convert_to_tensor=True)
    assert torch.equal(a, b)


def test_a_context_with_nan_is_refused_naming_it(cde, context):
    """#43 walk, C10: a NaN context gave NaN embeddings and an error advising bf16 or fp32 against a float16
    overflow, on an fp32 model; the context is named instead, with its first bad row."""
    bad = context.clone()
    bad[2, 0] = float("nan")
    with pytest.raises(ContextMissingError, match=r"NaN or inf in 1 of the 4 context vectors .*first: row 2"):
        cde.encode(["x"], dataset_embeddings=bad)
    more = torch.cat([context, torch.full((2, context.shape[1]), float("inf"))])  # rows past those read
    cde.encode(["x"], dataset_embeddings=more)


def test_null_context_is_deterministic(cde):
    a = cde.encode(DOCS, prompt_name="document", dataset_embeddings="null")
    b = cde.encode(DOCS[::-1], prompt_name="document", dataset_embeddings="null")[::-1]
    assert np.abs(a - b).max() <= 1e-6
    assert np.isfinite(a).all()


def test_query_and_document_prompts_differ(cde, context):
    q = cde.encode(DOCS[:2], prompt_name="query", dataset_embeddings=context)
    d = cde.encode(DOCS[:2], prompt_name="document", dataset_embeddings=context)
    assert np.abs(q - d).max() > 1e-4


@pytest.fixture(scope="module")
def saved_cde(cde, context, tmp_path_factory):
    path = tmp_path_factory.mktemp("cde") / "model"
    cde.save(str(path))
    return path


def test_save_load_round_trip_is_identical(cde, context, saved_cde):
    assert (
        json.loads((saved_cde / "modules.json").read_text())[0]["type"]
        == "modeling_cde.ContextualDocumentEmbedder"
    )
    loaded = neoembed.load(saved_cde)
    assert isinstance(loaded, ContextualSentenceTransformer)
    assert loaded.prompts["query"] == PROMPTS["query"] and loaded.n_context == 4
    torch.testing.assert_close(loaded.encode_context(DOCS[:4]), context, rtol=0, atol=0)
    for e in (context, "null"):
        a = cde.encode(DOCS, prompt_name="query", dataset_embeddings=e)
        b = loaded.encode(DOCS, prompt_name="query", dataset_embeddings=e)
        assert np.abs(a - b).max() == 0


def test_load_refuses_what_a_cde_model_does_not_take_and_trusts_no_remote_code(saved_cde, context, tmp_path):
    """neoembed.load is honest for CDE folders: bi-encoder building options are refused by name (they were
    dropped), and a folder written with neoembed's importable module path (as an earlier version could) loads as
    installed code, never with trust_remote_code switched on for it."""
    for options in ({"pooling": "cls"}, {"normalize": True}, {"attn_implementation": "sdpa"}):
        with pytest.raises(ValueError, match=rf"is a CDE model, which does not take {next(iter(options))}"):
            neoembed.load(saved_cde, **options)
    with pytest.raises(ValueError, match="backend='onnx'"):
        neoembed.load(saved_cde, file_name="model.onnx")
    for switch in ({"bucketing": "no"}, {"cuda_graphs": "yes"}):  # "no" is truthy: it switched bucketing on
        with pytest.raises(TypeError, match=f"{next(iter(switch))} is True, False or None"):
            neoembed.load(saved_cde, **switch)
    old = tmp_path / "old-style"
    shutil.copytree(saved_cde, old)
    modules = json.loads((old / "modules.json").read_text())
    modules[0]["type"] = "neoembed.cde.modeling_cde.ContextualDocumentEmbedder"
    (old / "modules.json").write_text(json.dumps(modules))
    loaded = neoembed.load(old, max_seq_length=64)
    assert loaded.trust_remote_code is False and type(loaded.cde).__module__ == "neoembed.cde.modeling_cde"
    torch.testing.assert_close(loaded.encode_context(DOCS[:4]), context, rtol=0, atol=0)


def test_a_cde_folder_without_its_tokenizer_is_refused_naming_it(saved_cde, tmp_path):
    """Walk W: a CDE folder copied without tokenizer.json loaded (through load_cde, which skips the bi-encoder
    folder's checks) and encoded every word as [UNK], exit 0."""
    broken = shutil.copytree(saved_cde, tmp_path / "broken")
    for name in ("tokenizer.json", "vocab.txt"):
        (broken / name).unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError, match=r"broken has no tokenizer files \(one of tokenizer.json"):
        neoembed.load(broken)


def test_loads_with_trust_remote_code_where_neoembed_is_not_installed(
    cde, context, saved_cde, tmp_path, block_neoembed
):
    expected = cde.encode(DOCS, prompt_name="query", dataset_embeddings=context)
    null = cde.encode(DOCS, prompt_name="query", dataset_embeddings="null")
    out = tmp_path / "e.npz"
    code = block_neoembed + textwrap.dedent(f"""
        import numpy as np
        from sentence_transformers import SentenceTransformer
        m = SentenceTransformer({str(saved_cde)!r}, trust_remote_code=True)
        e = m[0].encode_context({DOCS[:4]!r}, prompt=m.prompts.get("document"))
        a = m.encode({DOCS!r}, prompt_name="query", dataset_embeddings=e)
        b = m.encode({DOCS!r}, prompt_name="query", dataset_embeddings="null")
        np.savez({str(out)!r}, a=a, b=b)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    z = np.load(out)
    assert np.abs(z["a"] - expected).max() <= 1e-6
    assert np.abs(z["b"] - null).max() <= 1e-6


def _env():
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


# --------------------------------------------------------------------------------------------- the loss
def test_false_negative_masking_by_hand():
    torch.manual_seed(1)
    tq = F.normalize(torch.randn(3, 8), dim=-1)
    td = F.normalize(torch.randn(6, 8), dim=-1)  # 3 positives, then one hard negative per query
    td[1] = td[0]  # query 0's positive duplicated as row 1's positive -> a false negative for query 0
    td[3] = td[0]  # ... and as query 0's own hard negative: never masked
    mask = false_negative_mask(tq, td, n_negatives=1)
    assert mask[0, 1] and not mask[0, 0] and not mask[0, 3]
    assert not mask[torch.arange(3), torch.arange(3)].any()
    # the loss equals the cross-entropy over the unmasked candidates, by hand
    q, d, tau = torch.randn(3, 5), torch.randn(6, 5), 0.05
    loss = cde_loss(q, d, tau, mask)
    expected = 0.0
    for i in range(3):
        keep = [j for j in range(6) if not mask[i, j]]
        s = torch.stack([F.cosine_similarity(q[i], d[j], dim=0) / tau for j in keep])
        expected += -(s[keep.index(i)] - torch.logsumexp(s, 0))
    torch.testing.assert_close(loss, expected / 3)


def test_threshold_filtering():
    tq = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    td = torch.tensor([[1.0, 0.0], [0.9, 0.1]])
    assert false_negative_mask(tq, td, threshold=0.5).tolist() == [[False, True], [False, False]]


# --------------------------------------------------------------------------------------- two-stage GradCache
def _grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("chunk", "dtype", "tau", "rtol", "atol"),
    [
        # float32 at the tolerances of the issue; tau 1 keeps gradients O(1), so atol 1e-6 is above rounding
        (1, torch.float32, 1.0, 1e-4, 1e-6),
        (2, torch.float32, 1.0, 1e-4, 1e-6),
        (6, torch.float32, 1.0, 1e-4, 1e-6),
        # float64 at a sharp temperature: equal to rounding, so the only difference is summation order
        (1, torch.float64, 0.05, 1e-9, 1e-11),
        (2, torch.float64, 0.05, 1e-9, 1e-11),
    ],
)
def test_two_stage_gradcache_equals_full_backprop(tiny_official, chunk, dtype, tau, rtol, atol):
    torch.manual_seed(0)
    model = ContextualSentenceTransformer.from_backbone(str(tiny_official), n_context=6, n_soft_prompt=2)
    m = model.cde.to(dtype)
    with torch.no_grad():
        for p in m.output_mlp.parameters():
            p.normal_(0, 0.05)
    m.train()  # the fixture has no dropout, so both runs compute the same function
    tok = lambda t: dict(m.tokenizer(t, padding=True, return_tensors="pt"))  # noqa: E731
    ctx = tok(DOCS)
    queries = tok(["what do cats do", "capital of france", "why does bread rise"])
    docs = tok([DOCS[0], DOCS[1], DOCS[3], DOCS[2], DOCS[4], DOCS[5]])  # positives, then a negative each
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[0, 4] = True

    def loss_fn(q, d):
        return cde_loss(q.to(dtype), d.to(dtype), tau, mask)

    dropped = torch.tensor([False, True, False, False, True, False])
    m.zero_grad()
    ref_loss = full_backprop_step(m, ctx, queries, docs, loss_fn, dropped)
    ref = _grads(m)
    m.zero_grad()
    loss = two_stage_gradcache_step(m, ctx, queries, docs, loss_fn, chunk, dropped)
    got = _grads(m)
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    assert set(got) == set(ref)
    assert any(n.startswith("first_stage.") for n in ref) and any(n.startswith("second_stage.") for n in ref)
    assert ref["null_context"].abs().sum() > 0  # the dropped slots reach the null context
    for name in ref:
        bad = (got[name] - ref[name]).abs() > atol + rtol * ref[name].abs()
        assert not bad.any(), (name, ref[name][bad][:3].tolist(), got[name][bad][:3].tolist())


# ------------------------------------------------------------------------------------- contextual batching
@pytest.fixture(scope="module")
def train_pairs(shared_dir, minilm_path):
    """Teacher embeddings of queries and positives of ../shared/data/train (a seeded sample of 200 pairs a source:
    its hard negatives are not read, so no row is dropped for lacking one)."""
    from sentence_transformers import SentenceTransformer

    from neoembed.data.cards import build_pairs, load_card, load_rows

    teacher = SentenceTransformer(str(minilm_path), device="cpu")
    out = []
    for name in ("msrp_pairs", "sts2012_pairs", "trecqa_pairs"):
        card, folder = load_card(REPO / "tests" / "data_cards" / f"{name}.yaml")
        pairs = build_pairs(card, load_rows(card, folder, 200), max_negatives=0, with_instruction=False)
        q = teacher_embeddings(teacher, pairs["query"])
        d = teacher_embeddings(teacher, pairs["positive"])
        out.append((q, d))
    return out


def test_contextual_batches_are_harder_than_random(train_pairs):
    bs = 16
    assignments, centroids, offsets, off = [], [], [], 0
    for q, d in train_pairs:
        a, c = cluster_pairs(reduce_dimensions(q, 128), reduce_dimensions(d, 128), bs, seed=0)
        assignments.append(a)
        centroids.append(c)
        offsets.append(off)
        off += len(q)
    all_q = np.concatenate([q for q, _ in train_pairs])
    all_d = np.concatenate([d for _, d in train_pairs])
    source = np.concatenate([np.full(len(q), i) for i, (q, _) in enumerate(train_pairs)])

    def hardness(batches):  # mean teacher cosine between a query and the *other* documents of its batch
        total, n = 0.0, 0
        for b in batches:
            s = all_q[b] @ all_d[b].T
            total += (s.sum() - np.trace(s)) / (len(b) * (len(b) - 1))
            n += 1
        return total / n

    for tour in (False, True):
        sampler = ContextualBatches(assignments, offsets, bs, seed=0, tour=tour, centroids=centroids)
        for epoch in (0, 1):
            batches = sampler.epoch(epoch)
            flat = [i for b in batches for i in b]
            assert len(flat) == len(set(flat))  # every index at most once per epoch
            assert all(len({source[i] for i in b}) == 1 for b in batches)  # single source
            assert all(len(b) == bs for b in batches)
            for world in (2, 4):  # ranks take disjoint slices that cover the global batch
                for b in batches[:5]:
                    parts = [ContextualBatches.rank_slice(b, r, world) for r in range(world)]
                    assert sorted(sum(parts, [])) == sorted(b)
        contextual = hardness(sampler.epoch(0))
        randoms = [hardness(random_batches([len(q) for q, _ in train_pairs], bs, seed=s)) for s in range(10)]
        assert contextual >= np.mean(randoms) + 0.05, (contextual, randoms)
        assert contextual > max(randoms)


def test_batch_order_changes_per_epoch_and_is_seeded():
    a = [np.repeat(np.arange(5), 8)]
    s = ContextualBatches(a, [0], 8, seed=3)
    assert s.epoch(0) == ContextualBatches(a, [0], 8, seed=3).epoch(0)
    assert s.epoch(0) != s.epoch(1)
    with pytest.raises(ValueError, match="fewer than the batch size"):
        ContextualBatches([np.zeros(4, dtype=int)], [0], 8)


def test_clustering_cache_written_by_two_runs_at_once_holds_one_of_them(tmp_path, monkeypatch):
    """Two runs that miss the same cache key together (a sweep sharing the default cache) each write their own
    file: the second finishing between the first's write and its rename neither breaks the first nor leaves a
    torn file; a later run reads the stored clustering without computing."""
    import neoembed.cde.batching as batching

    def result(seed):
        rng = np.random.default_rng(seed)
        return np.arange(4), rng.normal(size=(2, 3)), rng.normal(size=(4, 3)), rng.normal(size=(4, 3))

    savez, calls, other_process = np.savez, [], os.getpid() + 1

    def interleaved(file, **arrays):  # the other run stores its result while this one is between write and rename
        savez(file, **arrays)
        calls.append(file)
        if len(calls) == 1:
            with monkeypatch.context() as m:
                m.setattr(os, "getpid", lambda: other_process)
                batching.cached_clustering(tmp_path, "k", lambda: result(1))

    monkeypatch.setattr(batching.np, "savez", interleaved)
    first = batching.cached_clustering(tmp_path, "k", lambda: result(0))
    assert len(calls) == 2 and [p.name for p in tmp_path.iterdir()] == ["k.npz"]
    monkeypatch.undo()
    stored = batching.cached_clustering(tmp_path, "k", lambda: pytest.fail("computed again"))
    for a, b in zip(stored, first, strict=True):
        np.testing.assert_array_equal(a, b)


def test_teacher_pass_shows_one_progress_line_and_encodes_the_same_with_or_without_it(monkeypatch, capsys):
    """The teacher encodes in chunks of TEACHER_CHUNK texts with its own bars off (sentence-transformers' bars piled
    their redraws into a run's log); with progress, neoembed's line counts the texts (plain lines where stderr is
    not a terminal), and the embeddings are the same either way."""
    import neoembed.cde.batching as batching
    import neoembed.progress

    class Teacher:
        calls: list = []

        def encode(self, texts, batch_size, convert_to_numpy, show_progress_bar):
            self.calls.append((len(texts), show_progress_bar))
            return np.array([[len(t), 1.0, i % 3] for i, t in enumerate(texts)], dtype=np.float32)

    monkeypatch.setattr(batching, "TEACHER_CHUNK", 4)
    monkeypatch.setattr(neoembed.progress, "PLAIN_DELAY", 0.0)
    texts = [f"text {'x' * i}" for i in range(10)]
    quiet = teacher_embeddings(Teacher(), texts)
    assert capsys.readouterr().err == ""
    shown = teacher_embeddings(Teacher(), texts, progress=True)
    np.testing.assert_array_equal(shown, quiet)
    assert Teacher.calls == [(4, False), (4, False), (2, False)] * 2
    err = capsys.readouterr().err
    assert "teacher embeddings" in err and "10/10" in err and "\r" not in err, err


def test_teacher_pass_embeds_nothing_twice_and_nothing_when_no_step_is_left(tmp_path, monkeypatch):
    """The teacher's embeddings of the hard negatives (filtering) are cached beside the clustering, so a second
    run (a resume) embeds no text again; a run with no step left (a resume that only writes the final model)
    needs no teacher at all, cache or not."""
    from neoembed.cde import trainer

    lines = (CDE_TINY.parent / "tiny/rows/pydoc_names.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines[:16]]

    def sources():
        negatives = [[rows[(i + 1) % 16]["positive"], rows[(i + 2) % 16]["positive"]] for i in range(16)]
        return [trainer.Source("s", [r["query"] for r in rows], [r["positive"] for r in rows], negatives)]

    calls, embed = [], trainer.teacher_embeddings
    counted = lambda t, texts, **kw: calls.append(len(texts)) or embed(t, texts, **kw)  # noqa: E731
    monkeypatch.setattr(trainer, "teacher_embeddings", counted)
    recipe = load_recipe(CDE_TINY, CDERecipe, [f"clustering.cache_dir={tmp_path}", "clustering.niter=2"])
    first_sources = sources()
    first, _ = trainer._teacher_pass(recipe, first_sources, progress=False)
    assert calls == [16, 16, 32]
    again = sources()
    second, _ = trainer._teacher_pass(recipe, again, progress=False)
    assert calls == [16, 16, 32], "a second run embedded texts again"
    torch.testing.assert_close(again[0].teacher_n, first_sources[0].teacher_n, rtol=0, atol=0)
    assert second.epoch(0) == first.epoch(0)
    uncached = load_recipe(CDE_TINY, CDERecipe, ["clustering.cache_dir=null"])
    done, _ = trainer._teacher_pass(uncached, sources(), progress=False, steps_left=False)
    assert calls == [16, 16, 32] and done.steps_per_epoch() == first.steps_per_epoch() == 2



def test_a_teacher_retrained_in_place_is_not_read_from_the_cache(tmp_path, minilm_path, tiny_official, monkeypatch):
    """The cache was keyed by the teacher's name: a teacher folder whose weights changed (the same path) gave
    the old clustering and negatives' embeddings, without a word (walk Q's B1). Its weights count now, and a
    resume with another teacher's weights is refused (its batches would not be the run's)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from neoembed.cde import trainer

    teacher = shutil.copytree(minilm_path, tmp_path / "teacher")
    rows = [json.loads(x) for x in (CDE_TINY.parent / "tiny/rows/pydoc_names.jsonl").read_text().splitlines()[:16]]
    queries, documents = [r["query"] for r in rows], [r["positive"] for r in rows]
    source = lambda: [trainer.Source("s", queries, documents, [[]] * 16)]  # noqa: E731
    calls, embed = [], trainer.teacher_embeddings
    monkeypatch.setattr(trainer, "teacher_embeddings", lambda t, x, **kw: calls.append(len(x)) or embed(t, x, **kw))
    overrides = [f"clustering.cache_dir={tmp_path / 'cache'}", "clustering.niter=2", f"clustering.teacher={teacher}"]
    recipe = load_recipe(CDE_TINY, CDERecipe, overrides)
    before = trainer.teacher_identity(str(teacher))
    trainer._teacher_pass(recipe, source(), progress=False)
    trainer._teacher_pass(recipe, source(), progress=False)
    assert calls == [16, 16]  # the second from the cache
    weights = teacher / "model.safetensors"
    save_file({k: v * 1.01 for k, v in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    trainer._teacher_pass(recipe, source(), progress=False)
    assert calls == [16, 16, 16, 16]  # embedded again by the changed teacher
    assert trainer.teacher_identity(str(teacher))["weights"] != before["weights"]
    pooling = teacher / "1_Pooling" / "config.json"  # the same weights, pooled another way (walk R's BAD-3)
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "pooling_mode_mean_tokens": False,
                                   "pooling_mode_cls_token": True}))  # fmt: skip
    trainer._teacher_pass(recipe, source(), progress=False)
    assert calls == [16, 16, 16, 16, 16, 16]
    base = shutil.copytree(tiny_official, tmp_path / "base")
    run = _recipe(tmp_path / "run", base, "steps=2", "save_steps=2", *overrides)
    train_cde(run, recipe_dir=CDE_TINY.parent, progress=False)
    kept = weights.read_bytes()
    save_file({k: v * 1.01 for k, v in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    said = r"clustering.teacher_identity: .*\"weights\": \"\w+\", \"pipeline\": \"\w+\"} in the folder's run"
    more = run.model_copy(update={"steps": 4})
    with pytest.raises(Exception, match=said):
        train_cde(more, recipe_dir=CDE_TINY.parent, resume=True, progress=False)
    # the backbone's tokenizer edited in place: its tokenizer loads beside the checkpoint's weights (walk T, 33)
    weights.write_bytes(kept)
    tokenizer = base / "tokenizer_config.json"
    tokenizer.write_text(json.dumps({**json.loads(tokenizer.read_text()), "do_lower_case": False}))
    with pytest.raises(Exception, match=r"\n  - model_fingerprint: .*\"pipeline\": \"\w+\"} in the folder's run"):
        train_cde(more, recipe_dir=CDE_TINY.parent, resume=True, progress=False)


# --------------------------------------------------------------------------------------------- the trainer
def _recipe(tmp_path, tiny_official, *overrides):
    return load_recipe(CDE_TINY, CDERecipe, [f"model={tiny_official}", f"output_dir={tmp_path}", *overrides])


@pytest.fixture(scope="module")
def cached(tmp_path_factory) -> str:
    """An override that gives the module's runs one clustering cache (cde-tiny keeps none): the runs whose subject
    is not the teacher pass read the clustering the first of them stored
    (test_clustering_cache_written_by_two_runs_at_once_holds_one_of_them)."""
    return f"clustering.cache_dir={tmp_path_factory.mktemp('teacher-cache')}"


def _losses(out: Path):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]  # not the eval_ rows


def test_tiny_cde_recipe_trains_saves_reloads(tmp_path, tiny_official, fake_hub):
    out = tmp_path / "run"
    recipe = _recipe(
        out,
        tiny_official,
        "datasets=[{card: pydoc_names, max_rows: 32}]",
        "steps=24",
        "save_steps=1000",
        "optimizer.lr=2.0e-3",
    )
    train_cde(recipe, recipe_dir=CDE_TINY.parent, progress=False)
    losses = _losses(out)
    assert len(losses) == 24
    assert np.mean(losses[-8:]) < np.mean(losses[:8]), losses  # 4 batches per epoch: epochs 0-1 vs 4-5
    record = json.loads((out / "run_record.json").read_text())
    assert record["command"] == "train-cde" and record["base_model"] is None  # a local model: no hub id
    assert (out / "training_curves.png").stat().st_size > 1000
    card = (out / "README.md").read_text()
    assert "pydoc_names" in card and "PSF-2.0" in card
    model = neoembed.load(out)
    # its queries trained behind the card's instruction: the saved query prompt (as the unified trainer saves it;
    # it was the recipe's "" and mteb scored held-out queries without it)
    instruction = yaml.safe_load((CDE_TINY.parent / "tiny/cards/pydoc_names.yaml").read_text())["instruction"]
    assert model.prompts["query"] == f"{instruction} " and model.prompts["document"] == ""
    e = model.encode_context(DOCS + DOCS[:2])
    assert e.shape == (8, model.get_embedding_dimension())
    a = model.encode(DOCS, dataset_embeddings=e)
    b = model.encode(DOCS, dataset_embeddings="null")
    assert np.isfinite(a).all() and np.isfinite(b).all() and np.abs(a - b).max() > 1e-4
    # pushed to the hub with the trainer's card (data and licences), its code naming the hub id
    model.push_to_hub("someone/tiny-cde")
    card = (fake_hub / "someone" / "tiny-cde" / "README.md").read_text()
    assert "pydoc_names" in card and "PSF-2.0" in card and str(tiny_official) not in card
    assert "base_model:" not in card and "built on a local model that names no hub id" in card
    assert 'neoembed.load("someone/tiny-cde")' in card and "PATH" not in card
    pushed = neoembed.load(fake_hub / "someone" / "tiny-cde")
    assert np.abs(pushed.encode(DOCS, dataset_embeddings=e) - a).max() <= 1e-6


def test_cde_resume_equals_uninterrupted(tmp_path, tiny_official, cached, capsys):
    full = tmp_path / "full"
    train_cde(
        _recipe(full, tiny_official, "steps=6", "save_steps=3", cached), recipe_dir=CDE_TINY.parent, progress=False
    )
    part = tmp_path / "part"
    train_cde(
        _recipe(part, tiny_official, "steps=6", "save_steps=3", cached), recipe_dir=CDE_TINY.parent, progress=False
    )
    # drop everything after checkpoint-3 and resume from it
    import shutil

    for p in part.iterdir():
        if p.name not in ("checkpoint-3", "metrics.jsonl", "run_record.json"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    train_cde(
        _recipe(part, tiny_official, "steps=6", "save_steps=3", cached),
        recipe_dir=CDE_TINY.parent,
        resume=True,
        progress=False,
    )
    assert _losses(part) == pytest.approx(_losses(full), rel=1e-6)
    # the same seed gives identical losses
    assert _losses(full)[:3] == _losses(part)[:3]
    from neoembed.runs import RunFinished  # once finished, a resume has nothing left to run

    with pytest.raises(RunFinished, match="finished at step 6, nothing left to run"):
        train_cde(
            _recipe(part, tiny_official, "steps=6", "save_steps=3", cached),
            recipe_dir=CDE_TINY.parent,
            resume=True,
            progress=False,
        )
    # stopped at the last step before the final model was written: the resume only writes it, without a teacher
    for p in part.iterdir():
        if p.name not in ("checkpoint-6", "metrics.jsonl", "run_record.json"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    import neoembed.cde.trainer

    with pytest.MonkeyPatch.context() as m:
        m.setattr(neoembed.cde.trainer, "teacher_embeddings", lambda *a, **k: pytest.fail("teacher embedded"))
        train_cde(
            _recipe(part, tiny_official, "steps=6", "save_steps=3", "clustering.cache_dir=null"),
            recipe_dir=CDE_TINY.parent,
            resume=True,
            progress=False,
        )
    assert (part / "cde_head.safetensors").is_file() and _losses(part) == _losses(full)
    said = capsys.readouterr().out.splitlines()[-1]  # no batch was made: "(clustered)" said one was (#43)
    assert "no batches (no step is left to train: the final model is written)" in said and "clustered" not in said


def test_cli_train_dispatches_cde_and_rejects_bad_recipes(tmp_path, tiny_official, run_neoembed):
    r = run_neoembed(
        ["train", "cde-tiny", f"model={tiny_official}", f"output_dir={tmp_path / 'o'}", "steps=2",
         "context.n_context=0"],
        cwd=REPO, env=_env(),
    )  # fmt: skip
    assert r.exit_code == 2 and "n_context" in r.stderr
    r = run_neoembed(
        ["train", "cde-tiny", f"model={tiny_official}", f"output_dir={tmp_path / 'o'}", "steps=2",
         "batch_size=1000"],
        cwd=REPO, env=_env(),
    )  # fmt: skip
    assert r.exit_code == 2 and "larger than the dataset" in r.stderr


# ------------------------------------------------------------------------------------------- neoembed mteb
def test_mteb_runs_cde_models_with_a_seeded_context_per_task(saved_cde, shared_dir, tmp_path):
    import yaml

    from neoembed.eval.cde import sample_context_texts, task_context_texts
    from neoembed.eval.runner import EvalConfig, resolve_tasks, run_mteb

    data = tmp_path / "tasks"
    (data / "TrecQA").mkdir(parents=True)
    (data / "TrecQA" / "task.yaml").write_text(
        yaml.safe_dump(
            {"name": "TrecQA", "type": "Reranking", "data": str(shared_dir / "data" / "eval" / "TrecQA")}
        )
    )
    (data / "STS13").symlink_to(shared_dir / "data" / "mteb" / "STS13")
    cfg = EvalConfig(model=str(saved_cde), output=tmp_path / "a", data_dir=data, seed=3)
    # what the context is drawn from: corpus documents for reranking, the evaluation sentences for STS
    tasks = {t.metadata.name: t for t, _ in resolve_tasks(cfg)}
    trec = task_context_texts(tasks["TrecQA"])
    assert len(trec) > 1000 and "What do practitioners of Wicca worship ?" not in trec  # no queries
    sts = task_context_texts(tasks["STS13"])
    assert len(sts) > 1000
    assert sample_context_texts(trec, 4, 3) == sample_context_texts(trec, 4, 3)
    assert sorted(sample_context_texts(["a", "b"], 4, 0)) in (
        ["a", "a", "b", "b"],
        ["a", "b", "b", "b"],
        ["a", "a", "a", "b"],
    )

    first = run_mteb(cfg)
    assert not first.failed, first.failed
    assert (tmp_path / "a" / "cde_context" / "TrecQA.pt").is_file()
    again = run_mteb(EvalConfig(model=str(saved_cde), output=tmp_path / "b", data_dir=data, seed=3))
    other = run_mteb(EvalConfig(model=str(saved_cde), output=tmp_path / "c", data_dir=data, seed=4))
    null = run_mteb(
        EvalConfig(model=str(saved_cde), output=tmp_path / "d", data_dir=data, cde_context="null")
    )
    for task in ("TrecQA", "STS13"):
        score = first.scores[task]["main_score"]
        assert again.scores[task]["main_score"] == score  # the same seed gives the same scores
        assert first.scores[task]["cde_context"] == "corpus" and null.scores[task]["cde_context"] == "null"
        assert np.isfinite(null.scores[task]["main_score"])
    assert other.scores["STS13"]["main_score"] != first.scores["STS13"]["main_score"]  # the context matters
    # so a result is reused only under its seed: another seed into the same folder reported seed 3's scores
    assert first.scores["STS13"]["cde_seed"] == 3 and "cde_seed" not in null.scores["STS13"]
    from neoembed.runs import OutputDirError

    with pytest.raises(OutputDirError, match=r"cde_seed \(--seed"):
        run_mteb(EvalConfig(model=str(saved_cde), output=tmp_path / "a", data_dir=data, seed=4))


def _trecqa_rows(shared_dir: Path, folder: Path, n: int) -> Path:
    """``eval/TrecQA`` (a dataset-card reranking task) as ``folder``, its test split cut to its first ``n`` rows."""
    import gzip

    src = shared_dir / "data" / "eval" / "TrecQA"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "card.yaml", folder / "card.yaml")
    with gzip.open(src / "test.jsonl.gz", "rt", encoding="utf8") as f:
        rows = f.readlines()[:n]
    with gzip.open(folder / "test.jsonl.gz", "wt", encoding="utf8") as f:
        f.writelines(rows)
    return folder


def test_mteb_draws_a_cde_context_again_from_changed_local_data(saved_cde, shared_dir, tmp_path):
    """#43 walk, M3: a local task cut to fewer rows after a CDE run kept its cached context (keyed by seed, N and
    model: drawn from the 1339 texts of the old file) and its score. The cache's key holds the data's
    fingerprint: the rerun draws from the new texts and scores what a fresh folder scores."""
    from neoembed.eval.runner import EvalConfig, run_mteb

    data = tmp_path / "tasks"
    _trecqa_rows(shared_dir, data / "TrecQA", 6)

    def run(out):
        return run_mteb(EvalConfig(model=str(saved_cde), output=out, data_dir=data)).scores["TrecQA"]

    def texts(out):
        return torch.load(out / "cde_context" / "TrecQA.pt", weights_only=False)["n_texts"]

    first = run(tmp_path / "a")
    before = texts(tmp_path / "a")
    _trecqa_rows(shared_dir, data / "TrecQA", 3)
    again = run(tmp_path / "a")
    assert texts(tmp_path / "a") < before
    assert again["data_fingerprint"] != first["data_fingerprint"]
    assert again["main_score"] == run(tmp_path / "b")["main_score"]


def test_mteb_records_which_texts_a_cde_context_was_drawn_from(saved_cde, shared_dir, tmp_path):
    """#43 walk, M5: a CDE result said only its seed, and the cache held E without the texts it encoded. A result
    records the positions drawn among task_context_texts(task) and their count: those texts, encoded, are the
    context the task was scored with, from a fresh draw and from the cache alike; and they are the draw of
    sample_context_texts, which docs/cde.md shows."""
    from neoembed.eval.cde import sample_context_texts, task_context_texts
    from neoembed.eval.resolve import resolve_tasks
    from neoembed.eval.runner import EvalConfig, run_mteb

    data = tmp_path / "tasks"
    _trecqa_rows(shared_dir, data / "TrecQA", 6)
    cfg = EvalConfig(model=str(saved_cde), output=tmp_path / "a", data_dir=data, seed=3)
    entry = run_mteb(cfg).scores["TrecQA"]
    texts = task_context_texts(resolve_tasks(cfg)[0][0])
    indices = entry["cde_context_indices"]
    assert entry["cde_context_n_texts"] == len(texts) and len(indices) == 4  # the model's N
    drawn = [texts[i] for i in indices]
    assert drawn == sample_context_texts(texts, 4, 3)
    cached = torch.load(tmp_path / "a" / "cde_context" / "TrecQA.pt", weights_only=False)["context"]
    torch.testing.assert_close(neoembed.load(saved_cde).encode_context(drawn), cached)
    (tmp_path / "a" / "TrecQA.json").unlink()  # scored again from the cached context
    assert run_mteb(cfg).scores["TrecQA"]["cde_context_indices"] == indices


def test_mteb_null_context_of_a_model_trained_without_context_dropout_is_warned(
    saved_cde, shared_dir, tmp_path, caplog
):
    """#43 walk, M7: --cde-context null on a model trained with context.dropout 0 (cde-tiny's default) scored
    with a null vector that training never used, without a word. The run warns, naming the dropout; a model whose
    cde_config.json says context.dropout above 0 learned the vector and is scored without the warning."""
    from neoembed.eval.runner import EvalConfig, run_mteb

    data = tmp_path / "tasks"
    _trecqa_rows(shared_dir, data / "TrecQA", 3)
    trained = tmp_path / "trained"
    shutil.copytree(saved_cde, trained)
    config = json.loads((trained / "cde_config.json").read_text())
    (trained / "cde_config.json").write_text(json.dumps({**config, "context_dropout": 0.05}))
    said = "--cde-context null: {} was trained with context.dropout 0.0 (context_dropout in its cde_config.json)"
    for model, warned in ((saved_cde, True), (trained, False)):
        caplog.clear()
        cfg = EvalConfig(model=str(model), output=tmp_path / f"out-{model.name}", data_dir=data, cde_context="null")
        assert not run_mteb(cfg).failed
        assert (said.format(model) in caplog.text) == warned, caplog.text


def test_run_mteb_leaves_no_context_on_the_model(saved_cde, shared_dir, tmp_path):
    """The context is passed per call: after an evaluation, encode without a context still raises (it once
    silently used the last task's corpus), and the model encodes as it did before the evaluation."""
    from neoembed.eval.runner import EvalConfig, run_mteb

    model = neoembed.load(saved_cde)
    context = model.encode_context(DOCS[:4])
    before = model.encode(["a query"], dataset_embeddings=context)
    attributes = set(vars(model))
    cfg = EvalConfig(
        model=str(saved_cde), output=tmp_path, tasks=[str(shared_dir / "data" / "mteb" / "STS13")]
    )
    report = run_mteb(cfg, model=model)
    assert not report.failed and report.scores["STS13"]["cde_context"] == "corpus"
    with pytest.raises(ContextMissingError, match="needs a context"):
        model.encode(["a query"])
    assert set(vars(model)) == attributes
    np.testing.assert_array_equal(model.encode(["a query"], dataset_embeddings=context), before)


def test_shipped_cde_recipes_validate_and_name_shipped_cards():
    from neoembed.data.cards import find_card

    for name in ("cde.yaml", "cde-tiny.yaml"):
        recipe = load_recipe(REPO / "recipes" / name, CDERecipe, [])
        dirs = [REPO / "recipes" / d for d in recipe.card_dirs] + [REPO / "data_cards"]
        for entry in recipe.datasets:
            assert find_card(entry.card, dirs).is_file()
    paper = load_recipe(REPO / "recipes" / "cde.yaml", CDERecipe, [])
    assert (paper.batch_size, paper.context.n_context, paper.clustering.cluster_size, paper.max_length) == (
        512,
        512,
        512,
        512,
    )
    assert paper.precision == "bf16"


def _mteb_cli(model: Path, task: Path, out: Path, monkeypatch) -> float:
    """`neoembed mteb --model MODEL --tasks TASK` in this process: the task's main score."""
    from neoembed.cli import main

    argv = ["neoembed", "mteb", "--model", str(model), "--tasks", str(task), "--output", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code in (0, None)
    return json.loads((out / f"{task.name}.json").read_text())["main_score"]


def test_cde_evaluation_during_training_scores_what_neoembed_mteb_scores(
    tmp_path, tiny_official, shared_dir, monkeypatch, cached
):
    """eval: in a CDE recipe: the score logged at step N equals `neoembed mteb --model RUN/checkpoint-N` (a
    seeded corpus sample as the context), and at the last step `neoembed mteb` on the final model; evaluating
    changes no training loss (the evaluator puts every RNG stream back)."""
    from neoembed.eval.training import MtebEvaluator

    task = shared_dir / "data" / "mteb" / "STS16"
    common = ("steps=4", "save_steps=2", "datasets=[{card: pydoc_names, max_rows: 32}]", cached)
    train_cde(_recipe(tmp_path / "plain", tiny_official, *common), recipe_dir=CDE_TINY.parent, progress=False)
    recipe = _recipe(tmp_path / "run", tiny_official, *common, f"eval={{steps: 2, tasks: [{task}]}}")
    out = train_cde(
        recipe,
        recipe_dir=CDE_TINY.parent,
        progress=False,
        evaluator=MtebEvaluator(recipe.eval, CDE_TINY.parent),
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_main_score" in r]
    assert [r["step"] for r in evals] == [2, 4] and set(evals[0]) == {
        "step",
        "eval_main_score",
        "eval_STS16_main_score",
    }
    assert [r["loss"] for r in rows if "loss" in r] == _losses(tmp_path / "plain")
    at_2 = _mteb_cli(out / "checkpoint-2", task, tmp_path / "scores-2", monkeypatch)
    assert at_2 == pytest.approx(evals[0]["eval_main_score"], abs=1e-6)
    final = _mteb_cli(out, task, tmp_path / "scores", monkeypatch)
    assert final == pytest.approx(evals[-1]["eval_main_score"], abs=1e-6)
    assert at_2 != pytest.approx(final, abs=1e-6)  # two steps of training moved the score
    assert (out / "eval" / "step-4" / "STS16.json").is_file()


def test_lora_on_both_stages_merged_equals_unmerged_and_trains_from_a_recipe(tmp_path, tiny_official, cached):
    """adapter: in a CDE recipe: LoRA in both stages' encoders (the head trains fully); the merged model's
    embeddings equal the unmerged one's, and the run saves an ordinary (merged) CDE model."""
    import neoembed
    from neoembed.adapters import add_lora, count_parameters, merge_lora

    torch.manual_seed(0)
    model = ContextualSentenceTransformer.from_backbone(
        str(tiny_official), n_context=4, n_soft_prompt=2
    ).eval()
    add_lora(model, r=4, alpha=8, train_heads=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("first_stage" in n and "lora_" in n for n in trainable)
    assert any("second_stage" in n and "lora_" in n for n in trainable)
    assert not any(
        "stage" in n and "lora_" not in n for n in trainable
    )  # the encoders' own weights are frozen
    assert any("stage" not in n for n in trainable)  # the head trains
    assert count_parameters(model)[0] < count_parameters(model)[1] / 2
    with torch.no_grad():  # a non-trivial adapter (B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name or "output_mlp" in name:
                p.normal_(0, 0.05)
    context = model.encode_context(DOCS[:4])
    before = model.encode(DOCS, dataset_embeddings=context)
    merge_lora(model)
    assert not any("lora_" in n for n, _ in model.named_parameters())
    after = model.encode(DOCS, dataset_embeddings=model.encode_context(DOCS[:4]))
    assert np.abs(before - after).max() <= 1e-5
    out = train_cde(
        _recipe(tmp_path / "run", tiny_official, "steps=2", "save_steps=1", "adapter={r: 4, alpha: 8}", cached),
        recipe_dir=CDE_TINY.parent,
        progress=False,
    )
    trained = neoembed.load(out)
    assert not any("lora_" in n for n, _ in trained.named_parameters())
    alone = neoembed.load(out / "adapter")  # the adapters alone, on the base encoder: the same model
    sample = (DOCS * 2)[:8]  # N = 8 in the recipe
    context = trained.encode_context(sample)
    torch.testing.assert_close(alone.encode_context(sample), context, atol=1e-5, rtol=0)
    expected = trained.encode(DOCS, dataset_embeddings=context)
    assert np.abs(alone.encode(DOCS, dataset_embeddings=context) - expected).max() <= 1e-5
    # checkpoint-1 is a merged copy: the model being trained kept its adapter (only adapted layers moved below)
    assert not any("lora_" in n for n, _ in neoembed.load(out / "checkpoint-1").named_parameters())
    base = ContextualSentenceTransformer.from_backbone(str(tiny_official), n_context=8)
    moved = [
        n
        for (n, p), (_, q) in zip(
            trained.cde.first_stage.named_parameters(), base.cde.first_stage.named_parameters(), strict=True
        )
        if not torch.equal(p.cpu(), q.cpu())
    ]
    assert moved and all(
        any(k in n for k in ("qkv", "wo", "w12", "w3")) for n in moved
    )  # only adapted layers


def test_cde_keep_best_survives_an_interruption_and_becomes_the_final_model(
    tmp_path, tiny_official, shared_dir, monkeypatch, sigterm_at, cached
):
    """keep_best in a CDE recipe: the best evaluated checkpoint stays through save_total_limit 1, a SIGTERM at
    step 4 and --resume keep it (trainer_state.json), and its model is the final one; best.json, the run record
    and the model card state its step and score. (mode min: the tiny run's STS16 score rises, 0.435 / 0.438 /
    0.442 at steps 2 / 4 / 6, so the best is step 2 and the final model must come from its checkpoint.)"""
    from neoembed.cde import trainer as cde_trainer
    from neoembed.eval.training import MtebEvaluator
    from neoembed.runs import TrainingInterrupted

    task = shared_dir / "data" / "mteb" / "STS16"
    settings = (
        "steps=6", "save_steps=2", "save_total_limit=1", "datasets=[{card: pydoc_names, max_rows: 32}]",
        f"eval={{steps: 2, tasks: [{task}]}}", "keep_best={metric: main_score, mode: min}", cached,
    )  # fmt: skip

    def run(out: Path, resume: bool = False) -> Path:
        recipe = _recipe(out, tiny_official, *settings)
        evaluator = MtebEvaluator(recipe.eval, CDE_TINY.parent)
        return train_cde(
            recipe, recipe_dir=CDE_TINY.parent, resume=resume, progress=False, evaluator=evaluator
        )

    full = run(tmp_path / "full")
    evals = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "eval_main_score" in r]
    top = min(evals, key=lambda r: r["eval_main_score"])  # the first of equals, as the loop keeps it
    best = json.loads((full / "best.json").read_text())
    assert (best["step"], best["value"], best["last_step"]) == (top["step"], top["eval_main_score"], 6)
    assert json.loads((full / "run_record.json").read_text())["keep_best"] == best
    assert f"step {best['step']} of 6" in (full / "README.md").read_text()
    assert best["step"] < 6 and (full / f"checkpoint-{best['step']}").is_dir()  # out of the rotation
    reference = neoembed.load(full / f"checkpoint-{best['step']}")
    sigterm_at(cde_trainer, "_cde_step", 4)
    with pytest.raises(TrainingInterrupted):
        run(tmp_path / "part")
    monkeypatch.undo()
    part = run(tmp_path / "part", resume=True)
    assert json.loads((part / "best.json").read_text()) == best
    assert _losses(part) == _losses(full)
    e = neoembed.load(part).encode_context(DOCS + DOCS[:2])
    assert np.abs(e - neoembed.load(full).encode_context(DOCS + DOCS[:2])).max() <= 1e-6
    assert np.abs(e - reference.encode_context(DOCS + DOCS[:2])).max() <= 1e-6  # the best step's model


def test_cde_eval_settings_are_checked_before_anything_loads(tmp_path, tiny_official):
    with pytest.raises(ValueError, match="add an eval: block"):
        _recipe(tmp_path, tiny_official, "keep_best={metric: main_score}")
    with pytest.raises(ValueError, match="eval.steps 2 must be a multiple of save_steps 3"):
        _recipe(
            tmp_path, tiny_official, "save_steps=3", "eval={steps: 2, tasks: [x]}", "keep_best={metric: m}"
        )
    with pytest.raises(ValueError, match="eval.steps"):
        _recipe(tmp_path, tiny_official, "eval={steps: 0, tasks: [x]}")


def test_a_cluster_size_above_a_sources_pairs_is_said_to_make_one_cluster(tmp_path, monkeypatch, caplog):
    """#43 walk, C4: clustering.cluster_size=100000 over 176 pairs made one cluster per source (k = ceil(n /
    size)) and the log still said "(clustered)": contextual batches were random ones without a word."""
    import sentence_transformers

    import neoembed.cde.trainer as trainer

    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", lambda *a, **k: None)
    rng = np.random.default_rng(0)
    monkeypatch.setattr(trainer, "teacher_embeddings", lambda t, texts, progress: rng.normal(size=(len(texts), 8)))
    sources = [trainer.Source("tiny", [f"q{i}" for i in range(12)], [f"d{i}" for i in range(12)], [[]] * 12)]
    for size, warned in ((100000, True), (4, False)):
        caplog.clear()
        overrides = [f"output_dir={tmp_path}", f"clustering.cluster_size={size}", "clustering.dims=8"]
        trainer._teacher_pass(load_recipe("cde-tiny", CDERecipe, overrides), sources, progress=False)
        said = "card tiny: 12 pairs and clustering.cluster_size 100000 make one cluster" in caplog.text
        assert said == warned, caplog.text


def test_clusters_smaller_than_a_batch_are_said_to_mix_or_to_make_random_batches(tmp_path, monkeypatch, caplog):
    """#43 walk, C3: clustering.cluster_size=1 made every pair its own cluster, concatenated in random order, and
    the summary still said "22 contextual batches of 8 per epoch (clustered)": random batches without a word.
    Clusters below the batch size are said to mix in each batch (to make random batches at 1), in the warning
    and the summary; the default (the batch size), larger ones and a tour are left as they were."""
    import sentence_transformers

    import neoembed.cde.trainer as trainer

    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", lambda *a, **k: None)
    rng = np.random.default_rng(0)
    monkeypatch.setattr(trainer, "teacher_embeddings", lambda t, texts, progress: rng.normal(size=(len(texts), 8)))
    sources = [trainer.Source("tiny", [f"q{i}" for i in range(12)], [f"d{i}" for i in range(12)], [[]] * 12)]
    cases = {  # overrides -> (the warning's words, the summary's), cde-tiny's batch size being 8
        "clustering.cluster_size=1": ("every pair is a cluster of its own", "random: clusters of 1 pair"),
        "clustering.cluster_size=3": ("pieces of 3 or more clusters in random order", "clustered in clusters of 3"),
        "clustering.cluster_size=8": (None, "clustered"),
        "clustering.cluster_size=10": (None, "clustered"),
        "clustering.tour=true": (None, "clustered"),
        "clustering.cluster_size=1 clustering.tour=true": (None, "clustered"),
        "clustering.enabled=false": (None, "random"),
    }
    for overrides, (warned, summary) in cases.items():
        caplog.clear()
        recipe = load_recipe(
            "cde-tiny", CDERecipe, [f"output_dir={tmp_path}", "clustering.dims=8", *overrides.split()]
        )
        trainer._teacher_pass(recipe, sources, progress=False)
        said = [r.getMessage() for r in caplog.records if "is below batch_size 8" in r.getMessage()]
        assert len(said) == (warned is not None) and all(warned in m for m in said), (overrides, said)
        assert trainer._batching(recipe).startswith(summary), overrides
