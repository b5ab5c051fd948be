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
    assert compiled.neoembed_bucketing  # reduce-overhead turns the length buckets on
    for _ in range(3):  # warm-up, graph recording, replay
        got = compiled.encode(texts, batch_size=16, convert_to_tensor=True).float()
    if dtype == "fp32":
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    else:
        # against the bf16 error of the eager model itself: compiled bf16 may not be more than 2x further off
        eager_bf16 = neoembed.load(tiny_official, device="cuda", dtype="bf16")
        own = (
            (eager_bf16.encode(texts, batch_size=16, convert_to_tensor=True).float() - reference).abs().max()
        )
        assert (got - reference).abs().max() <= 2 * own + 1e-3
