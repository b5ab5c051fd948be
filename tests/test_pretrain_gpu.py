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


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_zero_configs_run_the_tiny_recipe(tmp_path, shards, stage):
    pytest.importorskip("deepspeed")
    config = REPO / "recipes" / "accelerate" / f"deepspeed-zero{stage}.yaml"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config),
            "-m",
            "neoembed",
            *_args(shards, tmp_path / "ds"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "ds" / "checkpoint-3").is_dir() and (tmp_path / "ds" / "model.safetensors").is_file()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config),
            "-m",
            "neoembed",
            *_args(shards, tmp_path / "ds"),
            "--resume",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # a finished run resumes from its last checkpoint and ends at the same step
    assert r.returncode == 0, r.stderr[-3000:]
