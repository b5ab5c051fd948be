"""neoembed.compile on CUDA (marked gpu: skipped without one): CUDA graphs over length buckets give the eager
embeddings. Run: pytest -m gpu tests/test_compile_gpu.py"""

from __future__ import annotations

import gzip
import json

import pytest
import torch

import neoembed

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reduce_overhead_bucketed_encode_matches_eager(tiny_official, shared_dir, dtype):
    with gzip.open(next(shared_dir.glob("data/mteb/STS12/*.jsonl.gz")), "rt", encoding="utf8") as fh:
        texts = [json.loads(line)["sentence1"] for line, _ in zip(fh, range(100), strict=False)]
    eager = neoembed.load(tiny_official, device="cuda", dtype="fp32")
    reference = eager.encode(texts, batch_size=16, convert_to_tensor=True).float()
    compiled = neoembed.load(tiny_official, device="cuda", dtype=dtype, compile="reduce-overhead")
    (runner,) = compiled.neoembed_cuda_graphs  # compiled layers inside graphs recorded per length bucket
    assert all(b._compiled_call_impl is not None for b in compiled[0].auto_model.transformer_encoder)
    for _ in range(2):  # compilation and recording, then replays only
        got = compiled.encode(texts, batch_size=16, convert_to_tensor=True).float()
    assert runner.failed is None and runner.replays == 2 * 7  # 7 batches of <= 16 texts, twice
    with pytest.raises(ValueError, match="drop bucketing=False"):
        neoembed.load(tiny_official, device="cuda", compile="reduce-overhead", bucketing=False)
    if dtype == "fp32":
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    else:
        # against the bf16 error of the eager model itself: compiled bf16 may not be more than 2x further off
        eager_bf16 = neoembed.load(tiny_official, device="cuda", dtype="bf16")
        own = (
            (eager_bf16.encode(texts, batch_size=16, convert_to_tensor=True).float() - reference).abs().max()
        )
        assert (got - reference).abs().max() <= 2 * own + 1e-3


def _sts_sentences(shared_dir, n: int) -> list[str]:
    with gzip.open(next(shared_dir.glob("data/mteb/STS12/*.jsonl.gz")), "rt", encoding="utf8") as fh:
        return [json.loads(line)["sentence1"] for line, _ in zip(fh, range(n), strict=False)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_graphs_replay_the_eager_embeddings(tiny_official, shared_dir, dtype):
    texts = _sts_sentences(shared_dir, 100)
    reference = (
        neoembed.load(tiny_official, device="cuda", dtype="fp32")
        .encode(texts, batch_size=16, convert_to_tensor=True)
        .float()
    )
    graphed = neoembed.load(tiny_official, device="cuda", dtype=dtype, cuda_graphs=True)
    (runner,) = graphed.neoembed_cuda_graphs
    first = graphed.encode(texts, batch_size=16, convert_to_tensor=True).float()  # records each shape
    recorded = len(runner.graphs)
    got = graphed.encode(texts, batch_size=16, convert_to_tensor=True).float()  # replays only
    assert runner.failed is None
    assert len(runner.graphs) == recorded and runner.replays == 2 * 7  # 7 batches of <= 16 texts, twice
    torch.testing.assert_close(first, got, rtol=0, atol=0)
    if dtype == "fp32":
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    else:  # no further from the fp32 reference than the eager bf16 model is
        own = (
            neoembed.load(tiny_official, device="cuda", dtype="bf16")
            .encode(texts, batch_size=16, convert_to_tensor=True)
            .float()
        )
        assert (got - reference).abs().max() <= 2 * (own - reference).abs().max() + 1e-3


def test_cuda_graphs_leave_training_and_odd_input_eager(tiny_official):
    graphed = neoembed.load(tiny_official, device="cuda", dtype="fp32", cuda_graphs=True)
    (runner,) = graphed.neoembed_cuda_graphs
    backbone = graphed[0].auto_model
    ids = torch.randint(5, 100, (3, 9), device="cuda")
    mask = torch.ones_like(ids)
    out = backbone(input_ids=ids, attention_mask=mask).last_hidden_state  # gradients on: eager
    out.sum().backward()
    with torch.no_grad():
        backbone(input_ids=ids, attention_mask=mask, output_hidden_states=True)  # hidden states: eager
        assert runner.replays == 0 and not runner.graphs
        replayed = backbone(input_ids=ids, attention_mask=mask).last_hidden_state
    assert runner.replays == 1
    torch.testing.assert_close(replayed, out.detach(), rtol=1e-4, atol=1e-4)
    runner.remove()
    assert "forward" not in backbone.__dict__


def test_cuda_graphs_record_again_after_the_weights_move(tiny_official, shared_dir):
    """A cast replaces every parameter: the graphs recorded before would replay freed memory, so they are
    dropped and recorded again, and the embeddings are the cast model's."""
    texts = _sts_sentences(shared_dir, 40)
    graphed = neoembed.load(tiny_official, device="cuda", dtype="fp32", cuda_graphs=True)
    (runner,) = graphed.neoembed_cuda_graphs
    reference = graphed.encode(texts, batch_size=16, convert_to_tensor=True).float()  # fp32 graphs
    graphed.to(torch.bfloat16)
    got = graphed.encode(texts, batch_size=16, convert_to_tensor=True).float()
    eager_bf16 = (
        neoembed.load(tiny_official, device="cuda", dtype="bf16")
        .encode(texts, batch_size=16, convert_to_tensor=True)
        .float()
    )
    assert runner.failed is None and runner._recorded_with[1] == torch.bfloat16
    assert (got - reference).abs().max() <= 2 * (eager_bf16 - reference).abs().max() + 1e-3
    assert (got - reference).abs().max() > 0  # bf16 weights, not the fp32 graphs replayed
