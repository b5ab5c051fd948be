"""The backbone under torch.compile and torch.export: the padded path is one graph, the padding-free and packed
paths break once (where the lengths reach the host), and compiled or exported outputs and gradients equal eager.

Graph breaks are found with dynamo's ``explain`` and equality with the ``aot_eager`` backend (no code
generation: seconds); inductor, which generates C++, runs once, on the tiny official fixture.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, DataCollatorWithFlattening

from neoembed.modeling import NeoBERTConfig, NeoBERTModel

EQ = 1e-5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(padding_free: bool) -> NeoBERTModel:
    torch.manual_seed(0)
    config = NeoBERTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=100,
        padding_free=padding_free,
    )
    return NeoBERTModel(config)


def _batch(lengths=(9, 4, 1, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(1, 100, (len(lengths), L), generator=g)
    mask = (torch.arange(L)[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def _outputs_and_grads(model, run=None, **inputs):
    """Outputs of ``run`` (the model, or a compiled wrapper of it) and the gradients it leaves on the model."""
    model.zero_grad()
    out = (model if run is None else run)(**inputs).last_hidden_state
    mask = inputs.get("attention_mask")
    weights = torch.linspace(-1, 1, out.shape[-1])
    (out * weights * (1 if mask is None else mask[..., None])).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(eager, compiled, mask=None):
    (out_e, grads_e), (out_c, grads_c) = eager, compiled
    m = torch.ones(out_e.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    assert (out_e - out_c)[m].abs().max() <= EQ
    assert grads_e.keys() == grads_c.keys() and grads_e
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, atol=EQ, rtol=1e-4, msg=name)


def test_padded_path_is_one_graph_and_compiles_fullgraph():
    model = _model(padding_free=False)
    ids, mask = _batch()
    explanation = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    _assert_same(
        _outputs_and_grads(model, input_ids=ids, attention_mask=mask),
        _outputs_and_grads(model, compiled, input_ids=ids, attention_mask=mask),
        mask,
    )


def test_padding_free_path_breaks_at_most_once():
    model = _model(padding_free=True)
    ids, mask = _batch()
    explanation = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask)
    assert explanation.graph_break_count <= 1, explanation.break_reasons
    compiled = torch.compile(model, backend="aot_eager")
    _assert_same(
        _outputs_and_grads(model, input_ids=ids, attention_mask=mask),
        _outputs_and_grads(model, compiled, input_ids=ids, attention_mask=mask),
        mask,
    )


def test_packed_input_breaks_at_most_once():
    model = _model(padding_free=True)
    ids, mask = _batch()
    features = [{"input_ids": row[m.bool()].tolist()} for row, m in zip(ids, mask, strict=True)]
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(features)
    flat = {k: flat[k] for k in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k")}
    explanation = torch._dynamo.explain(model)(**flat)
    assert explanation.graph_break_count <= 1, explanation.break_reasons
    compiled = torch.compile(model, backend="aot_eager")
    _assert_same(_outputs_and_grads(model, **flat), _outputs_and_grads(model, compiled, **flat))


def test_export_of_padded_encoder_matches_eager():
    """torch.export with a dynamic batch and length; the exported program reruns at another shape."""
    model = _model(padding_free=False).eval()
    ids, mask = _batch()
    batch, length = torch.export.Dim("batch", max=64), torch.export.Dim("length", max=64)
    shapes = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}
    program = torch.export.export(
        model, (), {"input_ids": ids, "attention_mask": mask}, dynamic_shapes=shapes
    )
    for ids, mask in (_batch(), _batch((3, 12, 12, 5, 2), seed=1)):
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = program.module()(input_ids=ids, attention_mask=mask).last_hidden_state
        assert (got - expected).abs().max() <= EQ


def test_inductor_on_the_official_fixture(tiny_official, tiny_expected):
    """Generated code (inductor, fullgraph) reproduces the official outputs as eager does."""
    model = AutoModel.from_pretrained(tiny_official).eval()
    model.config.padding_free = False
    ids, mask = tiny_expected["input_ids"], tiny_expected["attention_mask"]
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.bool()
    assert (out - eager)[m].abs().max() <= EQ
    assert (out - tiny_expected["last_hidden_state"])[m].abs().max() <= 1e-4


def test_compiled_layers_on_the_varlen_path_compile_once_for_every_batch(monkeypatch):
    """Packed batches whose longest text differs (what encode() sends) reuse one dynamic compilation of the
    layers: the varlen kernel and its host int max_seqlen stay outside the graph. On CPU a per-text SDPA stands in
    for the CUDA kernel; the recompilations counted are dynamo's own."""
    from torch._dynamo.testing import CompileCounter

    from neoembed.modeling import attention_neobert, layout_neobert

    def cpu_varlen(q, k, v, cu, _cu, n, _n):
        lengths = cu.diff().tolist()
        assert n == max(lengths)
        parts = zip(*(t.split(lengths) for t in (q, k, v)), strict=True)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return torch.cat([sdpa(*(t.transpose(0, 1)[None] for t in p))[0].transpose(0, 1) for p in parts])

    monkeypatch.setattr(attention_neobert, "_flash_varlen", lambda: None)
    monkeypatch.setattr(attention_neobert, "_torch_varlen", lambda: cpu_varlen)
    monkeypatch.setattr(
        layout_neobert, "attention_function", lambda config, x, packed, out: "neobert_varlen" if packed else "sdpa"
    )
    model = _model(padding_free=True).eval()
    counter = CompileCounter()
    for layer in model.transformer_encoder:
        layer.compile(backend=counter, dynamic=True)
    reference = _model(padding_free=True).eval()
    for seed, lengths in enumerate([(9, 4, 1, 7), (12, 3), (5, 5, 2), (17, 1, 8, 2, 6), (3,)]):
        ids, mask = _batch(lengths, seed)
        with torch.inference_mode():
            got = model(input_ids=ids, attention_mask=mask).last_hidden_state
            want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
        assert (got - want)[mask.bool()].abs().max() <= EQ
    assert counter.frame_count <= 4, f"{counter.frame_count} graphs compiled for 5 batches"
