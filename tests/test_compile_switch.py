"""neoembed.compile: compiled layers equal eager ones (outputs and gradients, inductor on CPU), and bucketed
encoding equals plain encoding; the compile switch of load() and of the three recipes."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

import neoembed
from neoembed.compile import (
    DEFAULT_LENGTH_BUCKETS,
    bucket_batch,
    bucket_length,
    compile_layers,
    enable_bucketing,
    length_buckets_for,
    repeated_layers,
    resolve_compile_mode,
)


@pytest.fixture(scope="module")
def sentences(shared_dir) -> list[str]:
    """Real sentences of several lengths, plus long ones made of several sentences (truncated at 128 tokens)."""
    out: list[str] = []
    with gzip.open(next(shared_dir.glob("data/mteb/STS12/*.jsonl.gz")), "rt", encoding="utf8") as fh:
        for line, _ in zip(fh, range(20), strict=False):
            row = json.loads(line)
            out += [row["sentence1"], row["sentence2"]]
    return out[:37] + [" ".join(out[i : i + 12]) for i in range(3)]


# ------------------------------------------------------------------------------------------- pure functions
def test_bucket_length_picks_the_smallest_bucket_that_fits():
    assert [bucket_length(n, (16, 32, 48)) for n in (1, 16, 17, 32, 33, 48)] == [16, 16, 32, 32, 48, 48]
    assert DEFAULT_LENGTH_BUCKETS[:6] == (16, 32, 48, 64, 96, 128) and DEFAULT_LENGTH_BUCKETS[-1] == 8192
    with pytest.raises(ValueError, match="exceeds the largest bucket 48"):
        bucket_length(49, (16, 32, 48))
    with pytest.raises(ValueError, match=">= 1"):
        bucket_length(0)


def test_bucket_batch_is_the_next_power_of_two():
    assert [bucket_batch(n) for n in (1, 2, 3, 5, 8, 9, 32, 33)] == [1, 2, 4, 8, 8, 16, 32, 64]
    with pytest.raises(ValueError, match=">= 1"):
        bucket_batch(0)


def test_length_buckets_are_capped_at_the_maximum_length():
    assert length_buckets_for(100, (16, 32, 64, 128)) == (16, 32, 64, 100)
    assert length_buckets_for(128, (16, 32, 64, 128)) == (16, 32, 64, 128)


def test_resolve_compile_mode_names_the_valid_settings():
    assert [resolve_compile_mode(v) for v in (False, None, True, "reduce-overhead")] == [
        None,
        None,
        "default",
        "reduce-overhead",
    ]
    with pytest.raises(ValueError, match="'fast'.*reduce-overhead"):
        resolve_compile_mode("fast")


# ------------------------------------------------------------------------------------------------ bucketing
def test_bucketed_encode_equals_plain_encode(tiny_official, sentences):
    model = neoembed.load(tiny_official, max_seq_length=128, bucketing=True)
    backbone = model[0].auto_model
    assert backbone.config.padding_free is False  # the padded layout: shapes set by the buckets alone
    seen: list[tuple[int, int]] = []
    backbone.transformer_encoder[0].register_forward_hook(lambda m, a, out: seen.append(tuple(a[0].shape)))
    keys = set(model.state_dict())
    batch_sizes = (
        5,
        16,
    )  # 40 texts: the last batch is partial with 16 (8 real rows padded to 8, then 16 -> 8)
    got = [model.encode(sentences, batch_size=b, convert_to_tensor=True) for b in batch_sizes]
    assert seen and all(B == bucket_batch(B) and L in (16, 32, 48, 64, 96, 128) for B, L, _ in seen), seen
    assert any(L == 128 for _, L, _ in seen)  # the truncated long texts land in the capped last bucket
    assert {B for B, _, _ in seen} == {8, 16}  # 5 real rows run as 8
    assert set(model.state_dict()) == keys  # hooks, not wrappers: saving is unchanged

    for handle in model.neoembed_bucketing:  # plain encoding again, in the default padding-free layout
        handle.remove()
    backbone.config.padding_free = True
    n_seen = len(seen)
    for b, g in zip(batch_sizes, got, strict=True):
        want = model.encode(sentences, batch_size=b, convert_to_tensor=True)
        assert g.shape == want.shape == (len(sentences), 64)
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
    assert all(shape[0] == 1 for shape in seen[n_seen:])  # really unbucketed: (1, T, D) packed tokens


def test_bucketing_cuts_the_output_back_and_passes_other_input_through(tiny_official):
    from neoembed.modeling import NeoBERTModel

    model = NeoBERTModel.from_pretrained(tiny_official).eval()
    model.config.padding_free = False
    ids = torch.tensor([[101, 2023, 2003, 102, 0], [101, 7592, 102, 0, 0], [101, 2, 3, 4, 102]])
    mask = (ids != 0).long()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        (handle,) = enable_bucketing(model, buckets=(8, 16), max_length=16)
        got = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        embeds = model.encoder(ids)
        via_embeds = model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state  # not bucketed
        handle.remove()
        after = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert got.last_hidden_state.shape == want.shape == (3, 5, 64)
    assert all(h.shape == (3, 5, 64) for h in got.hidden_states)
    real = mask.bool()
    torch.testing.assert_close(got.last_hidden_state[real], want[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(via_embeds[real], want[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, want)


# ------------------------------------------------------------------------------------------ compiled layers
def test_repeated_layers_are_the_blocks_transformers_names(tiny_official, minilm_path):
    from neoembed.modeling import NeoBERTModel

    neo = NeoBERTModel.from_pretrained(tiny_official)
    assert repeated_layers(neo) == list(neo.transformer_encoder)
    minilm = neoembed.load(minilm_path)
    assert {type(m).__name__ for m in repeated_layers(minilm)} == {"BertEmbeddings", "BertLayer"}
    with pytest.raises(ValueError, match="no repeated layers in Linear"):
        compile_layers(torch.nn.Linear(2, 2))


def _loss(model, ids, mask) -> torch.Tensor:
    h = model(input_ids=ids, attention_mask=mask).last_hidden_state
    weights = torch.linspace(-1, 1, h.shape[-1])
    return ((h * weights).sum(-1) * mask).sum() / mask.sum()


def test_compiled_model_matches_eager_outputs_and_gradients(tiny_official, sentences):
    """Inductor on CPU fuses RMSNorm (float32 statistics), RoPE and SwiGLU inside each block: same outputs and
    gradients as eager, through load(compile=True) and the encoder alone. One compilation each for inference and
    training (symbolic shapes), so two batch shapes cost no more."""
    eager = neoembed.load(tiny_official, max_seq_length=128)
    compiled = neoembed.load(tiny_official, max_seq_length=128, compile=True)
    blocks = compiled[0].auto_model.transformer_encoder
    assert all(b._compiled_call_impl is not None for b in blocks)
    assert set(compiled.state_dict()) == set(eager.state_dict())  # compiled in place: names unchanged

    want = eager.encode(sentences, batch_size=16, convert_to_tensor=True)
    got = compiled.encode(sentences, batch_size=16, convert_to_tensor=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    tok = eager.tokenizer
    ref_model, model = eager[0].auto_model.train(), compiled[0].auto_model.train()
    ref_model.config.padding_free = False  # the layout the compiled CPU model runs (equal to padding-free)
    for texts in (sentences[:6], sentences[20:28]):  # two shapes
        enc = tok(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
        ref_model.zero_grad()
        model.zero_grad()
        _loss(ref_model, enc["input_ids"], enc["attention_mask"]).backward()
        loss = _loss(model, enc["input_ids"], enc["attention_mask"])
        loss.backward()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
            # gradients to float32 rounding of their own scale
            scale = q.grad.abs().max().clamp_min(1e-12)
            assert (p.grad - q.grad).abs().max() <= 1e-4 * scale, name


# --------------------------------------------------------------------------------------------- the switches
def test_load_rejects_an_unknown_compile_setting(tiny_official):
    with pytest.raises(ValueError, match="compile='yes' is not a compile setting"):
        neoembed.load(tiny_official, compile="yes")


@pytest.mark.parametrize(
    "module, schema",
    [
        ("neoembed.train.recipe", "UnifiedRecipe"),
        ("neoembed.cde.recipe", "CDERecipe"),
        ("neoembed.pretrain.recipe", "PretrainRecipe"),
    ],
)
def test_recipes_have_a_compile_switch_off_by_default(module, schema):
    import importlib

    from neoembed.recipe import RecipeError, load_recipe

    cls = getattr(importlib.import_module(module), schema)
    base = (
        {"seed": 0, "data": {"sources": [{"path": "x"}]}, "steps": 10, "schedule": {"warmup_steps": 1}}
        if schema == "PretrainRecipe"
        else {"seed": 0, "model": "m", "datasets": [{"card": "c"}]}
    )
    assert load_recipe(base, cls).compile is False
    assert load_recipe(base, cls, ["compile=true"]).compile is True
    assert (
        load_recipe(base, cls, ["compile=max-autotune-no-cudagraphs"]).compile == "max-autotune-no-cudagraphs"
    )
    with pytest.raises(RecipeError, match="compile"):
        load_recipe(base, cls, ["compile=reduce-overhead"])  # CUDA graphs need fixed shapes: encoding only


def test_pretraining_compiles_the_blocks_when_asked(tiny_official):
    from transformers import AutoTokenizer

    from neoembed.pretrain.recipe import PretrainRecipe
    from neoembed.pretrain.trainer import _build_model
    from neoembed.recipe import load_recipe

    recipe = load_recipe(
        {
            "seed": 0,
            "model": {"config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}},
            "data": {"sources": [{"path": "x"}], "seq_length": 64},
            "steps": 10,
            "schedule": {"warmup_steps": 1},
            "compile": True,
        },
        PretrainRecipe,
    )
    model = _build_model(recipe, AutoTokenizer.from_pretrained(tiny_official))
    assert [b._compiled_call_impl is not None for b in model.model.transformer_encoder] == [True, True]
    plain = _build_model(
        recipe.model_copy(update={"compile": False}), AutoTokenizer.from_pretrained(tiny_official)
    )
    assert all(b._compiled_call_impl is None for b in plain.model.transformer_encoder)


def test_cuda_graphs_refuse_a_cpu_model_and_compile(tiny_official):
    with pytest.raises(ValueError, match="need the model on a CUDA device, it is on \\['cpu'\\]"):
        neoembed.load(tiny_official, device="cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match="without compile and bucketing"):
        neoembed.load(tiny_official, device="cpu", cuda_graphs=True, compile="reduce-overhead")


def test_cuda_graphs_runner_runs_cpu_input_eagerly(tiny_official, sentences):
    """The runner replays only CUDA input: on CPU it is the eager forward, outputs unchanged (its replays are
    tested on a GPU, tests/test_compile_gpu.py)."""
    from neoembed.compile import CudaGraphs

    model = neoembed.load(tiny_official, device="cpu")
    reference = model.encode(sentences[:20], batch_size=8)
    runner = CudaGraphs(model[0].auto_model, (16, 32, 64, 128), pad_token_id=0)
    torch.testing.assert_close(
        torch.tensor(model.encode(sentences[:20], batch_size=8)), torch.tensor(reference)
    )
    assert runner.replays == 0 and not runner.graphs and runner.failed is None


def test_a_cuda_graph_is_specific_to_shape_inference_mode_and_autocast():
    """A graph recorded under fp16 autocast replays fp16 kernels: a call without autocast (or under bf16) must
    get its own graph."""
    from neoembed.compile import graph_key

    ids = torch.ones(4, 16, dtype=torch.long)
    inputs = {"input_ids": ids, "attention_mask": ids}
    plain = graph_key(inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = graph_key(inputs)
    with torch.autocast("cpu", dtype=torch.float16):
        fp16 = graph_key(inputs)
    with torch.inference_mode():
        inference = graph_key(inputs)
    wider = graph_key({"input_ids": torch.ones(4, 32, dtype=torch.long), "attention_mask": ids})
    assert len({plain, bf16, fp16, inference, wider}) == 5
    assert graph_key({"attention_mask": ids, "input_ids": ids}) == plain  # the keys' order does not matter
