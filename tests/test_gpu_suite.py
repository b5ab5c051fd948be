"""benchmarks/gpu_suite.sh without a GPU: its dry run checks every step; the CPU-side arithmetic of the scripts it
runs (FLOPs and MFU of a training step, the fp16/fp32 comparison of MTEB scores)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _suite_check  # noqa: E402
import mteb_precision  # noqa: E402
import train_step_cuda  # noqa: E402


def test_dry_run_checks_every_step_within_the_budget():
    out = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_suite.sh"), "--dry-run"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    steps = [line.split("]")[0][1:] for line in text.splitlines() if line.startswith("[")]
    # ordered by value: a run cut short still returns the training step and the throughput
    assert steps == ["train-step", "throughput", "encode", "profile", "pretrain-speed", "mteb-precision",
                     "gpu-tests", "train-defaults"]  # fmt: skip
    total = int(text.split("time limits adding up to ")[1].split(" s")[0])
    assert total <= 300  # the five minutes
    assert " tests collected for: " in text and "dry run: every step checked" in text


def test_the_check_names_a_missing_option_and_a_missing_script(monkeypatch):
    monkeypatch.chdir(REPO)
    problems = _suite_check.check("python benchmarks/throughput.py --device cuda --no-such-option")
    assert problems == ["benchmarks/throughput.py has no option --no-such-option"]
    assert _suite_check.check("python benchmarks/nothing.py") == ["benchmarks/nothing.py does not exist"]


def test_unknown_suite_arguments_are_refused():
    out = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_suite.sh"), "--fast"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "unknown argument '--fast'" in out.stderr


def test_only_runs_its_steps_in_its_order_and_refuses_a_misspelt_one():
    suite = str(REPO / "benchmarks" / "gpu_suite.sh")
    out = subprocess.run(["bash", suite, "--dry-run", "--only", "gpu-test"], capture_output=True, text=True)
    assert out.returncode == 2 and "--only: no step 'gpu-test'" in out.stderr
    # the loop walks ORDER: --only's order, so the GPU tests can come first on a short lease
    text = (REPO / "benchmarks" / "gpu_suite.sh").read_text()
    assert 'for i in "${ORDER[@]}"; do' in text and 'ORDER+=("$found")' in text
    out = subprocess.run(["bash", suite, "--dry-run", "--only", "gpu-tests,train-step"], capture_output=True, text=True)
    assert "would run, in order: gpu-tests train-step \n" in out.stdout, out.stdout
    out = subprocess.run(["bash", suite, "--dry-run"], capture_output=True, text=True)
    assert "would run, in order: train-step throughput encode profile pretrain-speed \n" in out.stdout


def test_training_step_flops_and_mfu():
    """3 x forward FLOPs of B queries + B positives of L tokens, for the quick mode's 2 x 64 model (by hand:
    linear parameters per layer 3D^2 + D^2 + 2DF + FD with D = 64, F = 88)."""
    from neoembed.modeling import NeoBERTConfig, NeoBERTModel

    model = NeoBERTModel(NeoBERTConfig(**train_step_cuda.QUICK_CONFIG, vocab_size=100))
    # SwiGLU's hidden size F: 2/3 of intermediate_size (128), rounded up to a multiple of 8
    D, F, layers, B, L = 64, 88, 2, 4, 64
    assert model.config.ffn_hidden_size == F
    linear = layers * (4 * D * D + 3 * D * F)
    per_token = 2 * linear + layers * 4 * L * D
    assert train_step_cuda.step_flops(model, "unified", B, L) == 3 * 2 * B * L * per_token
    assert train_step_cuda.step_flops(model, "gradcache", B, L) == 3 * 2 * B * L * per_token
    N, soft = 8, 4
    second = L + N + soft
    cde = 3 * (N * L * per_token + 2 * B * second * (2 * linear + layers * 4 * second * D))
    assert train_step_cuda.step_flops(model, "cde", B, L, N, soft) == cde
    assert train_step_cuda.mfu(1e12, 2.0, 1e12) == 0.5
    with pytest.raises(ValueError, match="unknown step 'mlm'"):
        train_step_cuda.step_flops(model, "mlm", B, L)


def test_fp16_against_fp32_scores_per_task():
    fp32 = {"STS12": {"main_score": 0.700}, "STS13": {"main_score": 0.600}, "MSRP": {"main_score": 0.8}}
    fp16 = {"STS12": {"main_score": 0.7015}, "STS13": {"main_score": 0.6030}}
    rows = {r["task"]: r for r in mteb_precision.precision_deltas(fp32, fp16)}
    assert rows["STS12"]["ok"] and rows["STS12"]["delta"] == pytest.approx(0.0015)
    assert not rows["STS13"]["ok"]  # 0.003 apart
    assert (
        not rows["MSRP"]["ok"] and rows["MSRP"]["fp16"] is None
    )  # missing on one side: reported, not dropped


def test_every_dependency_is_on_the_gpu_image_or_carried():
    """benchmarks/gpu_wheels.txt (what gpu_wheels.sh carries) and gpu_image.txt (what the GPU machine has) cover
    every runtime dependency of pyproject.toml, so the suite's offline install cannot miss one."""
    import tomllib

    from packaging.requirements import Requirement

    sys.path.insert(0, str(REPO / "benchmarks"))
    import _gpu_wheels

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {_gpu_wheels.norm(Requirement(d).name) for d in deps}
    have = set(_gpu_wheels.image_packages()) | set(_gpu_wheels.carried())
    assert names - have == set()
    assert {"torch", "transformers", "sentence-transformers"} <= set(_gpu_wheels.image_packages())
    assert "mteb" in _gpu_wheels.carried()  # the image has no mteb


def test_packed_model_round_trips_to_fp16_exact_weights(tmp_path):
    """gpu_wheels.sh carries the trained model packed (int8 rows + scales); unpacked on the GPU machine every
    weight is a float32 that float16 holds exactly (so fp16 and fp32 evaluate the same weights) and within a row's
    rounding step of the original."""
    import _gpu_wheels
    import torch
    from safetensors.torch import load_file, save_file

    src, packed, back = tmp_path / "src", tmp_path / "packed", tmp_path / "back"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    weights = {"emb.weight": torch.randn(1000, 96, generator=g), "norm.weight": torch.rand(96, generator=g) + 0.5,
               "ids": torch.arange(5)}  # fmt: skip
    save_file(weights, src / "model.safetensors")
    (src / "config.json").write_text("{}")
    _gpu_wheels.pack(src, packed)
    assert not (packed / "model.safetensors").exists() and (packed / "config.json").exists()
    assert (packed / _gpu_wheels.PACKED).stat().st_size < (src / "model.safetensors").stat().st_size / 3
    _gpu_wheels.unpack(packed, back)
    out = load_file(back / "model.safetensors")
    assert set(out) == set(weights) and torch.equal(out["ids"], weights["ids"])
    for name in ("emb.weight", "norm.weight"):
        assert out[name].dtype == torch.float32 and torch.equal(out[name].half().float(), out[name])
    step = weights["emb.weight"].abs().amax(dim=1, keepdim=True) / 127
    assert (
        (out["emb.weight"] - weights["emb.weight"]).abs()
        <= step / 2 + 1e-3 * step.abs() + 1e-3 * out["emb.weight"].abs()
    ).all()
    torch.testing.assert_close(out["norm.weight"], weights["norm.weight"], rtol=1e-3, atol=0)
