"""The NeoBERT backbone: parity with the official implementation's outputs, fast paths equal slow ones,
checkpoints round-trip, bad input fails loudly."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForMaskedLM, DataCollatorWithFlattening

import neoembed
from neoembed.modeling import NeoBERTConfig, NeoBERTForMaskedLM, NeoBERTModel
from neoembed.modeling.convert import convert_checkpoint

TOL = 1e-4  # parity with the official implementation (float32)
EQ = 1e-5  # fast path vs slow path


def tiny_config(**kw) -> NeoBERTConfig:
    base = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100
    )
    base.update(kw)
    return NeoBERTConfig(**base)


def random_batch(lengths, vocab=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = max(max(lengths), 1)
    ids = torch.zeros(len(lengths), L, dtype=torch.long)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask


# ------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_automodel_reproduces_official_outputs(tiny_official, tiny_expected, padding_free, attn):
    model = AutoModel.from_pretrained(tiny_official, attn_implementation=attn).eval()
    assert isinstance(model, NeoBERTModel)
    model.config.padding_free = padding_free
    mask = tiny_expected["attention_mask"].bool()
    with torch.no_grad():
        out = model(input_ids=tiny_expected["input_ids"], attention_mask=tiny_expected["attention_mask"])
    err = (out.last_hidden_state - tiny_expected["last_hidden_state"])[mask].abs().max().item()
    assert err <= TOL, err


def test_masked_lm_reproduces_official_logits(tiny_official, tiny_expected):
    model = AutoModelForMaskedLM.from_pretrained(tiny_official).eval()
    assert isinstance(model, NeoBERTForMaskedLM)
    mask = tiny_expected["attention_mask"].bool()
    with torch.no_grad():
        logits = model(
            input_ids=tiny_expected["input_ids"], attention_mask=tiny_expected["attention_mask"]
        ).logits
    assert (logits[..., :2048] - tiny_expected["logits_first_2048"])[mask].abs().max() <= TOL
    assert (logits.logsumexp(-1) - tiny_expected["logits_logsumexp"])[mask].abs().max() <= TOL


def test_long_sequence_reproduces_official(tiny_official, tiny_expected):
    model = AutoModelForMaskedLM.from_pretrained(tiny_official).eval()
    ids = tiny_expected["long_input_ids"]
    assert ids.shape == (1, 1536)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        logits = model(input_ids=ids).logits
    assert (hidden - tiny_expected["long_last_hidden_state"]).abs().max() <= TOL
    assert (logits.logsumexp(-1) - tiny_expected["long_logits_logsumexp"]).abs().max() <= TOL


def test_official_layout_variants_are_caught(tiny_official, tiny_expected):
    """The fixture would catch a [Q|K|V] split or half-rotation RoPE: check that it is sensitive at all."""
    model = AutoModel.from_pretrained(tiny_official).eval()
    blk = model.transformer_encoder[0]
    with torch.no_grad():
        w = blk.qkv.weight.view(4, 3, 16, 64)  # per head [q|k|v]; permute to a global [Q|K|V] reading
        blk.qkv.weight.copy_(w.transpose(0, 1).reshape(192, 64))
        out = model(input_ids=tiny_expected["input_ids"], attention_mask=tiny_expected["attention_mask"])
    mask = tiny_expected["attention_mask"].bool()
    assert (out.last_hidden_state - tiny_expected["last_hidden_state"])[mask].abs().max() > 1e-2


# ------------------------------------------------------------------------------- fast path == slow path
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padding_free_equals_padded(seed):
    torch.manual_seed(seed)
    model = NeoBERTModel(tiny_config()).eval()
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 0] + torch.randint(1, 40, (5,), generator=g).tolist()  # length 1 and a fully padded row
    ids, mask = random_batch(lengths, seed=seed)
    with torch.no_grad():
        model.config.padding_free = False
        padded = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        model.config.padding_free = True
        packed = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    m = mask.bool()
    assert torch.isfinite(padded.last_hidden_state).all() and torch.isfinite(packed.last_hidden_state).all()
    assert (padded.last_hidden_state - packed.last_hidden_state)[m].abs().max() <= EQ
    for a, b in zip(padded.hidden_states, packed.hidden_states, strict=True):
        assert (a - b)[m].abs().max() <= EQ


@pytest.mark.parametrize("slack", [1.0, 1.5, 1e9], ids=["one-length-per-group", "default", "one-group"])
def test_packed_attention_equals_block_diagonal_attention(slack):
    """The CPU padding-free attention (sequences grouped by length, each group padded to its longest) equals
    attention over all packed tokens with a block-diagonal mask, outputs and gradients, with empty and
    length-1 sequences among the others, however the sequences are grouped."""
    import torch.nn.functional as F

    from neoembed.modeling.attention_neobert import grouped_attention_forward, length_groups

    lengths = [1, 400, 200, 0, 190, 3, 60, 64, 400, 300, 7, 150]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 2, 8, generator=g, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    groups, order = length_groups(lengths, slack=slack)
    assert len(groups) == {1.0: 10, 1e9: 1}.get(slack, len(groups))  # 10 distinct non-zero lengths
    # packed in another order, the tokens are permuted into groups; the padding-free layout packs longest first
    assert order is not None and length_groups(sorted(lengths, reverse=True), slack=slack)[1] is None
    # (1, H, T, Dh) in and (1, T, H, Dh) out, as transformers' AttentionInterface passes and takes them
    packed, _ = grouped_attention_forward(
        None, *(t.transpose(0, 1)[None] for t in (q, k, v)), None, cu_seq_lens_q=cu, groups=groups, order=order
    )
    packed = packed[0]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    same_doc = doc[:, None] == doc[None, :]  # (T, T)
    reference = F.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=same_doc
    )[0].transpose(0, 1)
    torch.testing.assert_close(packed, reference, atol=1e-6, rtol=1e-5)
    weights = torch.randn(packed.shape, generator=g)
    grads = torch.autograd.grad((packed * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_every_attention_call_goes_through_transformers_attention_interface(monkeypatch):
    """No private registry: the function a forward runs is the one transformers' AttentionInterface holds under its
    name (a replacement registered there is what runs, padded and packed), and switching the implementation is
    transformers' own set_attn_implementation (no override of its check)."""
    from transformers import AttentionInterface

    from neoembed.modeling import modeling_neobert as mn

    assert "_can_set_attn_implementation" not in vars(mn.NeoBERTPreTrainedModel)
    model = NeoBERTModel(tiny_config()).eval()
    ids, mask = random_batch([7, 4])
    seen = []
    for name in ("sdpa", "neobert_grouped"):
        original = AttentionInterface._global_mapping[name]
        monkeypatch.setitem(
            AttentionInterface._global_mapping, name, lambda *a, n=name, f=original, **k: seen.append(n) or f(*a, **k)
        )
    with torch.no_grad():
        for padding_free in (False, True):
            model.config.padding_free = padding_free
            model(input_ids=ids, attention_mask=mask)
        assert seen == ["sdpa"] * 2 + ["neobert_grouped"] * 2  # one call per block
        model.set_attn_implementation("eager")
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert model.config._attn_implementation == "eager" and len(seen) == 4 and out.attentions[0] is not None


def test_each_sequence_alone_equals_batch():
    torch.manual_seed(0)
    model = NeoBERTModel(tiny_config()).eval()
    lengths = [7, 3, 12]
    ids, mask = random_batch(lengths)
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).last_hidden_state
        for i, n in enumerate(lengths):
            alone = model(input_ids=ids[i : i + 1, :n]).last_hidden_state
            assert (alone[0] - batch[i, :n]).abs().max() <= EQ


def test_flattened_input_equals_padded():
    """Input packed as transformers' DataCollatorWithFlattening emits it (sentence-transformers, pre-training)."""
    torch.manual_seed(0)
    model = NeoBERTModel(tiny_config()).eval()
    lengths = [5, 1, 17, 9]
    ids, mask = random_batch(lengths)
    features = [{"input_ids": ids[i, :n].tolist()} for i, n in enumerate(lengths)]
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(features)
    flat.pop("labels", None)
    with torch.no_grad():
        model.config.padding_free = False
        padded = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out = model(**flat).last_hidden_state
        # position_ids alone (no cu_seq_lens) also describe the boundaries
        out_pos = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"]).last_hidden_state
    assert out.shape == (1, sum(lengths), 32)
    assert (out[0] - padded[mask.bool()]).abs().max() <= EQ
    assert (out_pos - out).abs().max() <= EQ


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_block_diagonal_4d_mask_equals_padded(attn):
    """A bool (B, 1, L, L) mask, as transformers passes a prepared one: sequences packed into one row with a
    block-diagonal mask and positions restarting at each give the padded batch's hidden states (the packed
    ONNX graph runs this way, neoembed.export)."""
    torch.manual_seed(0)
    model = NeoBERTModel(tiny_config(attn_implementation=attn)).eval()
    lengths = [5, 1, 17, 9]
    ids, mask = random_batch(lengths)
    row = ids[mask.bool()][None]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    block = (doc[:, None] == doc[None, :])[None, None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).last_hidden_state
        packed = model(input_ids=row, attention_mask=block, position_ids=positions).last_hidden_state
    assert (packed[0] - padded[mask.bool()]).abs().max() <= EQ
    with pytest.raises(TypeError, match="must be bool"):
        model(input_ids=row, attention_mask=block.long(), position_ids=positions)


def test_gradient_checkpointing_same_gradients():
    torch.manual_seed(0)
    cfg = tiny_config()
    a = NeoBERTForMaskedLM(cfg)
    b = NeoBERTForMaskedLM(cfg)
    b.load_state_dict(a.state_dict())
    getattr(b, "activation_checkpointing_enable", b.gradient_checkpointing_enable)()
    b.train()
    a.train()
    ids, mask = random_batch([9, 4, 13])
    labels = ids.masked_fill(mask == 0, -100)
    for m in (a, b):
        m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name


def test_autocast_bf16_is_close_and_norm_stats_float32(tiny_official, tiny_expected):
    model = AutoModel.from_pretrained(tiny_official).eval()
    ids, mask = tiny_expected["input_ids"], tiny_expected["attention_mask"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    ref = tiny_expected["last_hidden_state"]
    m = mask.bool()
    cos = torch.nn.functional.cosine_similarity(out.float()[m], ref[m], dim=-1)
    assert torch.isfinite(out).all() and cos.min() > 0.99


def test_low_precision_load_keeps_rope(tiny_official, tiny_expected):
    """from_pretrained builds on the meta device; RoPE tables must not be lost (there is no buffer to lose)."""
    model = AutoModel.from_pretrained(tiny_official, dtype=torch.bfloat16).eval()
    assert model.encoder.weight.dtype == torch.bfloat16
    with torch.no_grad():
        out = model(input_ids=tiny_expected["long_input_ids"]).last_hidden_state
    cos = torch.nn.functional.cosine_similarity(
        out.float()[0], tiny_expected["long_last_hidden_state"][0], dim=-1
    )
    assert cos.min() > 0.98


def test_same_seed_same_numbers():
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        model = NeoBERTModel(tiny_config()).eval()
        ids, mask = random_batch([6, 11])
        with torch.no_grad():
            outs.append(model(input_ids=ids, attention_mask=mask).last_hidden_state)
    assert torch.equal(outs[0], outs[1])


def test_eager_attentions_and_fully_padded_row():
    model = NeoBERTModel(tiny_config()).eval()
    model.config._attn_implementation = "eager"
    ids, mask = random_batch([5, 0, 3])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (3, 4, 5, 5)
    assert torch.isfinite(out.last_hidden_state).all()
    assert all(torch.isfinite(a).all() for a in out.attentions)
    # attention never reaches padding keys of a real row
    assert out.attentions[0][2, :, :, 3:].abs().max() == 0


# ------------------------------------------------------------------------------------------------ YaRN
def test_yarn_factor_one_is_plain_rope_and_limits_length():
    torch.manual_seed(0)
    plain = NeoBERTModel(tiny_config(max_length=64)).eval()
    yarn1 = NeoBERTModel(
        tiny_config(max_length=64, rope_parameters={"rope_type": "yarn", "factor": 1.0})
    ).eval()
    yarn1.load_state_dict(plain.state_dict())
    ids, mask = random_batch([60, 30])
    with torch.no_grad():
        assert torch.equal(
            plain(input_ids=ids, attention_mask=mask).last_hidden_state,
            yarn1(input_ids=ids, attention_mask=mask).last_hidden_state,
        )
    long_ids, _ = random_batch([100])
    with pytest.warns(UserWarning, match="exceeds the 64 tokens.*yarn"):
        plain(input_ids=long_ids)
    yarn2 = NeoBERTModel(
        tiny_config(max_length=64, rope_parameters={"rope_type": "yarn", "factor": 2.0})
    ).eval()
    assert yarn2.config.max_sequence_length == 128
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # 100 tokens lie within YaRN's 2 x 64
        assert torch.isfinite(yarn2(input_ids=long_ids).last_hidden_state).all()
    with pytest.warns(UserWarning, match="exceeds the 128 tokens"):
        yarn2(input_ids=random_batch([129])[0])
    with pytest.raises(ValueError, match="unknown rope_parameters rope_type 'ntk'.*yarn"):
        tiny_config(rope_parameters={"rope_type": "ntk", "factor": 2.0})
    with pytest.raises(ValueError, match="once"):
        tiny_config(
            rope_parameters={"rope_type": "yarn", "factor": 2.0}, rope_scaling={"type": "yarn", "factor": 2.0}
        )


@pytest.mark.parametrize(
    "given", [{"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, {"rope_scaling": {"type": "yarn", "factor": 2}}]
)
def test_yarn_given_to_from_pretrained_equals_yarn_in_the_config(tiny_official, tmp_path, given):
    """backbone.md's long-context line: from_pretrained(..., rope_parameters={"rope_type": "yarn", "factor": 2})
    (or the older rope_scaling=) crashed in transformers' YaRN function with "NoneType ** Tensor" (walk U): the
    mapping is set on the loaded config, after the standardisation that fills rope_theta ran. It equals the
    checkpoint saved with YaRN in its config.json, past the trained length."""
    config = json.loads((tiny_official / "config.json").read_text())
    saved = tmp_path / "yarn"
    shutil.copytree(tiny_official, saved)
    yarn = {"rope_type": "yarn", "factor": 2.0}
    (saved / "config.json").write_text(json.dumps({**config, "rope_parameters": yarn}))
    want = AutoModel.from_pretrained(saved).eval()
    got = AutoModel.from_pretrained(tiny_official, **given).eval()
    assert got.config.rope_parameters == want.config.rope_parameters and got.config.max_sequence_length == 8192
    ids, mask = random_batch([4200, 17])
    with torch.no_grad():
        a = want(input_ids=ids, attention_mask=mask).last_hidden_state
        assert torch.equal(a, got(input_ids=ids, attention_mask=mask).last_hidden_state)


def _yarn_of_the_previous_code(
    dim: int, base: float, original: int, factor: float, beta_fast=32.0, beta_slow=1.0
):
    """YaRN's frequencies and cos/sin scale as neoembed computed them before adopting transformers' functions."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = (inv_freq / factor) * ramp + inv_freq * (1.0 - ramp)
    return inv_freq, 0.1 * math.log(factor) + 1.0


@pytest.mark.parametrize("factor", [2.0, 3.0])
def test_folder_saved_with_rope_scaling_loads_with_the_same_outputs(tmp_path, factor):
    """A folder written before rope_parameters existed (config.json with the keys the previous code wrote:
    rope_theta and rope_scaling YaRN) loads into rope_parameters with the same frequencies and outputs."""
    torch.manual_seed(0)
    model = NeoBERTModel(
        tiny_config(max_length=64, rope_parameters={"rope_type": "yarn", "factor": factor})
    ).eval()
    model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["rope_parameters"] == {
        "rope_type": "yarn",
        "factor": factor,
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 64,
    }
    old = {k: v for k, v in raw.items() if k != "rope_parameters"}
    old["rope_theta"] = 10000.0
    old["rope_scaling"] = {
        "attention_factor": None,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": factor,
        "type": "yarn",
    }
    (tmp_path / "config.json").write_text(json.dumps(old))
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert loaded.config.rope_parameters == raw["rope_parameters"] | {"beta_fast": 32.0, "beta_slow": 1.0}
    inv_freq, scale = _yarn_of_the_previous_code(8, 10000.0, 64, factor)
    # the same up to one float32 rounding: transformers divides by (factor * base**x), the old code by factor last
    torch.testing.assert_close(loaded.rotary_emb.inv_freq, inv_freq, atol=0, rtol=2e-7)
    assert loaded.rotary_emb.attention_scaling == pytest.approx(scale, abs=1e-12)
    ids, mask = random_batch([120, 70, 5])
    with torch.no_grad():
        for m in (mask, None):
            a = model(input_ids=ids, attention_mask=m).last_hidden_state
            b = loaded(input_ids=ids, attention_mask=m).last_hidden_state
            assert torch.equal(a, b)


def test_rope_scalings_of_transformers_run_and_differ():
    """rope_parameters takes transformers' scalings; each changes the long-input outputs; bfloat16 keeps float32
    frequencies."""
    torch.manual_seed(0)
    plain = NeoBERTModel(tiny_config(max_length=16)).eval()
    ids, _ = random_batch([40])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = plain(input_ids=ids).last_hidden_state
        for kind in ("linear", "dynamic", "yarn"):
            scaled = NeoBERTModel(
                tiny_config(max_length=16, rope_parameters={"rope_type": kind, "factor": 4.0})
            )
            scaled.load_state_dict(plain.state_dict())
            out = scaled.eval()(input_ids=ids).last_hidden_state
            assert torch.isfinite(out).all() and not torch.allclose(out, ref, atol=1e-4), kind
    half = plain.to(torch.bfloat16)
    assert half.rotary_emb.inv_freq.dtype == torch.float32 and half.encoder.weight.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------- save, load, convert
def _outputs(model_dir, expected):
    model = AutoModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(
            input_ids=expected["input_ids"], attention_mask=expected["attention_mask"]
        ).last_hidden_state


def test_convert_round_trip_both_layouts(tiny_official, tiny_expected, tmp_path):
    report = convert_checkpoint(tiny_official, tmp_path / "ne")
    assert "model.transformer_encoder.0.qkv.weight" in report
    ne = tmp_path / "ne"
    cfg = json.loads((ne / "config.json").read_text())
    assert cfg["model_type"] == "neobert" and cfg["neoembed_format"] == 1
    assert cfg["auto_map"]["AutoModel"] == "modeling_neobert.NeoBERTModel"
    assert (ne / "modeling_neobert.py").is_file() and (ne / "configuration_neobert.py").is_file()
    assert (ne / "tokenizer.json").is_file()
    convert_checkpoint(ne, tmp_path / "off", to="official")
    off_cfg = json.loads((tmp_path / "off" / "config.json").read_text())
    assert off_cfg["max_length"] == 4096 and off_cfg["dim_head"] == 16
    assert off_cfg["auto_map"]["AutoModel"] == "model.NeoBERT"
    a, b = (
        load_file(str(tiny_official / "model.safetensors")),
        load_file(str(tmp_path / "off" / "model.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    mask = tiny_expected["attention_mask"].bool()
    for d in (ne, tmp_path / "off"):
        assert (_outputs(d, tiny_expected) - tiny_expected["last_hidden_state"])[mask].abs().max() <= TOL


def test_save_pretrained_round_trip_without_prefix(tiny_official, tiny_expected, tmp_path):
    model = AutoModel.from_pretrained(tiny_official)
    model.save_pretrained(tmp_path)
    keys = load_file(str(tmp_path / "model.safetensors")).keys()
    assert "encoder.weight" in keys  # the bare encoder saves without the `model.` prefix
    mask = tiny_expected["attention_mask"].bool()
    assert (_outputs(tmp_path, tiny_expected) - tiny_expected["last_hidden_state"])[mask].abs().max() <= TOL
    # the MLM class loads an encoder-only checkpoint, warning that its decoder is new
    with pytest.warns(UserWarning, match="no masked-LM decoder"):
        AutoModelForMaskedLM.from_pretrained(tmp_path)


def test_cli_convert_round_trip(tiny_official, tmp_path, run_neoembed):
    r = run_neoembed(["convert", str(tiny_official), str(tmp_path / "a")])
    assert r.exit_code == 0, r.stderr
    assert "decoder.weight" in r.stdout
    r = run_neoembed(["convert", str(tmp_path / "a"), str(tmp_path / "b"), "--to", "official"])
    assert r.exit_code == 0, r.stderr
    a, b = (
        load_file(str(tiny_official / "model.safetensors")),
        load_file(str(tmp_path / "b" / "model.safetensors")),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fresh_process_loads_fixture_after_import_only(tiny_official, tiny_expected):
    code = textwrap.dedent(f"""
        import torch, neoembed
        from transformers import AutoModel
        from safetensors.torch import load_file
        e = load_file({str(tiny_official / "expected.safetensors")!r})
        m = AutoModel.from_pretrained({str(tiny_official)!r}).eval()
        with torch.no_grad():
            out = m(input_ids=e['input_ids'], attention_mask=e['attention_mask']).last_hidden_state
        err = (out - e['last_hidden_state'])[e['attention_mask'].bool()].abs().max().item()
        print('ERR', err)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.split("ERR")[1]) <= TOL


def test_import_without_optional_packages():
    """`import neoembed` works without faiss or xformers (blocked here) and without flash-attn (not installed on
    CPU machines; transformers probes for it, so it is not blocked by force)."""
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('faiss', 'xformers'):
                    raise ImportError(f'blocked {name}')
        sys.meta_path.insert(0, Block())
        import neoembed
        from neoembed.modeling import NeoBERTModel, NeoBERTConfig
        import torch
        assert 'faiss' not in sys.modules
        m = NeoBERTModel(NeoBERTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32, vocab_size=50))
        print(m(input_ids=torch.tensor([[1, 2, 3]])).last_hidden_state.shape)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "torch.Size([1, 3, 16])" in r.stdout


def test_official_config_is_read_and_checked(tiny_official, tmp_path):
    raw = json.loads((tiny_official / "config.json").read_text())
    cfg = NeoBERTConfig.from_dict(raw)
    assert cfg.max_length == cfg.max_position_embeddings == 4096 and cfg.head_dim == 16
    assert cfg.ffn_hidden_size == 176
    bad = dict(raw, dim_head=32)
    with pytest.raises(ValueError, match="dim_head=32"):
        NeoBERTConfig.from_dict(bad)
    cfg.save_pretrained(tmp_path)  # transformers 5 refuses generation keys such as max_length unless declared
    again = NeoBERTConfig.from_pretrained(tmp_path)
    assert again.max_length == 4096


# ------------------------------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    return NeoBERTModel(tiny_config(max_length=32)).eval()


def test_bad_input_ids(small_model):
    with pytest.raises(ValueError, match="2-D"):
        small_model(input_ids=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="2-D"):
        small_model(input_ids=torch.ones(1, 2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="integer token ids"):
        small_model(input_ids=torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"\[0, 100\)"):
        small_model(input_ids=torch.tensor([[1, 100]]))
    with pytest.warns(UserWarning, match="exceeds the 32 tokens this model supports"):
        small_model(input_ids=torch.ones(1, 33, dtype=torch.long))


def test_bad_attention_mask(small_model):
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="does not match"):
        small_model(input_ids=ids, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="does not match"):
        small_model(input_ids=ids, attention_mask=torch.ones(2, 1, 5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="only 0 and 1"):
        small_model(input_ids=ids, attention_mask=torch.full((2, 5), 2))
    with pytest.raises(ValueError, match="additive"):
        small_model(input_ids=ids, attention_mask=torch.full((2, 5), float("-inf")))


def test_bad_checkpoints(tiny_official, tmp_path):
    state = load_file(str(tiny_official / "model.safetensors"))
    shutil.copy(tiny_official / "config.json", tmp_path / "config.json")
    broken = dict(state)
    broken.pop("model.transformer_encoder.1.wo.weight")
    broken["model.extra.weight"] = torch.zeros(3)
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"missing keys \['transformer_encoder.1.wo.weight'\].*unexpected keys \['model.extra.weight'\]",
    ):
        AutoModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="missing keys"):
        convert_checkpoint(tmp_path, tmp_path / "out")
    # shapes that do not match the config
    cfg = json.loads((tiny_official / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=512)))
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises((ValueError, RuntimeError), match="(?i)mismatch|shape|size"):
        AutoModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="shape of model.transformer_encoder.0.ffn.w12.weight"):
        convert_checkpoint(tmp_path, tmp_path / "out")


def test_bad_attention_backends(tiny_official):
    with pytest.raises(ValueError, match="sdpa"):
        AutoModel.from_pretrained(tiny_official, attn_implementation="nonsense")
    if not _has_flash_attn():
        with pytest.raises(ImportError, match="(?i)flash"):
            AutoModel.from_pretrained(tiny_official, attn_implementation="flash_attention_2")
    model = NeoBERTModel(tiny_config()).eval()
    model.config._attn_implementation = "flash_attention_3"
    with pytest.raises(ValueError, match="valid: \\['eager', 'sdpa', 'flash_attention_2'\\]"):
        model(input_ids=torch.ones(1, 3, dtype=torch.long))


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def test_version_and_auto_registration():
    assert neoembed.__version__
    from transformers import AutoConfig

    assert AutoConfig.for_model("neobert").__class__ is NeoBERTConfig


# ------------------------------------------------------------------------ position-less prefix (CDE)
def _prefix_model(prefix: int):
    from neoembed.cde.modeling_cde import use_positionless_prefix

    torch.manual_seed(0)
    model = NeoBERTModel(tiny_config()).eval()
    assert use_positionless_prefix(model, prefix)  # CDE's attention lives with CDE
    return model


def _with_prefix(model, x, mask, prefix: int, offset: int = 0):
    """As CDE's second stage calls the backbone: every prefix slot at position 0, the text's from ``offset``,
    a 4-D key mask (the padded layout)."""
    text = torch.arange(x.shape[1] - prefix) + offset
    pos = torch.cat([torch.zeros(prefix, dtype=torch.long), text])[None].expand(x.shape[0], -1)
    return model(inputs_embeds=x, attention_mask=mask[:, None, None, :].bool(), position_ids=pos).last_hidden_state


def test_positionless_prefix_is_a_set_and_text_is_shift_invariant():
    model = _prefix_model(6)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(2, 6, 32, generator=g)
    text_ids, text_mask = random_batch([9, 5], seed=1)
    text = model.encoder(text_ids).detach()
    x = torch.cat([ctx, text], dim=1)
    mask = torch.cat([torch.ones(2, 6, dtype=torch.long), text_mask], dim=1)
    m = text_mask.bool()
    with torch.no_grad():
        out = _with_prefix(model, x, mask, 6)
        perm = torch.randperm(6, generator=g)
        x_perm = torch.cat([ctx[:, perm], text], dim=1)
        out_perm = _with_prefix(model, x_perm, mask, 6)
        assert (out[:, 6:] - out_perm[:, 6:])[m].abs().max() <= EQ
        assert (out[:, :6][:, perm] - out_perm[:, :6]).abs().max() <= EQ
        shifted = _with_prefix(model, x, mask, 6, offset=17)
        assert (out[:, 6:] - shifted[:, 6:])[m].abs().max() <= EQ
        changed = x.clone()
        changed[:, 2] += 1.0
        out_changed = _with_prefix(model, changed, mask, 6)
        assert (out[:, 6:] - out_changed[:, 6:])[m].abs().max() > 1e-3


def test_positionless_prefix_of_text_only_model_matches_plain_text():
    """With no prefix tokens attended (masked out), the text part equals the plain encoder on the text."""
    model = _prefix_model(3)
    ids, mask = random_batch([7, 4])
    with torch.no_grad():
        plain = NeoBERTModel(model.config).eval()
        plain.load_state_dict(model.state_dict())
        plain = plain(input_ids=ids, attention_mask=mask).last_hidden_state
        x = torch.cat([torch.randn(2, 3, 32), model.encoder(ids)], dim=1)
        full_mask = torch.cat([torch.zeros(2, 3, dtype=torch.long), mask], dim=1)
        out = _with_prefix(model, x, full_mask, 3)
    assert (out[:, 3:] - plain)[mask.bool()].abs().max() <= EQ


# ------------------------------------------------------------------------------ fast CPU forms vs plain ones
def test_swiglu_two_gemms_equal_the_fused_product():
    """On CPU the SwiGLU runs as two GEMMs on the row blocks of the fused w12; same outputs and gradients."""
    import torch.nn.functional as F

    from neoembed.modeling.modeling_neobert import NeoBERTSwiGLU

    torch.manual_seed(0)
    ffn = NeoBERTSwiGLU(tiny_config())
    x = torch.randn(3, 5, 32, requires_grad=True)
    fast = ffn(x)
    gate, value = ffn.w12(x).chunk(2, dim=-1)
    plain = ffn.w3(F.silu(gate) * value)
    torch.testing.assert_close(fast, plain, atol=1e-6, rtol=1e-5)
    w = torch.randn(fast.shape)
    for a, b in zip(
        torch.autograd.grad((fast * w).sum(), (x, ffn.w12.weight, ffn.w3.weight)),
        torch.autograd.grad((plain * w).sum(), (x, ffn.w12.weight, ffn.w3.weight)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    with torch.inference_mode():  # the in-place inference path
        torch.testing.assert_close(ffn(x.detach()), plain.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("grad", [True, False])
def test_rmsnorm_cpu_path_equals_the_reference(grad):
    """RMSNorm on CPU float32 (one norm pass; the weight product in place at inference) equals F.rms_norm,
    gradients included; the block's in-place residual additions leave training gradients as they were."""
    import torch.nn.functional as F

    from neoembed.modeling.modeling_neobert import NeoBERTRMSNorm

    torch.manual_seed(0)
    norm = NeoBERTRMSNorm(32, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(3, 5, 32) * 3).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out, ref = norm(x), F.rms_norm(x, (32,), norm.weight, 1e-5)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    if grad:
        w = torch.randn(out.shape)
        for a, b in zip(
            torch.autograd.grad((out * w).sum(), (x, norm.weight)),
            torch.autograd.grad((ref * w).sum(), (x, norm.weight)),
            strict=True,
        ):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_as_complex_product_equals_the_pair_rotation(dtype):
    """RoPE runs as a complex product; it equals rotating each interleaved pair (x0, x1) by its angle."""
    from neoembed.modeling.modeling_neobert import NeoBERTRotaryEmbedding, apply_rope

    qkv = torch.randn(2, 7, 4, 24).to(dtype)  # strided q, as cut from the fused projection
    q = qkv[..., :8]
    cos, sin = (t.unsqueeze(-2) for t in NeoBERTRotaryEmbedding(tiny_config())(q, torch.arange(7)[None]))
    x0, x1 = q.float()[..., 0::2], q.float()[..., 1::2]
    expected = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(dtype)
    torch.testing.assert_close(apply_rope(q, cos, sin), expected, atol=1e-6, rtol=1e-5)


def test_half_precision_rmsnorm_within_the_plain_forms_own_error():
    """The fused half-precision RMSNorm (one kernel, float32 statistics, one rounding) is no further from the
    float64 result than the plain form it replaced (float32 copy, norm, cast back, weight product)."""
    from neoembed.modeling.modeling_neobert import NeoBERTRMSNorm

    g = torch.Generator().manual_seed(0)
    norm = NeoBERTRMSNorm(768, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(768, generator=g) + 0.5)
    x = (torch.randn(64, 768, generator=g) * 3).bfloat16()
    exact = x.double() * (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * norm.weight.double()
    plain = torch.nn.functional.rms_norm(x.float(), (768,), None, 1e-5).bfloat16() * norm.weight.bfloat16()
    got = norm(x)
    assert got.dtype == torch.bfloat16
    err = (got.double() - exact).norm() / exact.norm()
    assert err <= (plain.double() - exact).norm() / exact.norm() * 1.05
