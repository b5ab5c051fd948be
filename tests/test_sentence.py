"""NeoBERT as a sentence-transformers model: load, encode, save, and load anywhere."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

import neoembed
from neoembed.model_card import base_model_name, model_card_text
from neoembed.sentence import NonFiniteEmbeddingError, build_prompts

TEXTS = ["NeoBERT is the most efficient model of its kind!", "a", "", "Two sentences. Of different lengths."]


@pytest.fixture(scope="module")
def tiny(tiny_official):
    return neoembed.load(tiny_official)


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("st") / "model"
    tiny.prompts = build_prompts("Represent the query for retrieval:")
    tiny.save(str(path))
    return path, tiny.encode(TEXTS, convert_to_numpy=True)


def _encode_in_subprocess(code: str, out_file) -> np.ndarray:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    return np.load(out_file)


def _env():
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def test_saved_folder_layout(saved):
    path, _ = saved
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "neobert"
    assert cfg["auto_map"]["AutoModel"] == "modeling_neobert.NeoBERTModel"
    bundled = ("modeling_neobert.py", "configuration_neobert.py", "attention_neobert.py", "layout_neobert.py")
    assert all((path / name).is_file() for name in bundled)  # the model's file and every file it imports
    modules = json.loads((path / "modules.json").read_text())
    assert all(m["type"].startswith("sentence_transformers.") for m in modules)  # stock modules only
    card = (path / "README.md").read_text()
    assert "Loading with and without neoembed" in card
    # the saved query prompt reaches RAG frameworks only when asked for (docs/integrations.md)
    assert 'query_encode_kwargs={"prompt_name": "query"}' in card and "query_instruction" in card


def test_case1_fresh_process_with_neoembed(saved, tmp_path):
    path, expected = saved
    out = tmp_path / "e.npy"
    code = textwrap.dedent(f"""
        import numpy as np, neoembed
        from sentence_transformers import SentenceTransformer
        m = SentenceTransformer({str(path)!r})  # no trust_remote_code
        np.save({str(out)!r}, m.encode({TEXTS!r}, convert_to_numpy=True))
    """)
    assert np.abs(_encode_in_subprocess(code, out) - expected).max() <= 1e-6


def test_case2_fresh_process_without_neoembed(saved, tmp_path, block_neoembed):
    path, expected = saved
    out, out2 = tmp_path / "e.npy", tmp_path / "h.npy"
    code = block_neoembed + textwrap.dedent(f"""
        import numpy as np, torch
        try:
            import neoembed
            raise SystemExit('neoembed should not be importable here')
        except ImportError:
            pass
        from sentence_transformers import SentenceTransformer
        from transformers import AutoModel, AutoTokenizer
        m = SentenceTransformer({str(path)!r}, trust_remote_code=True)
        assert type(m[0].auto_model).__module__.startswith('transformers_modules'), type(m[0].auto_model)
        np.save({str(out)!r}, m.encode({TEXTS!r}, convert_to_numpy=True))
        am = AutoModel.from_pretrained({str(path)!r}, trust_remote_code=True).eval()
        tok = AutoTokenizer.from_pretrained({str(path)!r})
        batch = tok({TEXTS!r}, padding=True, return_tensors='pt')
        with torch.no_grad():
            h = am(**batch).last_hidden_state
        mask = batch['attention_mask'].unsqueeze(-1).float()
        np.save({str(out2)!r}, ((h * mask).sum(1) / mask.sum(1)).numpy())
    """)
    assert np.abs(_encode_in_subprocess(code, out) - expected).max() <= 1e-6
    assert np.abs(np.load(out2) - expected).max() <= 1e-5


def test_case3_convert_sentence_cli_loads_both_ways(tiny_official, tmp_path, block_neoembed, run_neoembed):
    dst = tmp_path / "conv"
    r = run_neoembed(["convert", str(tiny_official), str(dst), "--sentence"], env=_env())
    assert r.exit_code == 0, r.stderr[-3000:]
    expected = neoembed.load(dst).encode(TEXTS)
    out = tmp_path / "e.npy"
    code = block_neoembed + textwrap.dedent(f"""
        import numpy as np
        from sentence_transformers import SentenceTransformer
        np.save({str(out)!r}, SentenceTransformer({str(dst)!r}, trust_remote_code=True).encode({TEXTS!r}))
    """)
    assert np.abs(_encode_in_subprocess(code, out) - expected).max() <= 1e-6


def test_convert_sentence_keeps_a_folders_pooling_and_names_a_cde_models_checkpoints(
    tiny_official, tmp_path, run_neoembed
):
    """``--pooling`` defaulted to mean, so converting a cls-pooled folder was refused ("pooling='mean' would be
    ignored") for an option never given; a CDE folder was refused as one with "no config.json", and nothing more."""
    cls = tmp_path / "cls"
    r = run_neoembed(["convert", str(tiny_official), str(cls), "--sentence", "--pooling", "cls"], env=_env())
    assert r.exit_code == 0 and "Pooling[cls]" in r.stdout, r.stderr[-3000:]
    again = tmp_path / "again"
    r = run_neoembed(["convert", str(cls), str(again), "--sentence"], env=_env())
    assert r.exit_code == 0 and "Pooling[cls]" in r.stdout, r.stderr[-3000:]
    assert np.allclose(neoembed.load(again).encode(TEXTS), neoembed.load(cls).encode(TEXTS), atol=1e-6)
    # a plain checkpoint of it keeps neither its pooling nor its prompts: said, with the way back (walk P's P2)
    r = run_neoembed(["convert", str(cls), str(tmp_path / "off"), "--to", "official"], env=_env())
    assert r.exit_code == 0 and "is a plain checkpoint without its cls pooling" in r.stderr, r.stderr[-3000:]
    assert "--sentence --pooling cls` makes it one again" in r.stderr
    r = run_neoembed(
        ["convert", str(cls), str(tmp_path / "mean"), "--sentence", "--pooling", "mean"], env=_env()
    )
    assert r.exit_code == 2 and "pools by 'cls'" in r.stderr, r.stderr[-3000:]
    for extra, said in (
        (["--pooling", "cls"], "add --sentence"),
        (["--sentence", "--to", "official"], "choose one"),
    ):
        r = run_neoembed(["convert", str(tiny_official), str(tmp_path / "ignored"), *extra], env=_env())
        assert r.exit_code == 2 and said in r.stderr and not (tmp_path / "ignored").exists(), r.stderr[-2000:]

    from neoembed.cde.model import ContextualSentenceTransformer

    cde = tmp_path / "cde"
    ContextualSentenceTransformer.from_backbone(str(tiny_official), n_context=4).save(str(cde))
    for extra in ([], ["--sentence"]):
        r = run_neoembed(["convert", str(cde), str(tmp_path / "out"), *extra], env=_env())
        assert r.exit_code == 2, (extra, r.stdout[-2000:], r.stderr[-3000:])
        assert "not a checkpoint" in r.stderr and "first_stage/, second_stage/" in r.stderr, r.stderr[-3000:]


def test_fixture_mean_pooling_matches_official_hidden_states(tiny, tiny_expected):
    ids, mask = tiny_expected["input_ids"], tiny_expected["attention_mask"]
    with torch.no_grad():
        emb = tiny({"input_ids": ids, "attention_mask": mask})["sentence_embedding"]
    m = mask.unsqueeze(-1).float()
    ref = (tiny_expected["last_hidden_state"] * m).sum(1) / m.sum(1)
    assert (emb - ref).abs().max() <= 1e-4


def test_cls_pooling_and_normalize(tiny_official, tiny_expected):
    model = neoembed.load(tiny_official, pooling="cls", normalize=True)
    ids, mask = tiny_expected["input_ids"], tiny_expected["attention_mask"]
    with torch.no_grad():
        emb = model({"input_ids": ids, "attention_mask": mask})["sentence_embedding"]
    ref = torch.nn.functional.normalize(tiny_expected["last_hidden_state"][:, 0], dim=-1)
    assert (emb - ref).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="valid: \\['cls', 'mean'\\]"):  # the registry, POOLING_MODES
        neoembed.load(tiny_official, pooling="max")
    from neoembed.recipe import RecipeError, load_recipe
    from neoembed.train.recipe import UnifiedRecipe

    with pytest.raises(RecipeError, match="unknown pooling 'max'"):  # recipes read the same registry
        load_recipe("tiny", UnifiedRecipe, ["pooling=max"])


def test_minilm_reproduces_sentence_transformers(minilm_path):
    ours = neoembed.load(minilm_path).encode(TEXTS)
    ref = SentenceTransformer(str(minilm_path)).encode(TEXTS)
    assert np.abs(ours - ref).max() <= 1e-6


def test_max_seq_length_defaults_to_model_maximum(tiny, tiny_official):
    assert tiny.max_seq_length == 4096
    assert neoembed.load(tiny_official, max_seq_length=128).max_seq_length == 128


def test_a_neobert_max_length_past_what_it_supports_warns_and_is_kept(tiny_official, caplog):
    """``max_seq_length`` / ``--max-length`` past NeoBERT's supported length was refused as past "positions" it
    does not have (rotary: ``max_position_embeddings`` only aliases ``max_length``), a YaRN-extended model's
    too; it is kept with a warning, and within a RoPE scaling's reach with none."""
    from neoembed.sentence import set_max_seq_length

    with caplog.at_level("WARNING", logger="neoembed.sentence"):
        model = neoembed.load(tiny_official, max_seq_length=8192)
    assert model.max_seq_length == 8192
    assert "longer than the 4096 tokens" in caplog.text and "extrapolate" in caplog.text
    model[0].auto_model.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    caplog.clear()
    with caplog.at_level("WARNING", logger="neoembed.sentence"):
        set_max_seq_length(model, 8192, "yarn")
        assert not caplog.text
        set_max_seq_length(model, 8193, "yarn")
    assert "longer than the 8192 tokens yarn supports (trained at 4096, times its RoPE" in caplog.text


def test_train_warns_past_a_neobert_length_counting_its_rope_scaling(tiny_official, tmp_path, caplog):
    """``neoembed train``'s check (config.json, before the model loads) warned past ``max_length`` even where a
    YaRN scaling extends it; it reads the length the model supports, as :func:`set_max_seq_length` does."""
    import json
    import shutil
    from types import SimpleNamespace

    from neoembed.train.trainer import _check_max_length

    model = tmp_path / "yarn"
    shutil.copytree(tiny_official, model)
    config = json.loads((model / "config.json").read_text())
    config["rope_scaling"] = {"type": "yarn", "factor": 2.0}
    (model / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="neoembed.train.trainer"):
        _check_max_length(SimpleNamespace(model=str(model), max_length=8192))
        assert not caplog.text
        _check_max_length(SimpleNamespace(model=str(model), max_length=8193))
    assert "longer than the 8192 tokens" in caplog.text


def test_prompts_survive_save_and_query_differs_by_instruction(saved, tiny):
    path, _ = saved
    model = neoembed.load(path)
    assert model.prompts["query"] == "Represent the query for retrieval: "
    assert model.prompts["document"] == ""
    q = model.encode_query(["what is neobert"])
    manual = model.encode(["Represent the query for retrieval: what is neobert"])
    d = model.encode_document(["what is neobert"])
    plain = model.encode(["what is neobert"])
    assert np.abs(q - manual).max() <= 1e-6 and np.abs(d - plain).max() <= 1e-6
    assert np.abs(q - d).max() > 1e-3


def test_fp16_close_to_fp32(tiny_official):
    texts = TEXTS[:2] + ["a third, somewhat longer sentence to encode in half precision"]
    ref = neoembed.load(tiny_official).encode(texts, convert_to_tensor=True)
    half = neoembed.load(tiny_official, dtype="fp16").encode(texts, convert_to_tensor=True).float()
    assert torch.nn.functional.cosine_similarity(ref, half).min() >= 0.999


def test_padding_free_and_padded_encode_agree(tiny_official):
    texts = ["short", "a considerably longer sentence that forces padding in the batch", "mid length one"]
    a = neoembed.load(tiny_official, padding_free=True).encode(texts)
    b = neoembed.load(tiny_official, padding_free=False).encode(texts)
    assert np.abs(a - b).max() <= 1e-5


# ------------------------------------------------------------------------------------------ bad input
def test_multi_process_pool_equals_one_process(tiny):
    """Multi-device encoding goes through sentence-transformers' own process pool (here two CPU workers):
    the same embeddings as one process, whatever chunk each worker gets."""
    texts = [f"sentence number {i} " * (1 + i % 7) for i in range(40)] + TEXTS
    one = tiny.encode(texts, batch_size=8)
    pool = tiny.start_multi_process_pool(["cpu", "cpu"])
    try:
        two = tiny.encode(texts, pool=pool, batch_size=8, chunk_size=11)
    finally:
        tiny.stop_multi_process_pool(pool)
    assert two.shape == one.shape
    np.testing.assert_allclose(two, one, atol=1e-5, rtol=1e-5)


def test_empty_list_and_empty_string(tiny):
    assert tiny.encode([]).shape == (0, 64)
    assert tiny.encode([], convert_to_tensor=True).shape == (0, 64)
    assert np.isfinite(tiny.encode([""])).all()


def test_non_string_item_names_its_index(tiny):
    with pytest.raises(TypeError, match="item 2 is int"):
        tiny.encode(["a", "b", 3])


def test_truncation_warns_once(tiny_official):
    model = neoembed.load(tiny_official, max_seq_length=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.encode(
            [
                "one two three four five six seven eight nine ten",
                "eleven twelve thirteen fourteen fifteen sixteen seventeen",
                "short",
            ]
        )
    msgs = [str(w.message) for w in caught if "max_seq_length" in str(w.message)]
    assert len(msgs) == 1 and "2 text(s)" in msgs[0]


def test_not_a_model_and_missing_tokenizer(tiny_official, tmp_path, run_neoembed):
    with pytest.raises(FileNotFoundError, match="is not a model") as error:
        neoembed.load(tmp_path)
    assert "without a final model" not in str(error.value)
    run = tmp_path / "run"  # a run stopped before its final model (#43 walk, D7: export of it gave no hint)
    for step in (3, 12):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"checkpoints without a final model: use .*checkpoint-12, or finish"):
        neoembed.load(run)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        neoembed.load(tmp_path / "typo")
    # on the command line: the message and exit code 2, no traceback
    r = run_neoembed(["mteb", "--model", str(tmp_path), "--tasks", "STS13"], env=_env())
    assert r.exit_code == 2 and "is not a model" in r.stderr and "Traceback" not in r.stderr, r.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_official / f, bare / f)
    with pytest.raises(FileNotFoundError, match="no tokenizer files.*tokenizer="):
        neoembed.load(bare)
    model = neoembed.load(bare, tokenizer=str(tiny_official))
    assert model.encode(["works with a separate tokenizer"]).shape == (1, 64)


def test_non_finite_output_raises_with_advice(tiny_official):
    model = neoembed.load(tiny_official)
    with torch.no_grad():
        model[0].auto_model.layer_norm.weight[0] = float("nan")
    with pytest.raises(NonFiniteEmbeddingError, match="bf16"):
        model.encode(["nan please"])


def test_push_to_hub_writes_a_card_that_loads_the_pushed_id(tiny_official, fake_hub):
    model = neoembed.load(tiny_official)
    model.push_to_hub("someone/neobert-st")
    pushed = fake_hub / "someone" / "neobert-st"
    card = (pushed / "README.md").read_text()
    assert "base_model:" not in card and str(tiny_official) not in card  # a local model: no hub id to name
    assert 'neoembed.load("someone/neobert-st")' in card
    assert 'SentenceTransformer("someone/neobert-st", trust_remote_code=True)' in card
    assert (
        json.loads((pushed / "config.json").read_text())["auto_map"]["AutoModel"]
        == "modeling_neobert.NeoBERTModel"
    )
    assert np.abs(neoembed.load(pushed).encode(TEXTS) - model.encode(TEXTS)).max() <= 1e-6


@pytest.mark.slow
def test_a_fresh_virtual_environment_without_neoembed_gives_the_same_embeddings(saved, tmp_path):
    """The check of the issue as a user would run it: a new venv with torch, transformers and
    sentence-transformers from the package index (same versions as here) and no neoembed at all."""
    import importlib.metadata as md
    import os

    path, expected = saved
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    pins = [f"{p}=={md.version(p).split('+')[0]}" for p in ("torch", "transformers", "sentence-transformers")]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONPATH")
    }
    r = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", *pins], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "e.npy"
    code = textwrap.dedent(f"""
        import importlib.util, numpy as np
        assert importlib.util.find_spec('neoembed') is None, 'neoembed is installed in the fresh venv'
        from sentence_transformers import SentenceTransformer
        m = SentenceTransformer({str(path)!r}, trust_remote_code=True)
        np.save({str(out)!r}, m.encode({TEXTS!r}, convert_to_numpy=True))
    """)
    r = subprocess.run(
        [str(py), "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**env, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert np.abs(np.load(out) - expected).max() <= 1e-6


def test_sentence_transformers_flattening_equals_padded(tiny_official, monkeypatch):
    """With flash attention on CUDA, sentence-transformers packs each batch itself (DataCollatorWithFlattening,
    long and short texts interleaved) and NeoBERT takes the packed input. flash-attn is absent here, so the
    packing is switched on by hand; the packed batches then run through the grouped CPU attention."""
    import transformers.modeling_flash_attention_utils as fa
    from sentence_transformers.base.modules import Transformer

    texts = TEXTS + [" ".join(["a longer text with some more words in it"] * k) for k in (3, 9, 1)]
    expected = neoembed.load(tiny_official, padding_free=False).encode(texts, batch_size=3)
    model = neoembed.load(tiny_official)
    assert not model._can_flatten_inputs()  # no flash attention requested
    monkeypatch.setattr(Transformer, "_is_flash_attention_requested", lambda self: True)
    monkeypatch.setattr(
        fa, "lazy_import_flash_attention", lambda *a, **k: ((None, object(), None, None), None)
    )
    model[0].unpad_inputs = True
    assert model._can_flatten_inputs()
    seen, forward = [], model[0].auto_model.forward

    def spy(**kwargs):  # sentence-transformers calls forward() directly, past any hook
        seen.append(kwargs["input_ids"].shape)
        return forward(**kwargs)

    model[0].auto_model.forward = spy
    got = model.encode(texts, batch_size=3)
    assert seen and all(s[0] == 1 for s in seen)  # every batch arrived packed
    assert np.abs(got - expected).max() <= 1e-5


def test_base_model_is_the_models_hub_id_never_a_folder(minilm_path, tiny_official, tmp_path, monkeypatch):
    """A model card's ``base_model``: the packaged MiniLM's hub id (by its ``packaged:`` name or its folder, which
    is called ``model``), a hub id as given, a local folder's ``_name_or_path`` only when that is a hub id; else
    none at all (not the folder's name, not a path of this machine)."""
    hub = "sentence-transformers/all-MiniLM-L6-v2"
    assert base_model_name("packaged:all-MiniLM-L6-v2") == hub
    assert minilm_path.name == "model" and base_model_name(minilm_path) == hub
    assert base_model_name("chandar-lab/NeoBERT") == "chandar-lab/NeoBERT"
    assert base_model_name(tiny_official) is None
    for named, expected in [("someone/base-v1", "someone/base-v1"), (str(tmp_path), None), ("model", None)]:
        folder = tmp_path / "runs" / "model"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(tiny_official, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": named}))
        assert base_model_name(folder) == expected, named
        monkeypatch.chdir(tmp_path / "runs")
        assert base_model_name("model") == expected, named  # relative, as a command line gives it
    card = model_card_text("run", base_model_name(minilm_path))
    assert f"base_model: {hub}\n" in card and f"fine-tuned with neoembed from `{hub}`" in card
    card = model_card_text("run", None)
    assert "base_model" not in card and "from a local model that names no hub id" in card


def test_the_model_card_says_what_was_optimised_and_how_queries_go():
    """#43, a walk's R16 and R36: the card said "InfoNCE" for a run of KL distillation alone under GradCache,
    and pointed a model trained without instructions to a saved query prompt that is empty."""
    from pathlib import Path

    from neoembed.model_card import PROMPT_NOTE
    from neoembed.recipe import load_recipe
    from neoembed.train.recipe import UnifiedRecipe
    from neoembed.train.trainer import _objective_notes

    tiny = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"
    kl = ["distillation={loss: kl, infonce_weight: 0}", "loss={name: cached_infonce, mini_batch_size: 4}"]
    said = _objective_notes(load_recipe(tiny, UnifiedRecipe, kl))
    assert said.startswith("Distillation alone: kl distillation") and "InfoNCE" not in said
    assert "GradCache in mini-batches of 4 texts" in said
    masked = _objective_notes(load_recipe(tiny, UnifiedRecipe, ["false_negatives={margin: 0.1}"]))
    assert masked.startswith("Unified contrastive recipe: InfoNCE") and "absolute margin 0.1, scope all" in masked
    bare = model_card_text("run", None, query_prompt="", prefixed=False)
    assert "Queries were trained without a prefix" in bare and PROMPT_NOTE not in bare
    several = model_card_text("run", None, query_prompt="", prefixed=True)
    assert "its own instruction" in several and PROMPT_NOTE not in several
    assert PROMPT_NOTE in model_card_text("run", None, query_prompt="query: ")


def test_a_width_the_model_was_not_trained_at_is_said(saved, tmp_path, caplog):
    """truncate_dim=20 on a model trained at 32, 16 and 8 dimensions loaded without a word, though its card says to
    load with one of them."""
    from neoembed.sentence import record_matryoshka_dims

    path, _ = saved
    trained = tmp_path / "trained"
    shutil.copytree(path, trained)
    record_matryoshka_dims(trained, [32, 16, 8])
    for width, said in ((20, True), (16, False), (32, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="neoembed.sentence"):
            assert neoembed.load(trained, truncate_dim=width).encode(TEXTS).shape[1] == width
        warned = "truncate_dim=20 is not one of the dimensions this model was trained at (32, 16, 8)" in caplog.text
        assert warned is said


def test_a_saved_copy_keeps_the_matryoshka_dimensions(saved, tmp_path):
    """#43, a walk's E3: `neoembed export` (any load-then-save) wrote config_sentence_transformers.json without
    the dimensions the model was trained for (sentence-transformers keeps no key it does not know)."""
    from neoembed.sentence import matryoshka_dims, record_matryoshka_dims

    path, _ = saved
    trained = tmp_path / "trained"
    shutil.copytree(path, trained)
    record_matryoshka_dims(trained, [8, 32, 16])
    neoembed.load(trained).save(str(tmp_path / "copy"))
    assert matryoshka_dims(tmp_path / "copy") == [32, 16, 8]
    neoembed.load(path).save(str(tmp_path / "plain"))
    assert matryoshka_dims(tmp_path / "plain") is None


def test_a_saved_folder_refuses_building_options_it_would_ignore(saved):
    """pooling, normalize and tokenizer build a bi-encoder from a plain checkpoint; a saved folder ignored them
    silently. Now: its own pooling is accepted, another refused by name, and nothing trusts remote code unasked."""
    path, expected = saved
    model = neoembed.load(path, pooling="mean")  # the folder's own
    assert model.trust_remote_code is False
    assert np.abs(model.encode(TEXTS, convert_to_numpy=True) - expected).max() <= 1e-6
    with pytest.raises(ValueError, match=r"pools by 'mean'; pooling='cls' would be ignored"):
        neoembed.load(path, pooling="cls")
    for options in ({"normalize": True}, {"tokenizer": str(path)}):
        with pytest.raises(ValueError, match="saved sentence-transformers model.*would be ignored"):
            neoembed.load(path, **options)
    with pytest.raises(ValueError, match="file_name='model.onnx' picks the graph of an ONNX export"):
        neoembed.load(path, file_name="model.onnx")


def test_a_module_type_neoembed_no_longer_has_is_named_not_trusted(saved, tmp_path):
    import shutil

    path, _ = saved
    old = tmp_path / "old"
    shutil.copytree(path, old)
    modules = json.loads((old / "modules.json").read_text())
    modules[1]["type"] = "neoembed.sentence.RemovedPooling"
    (old / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(
        ValueError, match=r"names the module type 'neoembed.sentence.RemovedPooling', which this"
    ):
        neoembed.load(old)


def test_walk_an_empty_call_has_the_shape_and_dtype_of_its_options(tiny):
    """E8: encode([]) gave (0, full width) float32 whatever truncate_dim or precision the call asked for, and an
    empty array of strings gave shape (0,)."""
    assert tiny.encode([], truncate_dim=8).shape == (0, 8)
    for precision, width, dtype in (("int8", 64, np.int8), ("ubinary", 8, np.uint8), ("binary", 8, np.int8)):
        empty = tiny.encode([], precision=precision)
        some = tiny.encode(["a", "b"], precision=precision)
        assert empty.shape == (0, width) == (0, some.shape[1]) and empty.dtype == some.dtype == dtype
    assert tiny.encode(np.array([], dtype=str)).shape == (0, 64)
    strings = np.array(["an array", "of strings"])
    assert np.array_equal(tiny.encode(strings), tiny.encode(list(strings)))


def test_walk_truncation_counts_the_prompt(tiny_official):
    """E9: a prompt that pushed a text past max_seq_length truncated it with no warning: the text was measured
    without its prompt."""
    model = neoembed.load(tiny_official, max_seq_length=16, prompts={"query": "a b c d e f g h i j k "})
    text = "one two three four five six seven eight nine"  # fits alone, not after the prompt
    for kwargs in ({}, {"prompt_name": "query"}, {"prompt": "a b c d e f g h i j k "}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.encode([text], **kwargs)
        said = [str(w.message) for w in caught if "max_seq_length" in str(w.message)]
        assert len(said) == (1 if kwargs else 0), (kwargs, said)
        assert not kwargs or "with their prompt" in said[0]


def test_walk_nan_is_found_before_quantization(tiny_official):
    """E10: NaN embeddings asked for as int8 or binary codes came back as codes (0s, -128s)."""
    model = neoembed.load(tiny_official)
    with torch.no_grad():
        model[0].auto_model.layer_norm.weight[0] = float("nan")
    for kwargs in (
        {"precision": "int8"},
        {"precision": "ubinary"},
        {"precision": "int8", "max_batch_tokens": 64},
    ):
        with pytest.raises(NonFiniteEmbeddingError, match="bf16"):
            model.encode(["nan please", "and again"], **kwargs)


def test_walk_load_options_a_model_cannot_take_are_refused(tiny_official, minilm_path):
    """E3-E6: a misspelt packaged name reached the hub client, max_seq_length 0 meant no truncation (and -5 an
    OverflowError), padding_free=True was dropped for a model without it, and a default_prompt_name naming no
    prompt left every text without one."""
    with pytest.raises(ValueError, match="the one packaged is packaged:all-MiniLM-L6-v2"):
        neoembed.load("packaged:all-MiniLM-L6")
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match="max_seq_length takes a positive whole number"):
            neoembed.load(tiny_official, max_seq_length=bad)
    with pytest.raises(ValueError, match="padding_free is NeoBERT's option"):
        neoembed.load(minilm_path, padding_free=True)
    neoembed.load(minilm_path, padding_free=False)  # padded: what it runs (mining asks for it on CPU)
    with pytest.raises(ValueError, match=r"default_prompt_name 'qurey' is not one of the model's prompts"):
        neoembed.load(minilm_path, prompts={"query": "query: "}, default_prompt_name="qurey")
    model = neoembed.load(minilm_path, prompts={"query": "query: "}, default_prompt_name="query")
    assert np.allclose(model.encode(["x"]), model.encode(["query: x"], prompt=""))
