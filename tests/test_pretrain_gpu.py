"""Pre-training on CUDA: bf16 packed training, and the DeepSpeed ZeRO-1/2 accelerate configs (marked gpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "tests" / "shared" / "fixtures" / "neobert-tiny-official"
MSRP = REPO / "tests" / "shared" / "data" / "train" / "msrp_pairs" / "train.jsonl.gz"

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from transformers import AutoTokenizer

    from neoembed.pretrain.data import preprocess

    out = tmp_path_factory.mktemp("gpu") / "shards"
    preprocess(
        str(MSRP), out, AutoTokenizer.from_pretrained(str(TOKENIZER)), column="positive", progress=False
    )
    return out


def _args(shards, out, *extra):
    return [
        "pretrain",
        "pretrain-tiny",
        f"tokenizer={TOKENIZER}",
        f"data.sources=[{{path: {shards}}}]",
        f"output_dir={out}",
        "precision=bf16",
        "steps=6",
        "save_steps=3",
        *extra,
    ]


def test_bf16_packed_training_on_cuda(tmp_path, shards):
    assert torch.cuda.is_available()
    r = subprocess.run(
        [sys.executable, "-m", "neoembed", *_args(shards, tmp_path / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(row["loss"] == row["loss"] for row in rows)


def _neoembed(*args, config: Path | None = None) -> None:
    """``python -m neoembed ARGS`` in this checkout, under ``accelerate launch --config_file CONFIG`` if given."""
    launch = ["-m", "accelerate.commands.launch", "--config_file", str(config)] if config else []
    r = subprocess.run(
        [sys.executable, *launch, "-m", "neoembed", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_zero_configs_run_the_tiny_recipe(tmp_path, shards, stage):
    pytest.importorskip("deepspeed")
    config = REPO / "recipes" / "accelerate" / f"deepspeed-zero{stage}.yaml"
    _neoembed(*_args(shards, tmp_path / "ds"), config=config)
    assert (tmp_path / "ds" / "checkpoint-3").is_dir() and (tmp_path / "ds" / "model.safetensors").is_file()
    # a finished run resumes from its last checkpoint and ends at the same step
    _neoembed(*_args(shards, tmp_path / "ds"), "--resume", config=config)


def test_deepspeed_zero1_on_one_rank_follows_plain_training(tmp_path, shards):
    """#40's check on one GPU: ZeRO-1 on a single rank, fp32, against the same run without DeepSpeed. ZeRO moves
    where the optimizer state lives, not the arithmetic: the same loss at every step to fp32's tolerance (the masks
    come from per-step generators, the clipping is 1.0 on both sides: the recipe's grad_clip, the config's)."""
    pytest.importorskip("deepspeed")
    config = tmp_path / "zero1-fp32.yaml"
    text = (REPO / "recipes" / "accelerate" / "deepspeed-zero1.yaml").read_text()
    assert "mixed_precision: bf16" in text and "gradient_clipping: 1.0" in text
    config.write_text(text.replace("mixed_precision: bf16", "mixed_precision: 'no'"))
    args = ["pretrain", "pretrain-tiny", f"tokenizer={TOKENIZER}", f"data.sources=[{{path: {shards}}}]",
            "precision=fp32", "steps=6", "save_steps=6", "logging_steps=1"]  # fmt: skip
    losses = {}
    for name, launch in (("plain", None), ("zero1", config)):
        _neoembed(*args, f"output_dir={tmp_path / name}", config=launch)
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [row["loss"] for row in rows if "loss" in row]
    assert len(losses["plain"]) == len(losses["zero1"]) == 6, losses
    for plain, zero in zip(losses["plain"], losses["zero1"], strict=True):
        assert abs(zero - plain) <= 1e-4 * abs(plain), losses
