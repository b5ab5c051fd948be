"""LoRA adapters (neoembed.adapters, ``adapter:`` in the unified recipe): merged == unmerged, a LoRA run saved merged
and as an adapter alone, the merged model loaded in a fresh process without neoembed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import neoembed
from neoembed.adapters import add_lora, count_parameters, merge_lora
from neoembed.recipe import load_recipe
from neoembed.train.recipe import UnifiedRecipe
from neoembed.train.trainer import train

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"
TEXTS = ["a sentence", "Return the absolute value of a number.", "os.path.join(a, *p)"]


def _printed(code: str) -> list:
    """The JSON list a fresh Python process running ``code`` prints last."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _randomise_lora(model) -> None:
    """A fresh LoRA adapter adds zero (B = 0): give B weights so that merging has something to fold in."""
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)


@pytest.mark.parametrize("which", ["neobert", "minilm"])
def test_merged_adapter_gives_the_unmerged_models_embeddings(which, tiny_official, minilm_path):
    model = neoembed.load(tiny_official if which == "neobert" else minilm_path)
    base = model.encode(TEXTS, convert_to_tensor=True)
    add_lora(model, r=4, alpha=8)
    trainable, total = count_parameters(model)
    assert 0 < trainable < total / 20
    _randomise_lora(model)
    unmerged = model.encode(TEXTS, convert_to_tensor=True)
    assert (unmerged - base).abs().max() > 1e-3  # the adapter changes the embeddings (every target is wired)
    merge_lora(model)
    merged = model.encode(TEXTS, convert_to_tensor=True)
    assert not any("lora_" in n for n, _ in model.named_parameters())
    # fp32 re-association of W x + B A x: the tolerance of the reference's own rounding, not a loose one
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)


def test_lora_targets_that_name_no_layer_and_a_rank_past_the_width_are_said(tiny_official, caplog):
    """A fault walk's l3 (PEFT's "Target modules {...} not found", no layer named) and l2 (a rank of 100,000 on
    a 64-wide model trained 80M parameters without a word)."""
    with pytest.raises(ValueError, match=r"names no layer of this model; its linear layers are \[.*'qkv'"):
        add_lora(neoembed.load(tiny_official), r=4, alpha=8, target_modules=["nonexistent_layer"])
    add_lora(neoembed.load(tiny_official), r=4, alpha=8)
    assert "adapter.r" not in caplog.text
    add_lora(neoembed.load(tiny_official), r=64, alpha=8)
    assert "adapter.r=64 is at least the width of the layers it adapts (the narrowest: 64)" in caplog.text


def test_an_adapter_whose_base_moved_names_it(tiny_official, tmp_path):
    # a fault walk's ad1: the hub client's "Repo id must be in the form 'repo_name'..." for a moved folder
    import shutil

    from neoembed.adapters import save_adapter

    base = shutil.copytree(tiny_official, tmp_path / "base")
    model = neoembed.load(base)
    add_lora(model, r=4, alpha=8)
    save_adapter(model, tmp_path / "adapter")
    shutil.rmtree(base)
    with pytest.raises(FileNotFoundError, match=rf"base model {base} \(base_model_name_or_path .* does not exist"):
        neoembed.load(tmp_path / "adapter")


def test_an_adapter_of_a_hub_model_names_its_hub_id_and_commit(tiny_official, tmp_path, monkeypatch, caplog):
    """An adapter trained on a hub model named the base by the machine's cache path (a sentence-transformers
    model loads from its snapshot folder), which loads nowhere else (#43). It names the hub id and the commit
    (PEFT's ``revision``); neoembed.load puts it on that commit from the cache, offline too."""
    import shutil

    import huggingface_hub
    import huggingface_hub.constants

    import neoembed.hub
    from neoembed.adapters import save_adapter
    from neoembed.hub import PACKAGED_MINILM, hub_reference, pinned_snapshot, resolve_packaged

    commit = "0123456789abcdef0123456789abcdef01234567"
    for name, save in (("tiny", shutil.copytree), ("tiny-st", lambda _, to: neoembed.load(tiny_official).save(to))):
        repo = tmp_path / "hub" / f"models--someone--{name}"  # a plain checkpoint, a sentence-transformers model
        save(tiny_official, repo / "snapshots" / commit)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for name in ("someone/tiny", "someone/tiny-st"):
        model = neoembed.load(name)
        add_lora(model, r=4, alpha=8)
        for p in model.parameters():  # a trained adapter: PEFT starts lora_B at zero
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.05)
        want = model.encode(TEXTS)
        save_adapter(model, tmp_path / name)
        config = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert (config["base_model_name_or_path"], config["revision"]) == (name, commit)
        assert neoembed.load(tmp_path / name).encode(TEXTS) == pytest.approx(want, abs=1e-5)
    assert hub_reference(tiny_official) == (str(tiny_official), None)  # a local folder stays as it is
    assert hub_reference(resolve_packaged(PACKAGED_MINILM[0]))[0] == PACKAGED_MINILM[1]
    assert pinned_snapshot("someone/tiny", "f" * 40) == "someone/tiny"  # not cached, offline: the newest, said
    assert "commit ffff" in caplog.text and "could not be downloaded" in caplog.text
    # online, a commit the cache lacks is downloaded (it loaded the hub's newest)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(neoembed.hub, "hub_unreachable_reason", lambda: None)
    asked = []
    monkeypatch.setattr(
        huggingface_hub,
        "snapshot_download",
        lambda name, revision, ignore_patterns: asked.append((name, revision, "onnx/*" in ignore_patterns))
        or "fetched",
    )
    assert pinned_snapshot("someone/tiny", "f" * 40) == "fetched" and asked == [("someone/tiny", "f" * 40, True)]


def test_lora_run_saves_merged_and_adapter_and_loads_without_neoembed(
    tmp_path, tiny_official, block_neoembed, run_neoembed
):
    out = tmp_path / "lora"
    overrides = [
        f"model={tiny_official}",
        f"output_dir={out}",
        "datasets=[{card: pydoc_names, max_rows: 64}]",
    ]
    recipe = load_recipe(
        TINY,
        UnifiedRecipe,
        [*overrides, "steps=4", "save_steps=2", "adapter={r: 4, alpha: 8}", "matryoshka={dims: [64, 8]}"],
    )
    train(recipe, recipe_dir=TINY.parent)
    assert "Trained as a LoRA adapter (rank 4, alpha 8.0)" in (out / "README.md").read_text()  # #43, R16
    merged = neoembed.load(out)
    from neoembed.sentence import matryoshka_dims

    assert matryoshka_dims(out / "adapter") == matryoshka_dims(out) == [64, 8]  # adapter/ had none
    checkpoints = list(out.glob("checkpoint-*"))  # exported or loaded as they are: the dims go with them
    assert checkpoints and all(matryoshka_dims(c) == [64, 8] for c in checkpoints), checkpoints
    emb = merged.encode(TEXTS)
    assert not torch.allclose(torch.tensor(emb), torch.tensor(neoembed.load(tiny_official).encode(TEXTS)))
    # the adapter alone: neoembed.load finds its base model and applies it; the merged model's embeddings
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["qkv", "w12", "w3", "wo"] and config["r"] == 4
    assert config["base_model_name_or_path"] == str(tiny_official)
    assert neoembed.load(out / "adapter").encode(TEXTS) == pytest.approx(emb, abs=1e-5)
    # with the run's query prompt (its card's instruction) and token limit: it was saved with neither
    alone = neoembed.load(out / "adapter")
    assert alone.prompts == merged.prompts and merged.prompts["query"]
    assert alone.max_seq_length == merged.max_seq_length == neoembed.load(tiny_official).max_seq_length
    assert alone.encode_query(TEXTS) == pytest.approx(merged.encode_query(TEXTS), abs=1e-5)
    # PEFT's own loader on the base backbone: the keys carry its prefix (without it, PeftModel.from_pretrained
    # found no adapter weight, warned, and left the base model as it was)
    from peft import PeftModel
    from transformers import AutoModel

    batch = {k: v for k, v in merged.tokenize(TEXTS).items() if k in ("input_ids", "attention_mask")}
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        want = merged[0].auto_model(**batch).last_hidden_state[real]
        peft = PeftModel.from_pretrained(AutoModel.from_pretrained(str(tiny_official)), str(out / "adapter"))
        got = peft(**batch).last_hidden_state[real]
        base = AutoModel.from_pretrained(str(tiny_official))(**batch).last_hidden_state[real]
    assert not torch.allclose(base, want, atol=1e-3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # trained further as a model, the adapter alone failed in autograd: refused, naming what to train from
    again = run_neoembed(["train", "tiny", f"model={out / 'adapter'}", f"output_dir={tmp_path / 'again'}"])
    assert again.exit_code == 2 and "is a LoRA adapter saved alone" in again.stderr, again.stderr
    assert not (tmp_path / "again").exists()
    short = neoembed.load(out / "adapter", truncate_dim=8).encode(TEXTS)  # its options reach the base model
    assert short == pytest.approx(neoembed.load(out, truncate_dim=8).encode(TEXTS), abs=1e-5)
    assert short.shape == (len(TEXTS), 8)
    # ... and plain sentence-transformers loads the adapter folder too (base model + adapter, its pipeline)
    code = (
        "import neoembed  # registers NeoBERT with transformers' Auto classes\n"
        "from sentence_transformers import SentenceTransformer\n"
        f"print(SentenceTransformer({str(out / 'adapter')!r}).encode({TEXTS!r}).tolist())\n"
    )
    from_adapter = _printed(code)
    torch.testing.assert_close(torch.tensor(from_adapter), torch.tensor(emb), atol=1e-5, rtol=0)
    # a fresh process, neoembed not importable: plain sentence-transformers loads the merged model
    code = block_neoembed + (
        "from sentence_transformers import SentenceTransformer\n"
        f"print(SentenceTransformer({str(out)!r}, trust_remote_code=True).encode({TEXTS!r}).tolist())\n"
    )
    plain = _printed(code)
    torch.testing.assert_close(torch.tensor(plain), torch.tensor(emb), atol=1e-6, rtol=0)


def test_cde_adapters_alone_load_with_neoembed_and_plain_sentence_transformers(
    tmp_path, minilm_path, block_neoembed
):
    """A CDE model's adapters saved alone (both stages in PEFT's layout, the head, cde_adapter.json naming the
    base): neoembed.load and plain sentence-transformers without neoembed rebuild the model whose embeddings
    equal the merged model's."""
    import copy

    from neoembed.cde.model import ContextualSentenceTransformer, save_cde_adapter

    docs = [
        *TEXTS,
        "Split the pathname path into a pair (head, tail).",
        "Return True if path is a directory.",
    ]
    model = ContextualSentenceTransformer.from_backbone(
        str(minilm_path), n_context=4, n_soft_prompt=2, prompts={"query": "query: ", "document": ""}
    ).eval()
    add_lora(model, r=4, alpha=8, train_heads=True)
    _randomise_lora(model)
    with torch.no_grad():  # the head trains in full: it must travel with the adapters
        for name, param in model.named_parameters():
            if "output_mlp" in name:
                param.normal_(0, 0.05)
    adapter = save_cde_adapter(model, tmp_path / "adapter")
    for stage in ("first_stage", "second_stage"):
        assert sorted(p.name for p in (adapter / stage).iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]  # no copy of the base encoder
    merged = copy.deepcopy(model)
    merge_lora(merged)
    context = merged.encode_context(docs)
    expected = merged.encode(TEXTS, prompt_name="query", dataset_embeddings=context)
    loaded = neoembed.load(adapter)
    assert loaded.prompts["query"] == "query: "
    torch.testing.assert_close(loaded.encode_context(docs), context, atol=1e-5, rtol=0)
    got = loaded.encode(TEXTS, prompt_name="query", dataset_embeddings=loaded.encode_context(docs))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)
    code = block_neoembed + (
        "from sentence_transformers import SentenceTransformer\n"
        f"m = SentenceTransformer({str(adapter)!r}, trust_remote_code=True)\n"
        f"E = m[0].encode_context({docs!r}, prompt=m.prompts.get('document'))\n"
        f"print(m.encode({TEXTS!r}, prompt_name='query', dataset_embeddings=E).tolist())\n"
    )
    plain = _printed(code)
    torch.testing.assert_close(torch.tensor(plain), torch.tensor(expected), atol=1e-5, rtol=0)


def test_case4_lora_run_stopped_by_a_signal_resumes_and_finishes(tmp_path, tiny_official, monkeypatch, sigterm_at):
    """A LoRA run's checkpoints hold PEFT's layer names (``qkv.base_layer.weight``, ``lora_A``): ``--resume`` after a
    SIGTERM failed with "does not match NeoBERTModel: missing keys". It resumes now, exactly: the same losses and
    the same final model (merged, and the adapter alone) as the run that was never stopped."""
    from safetensors.torch import load_file

    from neoembed.runs import TrainingInterrupted
    from neoembed.train import trainer as trainer_mod

    def recipe(out):
        overrides = [f"model={tiny_official}", f"output_dir={out}", "steps=6", "save_steps=2"]
        overrides += ["datasets=[{card: pydoc_names, max_rows: 64}]", "adapter={r: 4, alpha: 8}"]
        return load_recipe(TINY, UnifiedRecipe, overrides)

    def losses(out):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    full = train(recipe(tmp_path / "full"), recipe_dir=TINY.parent)
    out = tmp_path / "stopped"
    real = trainer_mod.unified_step
    sigterm_at(trainer_mod, "unified_step", 3)  # step 4 ends the run with checkpoint-4
    with pytest.raises(TrainingInterrupted, match="continue with --resume"):
        train(recipe(out), recipe_dir=TINY.parent)
    saved = load_file(str(out / "checkpoint-4" / "state" / "model.safetensors"))
    assert any("lora_A" in k for k in saved)  # the state resumed from is the adapter run's, not a merged copy
    loadable = load_file(str(out / "checkpoint-4" / "model.safetensors"))
    assert not any("lora" in k for k in loadable)  # beside it, the merged model that loads anywhere
    assert not (out / "model.safetensors").exists()
    monkeypatch.setattr(trainer_mod, "unified_step", real)
    train(recipe(out), recipe_dir=TINY.parent, resume=True)
    assert losses(out) == pytest.approx(losses(full), abs=1e-6) and sorted(losses(out)) == [1, 2, 3, 4, 5, 6]
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(str(out / name)), load_file(str(full / name))
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), name
