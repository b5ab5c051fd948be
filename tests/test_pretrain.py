"""Pre-training: masking, schedule, packing == one by one, shards (real tokenizer, resumable), the fast MLM
objective and pseudo-perplexity against their slow twins, exact resume, NaN stop, SIGTERM, two processes."""

from __future__ import annotations

import gzip
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from neoembed.modeling import NeoBERTConfig, NeoBERTForMaskedLM
from neoembed.pretrain.data import ShardedCorpus, build_subset, preprocess
from neoembed.pretrain.masking import IGNORE_INDEX, mask_tokens, step_generator
from neoembed.pretrain.packing import DocumentStream, collate_packed, collate_padded
from neoembed.pretrain.ppl import pseudo_nll, pseudo_nll_reference, pseudo_perplexity, write_ppl
from neoembed.pretrain.recipe import PretrainRecipe
from neoembed.pretrain.schedule import lr_at, lr_lambda
from neoembed.pretrain.trainer import MLMObjective, TrainingStopped, choose_source, pretrain
from neoembed.recipe import RecipeError, load_recipe
from neoembed.runs import OutputDirError, TrainingInterrupted

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO / "tests" / "shared"  # the copy of ../shared (tests/shared/README.md)
TOKENIZER = SHARED / "fixtures" / "neobert-tiny-official"
MSRP = SHARED / "data" / "train" / "msrp_pairs" / "train.jsonl.gz"


def _tiny_model(vocab=100, padding_free=True, seed=0):
    torch.manual_seed(seed)
    cfg = NeoBERTConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_length=256,
        padding_free=padding_free,
    )
    return NeoBERTForMaskedLM(cfg).eval()


class _ListCorpus:
    def __init__(self, docs):
        self.docs = [np.asarray(d, dtype=np.int64) for d in docs]

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return self.docs[i]


# ---------------------------------------------------------------------------------------------- masking
def test_masking_rate_specials_and_labels():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (400, 500), generator=g)
    ids[:, 0], ids[:, -1], ids[:, -50:-1] = 101, 102, 0  # [CLS], [SEP], padding
    special = [0, 100, 101, 102, 103]
    corrupted, labels = mask_tokens(ids, special, 103, 1000, rate=0.2, generator=step_generator(0, 0))
    chosen = labels != IGNORE_INDEX
    eligible = ~torch.isin(ids, torch.tensor(special))
    rate = chosen.sum().item() / eligible.sum().item()
    assert abs(rate - 0.2) < 0.005  # ~180k eligible tokens: sd 0.001
    assert not chosen[~eligible].any()  # special and padding tokens never masked
    assert torch.equal(labels[chosen], ids[chosen]) and (labels[~chosen] == IGNORE_INDEX).all()
    assert (corrupted[chosen] == 103).all() and torch.equal(corrupted[~chosen], ids[~chosen])  # 100% [MASK]
    again, _ = mask_tokens(ids, special, 103, 1000, rate=0.2, generator=step_generator(0, 0))
    assert torch.equal(again, corrupted)  # seeded by (seed, step) alone

    bert, blabels = mask_tokens(
        ids, special, 103, 1000, rate=0.15, scheme="bert", generator=step_generator(1, 0)
    )
    chosen = blabels != IGNORE_INDEX
    n = chosen.sum().item()
    assert abs(n / eligible.sum().item() - 0.15) < 0.005
    as_mask = (bert[chosen] == 103).sum().item() / n
    kept = (bert[chosen] == ids[chosen]).sum().item() / n
    assert abs(as_mask - 0.8) < 0.01 and abs(kept - 0.1 - 0.1 / 1000) < 0.01
    with pytest.raises(ValueError, match="valid: 'mask'"):
        mask_tokens(ids, special, 103, 1000, scheme="roberta")


# --------------------------------------------------------------------------------------------- schedule
def test_schedule_values_equal_the_formula():
    p, W, T = 6e-4, 2000, 1_000_000
    assert lr_at(0, p, W, T) == 0.0
    assert lr_at(1000, p, W, T) == pytest.approx(p / 2)
    assert lr_at(W, p, W, T) == pytest.approx(p)
    mid = W + (900_000 - W) // 2
    assert lr_at(mid, p, W, T) == pytest.approx(p * (0.1 + 0.9 * 0.5), rel=1e-6)
    t = 300_000
    expected = p * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - W) / (0.9 * T - W))))
    assert lr_at(t, p, W, T) == pytest.approx(expected, rel=1e-12)
    assert lr_at(900_000, p, W, T) == pytest.approx(0.1 * p) and lr_at(999_999, p, W, T) == pytest.approx(
        0.1 * p
    )
    # through torch's LambdaLR, as the trainer uses it
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=p)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, 100))
    seen = []
    for _ in range(100):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(t, p, 10, 100) for t in range(100)], rel=1e-12)
    with pytest.raises(ValueError, match="decay must end after the warm-up"):
        lr_lambda(2000, 2000)


# ---------------------------------------------------------------------------------------------- packing
def test_packed_batch_equals_documents_one_by_one():
    rng = np.random.default_rng(0)
    docs = [rng.integers(5, 100, n) for n in (7, 30, 3, 12, 19, 9, 25)]
    stream = DocumentStream(_ListCorpus(docs), seed=1)
    sequences = [stream.packed_sequence(24) for _ in range(3)]
    assert all(sum(len(f) for f in seq) == 24 for seq in sequences)
    batch = collate_packed(sequences)
    assert batch.cu_seq_lens_q.dtype == torch.int32 and int(batch.cu_seq_lens_q[-1]) == 72
    model = _tiny_model()
    with torch.no_grad():
        packed = model(**batch.model_inputs()).logits[0]
        fragments = [f for seq in sequences for f in seq]
        alone = torch.cat([model(input_ids=torch.from_numpy(f)[None]).logits[0] for f in fragments])
        torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-4)
        # the flawed variant (attention across documents, positions 0..L-1) differs
        crossed = model(**collate_packed(sequences, cross_document=True).model_inputs()).logits[0]
        assert (crossed - alone).abs().max() > 1e-3
        # padding mode (padding_free off) gives the same per-document logits too
        padded_model = _tiny_model(padding_free=False)
        pb = collate_padded(fragments, pad_token_id=0)
        out = padded_model(**pb.model_inputs()).logits
        got = torch.cat([out[i, : len(f)] for i, f in enumerate(fragments)])
        torch.testing.assert_close(got, alone, atol=2e-5, rtol=1e-4)


def test_stream_state_resumes_at_the_same_token_across_epochs():
    docs = [np.arange(n) + 10 * n for n in (5, 9, 4, 11)]
    a = DocumentStream(_ListCorpus(docs), seed=3)
    for _ in range(5):
        a.packed_sequence(7)
    state = a.state_dict()
    expected = [np.concatenate(a.packed_sequence(7)) for _ in range(8)]  # crosses epochs
    assert a.epoch >= 2
    b = DocumentStream(_ListCorpus(docs), seed=3)
    b.load_state_dict(state)
    got = [np.concatenate(b.packed_sequence(7)) for _ in range(8)]
    assert all(np.array_equal(x, y) for x, y in zip(expected, got, strict=True))
    # every epoch visits every token once
    c = DocumentStream(_ListCorpus(docs), seed=3)
    total = sum(len(d) for d in docs)
    tokens = np.concatenate([np.concatenate(c.packed_sequence(total))])
    assert sorted(tokens.tolist()) == sorted(np.concatenate(docs).tolist())


def test_source_mixture_follows_the_probabilities():
    p = np.array([0.2, 0.4, 0.4])
    counts = np.bincount([choose_source(0, s, p) for s in range(6000)], minlength=3) / 6000
    assert np.abs(counts - p).max() < 0.03
    assert [choose_source(5, s, p) for s in range(50)] == [choose_source(5, s, p) for s in range(50)]


# ------------------------------------------------------------------------------------ fast twin: MLM loss
def test_mlm_objective_equals_the_full_head_loss():
    model = _tiny_model()
    ids = torch.randint(5, 100, (3, 20), generator=torch.Generator().manual_seed(0))
    corrupted, labels = mask_tokens(ids, [0, 1, 2, 3], 4, 100, rate=0.3, generator=step_generator(0, 1))
    full = model(input_ids=corrupted, labels=labels).loss
    full_grads = torch.autograd.grad(full, list(model.parameters()))
    loss_sum, n, correct = MLMObjective(model)(labels, input_ids=corrupted)
    assert int(n) == int((labels != IGNORE_INDEX).sum())
    torch.testing.assert_close(loss_sum / n, full, atol=1e-6, rtol=1e-6)
    grads = torch.autograd.grad(loss_sum / n, list(model.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    logits = model(input_ids=corrupted).logits
    chosen = labels != IGNORE_INDEX
    assert int(correct) == int((logits[chosen].argmax(-1) == labels[chosen]).sum())


# ---------------------------------------------------------------------------------------- data / shards
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER))


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("shards") / "msrp"
    preprocess(str(MSRP), out, tokenizer, column="positive", shard_tokens=20_000, progress=False)
    return out


def test_preprocess_real_text_stats_subsets_and_resume(tmp_path, tokenizer, shards):
    texts = [json.loads(line)["positive"] for line in gzip.open(MSRP, "rt")]
    corpus = ShardedCorpus(shards)
    assert len(corpus) == len(texts) and len(list(shards.glob("shard-*.tokens.npy"))) >= 3
    for i in (0, 1234, len(texts) - 1):
        assert corpus[i].tolist() == tokenizer(texts[i])["input_ids"]  # [CLS] ... [SEP]
    stats = json.loads((shards / "stats.json").read_text())
    assert stats["documents"] == len(texts) and stats["tokens"] == int(corpus.lengths.sum())

    # interrupted after the second shard, then resumed: the same shards as one uninterrupted run
    calls = {"n": 0}

    class Flaky:
        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __len__(self):
            return len(self.tok)

        def __call__(self, *a, **k):
            calls["n"] += 1
            if calls["n"] == 4:
                raise KeyboardInterrupt
            return self.tok(*a, **k)

    out = tmp_path / "resumed"
    kwargs = {"column": "positive", "shard_tokens": 20_000, "progress": False, "min_lengths": (32, 40)}
    with pytest.raises(KeyboardInterrupt):
        preprocess(str(MSRP), out, Flaky(tokenizer), batch_size=256, **kwargs)
    done = json.loads((out / "progress.json").read_text())
    assert 0 < done["docs"] < len(texts)
    preprocess(str(MSRP), out, tokenizer, batch_size=256, **kwargs)
    resumed = ShardedCorpus(out)
    assert len(resumed) == len(corpus)
    assert all(np.array_equal(resumed[i], corpus[i]) for i in range(0, len(corpus), 97))
    sub = ShardedCorpus(out / "subsets" / "gt32")
    assert len(sub) == int((corpus.lengths > 32).sum()) and (sub.lengths > 32).all()
    with pytest.raises(
        ValueError, match="other inputs or another tokenizer .shard_tokens: 20000 there, 999 now"
    ):
        preprocess(str(MSRP), out, tokenizer, column="positive", shard_tokens=999, progress=False)


def test_the_packaged_tokenizer_loads_as_the_packaged_model_does(tmp_path):
    """tokenizer=packaged:all-MiniLM-L6-v2 (pre-training, preprocess --tokenizer) went to the hub as a repo id; the
    shards' meta.json records it by that name, not by its install path (a folder begun when it recorded the path
    continues)."""
    from neoembed.hub import resolve_packaged
    from neoembed.pretrain.data import load_tokenizer

    tokenizer = load_tokenizer("packaged:all-MiniLM-L6-v2")
    assert tokenizer("a b")["input_ids"][0] == 101  # BERT's [CLS]
    (tmp_path / "docs.txt").write_text("rivers run to the sea\nthe sea is salt\n")
    stats = preprocess(str(tmp_path / "docs.txt"), tmp_path / "shards", tokenizer, progress=False)
    meta = json.loads((tmp_path / "shards" / "meta.json").read_text())
    assert meta["tokenizer"] == "packaged:all-MiniLM-L6-v2", meta
    meta["tokenizer"] = resolve_packaged("packaged:all-MiniLM-L6-v2")
    (tmp_path / "shards" / "meta.json").write_text(json.dumps(meta))
    assert preprocess(str(tmp_path / "docs.txt"), tmp_path / "shards", tokenizer, progress=False) == stats


def test_preprocess_of_a_hub_corpus_offline_says_so_at_once(tmp_path, tokenizer, monkeypatch):
    """Offline, preprocess of a hub corpus card (refinedweb) left the dataset client to retry for ~28 s before
    saying the hub was unreachable; one probe says it first, and nothing is written."""
    import datasets

    import neoembed.data.check

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("the hub was asked"))
    monkeypatch.setattr(neoembed.data.check, "hub_unreachable_reason", lambda: "ConnectError from the endpoint")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(OSError, match="'tiiuae/falcon-refinedweb': the Hugging Face hub cannot be reached .Conn"):
        preprocess("refinedweb", tmp_path / "rw", tokenizer, max_docs=5, progress=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="cannot be reached .HF_HUB_OFFLINE is set"):
        preprocess("refinedweb", tmp_path / "rw", tokenizer, max_docs=5, progress=False)
    assert not (tmp_path / "rw").exists() or not any((tmp_path / "rw").glob("shard-*"))


def test_corpus_files_written_with_a_byte_order_mark_read_as_without_one(tmp_path):
    """A UTF-8 byte-order mark (Windows editors write one) is not text: it was refused in JSON lines ("Unexpected
    UTF-8 BOM") and kept as the first character of a .txt document."""
    from neoembed.pretrain.data import iter_documents

    texts = [json.loads(line)["positive"].strip() for line in gzip.open(MSRP, "rt")][:5]
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    writes = {
        "a.txt": lambda p, enc: p.write_text(texts[0], encoding=enc),
        "b.jsonl": lambda p, enc: p.write_text(lines, encoding=enc),
        "c.json": lambda p, enc: p.write_text(json.dumps([{"text": t} for t in texts]), encoding=enc),
        "d.jsonl.gz": lambda p, enc: p.write_bytes(gzip.compress(lines.encode(enc))),
    }
    read = {}
    for enc in ("utf-8", "utf-8-sig"):
        folder = tmp_path / enc
        folder.mkdir()
        for name, write in writes.items():
            write(folder / name, enc)
        read[enc] = list(iter_documents(str(folder)))
    assert read["utf-8-sig"] == read["utf-8"] == [texts[0], *texts, *texts, *texts]


def test_a_corpus_row_without_the_column_is_named_by_its_line(tmp_path):
    """It was a KeyError (printed in quotes) naming a 0-based row that skipped blank lines: "row 2" for line 4."""
    from neoembed.pretrain.data import iter_documents

    (tmp_path / "b.jsonl").write_text('{"text": "a"}\n\n{"text": "b"}\n{"content": "x"}\n')
    with pytest.raises(ValueError, match=r"b\.jsonl, line 4, has no column 'text' \(columns: \['content'\]\)"):
        list(iter_documents(str(tmp_path)))


def test_hidden_files_and_folders_of_a_corpus_folder_are_skipped(tmp_path):
    """#43 walk, P16: rglob read f/.ipynb_checkpoints/a-checkpoint.txt (a notebook's copy) as a document too. A
    folder that is itself hidden is read: only what lies under the corpus folder is looked at."""
    from neoembed.pretrain.data import iter_documents

    corpus = tmp_path / ".data" / "f"
    (corpus / ".ipynb_checkpoints").mkdir(parents=True)
    (corpus / "a.txt").write_text("the document")
    (corpus / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("the document, saved earlier")
    (corpus / ".notes.md").write_text("an editor's file")
    assert list(iter_documents(str(corpus))) == ["the document"]
    (corpus / "a.txt").unlink()
    with pytest.raises(FileNotFoundError, match="no corpus files under .*names start with '.', are skipped"):
        list(iter_documents(str(corpus)))


def test_a_corpus_folder_says_once_which_files_it_does_not_read(tmp_path, caplog):
    """A parquet part beside JSON-lines parts was left out without a word: the folder's documents shrank."""
    from neoembed.pretrain.data import _source_fingerprint, iter_documents

    (tmp_path / "part-0.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "part-1.parquet").write_bytes(b"PAR1")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.csv").write_text("text\nb\n")
    with caplog.at_level("WARNING", logger="neoembed.pretrain.data"):
        _source_fingerprint(str(tmp_path))
        assert list(iter_documents(str(tmp_path))) == ["a"]
    said = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert len(said) == 1 and "2 file(s) of other types are not read: part-1.parquet, sub/notes.csv" in said[0]


def test_a_corpus_whose_files_changed_is_other_inputs_and_a_finished_folder_says_so(tmp_path, tokenizer, caplog):
    """A rerun of preprocess on a corpus folder that gained a file returned the old shards without a word (the
    fingerprint was the source string), and the same folder named by its absolute path was refused: a resume
    would skip documents of a corpus that changed under it."""
    texts = [json.loads(line)["positive"] for line in gzip.open(MSRP, "rt")][:40]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:20]))
    out = tmp_path / "shards"
    kwargs = {"shard_tokens": 1_000, "progress": False}
    first = preprocess(str(corpus), out, tokenizer, **kwargs)
    with caplog.at_level("INFO", logger="neoembed.pretrain.data"):
        again = preprocess(str(corpus.resolve()), out, tokenizer, **kwargs)  # the same folder, spelled otherwise
    assert again == first and "already holds the finished shards of these inputs" in caplog.text
    (corpus / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[20:]))
    with pytest.raises(ValueError, match=r"other inputs .*files: .*\(a corpus whose files changed"):
        preprocess(str(corpus), out, tokenizer, **kwargs)
    assert preprocess(str(corpus), tmp_path / "fresh", tokenizer, **kwargs)["documents"] == 40


# ----------------------------------------------------------------------------------------- training loop
def _recipe(out: Path, shards: Path, *overrides) -> PretrainRecipe:
    return load_recipe(
        REPO / "recipes" / "pretrain-tiny.yaml",
        PretrainRecipe,
        [f"tokenizer={TOKENIZER}", f"data.sources=[{{path: {shards}}}]", f"output_dir={out}", *overrides],
    )


def _rows(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_resume_equals_uninterrupted_and_final_model(tmp_path, shards):
    full = pretrain(_recipe(tmp_path / "full", shards, "steps=6", "save_steps=3"), progress=False)
    again = pretrain(_recipe(tmp_path / "again", shards, "steps=6", "save_steps=3"), progress=False)
    losses = [r["loss"] for r in _rows(full)]
    assert losses == [r["loss"] for r in _rows(again)]  # same seed, identical CPU losses
    assert losses[0] == pytest.approx(math.log(30522), abs=0.1)  # from ln |V|
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-3", resumed / "checkpoint-3")
    (resumed / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in _rows(full)[:5])
    )  # stale rows
    pretrain(_recipe(resumed, shards, "steps=6", "save_steps=3"), resume=True, progress=False)
    rows = _rows(resumed)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == losses  # identical, not merely close
    assert {"masked_accuracy", "learning_rate", "grad_norm", "tokens_per_s"} <= set(rows[0])
    assert (full / "training_curves.png").stat().st_size > 1000
    record = json.loads((full / "run_record.json").read_text())
    assert record["seed"] == 0 and record["global_batch_tokens"] == 256
    # the final model: neoembed layout, reloads, converts to the official layout
    a = NeoBERTForMaskedLM.from_pretrained(str(full))
    b = NeoBERTForMaskedLM.from_pretrained(str(resumed))
    for (k, v), (_, w) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(v, w), k
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "neoembed",
            "convert",
            str(full),
            str(tmp_path / "official"),
            "--to",
            "official",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "model.NeoBERT" in (tmp_path / "official" / "config.json").read_text()
    with pytest.raises(OutputDirError, match="--resume"):
        pretrain(_recipe(tmp_path / "full", shards, "steps=6", "save_steps=3"), progress=False)
    from neoembed.runs import RunFinished  # the run loop keeps no checkpoint at the last step: still finished

    with pytest.raises(RunFinished, match="finished at step 6, nothing left to run"):
        pretrain(_recipe(tmp_path / "full", shards, "steps=6", "save_steps=3"), resume=True, progress=False)


def test_a_resume_on_other_edited_or_unfinished_shards_is_refused(tmp_path, shards):
    """#43, a walk's T22-T24: --resume continued silently on a shard folder replaced by another corpus or with a
    token edited in place (and rewrote the record's data fingerprint); a folder whose preprocess was interrupted
    trained on the documents it had so far. A copy of the same shards elsewhere is the same data, and a resume
    on it continues (it was refused as a changed data.sources path: walk Q)."""
    own = shutil.copytree(shards, tmp_path / "shards")
    pretrain(_recipe(tmp_path / "run", own, "steps=4", "save_steps=2"), progress=False)
    # the same folder spelled another way is the same source (a resume of it is no other run)
    pretrain(_recipe(tmp_path / "run", f"{own}/../shards/", "steps=5", "save_steps=2"), resume=True, progress=False)
    copy = shutil.copytree(own, tmp_path / "copy")
    assert ShardedCorpus(copy).content_key() == ShardedCorpus(own).content_key()
    # moved: the same shards in another folder continue the run (the path is not compared, the content is)
    pretrain(_recipe(tmp_path / "run", copy, "steps=6", "save_steps=2"), resume=True, progress=False)
    tokens = np.load(own / "shard-00000.tokens.npy", mmap_mode="r+")
    tokens[100] = 7 if tokens[100] != 7 else 8
    tokens.flush()
    del tokens
    with pytest.raises(OutputDirError, match=r"holds a different run.*\n  - data\.sources\.0\.shards: "):
        pretrain(_recipe(tmp_path / "run", own, "steps=6", "save_steps=2"), resume=True, progress=False)
    meta = json.loads((own / "meta.json").read_text())
    (own / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    with pytest.raises(ValueError, match="is unfinished: its preprocess stopped before the end"):
        pretrain(_recipe(tmp_path / "new", own), progress=False)
    assert not (tmp_path / "new").exists()


def test_continuing_a_checkpoint_with_another_tokenizer_is_refused(tmp_path):
    """#43, a walk's T31: init_from a checkpoint trained with a 30,522-token WordPiece, with the tiny recipes'
    1,500-token one as the recipe's tokenizer, trained on (every id meaning another token) and saved the model
    beside the wrong tokenizer. The checkpoint's own tokenizer is compared with the recipe's."""
    tiny = REPO / "recipes" / "tiny"
    recipe = load_recipe(REPO / "recipes" / "pretrain-tiny.yaml", PretrainRecipe, [
        f"tokenizer={tiny / 'model'}", f"data.sources=[{{path: {tiny / 'shards'}}}]", f"model.init_from={TOKENIZER}",
        "model.config={}", f"output_dir={tmp_path / 'run'}"])  # fmt: skip
    with pytest.raises(ValueError, match=r"init_from .* was trained with its own tokenizer \(30522 tokens\)"):
        pretrain(recipe, progress=False)
    assert not (tmp_path / "run").exists()


def test_a_resumed_runs_first_row_averages_its_whole_logging_window(tmp_path, shards):
    """A checkpoint inside a logging window (save at 3, rows every 2 steps): the resumed run's row at step 4
    averaged step 4 alone where the uninterrupted run's averages steps 3 and 4; the window's sums now travel in
    the checkpoint, so the rows are the uninterrupted run's."""
    settings = ("steps=4", "save_steps=3", "logging_steps=2")
    full = pretrain(_recipe(tmp_path / "full", shards, *settings), progress=False)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-3", resumed / "checkpoint-3")
    (resumed / "metrics.jsonl").write_text(json.dumps(_rows(full)[0]) + "\n")
    pretrain(_recipe(resumed, shards, *settings), resume=True, progress=False)
    keys = ("step", "loss", "masked_accuracy")
    assert [[r[k] for k in keys] for r in _rows(resumed)] == [[r[k] for k in keys] for r in _rows(full)]


def test_padded_mode_and_mixture_train(tmp_path, shards):
    out = pretrain(
        _recipe(
            tmp_path / "padded",
            shards,
            "steps=2",
            "schedule.warmup_steps=0",
            "data.packing=padded",
            "save_steps=100",
        ),
        progress=False,
    )
    rows = _rows(out)
    assert len(rows) == 2 and all(r["tokens"] < 4 * 64 for r in rows)  # real tokens only
    sources = f"[{{path: {shards}, weight: 0.2}}, {{path: {shards / 'subsets' / 'gt32'}, weight: 0.8}}]"
    build_subset(shards, 32)
    out = pretrain(
        _recipe(tmp_path / "mix", shards, "steps=3", f"data.sources={sources}", "save_steps=100"),
        progress=False,
    )
    assert all(r["source"] for r in _rows(out))


def test_nan_loss_stops_with_a_message(tmp_path, shards):
    recipe = _recipe(
        tmp_path / "nan",
        shards,
        "steps=20",
        "optimizer.lr=1.0e+30",
        "optimizer.grad_clip=1.0e+30",
        "save_steps=100",
    )
    with pytest.raises(TrainingStopped, match="loss is nan at step .* before the update"):
        pretrain(recipe, progress=False)
    assert not (tmp_path / "nan" / "model.safetensors").exists()


def test_bad_recipes_name_the_fix(tmp_path, shards):
    with pytest.raises(RecipeError, match="unknown key 'masking.ratee'"):
        _recipe(tmp_path, shards, "masking.ratee=0.1")
    with pytest.raises(RecipeError, match="must exceed schedule.warmup_steps"):
        _recipe(tmp_path, shards, "steps=2")
    # #43 walk, C17: a rate that masks no token logged loss 0 at every step and said "done"
    with pytest.raises(RecipeError, match="masked tokens expected per step: most steps would mask none"):
        _recipe(tmp_path, shards, "masking.rate=0.0001")
    _recipe(tmp_path, shards, "masking.rate=0.01")  # a few tokens a step: trains
    with pytest.raises(ValueError, match="exceeds the model's maximum"):
        pretrain(_recipe(tmp_path / "x", shards, "data.seq_length=512"), progress=False)
    with pytest.raises(FileNotFoundError, match="neoembed preprocess"):
        pretrain(_recipe(tmp_path / "y", tmp_path / "nowhere"), progress=False)


def _cli(*args):
    return [sys.executable, "-m", "neoembed", *args]


def test_sigterm_checkpoints_then_resume_finishes(tmp_path, shards):
    out = tmp_path / "sig"
    args = [
        "pretrain",
        "pretrain-tiny",
        f"tokenizer={TOKENIZER}",
        f"data.sources=[{{path: {shards}}}]",
        f"output_dir={out}",
        "steps=100000",
        "save_steps=100000",
    ]
    proc = subprocess.Popen(_cli(*args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]  # checkpointed, but not finished: a scheduler must know
    ckpts = list(out.glob("checkpoint-*"))
    assert len(ckpts) == 1 and not (out / "model.safetensors").exists(), err[-2000:]
    stopped_at = int(ckpts[0].name.split("-")[1])
    r = subprocess.run(
        _cli(*args[:-2], f"steps={stopped_at + 2}", "save_steps=100000", "--resume"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert [row["step"] for row in _rows(out)][-3:] == [stopped_at, stopped_at + 1, stopped_at + 2]
    assert (out / "model.safetensors").is_file()


def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path, shards):
    from test_train import _LAUNCH_KW, _launch

    one = pretrain(_recipe(tmp_path / "one", shards, "steps=4", "save_steps=100"), progress=False)
    r = subprocess.run(
        [
            *_launch(2),
            "-m",
            "neoembed",
            "pretrain",
            "pretrain-tiny",
            f"tokenizer={TOKENIZER}",
            f"data.sources=[{{path: {shards}}}]",
            f"output_dir={tmp_path / 'two'}",
            "steps=4",
            "save_steps=100",
            "batch.micro_batch_size=2",
        ],
        cwd=REPO,
        **_LAUNCH_KW,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        "4 sequences x 64 tokens = 256 tokens packed per step (micro-batch 2 x accumulation 1 x 2 processes)"
        in r.stdout
    )
    a, b = _rows(one), _rows(tmp_path / "two")
    assert [x["loss"] for x in b] == pytest.approx([x["loss"] for x in a], rel=1e-5)
    assert [x["masked_accuracy"] for x in b] == pytest.approx([x["masked_accuracy"] for x in a], abs=1e-9)


# ------------------------------------------------------------------------------------ pseudo-perplexity
def test_pseudo_perplexity_equals_the_slow_reference(tmp_path):
    model = _tiny_model()
    ids = torch.randint(5, 100, (20,), generator=torch.Generator().manual_seed(3))
    ids[0], ids[-1] = 1, 2
    fast, n = pseudo_nll(model, ids, [0, 1, 2, 3, 4], 4, batch_size=7)  # 3 forwards of up to 7 copies
    slow, m = pseudo_nll_reference(model, ids, [0, 1, 2, 3, 4], 4)
    assert n == m == 18
    assert fast == pytest.approx(slow, rel=1e-5)
    docs = [torch.randint(5, 100, (n,)).numpy() for n in (10, 40, 33, 50)]
    result = pseudo_perplexity(model, docs, [8, 16, 32], [0, 1, 2, 3, 4], 4, max_docs=2, progress=False)
    assert result["documents"] == 2 and [r["length"] for r in result["lengths"]] == [8, 16, 32]
    nll16 = sum(
        pseudo_nll_reference(model, torch.as_tensor(d[:16]), [0, 1, 2, 3, 4], 4)[0] for d in docs[1:3]
    )
    assert result["lengths"][1]["pseudo_perplexity"] == pytest.approx(math.exp(nll16 / 32), rel=1e-5)
    j, png = write_ppl(result, tmp_path)
    assert json.loads(j.read_text())["lengths"][0]["scored_tokens"] == 16 and png.stat().st_size > 1000
    with pytest.raises(ValueError, match="no document has 64 tokens"):
        pseudo_perplexity(model, docs, [64], [0], 4, progress=False)


def test_poor_ppl_refuses_a_model_without_its_masked_lm_head(tmp_path, tiny_official, capfd, monkeypatch):
    """An encoder without the pre-training head once scored a random decoder (chance-level pseudo-perplexity,
    exit 0); it is refused by name, without transformers' load report before it (#43, L4); a model of another
    kind, the packaged MiniLM too, is said to be one (L5: it was sent to the hub as a repo id)."""
    import shutil
    import sys

    from neoembed.cli import main
    from neoembed.modeling import NeoBERTForMaskedLM

    encoder = tmp_path / "encoder"
    NeoBERTForMaskedLM.from_pretrained(str(tiny_official)).model.save_pretrained(encoder)
    for f in tiny_official.glob("*tok*"):
        shutil.copy(f, encoder)
    shutil.copy(tiny_official / "vocab.txt", encoder)
    (tmp_path / "docs.txt").write_text("a short document about rivers and the sea\n")
    argv = ["neoembed", "ppl", "--model", str(encoder), "--data", str(tmp_path / "docs.txt")]
    monkeypatch.setattr(
        sys, "argv", [*argv, "--lengths", "8", "--out", str(tmp_path / "o"), "--device", "cpu"]
    )
    with pytest.raises(SystemExit) as e:
        main()
    err = capfd.readouterr().err
    assert e.value.code == 2 and "no masked-LM head" in err and str(encoder) in err, err
    assert "LOAD REPORT" not in err, err
    argv[3] = "packaged:all-MiniLM-L6-v2"
    monkeypatch.setattr(sys, "argv", [*argv, "--lengths", "8", "--out", str(tmp_path / "m")])
    with pytest.raises(SystemExit) as e:
        main()
    err = capfd.readouterr().err
    assert e.value.code == 2 and "packaged:all-MiniLM-L6-v2 is a bert model: ppl scores NeoBERT" in err, err
    from neoembed.cde.model import CLASS_REF

    cde = tmp_path / "cde"  # a CDE model's folder as it saves one: its stages in folders of their own
    cde.mkdir()
    (cde / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": CLASS_REF}]))
    argv[3] = str(cde)
    monkeypatch.setattr(sys, "argv", [*argv, "--lengths", "8", "--out", str(tmp_path / "c")])
    with pytest.raises(SystemExit) as e:
        main()
    err = capfd.readouterr().err
    assert e.value.code == 2 and "is a CDE model" in err and "no masked-LM head" in err, err
    # folders that are no masked-LM model are said to be what they are, not by the tokenizer loader's error
    (stage := cde / "first_stage").mkdir()
    (stage / "config.json").write_text((encoder / "config.json").read_text())
    (run_checkpoint := tmp_path / "run" / "checkpoint-12" / "state").mkdir(parents=True)
    (untokenized := tmp_path / "untokenized").mkdir()
    shutil.copy(encoder / "config.json", untokenized)
    cases = {
        stage: "or one of its stages, which has no masked-LM head",
        run_checkpoint.parent: "is a training checkpoint (its state/ is what --resume continues from), not a model",
        untokenized: "has no tokenizer (tokenizer.json, tokenizer_config.json or vocab.txt)",
    }
    for folder, said in cases.items():
        argv[3] = str(folder)
        monkeypatch.setattr(sys, "argv", [*argv, "--lengths", "8", "--out", str(tmp_path / "c" / folder.name)])
        with pytest.raises(SystemExit) as e:
            main()
        err = capfd.readouterr().err
        assert e.value.code == 2 and said in err, err


def test_progress_is_a_plain_line_per_logging_step_when_not_a_terminal(tmp_path, shards, capfd):
    """Under pytest stderr is not a terminal: no bar redraws, one line per logged step with the time left."""
    pretrain(_recipe(tmp_path / "p", shards, "steps=3", "logging_steps=1", "save_steps=100"), progress=True)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]
    assert all(" loss " in line and " left " in line for line in lines)


def test_mlflow_tracks_the_run_loop_and_a_resume_continues_the_same_run(
    tmp_path, shards, held_out, monkeypatch
):
    """accelerate's MLflow tracker against a local file store: a run of 4 steps (checkpoints at 2 and 4), resumed
    from checkpoint-4 to 6 steps: one MLflow run, continued, whose values per step equal metrics.jsonl (the
    eval_ scores too)."""
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow >= 3.10 asks for it to use a file store
    out = tmp_path / "tracked"
    common = (
        "save_steps=2", "logging_steps=1", "schedule.warmup_steps=0", "report_to=[mlflow]",
        f"eval={{steps: 2, sources: [{{path: {held_out}}}], sequences: 4}}",
    )  # fmt: skip
    pretrain(_recipe(out, shards, "steps=4", *common), progress=False)
    pretrain(_recipe(out, shards, "steps=6", *common), resume=True, progress=False)
    losses = {r["step"]: r["loss"] for r in _rows(out) if "loss" in r}
    client = MlflowClient(uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1 and runs[0].info.run_name == "tracked"
    params = runs[0].data.params  # the recipe as hyperparameters, from the first start (the resume adds none)
    assert params["recipe.steps"] == "4" and params["recipe.optimizer.lr"] == "0.002"
    assert params["recipe.masking.rate"] == "0.2"
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    by_step: dict[int, list[float]] = {}
    for m in history:
        by_step.setdefault(m.step, []).append(m.value)
    assert sorted(by_step) == sorted(losses) == list(range(1, 7))
    # the first run checkpointed its last step (4) too, and the resume continues from it: every step logged once
    assert {s: len(v) for s, v in by_step.items()} == {1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1}
    assert {s: v[-1] for s, v in by_step.items()} == pytest.approx(losses, rel=1e-6)
    evals = {r["step"]: r["eval_mlm_loss"] for r in _rows(out) if "eval_mlm_loss" in r}
    tracked = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, "eval_mlm_loss")}
    assert sorted(evals) == [2, 4, 6]
    assert tracked == pytest.approx(evals, rel=1e-6)


@pytest.fixture(scope="module")
def held_out(tmp_path_factory, tokenizer):
    """Held-out shards: this repository's documentation pages, never trained on."""
    out = tmp_path_factory.mktemp("held_out") / "docs"
    preprocess(str(REPO / "docs"), out, tokenizer, shard_tokens=20_000, progress=False)
    return out


def _weights_equal(final: Path, checkpoint: Path) -> None:
    from safetensors.torch import load_file

    saved, state = (
        load_file(str(final / "model.safetensors")),
        load_file(str(checkpoint / "state" / "model.safetensors")),
    )
    for key, value in saved.items():
        assert torch.equal(value, state[f"mlm.{key}"]), key


def _final_pseudo_perplexity(final: Path, held_out: Path, tokenizer) -> float:
    """`neoembed ppl --model FINAL --data HELD_OUT --lengths 32 --max-docs 2`'s number, in this process."""
    model = NeoBERTForMaskedLM.from_pretrained(str(final))
    docs = ShardedCorpus(held_out)
    result = pseudo_perplexity(
        model, (docs[i] for i in range(len(docs))), [32], sorted(set(tokenizer.all_special_ids)),
        tokenizer.mask_token_id, max_docs=2, progress=False,
    )  # fmt: skip
    return result["lengths"][0]["pseudo_perplexity"]


def test_evaluation_on_held_out_shards_and_the_best_checkpoint_kept_across_a_resume(
    tmp_path, shards, held_out, tokenizer, monkeypatch, sigterm_at
):
    """eval: masked-LM loss, accuracy and perplexity on held-out shards and the pseudo-perplexity of held-out
    documents every eval.steps, without changing a training loss; the held-out shards are in the run record.
    keep_best: the best saved step survives save_total_limit and a SIGTERM + --resume, and its weights are the
    final model (its pseudo-perplexity is neoembed ppl's on that model). (mode max on the loss picks an early
    step, so that the final model must be loaded from a checkpoint; the machinery is the same for min.)"""
    settings = (
        "steps=6", "save_steps=2", "save_total_limit=1",
        f"eval={{steps: 2, sources: [{{path: {held_out}}}], sequences: 8, ppl_texts: 2, ppl_length: 32}}",
        "keep_best={metric: mlm_loss, mode: max}",
    )  # fmt: skip
    plain = pretrain(_recipe(tmp_path / "plain", shards, "steps=6", "save_steps=2"), progress=False)
    full = pretrain(_recipe(tmp_path / "full", shards, *settings), progress=False)
    rows = _rows(full)
    evals = [r for r in rows if "eval_mlm_loss" in r]
    assert [r["loss"] for r in rows if "loss" in r] == [r["loss"] for r in _rows(plain)]
    assert [r["step"] for r in evals] == [2, 4, 6]
    for r in evals:
        assert 0 <= r["eval_mlm_accuracy"] <= 1 and r["eval_pseudo_perplexity"] > 1
        assert r["eval_mlm_perplexity"] == pytest.approx(math.exp(r["eval_mlm_loss"]))
    worst = max(evals, key=lambda r: r["eval_mlm_loss"])
    best = json.loads((full / "best.json").read_text())
    assert (best["step"], best["value"], best["last_step"]) == (worst["step"], worst["eval_mlm_loss"], 6)
    assert best["step"] < 6 and (full / f"checkpoint-{best['step']}").is_dir()  # kept out of the rotation
    _weights_equal(full, full / f"checkpoint-{best['step']}")
    assert _final_pseudo_perplexity(full, held_out, tokenizer) == pytest.approx(
        worst["eval_pseudo_perplexity"], rel=1e-5
    )
    record = json.loads((full / "run_record.json").read_text())
    assert record["keep_best"] == best and list(record["eval_data_fingerprints"]) == [held_out.as_posix()]
    assert any(k.startswith(str(held_out)) for k in record["data"])  # its index files hashed
    from neoembed.pretrain import trainer as pretrain_trainer

    # a SIGTERM in step 4: checkpoint-5 is written, and the run stops
    held = shutil.copytree(held_out, tmp_path / "held")  # the same shards, in a folder of the run's own
    settings = tuple(x.replace(str(held_out), str(held)) for x in settings)
    sigterm_at(pretrain_trainer, "_mlm_step", 4)
    with pytest.raises(TrainingInterrupted):
        pretrain(_recipe(tmp_path / "part", shards, *settings), progress=False)
    monkeypatch.undo()
    assert (tmp_path / "part" / "checkpoint-5").is_dir() and not (tmp_path / "part" / "best.json").exists()
    # a held-out shard edited in place (its path kept): keep_best would compare scores of other data (walk Q's B2)
    shard = sorted(held.glob("shard-*.npy"))[0]
    kept, tokens = shard.read_bytes(), np.load(shard)
    np.save(shard, np.roll(tokens, 1))
    with pytest.raises(ValueError, match=r"best so far \(step \d, .*other evaluation settings \(eval.data: "):
        pretrain(_recipe(tmp_path / "part", shards, *settings), resume=True, progress=False)
    shard.write_bytes(kept)
    part = pretrain(_recipe(tmp_path / "part", shards, *settings), resume=True, progress=False)
    assert json.loads((part / "best.json").read_text()) == best
    assert [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in _rows(part)] == [
        {k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows
    ]
    _weights_equal(part, full / f"checkpoint-{best['step']}")


def test_tensorboard_receives_the_recipe_as_hyperparameters_and_the_eval_scores(tmp_path, shards, held_out):
    """report_to: [tensorboard] in the run loop: the validated recipe (recipe.a.b keys) in the HPARAMS tab of the
    run's own event file, and the eval_ scores as scalars beside the loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    out = pretrain(
        _recipe(
            tmp_path / "tb", shards, "steps=2", "save_steps=2", "schedule.warmup_steps=0", "report_to=[tensorboard]",
            f"eval={{steps: 2, sources: [{{path: {held_out}}}], sequences: 4}}",
        ),
        progress=False,
    )  # fmt: skip
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    # evaluation under eval/, as transformers' TensorBoard callback files it
    assert {"train/loss", "eval/mlm_loss", "eval/mlm_accuracy"} <= set(acc.Tags()["scalars"])
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["recipe.steps"].number_value == 2
    assert hparams["recipe.masking.scheme"].string_value == "mask"
    assert json.loads(hparams["recipe.eval.sources"].string_value) == [{"path": str(held_out), "weight": 1.0}]


def test_eval_settings_are_checked_before_anything_loads(tmp_path, shards):
    with pytest.raises(ValueError, match="also in data.sources"):
        _recipe(tmp_path, shards, f"eval={{steps: 2, sources: [{{path: {shards}}}]}}")
    with pytest.raises(ValueError, match="eval.steps 2 must be a multiple of save_steps 3"):
        _recipe(
            tmp_path,
            shards,
            "save_steps=3",
            "eval={steps: 2, sources: [{path: x}]}",
            "keep_best={metric: mlm_loss}",
        )
    with pytest.raises(ValueError, match="add an eval: block"):
        _recipe(tmp_path, shards, "keep_best={metric: mlm_loss}")
    with pytest.raises(ValueError, match="eval.ppl_length 128 exceeds data.seq_length 64"):
        _recipe(tmp_path, shards, "eval={steps: 2, sources: [{path: x}], ppl_texts: 2}")


def test_held_out_shards_spelled_another_way_or_copied_are_refused(tmp_path, shards):
    """The recipe compares eval.sources with data.sources as written: `./shards`, the path through a link, or a
    copy of the training shards scored "held-out" metrics on the training data, exit 0 (#43, a walk's P10, P09).
    The shards themselves are compared now, before anything is written."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    (tmp_path / "link").symlink_to(shards)
    for same in (copy, tmp_path / "link", f"{shards}/."):
        recipe = _recipe(tmp_path / "o", shards, f"eval={{steps: 2, sources: [{{path: {same}}}]}}")
        with pytest.raises(ValueError, match="holds the documents of data.sources"):
            pretrain(recipe, progress=False)
        assert not (tmp_path / "o").exists()


def test_too_few_long_held_out_documents_fail_before_the_model_loads(tmp_path, shards, held_out, monkeypatch):
    from neoembed.pretrain import trainer as pretrain_trainer

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the eval settings were checked")

    monkeypatch.setattr(pretrain_trainer, "_build_model", no_model)
    recipe = _recipe(
        tmp_path / "o",
        shards,
        f"eval={{steps: 2, sources: [{{path: {held_out}}}], ppl_texts: 100000, ppl_length: 8}}",
    )
    with pytest.raises(ValueError, match="eval.ppl_texts 100000: the held-out shards have only"):
        pretrain(recipe, progress=False)


def test_held_out_paths_resolve_like_the_training_shards(tmp_path, monkeypatch):
    """`neoembed pretrain RECIPE`: eval.sources, like data.sources, are found beside the recipe when the working
    directory lacks them (the shipped tiny recipe names tiny/shards, which is beside it)."""
    from neoembed.pretrain.cli import resolve_recipe_paths

    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(
        REPO / "recipes" / "pretrain-tiny.yaml",
        PretrainRecipe,
        ["eval={steps: 2, sources: [{path: tiny/model}]}"],
    )
    resolved = resolve_recipe_paths(recipe, REPO / "recipes")
    assert Path(resolved.eval.sources[0].path) == REPO / "recipes" / "tiny" / "model"
    assert Path(resolved.data.sources[0].path) == REPO / "recipes" / "tiny" / "shards"


@pytest.mark.parametrize(
    ("given", "refused"), [({}, False), ({"train_micro_batch_size_per_gpu": "auto"}, False),
                           ({"train_micro_batch_size_per_gpu": 8}, True), ({"gradient_accumulation_steps": 3}, True)]
)  # fmt: skip
def test_deepspeed_config_takes_the_recipes_micro_batch_or_is_refused(tmp_path, monkeypatch, given, refused):
    """Under DeepSpeed, prepare() reads the micro-batch off a DataLoader, and pre-training streams have none (the
    first GPU run failed there): the recipe's micro-batch and accumulation go into DeepSpeed's config, and a
    config that names others is refused before anything loads."""
    from types import SimpleNamespace

    import neoembed.pretrain.trainer as pt

    config = dict(given)
    fake = SimpleNamespace(
        distributed_type=SimpleNamespace(value="DEEPSPEED"),
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)),
    )
    monkeypatch.setattr(pt, "accelerator", lambda **_: fake)
    recipe = _recipe(tmp_path / "out", tmp_path, "batch.micro_batch_size=4", "batch.grad_accumulation=2")
    if refused:
        with pytest.raises(ValueError, match="set deepspeed_config"):
            pt._accelerator(recipe)
    else:
        assert pt._accelerator(recipe) is fake
        assert config == {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}


def test_a_corpus_smaller_than_a_step_is_said_to_repeat(tmp_path, tokenizer, shards, caplog):
    """#43 walk, C14: pre-training on a 3-document corpus of 16 tokens, where each step packs 256, trained on the
    corpus repeated in every step without a word."""
    from neoembed.pretrain.trainer import _open_sources

    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("hello world", "a b", "x")))
    preprocess(str(small), tmp_path / "small", tokenizer, progress=False)
    _open_sources(_recipe(tmp_path / "run", tmp_path / "small"))
    assert "fewer than one step takes per process (256)" in caplog.text and "repeats it about" in caplog.text
    caplog.clear()
    # padded rows hold one document each: 4 rows a step from 3 documents (T13 of a later walk: "about 20 times")
    _open_sources(_recipe(tmp_path / "run", tmp_path / "small", "data.packing=padded"))
    assert "holds 3 documents, fewer than one step takes per process (4)" in caplog.text, caplog.text
    caplog.clear()
    _open_sources(_recipe(tmp_path / "run", shards))  # MSRP's sentences: many steps' worth
    assert "fewer than one step" not in caplog.text
    build_subset(tmp_path / "small", 1000)  # no document that long (T14: "0 tokens ... 256 times", then a crash)
    with pytest.raises(ValueError, match=r"gt1000 holds no documents: remove it from data.sources"):
        _open_sources(_recipe(tmp_path / "run", tmp_path / "small" / "subsets" / "gt1000"))
