"""Two gloo processes against one (issue #40): every parameter's gradient equal, and the gradient collectives of a
step counted.

Gradients: 1 process with a batch of 2B against 2 processes with B each and ``gather_across_devices`` (every
process scores its queries against the candidates of both), each gradient averaged over the processes as DDP
averages it; for every parameter tensor, max|g2 - g1| <= 1e-5 * max|g1| in fp32. The losses of the unified trainer
(plain, cached) and its objectives run in one launch; pre-training runs its real trainer, with and without gradient
accumulation, its gradients read at the first optimizer step by benchmarks/_probe (which also counts collectives:
benchmarks/collectives.py). The unified trainer has no gradient accumulation (its recipe has no such key). The
losses also run on two "nodes" of one process each (`torchrun --nnodes 2` on localhost) against the same reference.

Each launch imports torch in two processes (tens of seconds on 2 cores); the one-process reference of the losses is
computed in this process.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "recipes" / "tiny" / "model"
TINY_OFFICIAL = REPO / "tests" / "shared" / "fixtures" / "neobert-tiny-official"
PROBE = REPO / "benchmarks" / "_probe"
RELATIVE = 1e-5  # max|g2 - g1| <= RELATIVE * max|g1| for every parameter tensor (fp32)


def _launch(processes: int) -> list[str]:
    """`accelerate launch` for N gloo processes on CPU, as tests/test_train.py launches (see its _launch)."""
    mode = ["--multi_gpu"] if processes > 1 else ["--cpu"]
    return [
        sys.executable, "-m", "accelerate.commands.launch", *mode,
        "--num_machines", "1", "--num_processes", str(processes), "--main_process_port", "0",
        "--mixed_precision", "no", "--dynamo_backend", "no",
    ]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    # PYTHONFAULTHANDLER: a process that aborts (SIGABRT in gloo) prints where its Python threads were
    fixed = {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "PYTHONPATH": path}
    return {**os.environ, **fixed, **extra}


# The losses of the unified trainer on one process's share of a fixed batch; run as a script under accelerate
# (2 processes) and imported here (1 process). Each config: loss class, its options.
LOSS_SCRIPT = textwrap.dedent('''
    import os, sys, torch

    CONFIGS = {
        "plain": ("InfoNCELoss", {}),
        "cached": ("CachedInfoNCELoss", {"mini_batch_size": 2}),
        "plain_matryoshka": ("InfoNCELoss", {"matryoshka": {"dims": [32, 16, 8]}}),
        "cached_matryoshka": ("CachedInfoNCELoss", {"mini_batch_size": 2, "matryoshka": {"dims": [32, 8]}}),
        "plain_false_negatives": ("InfoNCELoss", {"false_negatives": {"margin": 0.05}}),
        "cached_false_negatives": ("CachedInfoNCELoss", {"mini_batch_size": 3, "false_negatives": {"margin": 0.05}}),
        "plain_improved_contrastive": ("InfoNCELoss", {"improved_contrastive": True}),
        # the control: without gathering, 2 processes score fewer negatives, so the comparison must fail
        "plain_not_gathered": ("InfoNCELoss", {"gather_across_devices": False}),
    }
    TOPICS = ["parse a date", "open a file", "sort a list", "join paths", "read json", "spawn a process",
              "format a float", "hash bytes"]

    def batch():
        """8 rows: query, positive, hard negative (distinct texts, of different lengths)."""
        q = [f"how do I {t}" + " quickly" * (i % 3) for i, t in enumerate(TOPICS)]
        p = [f"the function to {t} is in the standard library" for t in TOPICS]
        n = [f"a module that cannot {t}" + " at all" * (i % 2) for i, t in enumerate(TOPICS)]
        return q, p, n

    def gradients(model_path, world, rank):
        """config -> {"loss": mean over processes, "grads": {name: gradient averaged over processes}}."""
        import torch.distributed as dist
        import neoembed
        from neoembed import losses

        model = neoembed.load(model_path)
        columns = batch()
        n = len(columns[0])
        rows = slice(rank * n // world, (rank + 1) * n // world)
        out = {}
        for name, (cls, options) in CONFIGS.items():
            model.zero_grad(set_to_none=True)
            options = dict(options)
            mrl = options.pop("matryoshka", None)  # nested dimensions wrap the loss, as build_loss does
            loss = getattr(losses, cls)(model, **{"gather_across_devices": world > 1, **options})
            loss = loss if mrl is None else losses.with_matryoshka(model, loss, mrl)
            features = [model.tokenize(c[rows]) for c in columns]
            value = loss(features, torch.zeros(len(columns[0][rows])))
            value.backward()
            value = value.detach().clone()
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
            if world > 1:
                for g in [value, *grads.values()]:
                    dist.all_reduce(g)
                    g /= world
            out[name] = {"loss": float(value), "grads": grads, "parameters": len(list(model.parameters()))}
        return out

    if __name__ == "__main__":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        result = gradients(sys.argv[1], acc.num_processes, acc.process_index)
        if acc.is_main_process:
            torch.save({"world": acc.num_processes, "result": result}, sys.argv[2])
        acc.wait_for_everyone()
        acc.end_training()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)  # results saved: skip interpreter teardown, where gloo's threads can abort (torch #190489)
''')


def _mismatches(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor], label: str = "") -> list[str]:
    """Each parameter whose gradients differ beyond RELATIVE x its scale, with the numbers (the worst ratio of
    all is printed: ``pytest -s`` shows how far inside the tolerance the gradients are)."""
    assert sorted(one) == sorted(two), (sorted(set(one) ^ set(two)), "have a gradient on one side only")
    bad, worst = [], (0.0, "")
    for name, g1 in one.items():
        diff, scale = (two[name] - g1).abs().max().item(), g1.abs().max().item()
        worst = max(worst, (diff / scale if scale else float(diff > 0), name))
        if diff > RELATIVE * scale:
            bad.append(f"{name}: max|g2-g1| {diff:.3e} > {RELATIVE:g} x max|g1| {scale:.3e}")
    print(f"{label}: worst max|g2-g1| / max|g1| = {worst[0]:.2e} ({worst[1]}) over {len(one)} tensors")
    return bad


def _one_process_losses(tmp_path: Path) -> tuple[Path, dict]:
    """The loss script written to ``tmp_path`` and its one-process reference, computed here."""
    script = tmp_path / "losses.py"
    script.write_text(LOSS_SCRIPT)
    scope: dict = {"__name__": "losses_reference"}
    exec(compile(LOSS_SCRIPT, str(script), "exec"), scope)
    return script, scope["gradients"](str(TINY_MODEL), 1, 0)


def _assert_losses_equal(one: dict, saved: dict) -> None:
    """Two processes' losses and averaged gradients equal one process's, for every config; the control (not
    gathered) differs."""
    assert saved["world"] == 2  # really two processes
    two = saved["result"]
    assert sorted(two) == sorted(one) and "plain_not_gathered" in one
    one = dict(one)
    control = two.pop("plain_not_gathered")
    assert control["loss"] != pytest.approx(one.pop("plain_not_gathered")["loss"], rel=1e-3)
    assert _mismatches(
        one["plain"]["grads"], control["grads"], "control (not gathered)"
    )  # the check can fail
    failures = {}
    for name, ref in one.items():
        assert two[name]["loss"] == pytest.approx(ref["loss"], rel=1e-5), name
        # every parameter of the model gets a gradient (the losses reach the whole encoder), not all zero
        assert len(ref["grads"]) == ref["parameters"], name
        assert any(g.abs().max() > 0 for g in ref["grads"].values()), name
        bad = _mismatches(ref["grads"], two[name]["grads"], name)
        if bad:
            failures[name] = bad
    assert not failures, json.dumps(failures, indent=1)


def test_two_processes_give_every_gradient_of_one_process_for_each_loss(tmp_path):
    """Plain and cached InfoNCE, with Matryoshka, false-negative masking and the improved contrastive loss; and a
    control that must differ (2 processes without gathering)."""
    script, one = _one_process_losses(tmp_path)
    r = subprocess.run(
        [*_launch(2), str(script), str(TINY_MODEL), str(tmp_path / "two.pt")],
        capture_output=True, text=True, timeout=600, env=_env(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_losses_equal(one, torch.load(tmp_path / "two.pt"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_nodes_give_every_gradient_of_one_process_for_each_loss(tmp_path):
    """The same losses on two "nodes" of one process each (`torchrun --nnodes 2`, rendezvous on localhost, as
    docs/distributed.md launches them): each node's process knows only its global rank, and the gradients still
    equal one process's with the whole batch."""
    script, one = _one_process_losses(tmp_path)
    port, out = _free_port(), tmp_path / "two.pt"

    def node(rank: int) -> subprocess.Popen:  # its output to a file: a full pipe would stall both nodes
        with (tmp_path / f"node{rank}.log").open("w") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                 "--node-rank", str(rank), "--master-addr", "localhost", "--master-port", str(port),
                 str(script), str(TINY_MODEL), str(out)],
                stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=tmp_path,
            )  # fmt: skip

    nodes = [node(0), node(1)]  # node 0 hosts the rendezvous store
    try:
        codes = [p.wait(timeout=600) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    logs = [(tmp_path / f"node{rank}.log").read_text()[-3000:] for rank in (0, 1)]
    assert codes == [0, 0], "\n".join(logs)
    _assert_losses_equal(one, torch.load(out))


def _probed_run(
    tmp_path: Path,
    processes: int,
    args: list[str],
    grads: bool = False,
    out_option: str | None = None,
    save_steps: int = 1000,
) -> tuple[list[dict], Path]:
    """A real training run under benchmarks/_probe; returns each process's record (rank order) and its folder
    (the run's output folder is ``run`` in it). ``out_option``: the option naming the output folder (``--out`` for
    ``neoembed glue``); default the recipe's ``output_dir`` key."""
    folder = tmp_path / f"probe-{processes}-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    env = _env(NEOEMBED_PROBE_DIR=str(folder), NEOEMBED_PROBE_GRADS="1" if grads else "0")
    env["PYTHONPATH"] = os.pathsep.join([str(PROBE), env["PYTHONPATH"]])
    where = [f"output_dir={folder / 'run'}", f"save_steps={save_steps}"]
    if out_option is not None:
        where = [out_option, str(folder / "run")]
    r = subprocess.run(
        [*_launch(processes), "-m", "neoembed", *args, *where],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    records = sorted((json.loads(p.read_text()) for p in folder.glob("rank*.json")), key=lambda d: d["rank"])
    assert [d["rank"] for d in records] == list(range(processes)), "a process wrote no probe record"
    assert all(d["world_size"] == processes for d in records)
    return records, folder


@pytest.mark.parametrize(
    "loss",
    [["loss.name=infonce"], ["loss.name=cached_infonce", "loss.mini_batch_size=4"]],
    ids=["plain", "cached"],
)
def test_unified_trainer_reduces_gradients_once_per_step_in_ddp_buckets(tmp_path, loss):
    """3 optimizer steps of `neoembed train tiny` on 2 processes: each step one DDP bucket reduction holding every
    parameter's bytes once, one 16-byte reduction of the loss and the stop flag, and no other all-reduce of a gradient (the cached loss: 4 GradCache mini-batches a
    step, replayed under no_sync but the last). The ranks' reduced gradients agree."""
    records, folder = _probed_run(tmp_path, 2, ["train", "tiny", "steps=3", *loss], grads=True)
    for record in records:
        assert record["steps"] == 3
        param_bytes = record["params"]["bytes"]
        for step in (1, 2, 3):
            events = [e for e in record["events"] if e["step"] == step]
            buckets = [e for e in events if e["op"] == "ddp_hook"]
            reduces = [e for e in events if e["op"] == "all_reduce"]
            assert len(buckets) == 1 and buckets[0]["bytes"] == param_bytes, (step, buckets, param_bytes)
            # the bucket's, and the loss with the stop flag (two float64: a signal to one process stops them all
            # at one step), reduced together once in the step, after the backward pass
            reduced = sorted((e["kind"], e["bytes"]) for e in reduces)
            assert reduced == [("", 16), ("ddp_bucket", param_bytes)], (step, reduced)
    g0, g1 = (torch.load(folder / f"grads-rank{r}.pt") for r in (0, 1))
    assert len(g0) == records[0]["params"]["tensors"]
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # DDP hands every rank the same averaged gradient


# CDE's step on each process's share, its two stages in DDP; against the same processes' local gradients averaged
# by hand (what DDP must equal). Run under accelerate with 2 processes.
CDE_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel

    from neoembed.cde.gradcache import TextStage, full_backprop_step, stages, two_stage_gradcache_step
    from neoembed.cde.model import ContextualSentenceTransformer
    from neoembed.cde.loss import cde_loss

    DOCS = ["cats sleep most of the day", "paris is the capital of france", "bread rises because of yeast",
            "the sun is a star", "water boils at one hundred degrees", "a violin has four strings",
            "rust has a borrow checker", "the moon orbits the earth"]
    QUERIES = ["what do cats do", "capital of france", "why does bread rise", "what is the sun"]

    def grads(model):
        return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}

    def main(model_path, out):
        acc = Accelerator(cpu=True)
        world, rank = acc.num_processes, acc.process_index
        torch.manual_seed(0)
        m = ContextualSentenceTransformer.from_backbone(model_path, n_context=8, n_soft_prompt=2).cde
        with torch.no_grad():
            for p in m.output_mlp.parameters():
                p.normal_(0, 0.05)
        m.train()
        tok = lambda t: dict(m.tokenizer(t, padding=True, return_tensors="pt"))
        mine = slice(rank * 2, rank * 2 + 2)
        ctx, q, d = tok(DOCS), tok(QUERIES[mine]), tok(DOCS[:4][mine])
        loss_fn = lambda a, b: cde_loss(a, b, 0.5)
        dropped = torch.tensor([False, True] + [False] * 6)
        wrap = lambda stage: DistributedDataParallel(
            stage, find_unused_parameters=isinstance(stage, TextStage), broadcast_buffers=False
        )
        result = {}
        for name, step in (
            ("gradcache", lambda st: two_stage_gradcache_step(m, ctx, q, d, loss_fn, 1, dropped, model_stages=st)),
            ("full", lambda st: full_backprop_step(m, ctx, q, d, loss_fn, dropped, st)),
        ):
            m.zero_grad(set_to_none=True)
            step(stages(m))  # local gradients, averaged by hand
            by_hand = grads(m)
            for g in by_hand.values():
                dist.all_reduce(g)
                g /= world
            m.zero_grad(set_to_none=True)
            step(stages(m, wrap))
            result[name] = {"ddp": grads(m), "by_hand": by_hand}
        if rank == 0:
            torch.save(result, out)
        acc.wait_for_everyone()
        acc.end_training()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)  # results saved: skip interpreter teardown, where gloo's threads can abort (torch #190489)

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2])
""")


def test_cde_stages_in_ddp_give_the_averaged_local_gradients(tmp_path):
    """Each CDE stage in its own DDP wrapper, replays under no_sync but the last: every gradient equals the
    processes' local gradients averaged by hand, for the two-stage GradCache (chunks of 1) and full backprop."""
    script = tmp_path / "cde_ddp.py"
    script.write_text(CDE_SCRIPT)
    out = tmp_path / "cde.pt"
    r = subprocess.run(
        [*_launch(2), str(script), str(TINY_OFFICIAL), str(out)],
        capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    result = torch.load(out)
    for name, g in result.items():
        assert any(k.startswith("first_stage.") for k in g["ddp"]) and "null_context" in g["ddp"], name
        bad = _mismatches(g["by_hand"], g["ddp"], f"cde {name}")
        assert not bad, (name, bad)


CDE = ["train", "cde-tiny", "optimizer.grad_clip=1.0e+9"]


@pytest.fixture(scope="module")
def cde_runs(tmp_path_factory) -> dict[str, tuple[list[dict], Path]]:
    """`neoembed train cde-tiny` (clipping off) probed: 1 process for 1 step; 2 processes for 3 steps, with and
    without gathering the documents (without: a checkpoint at step 2, which test_two_processes_run_the_cde_recipe
    resumes). The run on 1 process stores its clustering in a cache, which the run without gathering reads; the
    gathered run, whose gradients must equal 1 process's, has every process compute it (cde-tiny's default)."""
    tmp = tmp_path_factory.mktemp("cde")
    cache = f"clustering.cache_dir={tmp / 'teacher-cache'}"
    return {
        "one": _probed_run(tmp, 1, [*CDE, "steps=1", cache], grads=True),
        "two": _probed_run(tmp, 2, [*CDE, "steps=3", cache], grads=True, save_steps=2),
        "two_gathered": _probed_run(tmp, 2, [*CDE, "steps=3", "gather_across_devices=true"], grads=True),
    }


@pytest.mark.parametrize("run", ["two", "two_gathered"])
def test_cde_trainer_reduces_each_stage_in_ddp_buckets_once_per_step(cde_runs, run):
    """3 optimizer steps of `neoembed train cde-tiny` on 2 processes: per step one DDP bucket per stage (the
    tiny stages fit DDP's first bucket), together every parameter's bytes once, one all-reduce of the loss and
    stop flag, and no all-reduce of a single gradient; the ranks' reduced gradients agree. Gathering adds the
    documents' all-gathers and no reduction."""
    records, folder = cde_runs[run]
    for record in records:
        assert record["steps"] == 3
        param_bytes = record["params"]["bytes"]
        for step in (2, 3):  # step 1's window also holds DDP's set-up broadcasts
            events = [e for e in record["events"] if e["step"] == step]
            buckets = [e for e in events if e["op"] == "ddp_hook"]
            assert len(buckets) == 2 and sum(e["bytes"] for e in buckets) == param_bytes, (step, buckets)
            reduces = sorted((e["kind"], e["bytes"]) for e in events if e["op"] == "all_reduce")
            assert [k for k, _ in reduces] == ["", "ddp_bucket", "ddp_bucket"], (step, reduces)
            gathers = [e for e in events if e["op"] == "all_gather"]
            assert bool(gathers) == (run == "two_gathered"), (step, gathers)
    g0, g1 = (torch.load(folder / f"grads-rank{r}.pt") for r in (0, 1))
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cde_gradients_equal_on_one_and_two_processes_when_gathered(cde_runs):
    """CDE's real trainer (two-stage GradCache, the teacher's false negatives and duplicates masked) at a global
    batch of 8: every gradient at the first optimizer step equal on 1 process and on 2 that gather each other's
    documents; 2 processes that do not gather score fewer documents, and their gradients differ (the control)."""
    (records, one), (_, control), (_, gathered) = (cde_runs[k] for k in ("one", "two", "two_gathered"))
    g1, g_control, g2 = (
        {str(i): g for i, g in enumerate(torch.load(f / "grads-rank0.pt"))} for f in (one, control, gathered)
    )
    assert len(g1) == records[0]["params"]["tensors"]
    assert _mismatches(g1, g_control, "cde, not gathered")  # the check can fail
    bad = _mismatches(g1, g2, "cde, gathered")
    assert not bad, bad


def test_two_processes_run_the_cde_recipe(cde_runs, tmp_path, run_neoembed):
    """`neoembed train cde-tiny` on 2 processes: every step logged with both, the one checkpoint format of
    neoembed.loop (accelerate's state + trainer_state.json, sealed by its marker), a model that loads; CDE's batch
    is global (split over the processes), so its checkpoint resumes on one process."""
    import neoembed
    from neoembed.runs import verify_checkpoint

    out = cde_runs["two"][1] / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3] and all(row["world_size"] == 2 for row in rows)
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "state").is_dir()
    assert verify_checkpoint(checkpoint) is None
    assert neoembed.load(out).n_context == 8
    assert os.environ.get("WORLD_SIZE") is None  # nothing leaked into this process
    one = tmp_path / "one"
    shutil.copytree(checkpoint, one / "checkpoint-2")
    r = run_neoembed([*CDE, "steps=3", "save_steps=2", f"output_dir={one}", "--resume"], cwd=REPO)
    assert r.exit_code == 0, r.stderr[-3000:]
    assert "Batches" not in r.stderr  # the teacher pass's library bars stay off the console
    rows = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["world_size"]) for row in rows] == [(3, 1)]
    assert neoembed.load(one).n_context == 8


PRETRAIN = ["pretrain", "pretrain-tiny", "steps=1", "schedule.warmup_steps=0", "optimizer.grad_clip=1.0e+9"]


@pytest.mark.parametrize(
    "one,two",
    [
        (["batch.micro_batch_size=8"], ["batch.micro_batch_size=4"]),
        (
            ["batch.micro_batch_size=4", "batch.grad_accumulation=2"],
            ["batch.micro_batch_size=2", "batch.grad_accumulation=2"],
        ),
    ],
    ids=["no_accumulation", "accumulation_2"],
)
def test_pretraining_gradients_equal_on_one_and_two_processes(tmp_path, one, two):
    """Pre-training's real trainer at a global batch of 8 sequences: every gradient at the first optimizer step
    (DDP-averaged, clipping off) equal on 1 and 2 processes, and one bucket reduction per step."""
    _, folder1 = _probed_run(tmp_path, 1, [*PRETRAIN, *one], grads=True)
    records, folder2 = _probed_run(tmp_path, 2, [*PRETRAIN, *two], grads=True)
    g1, g2 = torch.load(folder1 / "grads-rank0.pt"), torch.load(folder2 / "grads-rank0.pt")
    assert len(g1) == len(g2) == records[0]["params"]["tensors"]
    bad = _mismatches(
        {str(i): g for i, g in enumerate(g1)}, {str(i): g for i, g in enumerate(g2)}, f"pretraining {one}"
    )
    assert not bad, bad
    buckets = [e for e in records[0]["events"] if e["op"] == "ddp_hook"]
    assert len(buckets) == 1 and buckets[0]["bytes"] == records[0]["params"]["bytes"]


def test_glue_gradients_equal_on_one_and_two_processes(tmp_path, shared_dir):
    """`neoembed glue MRPC` on the run loop: ``batch_size`` is the global batch, each of 2 processes takes half, and
    every gradient at the first optimizer step equals one process's (classifier dropout off, as the encoder has
    none); one DDP bucket reduction per step."""
    import gzip

    import pandas as pd

    with gzip.open(shared_dir / "data" / "eval" / "MSRP" / "test.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(24), f, strict=False)]
    data = tmp_path / "glue" / "mrpc"
    data.mkdir(parents=True)
    pd.DataFrame(rows[:16]).to_parquet(data / "train-00000-of-00001.parquet")
    pd.DataFrame(rows[16:]).to_parquet(data / "validation-00000-of-00001.parquet")
    model = tmp_path / "model"
    shutil.copytree(TINY_OFFICIAL, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "classifier_dropout": 0.0}))
    glue = ["glue", "MRPC", "--model", str(model), "--data-dir", str(tmp_path / "glue")]
    glue += ["epochs=1", "batch_size=8"]
    records1, folder1 = _probed_run(tmp_path, 1, glue, grads=True, out_option="--out")
    records2, folder2 = _probed_run(tmp_path, 2, glue, grads=True, out_option="--out")
    g1, g2 = torch.load(folder1 / "grads-rank0.pt"), torch.load(folder2 / "grads-rank0.pt")
    assert records1[0]["steps"] == records2[0]["steps"] == 2  # 16 rows, a global batch of 8
    bad = _mismatches({str(i): g for i, g in enumerate(g1)}, {str(i): g for i, g in enumerate(g2)}, "glue")
    assert not bad, bad
    for step in (1, 2):
        buckets = [e for e in records2[0]["events"] if e["op"] == "ddp_hook" and e["step"] == step]
        assert len(buckets) == 1 and buckets[0]["bytes"] == records2[0]["params"]["bytes"], (step, buckets)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine torchrun's processes join over NCCL")
@pytest.mark.parametrize(
    "command", [["train", "tiny"], ["pretrain", "pretrain-tiny"]], ids=["train", "pretrain"]
)
def test_torchrun_without_a_gpu_joins_the_processes_into_one_run(tmp_path, command):
    """`torchrun --nproc-per-node 2` on a machine without CUDA and without ACCELERATE_USE_CPU: the processes train
    together over gloo (every step sees both), not as two copies writing one folder (the unified trainer did that
    and tore its own checkpoints: "could not write checkpoint-4")."""
    env = {k: v for k, v in _env().items() if k != "ACCELERATE_USE_CPU"}
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "neoembed", *command, f"output_dir={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert (out / "model.safetensors").exists()
    # both trainers record the process count, and the unified trainer logs it with every step as well
    record = json.loads((out / "run_record.json").read_text())
    assert record["world_size"] == 2, record.get("world_size")
    if command[0] == "train":
        steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert {s["world_size"] for s in steps if "world_size" in s} == {2}


def test_join_on_cpu_only_for_several_processes_without_cuda(monkeypatch):
    from neoembed.loop import check_launch, join_on_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not join_on_cpu()  # one process: the device is the trainer's own choice
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert join_on_cpu()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not join_on_cpu()  # NCCL joins them
    with pytest.raises(RuntimeError, match="2 processes were launched .* accelerate sees 1"):
        check_launch(1)
    check_launch(2)


@pytest.mark.parametrize(
    ("command", "engine"),
    [
        (["train", "tiny"], "DEEPSPEED"),
        (["train", "cde-tiny"], "FSDP"),
        (["pretrain", "pretrain-tiny"], "FSDP"),
    ],
    ids=["unified-deepspeed", "cde-fsdp", "pretrain-fsdp"],
)
def test_a_sharded_engine_not_verified_for_a_trainer_is_refused_before_the_model_loads(
    tmp_path, capsys, monkeypatch, command, engine
):
    """DeepSpeed and FSDP are refused for every trainer not verified on them (ZeRO-1/2 pre-training is, on one
    GPU), naming why, before data or a model loads; a DDP launch is unaffected (the other tests)."""
    from test_runs import _cli

    from neoembed.loop import ENGINE_SUPPORT, check_engine

    monkeypatch.setenv(f"ACCELERATE_USE_{engine}", "true")
    code, msg = _cli(capsys, monkeypatch, *command, f"output_dir={tmp_path / 'out'}")
    assert code == 2 and "is not supported" in msg and "DDP" in msg, msg
    assert not (tmp_path / "out").exists()
    monkeypatch.delenv(f"ACCELERATE_USE_{engine}")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_engine("pretrain")  # verified: passes
    assert {"unified", "cde", "glue", "pretrain"} == set(ENGINE_SUPPORT)


def test_a_verified_sharded_engine_without_cuda_is_refused_not_run_as_ddp(tmp_path, capsys, monkeypatch):
    """accelerate shards on accelerator devices only: on a CPU machine a DeepSpeed launch of pre-training (verified
    on one GPU) trained as plain DDP under DeepSpeed's name. It is refused before data or a model loads."""
    from test_runs import _cli

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, msg = _cli(capsys, monkeypatch, "pretrain", "pretrain-tiny", f"output_dir={tmp_path / 'out'}")
    assert code == 2 and "DeepSpeed needs CUDA" in msg and "plain DDP" in msg, msg
    assert not (tmp_path / "out").exists()


def test_accelerate_on_cpu_runs_an_fsdp_launch_as_ddp():
    """Why check_engine refuses a sharded engine without CUDA (docs/distributed.md): accelerate, told to run on
    the CPU, gives a process of an FSDP launch the plain multi-CPU (DDP) type. When a release shards on CPU, this
    fails, and the refusal can go."""
    code = "from accelerate import Accelerator; print(Accelerator(cpu=True).distributed_type.value)"
    launched = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env = _env(**launched, MASTER_ADDR="127.0.0.1", MASTER_PORT="29617", ACCELERATE_USE_FSDP="true")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "MULTI_CPU", r.stdout


def test_the_unified_trainers_progress_line_prints_once_not_once_per_process(tmp_path, capsys):
    """Under torchrun each process printed every progress line: the run loop, which the unified trainer runs on,
    prints them from the first process alone."""
    from types import SimpleNamespace

    from neoembed.loop import RunLoop, StepOutput
    from neoembed.recipe import load_recipe
    from neoembed.train.recipe import UnifiedRecipe

    recipe = load_recipe("tiny", UnifiedRecipe, ["steps=3", "save_steps=100", f"output_dir={tmp_path}"])
    optimizer = SimpleNamespace(step=lambda: None, zero_grad=lambda set_to_none: None)
    scheduler = SimpleNamespace(step=lambda: None, get_last_lr=lambda: [1e-3])
    for first in (True, False):
        acc = SimpleNamespace(
            is_main_process=first,
            register_for_checkpointing=lambda obj: None,
            clip_grad_norm_=lambda p, c: 0.0,
        )
        (tmp_path / str(first)).mkdir()
        loop = RunLoop(acc, recipe, tmp_path / str(first), optimizer=optimizer, scheduler=scheduler,
                       parameters=list, grad_clip=1.0, settings=None)  # fmt: skip
        loop.save = lambda: None  # the last step's checkpoint is not what this test reads
        loop.run(lambda step, stop: StepOutput(1.0, False, {"loss": 1.0}), lambda sums, *a: {"loss": 1.0})
    err = capsys.readouterr().err
    assert err.count("step 3/3") == 1, err


def test_sigterm_to_one_process_stops_every_process_at_one_checkpoint(tmp_path):
    """SIGTERM to one process of a 2-process unified run: before, that process stopped alone and the other waited in
    its next gradient reduction (or, signalled second, saved its final model early). Both now stop after the same
    step with one checkpoint and exit 143, and --resume finishes the run."""
    import contextlib
    import signal
    import time

    import psutil

    out = tmp_path / "run"
    args = ["-m", "neoembed", "train", "tiny", f"output_dir={out}", "steps=200", "save_steps=1000"]
    launcher = subprocess.Popen([*_launch(2), *args], env=_env(), cwd=REPO, stderr=subprocess.PIPE, text=True)
    tree, procs = psutil.Process(launcher.pid), []
    try:
        deadline = time.monotonic() + 300
        while (
            not (out / "metrics.jsonl").is_file() or len((out / "metrics.jsonl").read_text().splitlines()) < 2
        ):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run ended or never logged"
            time.sleep(0.5)
        procs = tree.children(recursive=True)
        ranks = {p.environ().get("RANK"): p for p in procs}
        ranks["1"].send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=240)  # a process left waiting would hang here, not pass
    finally:
        for p in [*procs, tree]:  # nothing left running if the test fails
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert len(checkpoints) == 1 and not (out / "model.safetensors").exists(), (checkpoints, err[-2000:])
    assert "143" in err or "SIGTERM" in err, err[-2000:]
    assert err.count("training stopped: stopped by SIGTERM") == 1, err[-2000:]  # said once, not once a process
    stopped = int(checkpoints[0].name.split("-")[1])
    r = subprocess.run([*_launch(2), *args[:-2], f"steps={stopped + 2}", "save_steps=1000", "--resume"],
                       env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0 and (out / "model.safetensors").is_file(), r.stderr[-2000:]


def test_a_run_on_two_processes_resumes_bit_identically(tmp_path):
    """`neoembed train tiny` on 2 processes with gathered negatives, 8 steps: every step logged with both
    processes, the model saved; the same run resumed on 2 processes from its step-4 checkpoint logs the same
    losses at steps 5-8 and ends at the same weights, bit for bit (each rank's sampler, RNG and optimizer state
    come back, not only rank 0's)."""
    from safetensors.torch import load_file

    def run(out: Path, *extra: str) -> list[dict]:
        r = subprocess.run(
            [*_launch(2), "-m", "neoembed", "train", "tiny", f"output_dir={out}", "steps=8", "save_steps=4",
             "gather_across_devices=true", *extra],
            capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        said = r.stdout + r.stderr  # once per launch, not per process, and no library's notice (#43, M2)
        assert said.count("done: ") == 1 and said.count("card pydoc_names: ") == 1, said[-3000:]
        assert "FutureWarning" not in said, said[-3000:]
        return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    rows = run(full)
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert all(row["world_size"] == 2 for row in rows)  # really two processes
    assert (full / "model.safetensors").is_file()
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 8
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-4", resumed / "checkpoint-4")
    assert [row["loss"] for row in run(resumed, "--resume") if "loss" in row] == losses[4:]
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
