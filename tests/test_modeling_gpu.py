"""CUDA paths of the backbone (marked `gpu`: skipped without a GPU). Run: pytest -m gpu tests/test_modeling_gpu.py"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AutoModel

from neoembed.modeling import NeoBERTConfig, NeoBERTModel

pytestmark = pytest.mark.gpu


def _batch(lengths, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.zeros(len(lengths), L, dtype=torch.long)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return ids.to(device), mask.to(device)


def test_fixture_parity_on_cuda(tiny_official, tiny_expected):
    model = AutoModel.from_pretrained(tiny_official).cuda().eval()
    ids, mask = tiny_expected["input_ids"].cuda(), tiny_expected["attention_mask"].cuda()
    m = mask.bool()
    for padding_free in (False, True):
        model.config.padding_free = padding_free
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert (out - tiny_expected["last_hidden_state"].cuda())[m].abs().max() <= 1e-3  # TF32 allowed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_kernel_matches_padded_in_low_precision(dtype):
    """Padding-free on CUDA runs flash-attn's (or torch's) varlen kernel; padded runs SDPA with a key mask."""
    torch.manual_seed(0)
    cfg = NeoBERTConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
    model = NeoBERTModel(cfg).cuda().to(dtype).eval()
    ids, mask = _batch([1, 17, 300, 512, 64, 0], cfg.vocab_size, "cuda")
    with torch.no_grad():
        model.config.padding_free = False
        padded = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        model.config.padding_free = True
        packed = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    m = mask.bool()
    rel = (packed - padded)[m].norm() / padded[m].norm()
    assert torch.isfinite(packed).all() and torch.isfinite(padded).all()
    assert rel < 2e-2, rel.item()


def test_flash_attention_2_if_installed():
    pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    cfg = NeoBERTConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024)
    ref = NeoBERTModel(cfg).cuda().to(torch.bfloat16).eval()
    cfg2 = NeoBERTConfig(**{**cfg.to_dict(), "padding_free": False})
    cfg2._attn_implementation = "flash_attention_2"
    fa = NeoBERTModel(cfg2).cuda().to(torch.bfloat16).eval()
    fa.load_state_dict(ref.state_dict())
    ids, mask = _batch([5, 128, 77], cfg.vocab_size, "cuda")
    with torch.no_grad():
        a = ref(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        b = fa(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    m = mask.bool()
    assert (a - b)[m].norm() / a[m].norm() < 2e-2


def test_sentence_transformers_packs_batches_itself_with_flash_attention(tiny_official):
    """With flash-attn, sentence-transformers' own flattening feeds NeoBERT packed batches (no padding at all)."""
    pytest.importorskip("flash_attn")
    import neoembed

    texts = ["short", "a somewhat longer sentence about encoders", "mid length text here"] * 5
    padded = neoembed.load(tiny_official, dtype="bf16", device="cuda", padding_free=False)
    model = neoembed.load(tiny_official, dtype="bf16", device="cuda", attn_implementation="flash_attention_2")
    assert model._can_flatten_inputs()
    a = torch.nn.functional.normalize(torch.as_tensor(padded.encode(texts, batch_size=4)), dim=-1)
    b = torch.nn.functional.normalize(torch.as_tensor(model.encode(texts, batch_size=4)), dim=-1)
    assert (a * b).sum(-1).min() >= 0.999


def test_autocast_packs_into_the_varlen_kernel_not_a_loop_per_sequence(monkeypatch):
    """fp32 weights under bf16 autocast (accelerate's mixed precision): the embeddings are fp32 but the
    projections hand attention bf16 q, k, v, so the packed layout must take the varlen kernel; the per-sequence
    loop made packed pre-training 10x slower than padded on an H200."""

    torch.manual_seed(0)
    cfg = NeoBERTConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024)
    model = NeoBERTModel(cfg).cuda().train()
    ids, mask = _batch([17, 300, 64, 5], cfg.vocab_size, "cuda")

    def refuse(*_, **__):
        raise AssertionError("the packed layout ran the CPU's grouped attention under autocast")

    monkeypatch.setitem(AttentionInterface._global_mapping, "neobert_grouped", refuse)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model.config.padding_free = False
        padded = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        model.config.padding_free = True
        packed = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    packed.sum().backward()
    m = mask.bool()
    assert (packed - padded)[m].norm() / padded[m].norm() < 2e-2
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_fp32_packed_layout_on_cuda_runs_in_length_groups(monkeypatch):
    """No varlen kernel takes fp32: the packed layout runs the grouped backend on CUDA too (one SDPA call per
    group of similar lengths, rows moved by index_copy); outputs and gradients equal the padded layout's."""
    import neoembed.modeling.attention_neobert as mn

    torch.manual_seed(0)
    cfg = NeoBERTConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
    model = NeoBERTModel(cfg).cuda().train()
    ids, mask = _batch([17, 300, 64, 5, 290, 33], cfg.vocab_size, "cuda")
    calls = []
    grouped = mn.grouped_attention_forward
    monkeypatch.setitem(
        AttentionInterface._global_mapping, "neobert_grouped", lambda *a, **k: calls.append(1) or grouped(*a, **k)
    )
    runs = {}
    for padding_free in (False, True):
        model.zero_grad()
        model.config.padding_free = padding_free
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        (out * mask[..., None]).pow(2).sum().backward()
        runs[padding_free] = out.detach(), [p.grad.clone() for p in model.parameters()]
    m = mask.bool()
    (padded, g_padded), (packed, g_packed) = runs[False], runs[True]
    assert calls, "the packed layout did not run the grouped backend"
    assert (packed - padded)[m].norm() / padded[m].norm() < 1e-5
    for a, b in zip(g_packed, g_padded, strict=True):
        assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8
