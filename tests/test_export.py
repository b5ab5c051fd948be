"""ONNX export (``neoembed export``) and ONNX Runtime serving (``neoembed.load(path, backend="onnx")``).

Embeddings are compared with the torch model that was exported (NeoBERT in its default padding-free layout, so
the padded graph is checked against the other layout too), on real MTEB sentences (MSRP, TrecQA).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import neoembed
from neoembed.export.onnx import export, isa_suffix

pytest.importorskip("onnxruntime", reason="the onnx extra: pip install -e '.[onnx]'")


def _sentences(shared_dir, n: int = 24) -> list[str]:
    """Real MTEB sentences of mixed lengths: MSRP pairs and TrecQA questions with their long answers."""
    texts = []
    with gzip.open(shared_dir / "data" / "eval" / "MSRP" / "test.jsonl.gz", "rt") as f:
        for line, _ in zip(f, range(n // 2), strict=False):
            texts.append(json.loads(line)["sentence1"])
    with gzip.open(shared_dir / "data" / "eval" / "TrecQA" / "test.jsonl.gz", "rt") as f:
        for line, _ in zip(f, range(n // 4), strict=False):
            row = json.loads(line)
            texts += [row["query"], " ".join(row["positive"][:1] + row["negative"][:4])]  # up to ~250 tokens
    return texts


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def tiny_export(tiny_official, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tiny"
    record = export(str(tiny_official), out, quantize="int8")
    return out, record


@pytest.fixture(scope="module")
def minilm_export(minilm_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "minilm"
    export(str(minilm_path), out, quantize="int8")
    return out


def test_export_writes_where_sentence_transformers_looks(tiny_export):
    out, record = tiny_export
    isa = isa_suffix()
    graphs = ["model.onnx", "model_packed.onnx", f"model_qint8_{isa}.onnx", f"model_packed_qint8_{isa}.onnx"]
    assert record["files"] == [f"onnx/{g}" for g in graphs] and record["packed"]
    assert all((out / "onnx" / g).is_file() for g in graphs)
    assert {"modules.json", "config.json", "tokenizer.json", "1_Pooling"} <= {p.name for p in out.iterdir()}
    # module paths every sentence-transformers release imports (5.x, whose ONNX backend runs, and 6.x)
    types = [m["type"] for m in json.loads((out / "modules.json").read_text())]
    assert types == ["sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling"]
    # the torch weights beside the graphs are as readable as the config (safetensors 0.8 writes 0600)
    config = (out / "config.json").stat().st_mode & 0o777
    assert {w.stat().st_mode & 0o777 for w in out.rglob("*.safetensors")} == {config}


def test_neobert_onnx_matches_torch_on_real_sentences(tiny_export, shared_dir):
    out, _ = tiny_export
    texts = _sentences(shared_dir)
    torch_model, onnx_model = neoembed.load(out), neoembed.load(out, backend="onnx")
    # one batch of mixed lengths (padding inside the graph), and one by one
    expected = torch_model.encode(texts, batch_size=len(texts))
    got = onnx_model.encode(texts, batch_size=len(texts))
    assert np.abs(got - expected).max() <= 1e-5
    assert _cosines(got, expected).min() >= 0.99999
    single = np.stack([onnx_model.encode([t])[0] for t in texts[:4]])
    assert np.abs(single - expected[:4]).max() <= 1e-5


def test_a_bf16_folder_exports_an_fp32_graph_that_loads(tiny_official, shared_dir, tmp_path):
    # the serving page saves bf16; its export was a bf16 graph ONNX Runtime cannot run (no bf16 MatMul on CPU)
    import onnx

    saved = tmp_path / "bf16"
    neoembed.load(tiny_official, dtype="bf16").save(str(saved))
    export(str(saved), tmp_path / "out")
    graph = onnx.load(str(tmp_path / "out" / "onnx" / "model.onnx"))
    assert {t.data_type for t in graph.graph.initializer if t.data_type in (1, 10, 16)} == {onnx.TensorProto.FLOAT}
    texts = _sentences(shared_dir, 8)
    expected = neoembed.load(saved, dtype="fp32").encode(texts)
    assert np.abs(neoembed.load(tmp_path / "out", backend="onnx").encode(texts) - expected).max() <= 1e-5


def test_neobert_onnx_long_input_4096_tokens(tiny_export, shared_dir):
    out, _ = tiny_export
    long_doc = " ".join(_sentences(shared_dir, 48)) * 6
    torch_model, onnx_model = neoembed.load(out), neoembed.load(out, backend="onnx")
    assert len(torch_model.tokenize([long_doc])["input_ids"][0]) == 4096  # truncated at the model's maximum
    texts = [long_doc, "a short one"]
    expected, got = torch_model.encode(texts), onnx_model.encode(texts)
    assert _cosines(got, expected).min() >= 0.99999
    assert np.abs(got - expected).max() <= 1e-5


@pytest.mark.slow
def test_full_size_neobert_onnx_matches_torch(tiny_official, shared_dir, tmp_path):
    """Full-size NeoBERT (random weights: 28 x 768, the paper's shape): the fp32 graph against torch's padding-free
    model on a mixed-length batch of real sentences and a 4,096-token input; int8's cosine to fp32."""
    import torch
    from transformers import AutoTokenizer

    from neoembed.modeling import NeoBERTConfig, NeoBERTModel

    torch.manual_seed(0)
    folder = tmp_path / "neobert"
    NeoBERTModel(NeoBERTConfig()).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tiny_official)).save_pretrained(folder)
    export(str(folder), tmp_path / "export", quantize="int8")
    texts, long_doc = _sentences(shared_dir), " ".join(_sentences(shared_dir, 48)) * 6
    torch_model = neoembed.load(folder)
    fp32 = neoembed.load(tmp_path / "export", backend="onnx")
    assert len(torch_model.tokenize([long_doc])["input_ids"][0]) == 4096

    def encode(
        model, batch
    ):  # the 4,096-token text alone: a padded batch of it needs (B, 12, 4096, 4096) scores
        return np.concatenate([model.encode(texts, batch_size=batch), model.encode([long_doc])])

    expected, got = encode(torch_model, len(texts)), encode(fp32, len(texts))
    assert _cosines(got, expected).min() >= 0.99999
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    int8 = neoembed.load(tmp_path / "export", backend="onnx", file_name=f"model_qint8_{isa_suffix()}.onnx")
    cos = _cosines(encode(int8, len(texts)), got)
    print(f"full-size int8 vs fp32 cosine: min {cos.min():.5f} mean {cos.mean():.5f}")
    assert cos.min() >= 0.99


def test_neobert_int8_close_to_fp32(tiny_export, shared_dir):
    out, record = tiny_export
    texts = _sentences(shared_dir)
    fp32 = neoembed.load(out, backend="onnx").encode(texts)
    int8 = neoembed.load(out, backend="onnx", file_name=f"model_qint8_{isa_suffix()}.onnx").encode(texts)
    cos = _cosines(int8, fp32)
    print(f"int8 vs fp32 cosine on {len(texts)} sentences: min {cos.min():.5f} mean {cos.mean():.5f}")
    assert cos.min() >= 0.99 and not np.allclose(int8, fp32, atol=1e-6)  # quantized, and close


def test_int8_graph_quantizes_every_linear_layer(tiny_export, tiny_official):
    """Every weight product becomes int8: NeoBERT's eager CPU SwiGLU splits its fused weight at run time, which an
    exported graph would carry as ops on the weight, left in fp32 by the quantizer (2.4x instead of 1.3x over fp32
    on full-size NeoBERT, benchmarks/results/onnx_profile_cpu.md)."""
    import onnx
    import torch

    out, record = tiny_export
    graph = onnx.load(str(out / "onnx" / f"model_qint8_{isa_suffix()}.onnx")).graph
    weights = {i.name for i in graph.initializer}
    quantized = [n for n in graph.node if n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul")]
    fp32_on_weights = [n.name for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    linears = [
        m for m in neoembed.load(tiny_official)[0].auto_model.modules() if isinstance(m, torch.nn.Linear)
    ]
    assert len(quantized) == len(linears) and not fp32_on_weights
    # 7-bit weights where uint8 x int8 products saturate (x86 without VNNI), the full 8 bits elsewhere
    from onnx.numpy_helper import to_array

    from neoembed.export.onnx import int8_saturates

    int8 = [to_array(i) for i in graph.initializer if i.data_type == onnx.TensorProto.INT8 and i.dims]
    top = max(int(np.abs(w.astype(np.int32)).max()) for w in int8)
    assert record["int8_weight_bits"] == (7 if int8_saturates() else 8)
    assert top <= 64 if int8_saturates() else top == 127


def test_the_export_record_names_the_packaged_model_not_its_path(minilm_export):
    assert json.loads((minilm_export / "export.json").read_text())["model"] == "packaged:all-MiniLM-L6-v2"


@pytest.mark.parametrize("graph", ["model.onnx", "model_packed.onnx"])
def test_minilm_onnx_matches_torch_on_real_sentences(minilm_export, shared_dir, graph):
    texts = _sentences(shared_dir)
    expected = neoembed.load(minilm_export).encode(texts, batch_size=len(texts))
    got = neoembed.load(minilm_export, backend="onnx", file_name=graph).encode(texts, batch_size=len(texts))
    assert np.abs(got - expected).max() <= 1e-5 and _cosines(got, expected).min() >= 0.99999


def test_neobert_packed_graph_matches_torch(tiny_export, shared_dir):
    """The packed graph (several sequences per row, block-diagonal attention) against torch's padding-free model:
    a mixed-length batch whose short sentences share rows, one by one, and a 4,096-token input with short texts
    packed beside nothing (it fills its row)."""
    out, _ = tiny_export
    texts, long_doc = _sentences(shared_dir), " ".join(_sentences(shared_dir, 48)) * 6
    torch_model = neoembed.load(out)
    packed = neoembed.load(out, backend="onnx", file_name="model_packed.onnx")
    assert packed[0].auto_model.packed
    for batch, size in ((texts, len(texts)), (texts[:3], 1), ([long_doc, *texts[:3]], 4)):
        expected, got = torch_model.encode(batch, batch_size=size), packed.encode(batch, batch_size=size)
        assert np.abs(got - expected).max() <= 1e-5 and _cosines(got, expected).min() >= 0.99999


def test_pack_rows_lays_every_token_once():
    """First-fit decreasing into rows of the batch's length: every real token once, in order, positions from 0,
    a segment of its own within its row, no row over length, and the grid read back from the rows."""
    from neoembed.export.runtime import pack_rows

    rng = np.random.default_rng(0)
    lengths = np.array([16, 3, 9, 16, 1, 7, 5, 12, 2, 4])
    mask = (np.arange(16)[None] < lengths[:, None]).astype(np.int64)
    mask[1] = mask[1][::-1]  # a left-padded row too
    ids = rng.integers(5, 1000, mask.shape) * mask
    feed, src, dst = pack_rows(ids, mask)
    rows, positions, segments = feed["input_ids"], feed["position_ids"], feed["segment_ids"]
    assert rows.shape[1] == 16 and rows.shape[0] < len(lengths) and (segments > 0).sum() == lengths.sum()
    np.testing.assert_array_equal(rows.flat[dst], ids.flat[src])
    grid_rows = src // 16
    for i, n in enumerate(lengths):
        at = dst[grid_rows == i]
        assert len(at) == n and len(set(at // 16)) == 1 and np.all(np.diff(at) == 1)  # one row, contiguous
        np.testing.assert_array_equal(positions.flat[at], np.arange(n))
        assert len(set(segments.flat[at])) == 1
        others = dst[(grid_rows != i) & (dst // 16 == at[0] // 16)]
        assert segments.flat[at[0]] not in set(segments.flat[others])
    assert sum(1 for r in range(rows.shape[0]) if (segments[r] > 0).sum() == 16) >= 2  # the two full rows


def test_packed_graph_for_a_small_vocabulary(tmp_path):
    """The probe batch draws its ids inside the model's vocabulary: the tiny recipe's NeoBERT (1,500 tokens) gets
    its packed graph."""
    from pathlib import Path

    from neoembed.export.onnx import export_packed_graph

    model = neoembed.load(Path(__file__).resolve().parents[1] / "recipes" / "tiny" / "model")
    assert model[0].auto_model.config.vocab_size < 2000
    assert export_packed_graph(model, tmp_path / "model_packed.onnx") is None
    assert (tmp_path / "model_packed.onnx").is_file()


def test_packed_graph_needs_a_model_that_takes_positions(minilm_path, tmp_path):
    """A model that ignores position_ids would give packed sequences the wrong positions: no packed graph, and
    the reason, instead of a graph that looks right and is not."""
    import torch

    from neoembed.export.onnx import export_packed_graph

    class IgnoresPositions(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, position_ids=None, **kwargs):
            return self.inner(**kwargs)

    model = neoembed.load(minilm_path)
    model[0].model = IgnoresPositions(model[0].model)  # (auto_model reads it)
    reason = export_packed_graph(model, tmp_path / "model_packed.onnx")
    assert "differ" in reason and not (tmp_path / "model_packed.onnx").exists()


def test_exported_graph_serves_without_neoembed(tiny_export, shared_dir, tmp_path, block_neoembed):
    """The folder alone (ONNX graph, tokenizer, pooling config) gives the embeddings where neoembed cannot be
    imported: ONNX Runtime and the tokenizer, mean pooling as in 1_Pooling."""
    out, _ = tiny_export
    texts = _sentences(shared_dir, 8)
    expected = neoembed.load(out).encode(texts)
    result = tmp_path / "e.npy"
    code = block_neoembed + textwrap.dedent(f"""
        import json, numpy as np, onnxruntime as ort
        from transformers import AutoTokenizer
        try:
            import neoembed
            raise SystemExit('neoembed should not be importable here')
        except ImportError:
            pass
        assert json.load(open({str(out / "1_Pooling" / "config.json")!r}))['pooling_mode'] == 'mean'
        tok = AutoTokenizer.from_pretrained({str(out)!r})
        batch = tok({texts!r}, padding=True, return_tensors='np')
        session = ort.InferenceSession({str(out / "onnx" / "model.onnx")!r})
        feed = {{i.name: batch[i.name].astype(np.int64) for i in session.get_inputs()}}
        h = session.run(None, feed)[0]
        mask = batch['attention_mask'][..., None].astype(np.float32)
        np.save({str(result)!r}, (h * mask).sum(1) / mask.sum(1))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-3000:]
    assert np.abs(np.load(result) - expected).max() <= 1e-5


def _cli(monkeypatch, *args: str) -> int:
    from neoembed.cli import main

    monkeypatch.setattr(sys, "argv", ["neoembed", *args])
    with pytest.raises(SystemExit) as stop:
        main()
    return stop.value.code


def test_cli_refuses_an_output_folder_that_holds_an_export(tiny_export, tiny_official, monkeypatch, capsys):
    out, _ = tiny_export
    assert _cli(monkeypatch, "export", str(tiny_official), str(out), "--format", "onnx") == 2
    assert "already holds another export" in capsys.readouterr().err
    assert _cli(monkeypatch, "export", str(tiny_official), str(out / "new"), "--format", "tflite") == 2
    assert "--format" in capsys.readouterr().err and not (out / "new").exists()
    # a stage line as each graph is written (#44's walk: 46 s without a word before "wrote ...")
    assert _cli(monkeypatch, "export", str(tiny_official), str(out.parent / "staged"), "--quantize", "int8") == 0
    err = capsys.readouterr().err
    stages = [line for line in err.splitlines() if line.startswith("export: ")]
    assert len(stages) == 4 and "tracing model.onnx" in stages[0] and "quantizing" in stages[-1], err


def test_an_export_into_the_working_folder_or_a_link_fills_it_in_place(
    tiny_official, tmp_path, monkeypatch, capsys
):
    """``neoembed export MODEL .`` in an empty folder traced the whole export, then failed with "[Errno 22]
    Invalid argument: '.'" and deleted it; OUT a link to an empty folder, "[Errno 20] Not a directory" (walk S,
    27 and 28). An existing folder is filled in place: the working folder stays where the shell is."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert _cli(monkeypatch, "export", str(tiny_official), ".") == 0, capsys.readouterr().err
    assert (here / "export.json").is_file() and Path.cwd() == here and not list(tmp_path.glob(".*export*"))
    # the card's loading code names the export (it named the deleted staging folder: walk S, 26)
    assert 'neoembed.load("here")' in (here / "README.md").read_text()
    want = neoembed.load(here, backend="onnx").encode(["a sentence"])
    (tmp_path / "link").symlink_to(here)
    assert _cli(monkeypatch, "export", str(tiny_official), str(tmp_path / "link"), "--overwrite") == 0
    assert (tmp_path / "link").is_symlink() and (here / "export.json").is_file()
    assert 'neoembed.load("link")' in (here / "README.md").read_text()  # the name given, not the target's
    assert neoembed.load(here, backend="onnx").encode(["a sentence"]) == pytest.approx(want, abs=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "link"]  # no staging, lock or old folder left


KILLED_EXPORT = """
import os, signal, sys
import neoembed.export.onnx as onnx

def killed(model, path):  # SIGKILL once the sentence-transformers folder is written, before any graph
    os.kill(os.getpid(), signal.SIGKILL)

onnx.export_graph = killed
onnx.export(sys.argv[1], sys.argv[2])
"""


def test_killed_export_leaves_no_folder_that_loads(tiny_official, tmp_path, monkeypatch, capsys):
    """A killed export left OUT holding a saved model without its graphs: it loaded and scored without a warning,
    and the rerun was refused ("already holds another export") with no way to replace it. The export is written
    into a hidden sibling and renamed to OUT when complete: after a kill OUT does not exist, the rerun writes it
    (removing the leftover), and ``--overwrite`` replaces a finished export, nothing else."""
    out = tmp_path / "exported"
    staged = tmp_path / ".exported.export-partial"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_EXPORT, str(tiny_official), str(out)], capture_output=True, text=True
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (staged / "modules.json").is_file()  # killed after the model was saved ...
    assert not out.exists()  # ... and nothing at OUT to load

    assert _cli(monkeypatch, "export", str(tiny_official), str(out)) == 0
    assert not staged.exists() and (out / "export.json").is_file()
    neoembed.load(out, backend="onnx").encode(["a sentence"])
    first = (out / "export.json").read_bytes()

    assert _cli(monkeypatch, "export", str(tiny_official), str(out)) == 2
    err = capsys.readouterr().err
    assert "already holds another export" in err and "pass --overwrite to replace it" in err, err
    import neoembed.export.onnx as onnx

    def stub_graph(model, path):  # the second export's graphs are not what is tested here: keep it short
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"stub")
        return ("input_ids", "attention_mask")

    monkeypatch.setattr(onnx, "export_graph", stub_graph)
    monkeypatch.setattr(onnx, "export_packed_graph", lambda model, path: "stubbed")
    assert _cli(monkeypatch, "export", str(tiny_official), str(out), "--overwrite") == 0
    record = (out / "export.json").read_bytes()
    assert json.loads(record)["packed_not_written"] == "stubbed" and record != first
    assert (out / "onnx" / "model.onnx").read_bytes() == b"stub"
    assert not (out / "onnx" / "model_packed.onnx").exists()  # the first export's files went with it
    assert not list(tmp_path.glob(".exported.export-*"))

    # --overwrite replaces only a finished export: a folder without export.json is refused and left as it was
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    capsys.readouterr()
    assert _cli(monkeypatch, "export", str(tiny_official), str(other), "--overwrite") == 2
    assert "no export.json" in capsys.readouterr().err and (other / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in other.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_export_stopped_by_a_signal_leaves_out_as_it_was(
    tiny_export, tiny_official, monkeypatch, capsys, sig, code
):
    """SIGTERM killed an export without a word and SIGINT said only "interrupted": both end now with the documented
    exit status and message, and OUT (here a finished export being replaced with --overwrite) is left as it was."""
    import neoembed.export.onnx as onnx

    out, _ = tiny_export
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    def signalled(model, path):
        os.kill(os.getpid(), sig)
        raise AssertionError("the signal did not stop the export")

    class Unhandled(Exception):
        pass

    def unhandled(signum, frame):  # the old code installed nothing: the process ended without a message
        raise Unhandled(signal.Signals(signum).name)

    monkeypatch.setattr(onnx, "export_graph", signalled)
    previous = signal.signal(sig, unhandled)
    try:
        status = _cli(monkeypatch, "export", str(tiny_official), str(out), "--overwrite")
    finally:
        signal.signal(sig, previous)
    err = capsys.readouterr().err
    assert status == code, err
    assert f"export stopped: stopped by {sig.name}: no export was written to {out}" in err
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    assert not list(out.parent.glob(f".{out.name}.export-*"))


def test_missing_graph_names_the_folder_files(tiny_export, tiny_official):
    out, _ = tiny_export
    with pytest.raises(FileNotFoundError, match="model_qint8") as e:
        neoembed.load(out, backend="onnx", file_name="model_O4.onnx")
    # each caller's way of naming a graph: the command line's option, load's argument, sentence-transformers'
    assert all(s in str(e.value) for s in ("--onnx-file NAME", "file_name=NAME", "model_kwargs={'file_name'"))
    with pytest.raises(FileNotFoundError, match=r"holds no ONNX export .*: export it first \(neoembed export "):
        neoembed.load(tiny_official, backend="onnx")  # a model never exported
    with pytest.raises(FileNotFoundError, match=r"neoembed export packaged:all-MiniLM-L6-v2 OUT"):
        neoembed.load("packaged:all-MiniLM-L6-v2", backend="onnx")  # named as given, not by its install path
    # another folder's graph ran on this folder's tokenizer and pooling (walk S, 25: a 384-wide graph under a
    # 32-wide model's name); a path out of the folder is refused, one inside it loads
    other = out.parent / "other.onnx"
    shutil.copy(out / "onnx" / "model.onnx", other)
    for name in (str(other), "../other.onnx"):
        with pytest.raises(ValueError, match=r"is not a file of .*: name a graph of its onnx/ folder"):
            neoembed.load(out, backend="onnx", file_name=name)
    same = neoembed.load(out, backend="onnx", file_name="onnx/model.onnx").encode(["a"])
    assert same == pytest.approx(neoembed.load(out, backend="onnx").encode(["a"]))
    # a hub cache snapshot: its files are links into blobs/, outside the folder, and load all the same (walk W)
    snapshot, blobs = out.parent / "snapshot", out.parent / "blobs"
    shutil.copytree(out, snapshot)
    blobs.mkdir()
    shutil.move(snapshot / "onnx" / "model.onnx", blobs / "abc123")
    (snapshot / "onnx" / "model.onnx").symlink_to(blobs / "abc123")
    linked = neoembed.load(snapshot, backend="onnx", file_name="onnx/model.onnx").encode(["a"])
    assert linked == pytest.approx(same)
    # an adapter saved alone: the merged model beside it is what exports (walk S, 24: it said to export the adapter)
    adapter = out.parent / "run" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"adapter saved alone.*neoembed export .*run OUT"):
        neoembed.load(adapter, backend="onnx")


def test_a_missing_onnx_package_is_named_with_its_extra_before_any_work(
    tiny_export, tiny_official, tmp_path, monkeypatch, capsys
):
    """#43 walk, D12-D14: without onnxscript, `neoembed export` ended in a raw ModuleNotFoundError ("please report
    it", exit 1), without onnxruntime `--quantize int8` after 14 s of work, and `load(backend="onnx")` raised the
    bare import error. Each names the extra that installs the package, before any model loads."""
    import importlib.util

    real = importlib.util.find_spec
    for gone in ("onnxscript", "onnxruntime"):
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a, _gone=gone: None if name == _gone else real(name, *a),
        )
        out = tmp_path / gone
        assert _cli(monkeypatch, "export", str(tiny_official), str(out), "--quantize", "int8") == 2
        err = capsys.readouterr().err
        assert f"needs {gone}, which is not installed: pip install -e '.[onnx]'" in err, err
        assert not out.exists()
    with pytest.raises(ValueError, match=r"backend='onnx' needs onnxruntime, .* pip install -e '.\[onnx\]'"):
        neoembed.load(tiny_export[0], backend="onnx")


def test_neoembed_mteb_scores_the_onnx_graphs(
    tiny_export, tiny_official, shared_dir, tmp_path, monkeypatch, capsys
):
    """`neoembed mteb --backend onnx [--onnx-file]` and `--quantize int8`: the fp32 graph scores what torch scores,
    int8 (graph or torch layers) close to it; each result names how it ran, and compare refuses to set an int8
    graph beside the torch model."""
    from neoembed.eval.summary import compare_runs

    out, _ = tiny_export
    task = shared_dir / "data" / "mteb" / "STS16"
    int8 = f"model_qint8_{isa_suffix()}.onnx"
    runs = {
        "torch": ["--model", str(tiny_official)],
        "onnx": ["--model", str(out), "--backend", "onnx"],
        "int8": ["--model", str(out), "--backend", "onnx", "--onnx-file", int8],
        "torch int8": ["--model", str(tiny_official), "--quantize", "int8"],
    }
    scores = {}
    for name, args in runs.items():
        assert _cli(monkeypatch, "mteb", *args, "--tasks", str(task), "--output", str(tmp_path / name)) in (
            0,
            None,
        )
        entry = json.loads((tmp_path / name / "STS16.json").read_text())
        scores[name] = entry["main_score"]
        labels = {
            "torch": "torch",
            "onnx": "onnx:model.onnx",
            "int8": f"onnx:{int8}",
            "torch int8": "torch:int8",
        }
        assert entry["backend"] == labels[name]
    assert f"backend: onnx:{int8}" in (tmp_path / "int8" / "summary.md").read_text()
    assert scores["onnx"] == pytest.approx(scores["torch"], abs=1e-5)
    assert scores["int8"] != scores["onnx"] and abs(scores["int8"] - scores["onnx"]) < 0.05
    assert scores["torch int8"] != scores["torch"] and abs(scores["torch int8"] - scores["torch"]) < 0.05
    with pytest.raises(ValueError, match="backend"):
        compare_runs([tmp_path / "torch", tmp_path / "int8"])
    capsys.readouterr()
    assert _cli(monkeypatch, "mteb", *runs["int8"], "--precision", "fp16", "--tasks", str(task)) == 2
    assert "drop --precision" in capsys.readouterr().err
    assert _cli(monkeypatch, "mteb", *runs["onnx"], "--quantize", "int8", "--tasks", str(task)) == 2
    assert "--onnx-file" in capsys.readouterr().err
    assert _cli(monkeypatch, "mteb", *runs["torch int8"], "--precision", "bf16", "--tasks", str(task)) == 2
    assert "drop --precision" in capsys.readouterr().err


def _distance(model, texts, expected) -> float:
    """Mean cosine distance of ``model``'s embeddings of ``texts`` to ``expected``."""
    return float((1 - _cosines(model.encode(texts), expected)).mean())


@pytest.mark.parametrize("which", ["neobert", "minilm"])
def test_torch_int8_as_close_to_fp32_as_the_onnx_int8_graph(
    which, tiny_export, tiny_official, minilm_export, minilm_path, shared_dir
):
    """``quantize="int8"`` (torch, padding-free) quantizes as the ONNX int8 graph does (8-bit activations, 7-bit
    weights where products saturate): its distance to fp32 is the graph's, within 25%; PyTorch's own dynamic layer
    (7-bit activations) is at least 1.5x further."""
    import torch
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    from neoembed.export.torch_int8 import Int8Linear

    path, graphs = (tiny_official, tiny_export[0]) if which == "neobert" else (minilm_path, minilm_export)
    texts = _sentences(shared_dir)
    fp32 = neoembed.load(path).encode(texts)
    onnx_int8 = neoembed.load(graphs, backend="onnx", file_name=f"model_qint8_{isa_suffix()}.onnx").encode(
        texts
    )
    reference = float((1 - _cosines(onnx_int8, fp32)).mean())
    model = neoembed.load(path, quantize="int8")
    ours = _distance(model, texts, fp32)
    pytorch_own = neoembed.load(path)  # PyTorch's own dynamic layer: 7-bit activations, 8-bit weights
    quantize_dynamic(pytorch_own[0].model, {torch.nn.Linear: per_channel_dynamic_qconfig}, inplace=True)
    own = _distance(pytorch_own, texts, fp32)
    print(f"{which}: mean cosine distance to fp32: onnx int8 {reference:.5f}, torch int8 {ours:.5f}, "
          f"PyTorch's own layer {own:.5f}")  # fmt: skip
    assert 0 < ours <= 1.25 * reference and own >= 1.5 * ours
    layers = [type(m) for m in model[0].model.modules() if isinstance(m, (torch.nn.Linear, Int8Linear))]
    assert layers and set(layers) == {Int8Linear}  # every linear layer of the encoder


def _with_lora(path):
    """The model at ``path`` with a LoRA adapter that changes its embeddings (a fresh adapter adds zero)."""
    import torch

    from neoembed.adapters import add_lora

    model = neoembed.load(path)
    add_lora(model, r=4, alpha=8)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model


def test_torch_int8_merges_lora_and_refuses_what_it_cannot_serve(tiny_official, tiny_export, shared_dir):
    from peft.tuners.tuners_utils import BaseTunerLayer

    from neoembed.export.torch_int8 import quantize_int8

    texts = _sentences(shared_dir, n=8)
    model = _with_lora(tiny_official)
    adapted = model.encode(texts)
    assert _cosines(adapted, neoembed.load(tiny_official).encode(texts)).min() < 0.999
    quantize_int8(model)
    assert not any(isinstance(m, BaseTunerLayer) for m in model.modules())
    assert _cosines(model.encode(texts), adapted).min() > 0.99  # the adapter merged, then quantized
    with pytest.raises(ValueError, match="choose one of int8"):
        neoembed.load(tiny_official, quantize="int4")
    with pytest.raises(ValueError, match="torch backend"):
        neoembed.load(tiny_export[0], backend="onnx", quantize="int8")


def test_adapter_folder_loads_quantized(tiny_official, tmp_path, shared_dir):
    """#43: neoembed.load(adapter_folder, quantize="int8") crashed at encode ('function' object has no attribute
    'dtype': the adapter's own linear layers were quantized); the adapter is merged first, as the docs say."""
    from neoembed.adapters import save_adapter

    texts = _sentences(shared_dir, n=8)
    model = _with_lora(tiny_official)
    adapted = model.encode(texts)
    save_adapter(model, tmp_path / "adapter")
    quantized = neoembed.load(tmp_path / "adapter", quantize="int8")
    assert _cosines(quantized.encode(texts), adapted).min() > 0.99


def test_int8_serves_a_half_precision_folder_and_refuses_to_save(tiny_official, tmp_path, shared_dir):
    """quantize='int8' on a folder saved in bf16 (or with dtype='fp16') loaded, then failed at the first encode
    ("expected scalar type Float but found BFloat16"); saving an int8 model failed half-way, leaving configs
    without weights. Saved weights were readable by their owner alone (0600)."""
    import os

    texts = _sentences(shared_dir, n=8)
    neoembed.load(tiny_official, dtype="bf16").save(str(tmp_path / "bf16"))
    weights = tmp_path / "bf16" / "model.safetensors"
    umask = os.umask(0)
    os.umask(umask)
    assert weights.stat().st_mode & 0o777 == 0o666 & ~umask
    quantized = neoembed.load(tmp_path / "bf16", quantize="int8")
    rounded = neoembed.load(tmp_path / "bf16", dtype="fp32").encode(texts)
    assert _cosines(quantized.encode(texts), rounded).min() > 0.99
    with pytest.raises(ValueError, match="drop dtype='fp16'"):
        neoembed.load(tiny_official, quantize="int8", dtype="fp16")
    with pytest.raises(ValueError, match="int8-quantized"):
        quantized.save(str(tmp_path / "q"))
    assert not (tmp_path / "q").exists()


def test_an_onnx_export_refuses_torch_options(tiny_export):
    """Options that shape a torch model (dtype, device, pooling, ...) were dropped for an ONNX export."""
    out, _ = tiny_export
    for options in ({"dtype": "bf16"}, {"normalize": True}, {"pooling": "cls"}):
        with pytest.raises(
            ValueError, match=rf"is an ONNX export, which does not take {next(iter(options))}"
        ):
            neoembed.load(out, backend="onnx", **options)


def test_an_onnx_export_takes_what_it_can_honour_and_checks_prompts(tiny_export, tiny_official, shared_dir):
    """An ONNX export refused max_seq_length (the tokenizer's cut, applied in Python) and the defaults
    compile=False and trust_remote_code=False; prompts="q: " or {"query": 3} loaded and failed at encode."""
    out, _ = tiny_export
    texts = _sentences(shared_dir, n=4)
    model = neoembed.load(out, backend="onnx", max_seq_length=8, compile=False, trust_remote_code=False)
    assert model.max_seq_length == 8
    cut = neoembed.load(tiny_official, max_seq_length=8).encode(texts)
    assert _cosines(model.encode(texts), cut).min() > 0.9999
    for prompts in ("q: ", {"query": 3}):
        with pytest.raises(TypeError, match="prompt"):
            neoembed.load(out, backend="onnx", prompts=prompts)
    with pytest.raises(TypeError, match="bucketing is True, False or None"):
        neoembed.load(tiny_official, bucketing="no")


def test_export_refuses_a_cde_model_before_loading_it(tiny_official, tmp_path, monkeypatch, capsys):
    """A CDE folder crashed the export after loading (its module has no ``auto_model``, "please report it")."""
    from neoembed.cde.model import ContextualSentenceTransformer

    cde = tmp_path / "cde"
    ContextualSentenceTransformer.from_backbone(str(tiny_official), n_context=4).save(str(cde))
    import neoembed.export.onnx as onnx

    monkeypatch.setattr(onnx, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert _cli(monkeypatch, "export", str(cde), str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "is a CDE model" in err and "please report" not in err
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_lora_adapter_and_names_the_merged_model_beside_it(
    tiny_official, tmp_path, monkeypatch, capsys
):
    """``neoembed export RUN/adapter`` loaded the base model with the adapter, then failed in transformers' save
    ("PEFT >= 0.22.0"); with that PEFT it writes the adapter alone, no graph. The merged model beside it exports."""
    import neoembed
    import neoembed.export.onnx as onnx
    from neoembed.adapters import add_lora, merge_lora, save_adapter

    model = neoembed.load(tiny_official)
    add_lora(model, r=4, alpha=8)
    run = tmp_path / "run"
    save_adapter(model, run / "adapter")
    merge_lora(model)
    model.save(str(run))
    load = onnx.load
    monkeypatch.setattr(onnx, "load", lambda *a, **k: pytest.fail("the adapter was loaded"))
    assert _cli(monkeypatch, "export", str(run / "adapter"), str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "is a LoRA adapter saved alone" in err and f"{run} holds it" in err, err
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(onnx, "load", load)
    assert _cli(monkeypatch, "export", str(run), str(tmp_path / "out")) == 0
    assert (tmp_path / "out" / "export.json").is_file()


def test_export_names_a_first_module_it_cannot_write(tmp_path):
    import torch

    from neoembed.export.onnx import _write

    with pytest.raises(ValueError, match="first module is a transformer; m's is Identity"):
        _write([torch.nn.Identity()], "m", tmp_path / "out", "onnx", None, "out")
    assert not (tmp_path / "out").exists()
