"""Inference throughput of NeoBERT against ModernBERT-base and BERT-base: the paper's Table 10 / Figure 3 as a harness.

    python benchmarks/throughput.py --quick          # CPU fp32, < 5 minutes on 2 cores
    python benchmarks/throughput.py --device cuda    # bf16, lengths 512 ... 8192, batch size searched per length
    python benchmarks/throughput.py --official PATH  # CPU fp32: against the official code, same weights, one run
    python benchmarks/throughput.py --official PATH --compile   # ... and neoembed under torch.compile beside it

``--official`` takes a checkout of github.com/chandar-lab/NeoBERT (its ``src/neobert/model/``; patched in memory as
``benchmarks/_official.py`` describes) and times, on identical full-size random weights, unpadded 4 x 512 and 16
real texts of 20-400 tokens padded to the longest (paragraphs of the NeoBERT paper, see ``official_inputs``); the
runs alternate and each figure is a median.

Every model has random weights built from its config (no hub). Measured side by side in one run:

* fixed lengths: tokens/s at each sequence length with the best batch size found under a token budget
  (NeoBERT at 8,192 runs with YaRN factor 2 and is labelled so; BERT-base only at 512);
* real variable-length text: texts of ../shared/data in random order, batches of 32, "padded" = each batch
  padded to its longest text; tokens/s counts real tokens only; NeoBERT padded vs padding-free;
* the machine's matrix-multiply rate (fp32 on CPU, bf16 on CUDA), so the model's share of it is reported.

Model FLOPs per token = 2 x (parameters of all linear layers outside the embedding) + 4 x L x D per layer
(QK^T and attention x V, with L the number of keys attended). Results: benchmarks/results/throughput_<device>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import statistics
import time
from pathlib import Path

import torch
from _common import (
    SHARED,
    first_and_median,
    header,
    matmul_rate,
    median_time,
    model_flops,
    real_texts,
    write_results,
)
from transformers import AutoTokenizer, BertConfig, BertModel, ModernBertConfig, ModernBertModel

from neoembed.modeling import NeoBERTConfig, NeoBERTModel

TOKENIZER = str(SHARED / "fixtures" / "neobert-tiny-official")


def build(kind: str, device: str, dtype: torch.dtype, padding_free: bool = True, yarn: bool = False):
    torch.manual_seed(0)
    # initialised on the device: 250M random values take seconds on the CPU, out of the GPU suite's time box
    with torch.device(device):
        if kind == "neobert":
            cfg = NeoBERTConfig(
                padding_free=padding_free, rope_scaling={"type": "yarn", "factor": 2.0} if yarn else None
            )
            cfg._attn_implementation = "sdpa"
            model = NeoBERTModel(cfg)
        elif kind == "modernbert":
            cfg = ModernBertConfig()
            # its best attention: flash-attn's kernels (unpadded) where installed, else SDPA
            cfg._attn_implementation = "flash_attention_2" if modernbert_flash(device, dtype) else "sdpa"
            model = ModernBertModel(cfg)
        elif kind == "bert":
            cfg = BertConfig()
            cfg._attn_implementation = "sdpa"
            model = BertModel(cfg, add_pooling_layer=False)
        else:
            raise ValueError(f"unknown model {kind!r}; valid: neobert, modernbert, bert")
    return model.to(device=device, dtype=dtype).eval()


def modernbert_flash(device: str, dtype: torch.dtype) -> bool:
    import importlib.util

    return (
        device.startswith("cuda")
        and dtype != torch.float32
        and importlib.util.find_spec("flash_attn") is not None
    )


def graphed(model):
    from neoembed.compile import enable_cuda_graphs

    enable_cuda_graphs(model, max_length=512)  # the variable-length batches are cut at 512 tokens
    return model


def forward_fn(model, ids, mask):
    def run():
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask)

    return run


def fixed_length(models: dict, lengths, batches, device, reps, token_budget, on_length=None) -> list[dict]:
    """The best tokens/s of each model at each length; ``on_length(rows)`` after each length."""
    rows = []
    for L in lengths:
        entries = {name: m for name, m in models.items() if L <= 512 or name != "BERT-base"}
        if L > 4096:
            entries = (
                {"NeoBERT (YaRN x2)": models["NeoBERT (YaRN x2)"]} if "NeoBERT (YaRN x2)" in models else {}
            )
        elif "NeoBERT (YaRN x2)" in entries:
            entries.pop("NeoBERT (YaRN x2)")
        for name, model in entries.items():
            limit = getattr(model.config, "max_sequence_length", model.config.max_position_embeddings)
            if L > limit:
                continue
            best = None
            fits = [b for b in batches if b * L <= token_budget]
            for b in fits[-1:] if device.startswith("cuda") else fits[-2:]:  # the largest (CPU: two) that fit
                ids = torch.randint(1000, 20000, (b, L), device=device)
                mask = torch.ones_like(ids)
                try:
                    t = median_time(forward_fn(model, ids, mask), device, reps)
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    break
                rate = b * L / t
                if best is None or rate > best["tokens_per_s"]:
                    best = {
                        "model": name,
                        "length": L,
                        "batch": b,
                        "tokens_per_s": rate,
                        "gflops": model_flops(model, b * L, L) / t / 1e9,
                    }
            if best:
                rows.append(best)
                print(
                    f"  L={L:5d} {name:22s} batch {best['batch']:4d}: {best['tokens_per_s']:10.0f} tok/s "
                    f"({best['gflops']:.1f} GFLOP/s)",
                    flush=True,
                )
        if on_length is not None:
            on_length(rows)
    return rows


def variable_length(models: dict, texts, device, n_batches: int, batch_size: int, reps: int) -> list[dict]:
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    random.Random(0).shuffle(texts)
    batches = []
    for i in range(n_batches):
        chunk = texts[i * batch_size : (i + 1) * batch_size]
        enc = tok(chunk, padding=True, truncation=True, max_length=512, return_tensors="pt")
        batches.append((enc["input_ids"].to(device), enc["attention_mask"].to(device)))
    real = sum(int(m.sum()) for _, m in batches)
    padded = sum(m.numel() for _, m in batches)
    rows = []

    def run(model):
        with torch.inference_mode():
            for ids, mask in batches:
                model(input_ids=ids, attention_mask=mask)

    timed = first_and_median({name: functools.partial(run, model) for name, model in models.items()}, device, reps)
    for name, (first, t) in timed.items():
        rows.append({"model": name, "real_tokens": real, "padded_tokens": padded, "tokens_per_s": real / t,
                     "first_pass_tokens_per_s": real / first})  # fmt: skip
        print(f"  variable-length {name:28s}: {real / t:10.0f} real tok/s", flush=True)
    return rows


def _timed(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        with torch.inference_mode():
            fn()
        times.append(time.perf_counter() - t0)
    return times


def paper_paragraphs() -> list[str]:
    """The prose paragraphs of ../shared/paper/neobert-paper.md (headings, tables, figures, formulas and code
    left out), in document order."""
    text = (SHARED / "paper" / "neobert-paper.md").read_text(encoding="utf8")
    paragraphs = (p.strip() for p in re.split(r"\n\s*\n", text))
    return [
        p for p in paragraphs if not p.startswith(("#", "|", "!", "$$", "```", "<")) and len(p.split()) > 5
    ]


def official_inputs():
    """Unpadded 4 x 512 random ids, and 16 real texts of 20-400 tokens padded to the longest.

    The texts are paragraphs of the NeoBERT paper (../shared/paper/neobert-paper.md; ../shared/data holds no text
    between ~115 and 400 tokens): for each of 16 target lengths evenly spaced from 20 to 400 tokens, the paragraph
    whose length is closest (first in document order on ties, none used twice), so that the batch spans the range
    the way a mixed real batch does: lengths 20-394, 3,377 real of 6,304 padded tokens, so padding removal can
    save at most 1.87x of the linear layers' work on this batch (2.65x of the attention's). A seeded random draw of
    16 paragraphs is no more padded (30-186 tokens, 1,494 real of 2,976). Deterministic: same paper, same
    tokenizer, same batch."""
    g = torch.Generator().manual_seed(0)
    unpadded = torch.randint(1000, 20000, (4, 512), generator=g)
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    sized = [(len(tok(p)["input_ids"]), p) for p in paper_paragraphs()]
    sized = [(n, p) for n, p in sized if 20 <= n <= 400]
    picked = []
    for target in (20 + i * 380 / 15 for i in range(16)):
        best = min(range(len(sized)), key=lambda i: abs(sized[i][0] - target))
        picked.append(sized.pop(best)[1])
    enc = tok(picked, padding=True, truncation=True, max_length=512, return_tensors="pt")
    n = enc["attention_mask"].sum(1)
    name = f"padded real text 16 paper paragraphs of {int(n.min())}-{int(n.max())} tokens"
    return {
        "unpadded 4x512": (unpadded, torch.ones_like(unpadded)),
        name: (enc["input_ids"], enc["attention_mask"]),
    }


def official_comparison(checkout: Path, reps: int, compiled: bool, commit: str | None, cases=()) -> None:
    """neoembed against the official implementation, same weights, alternating runs in one process."""
    from _official import official_commit, official_forward, official_twin

    ours = build("neobert", "cpu", torch.float32)
    official = official_twin(ours, checkout)
    variants = {"neoembed": lambda ids, mask: ours(input_ids=ids, attention_mask=mask)}
    if compiled:
        fast = torch.compile(ours)
        variants["neoembed compiled"] = lambda ids, mask: fast(input_ids=ids, attention_mask=mask)
    rows, load = [], os.getloadavg()
    rate = matmul_rate("cpu", torch.float32, 2048)  # what the GEMMs can reach here, measured in this run
    for case, (ids, mask) in official_inputs().items():
        if cases and not any(case.startswith(c) for c in cases):
            continue
        runs = {
            "official": lambda ids=ids, mask=mask: official_forward(
                official, ids, None if bool(mask.all()) else mask
            )
        }
        runs.update({n: (lambda f=f, ids=ids, mask=mask: f(ids, mask)) for n, f in variants.items()})
        # first call of each, untimed in the medians (compilation for the compiled one); its outputs are compared
        warm, first = {}, {}
        for n, f in runs.items():
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = f()
            warm[n], first[n] = time.perf_counter() - t0, out if n == "official" else out.last_hidden_state
        diff = {n: float((first[n] - first["official"])[mask.bool()].abs().max()) for n in runs}
        times: dict[str, list[float]] = {n: [] for n in runs}
        for _ in range(reps):  # alternate, so that the machine's load drifts over all of them alike
            for n, f in runs.items():
                times[n] += _timed(f, 1)
        med = {n: statistics.median(t) for n, t in times.items()}
        # the fastest any implementation could be: the real tokens' FLOPs (each token attends to its own text) at
        # the matmul rate, nothing else costing anything
        floor = sum(model_flops(ours, n, n) for n in mask.sum(1).tolist()) / rate
        for n in runs:
            row = {
                "case": case,
                "implementation": n,
                "median_s": med[n],
                "times_s": times[n],
                "first_call_s": warm[n],
                "speedup_vs_official": med["official"] / med[n],
                "real_tokens": int(mask.sum()),
                "padded_tokens": mask.numel(),
                "max_abs_diff_vs_official": diff[n],
                "floor_s_at_matmul_rate": floor,
            }
            rows.append(row)
            print(
                f"  {case:30s} {n:18s} {med[n] * 1e3:8.0f} ms  x{row['speedup_vs_official']:.2f} vs official",
                flush=True,
            )
    head = header()
    # the checkout's place is this machine's business; its commit, recorded below, says which code it was
    head["command"] = head["command"].replace(str(checkout), "OFFICIAL_CHECKOUT")
    payload = {
        "header": head,
        "official_commit": commit or official_commit(checkout),
        "threads": torch.get_num_threads(),
        "load_average_1_5_15_before": load,
        "load_average_1_5_15_after": os.getloadavg(),
        "reps": reps,
        "matmul_gflop_per_s": rate / 1e9,
        "rows": rows,
    }
    md = [
        f"neoembed vs official NeoBERT (commit {payload['official_commit']}), CPU fp32, "
        f"{payload['threads']} threads, median of {reps} alternating runs; load average before / after: "
        f"{load[0]:.1f} / {payload['load_average_1_5_15_after'][0]:.1f}",
        "",
        "| case | implementation | median ms | ms per real token | speed-up vs official | first call ms "
        "| max abs diff |",
        "|---|---|---|---|---|---|---|",
    ]
    md += [
        f"| {r['case']} | {r['implementation']} | {r['median_s'] * 1e3:.0f} "
        f"| {r['median_s'] * 1e3 / r['real_tokens']:.2f} | {r['speedup_vs_official']:.2f}x "
        f"| {r['first_call_s'] * 1e3:.0f} | {r['max_abs_diff_vs_official']:.1e} |"
        for r in rows
    ]
    # what padding removal can win on each batch: the official code computes every padded token
    md += [""] + [
        f"- {case}: {r['real_tokens']:,} real of {r['padded_tokens']:,} tokens, so dropping padding divides the "
        f"linear layers' work by at most {r['padded_tokens'] / r['real_tokens']:.2f}"
        for case, r in {r["case"]: r for r in rows}.items()
        if r["padded_tokens"] > r["real_tokens"]
    ]
    official_s = {r["case"]: r["median_s"] for r in rows if r["implementation"] == "official"}
    md += [
        f"- {case}: its real tokens' FLOPs take at least {floor * 1e3:.0f} ms at this run's fp32 matmul rate "
        f"({rate / 1e9:.0f} GFLOP/s, 2,048^3): no implementation can run it more than "
        f"{official_s[case] / floor:.2f}x faster than the official code here"
        for case, floor in {r["case"]: r["floor_s_at_matmul_rate"] for r in rows}.items()
    ]
    stem = "throughput_cpu_official" + "".join("_" + c.replace(" ", "-") for c in cases)
    j, m = write_results(stem, payload, "\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {j}, {m}")


def plot(payload: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    by_model: dict[str, list] = {}
    for r in payload["fixed_length"]:
        by_model.setdefault(r["model"], []).append((r["length"], r["tokens_per_s"]))
    for name, pts in by_model.items():
        xs, ys = zip(*sorted(pts), strict=True)
        ax1.plot(xs, ys, marker="o", label=name)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("sequence length (tokens)")
    ax1.set_ylabel("tokens / s (best batch size)")
    ax1.set_title("Fixed length")
    ax1.legend()
    names = [r["model"] for r in payload["variable_length"]]
    ax2.barh(names, [r["tokens_per_s"] for r in payload["variable_length"]])
    ax2.set_xlabel("real tokens / s")
    ax2.set_title("Real variable-length text, random order")
    fig.suptitle(f"Inference throughput ({payload['device']}, {payload['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="CPU quick mode: lengths 512 and 1024, small batches")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument(
        "--official", type=Path, default=None, help="checkout of chandar-lab/NeoBERT: compare on CPU"
    )
    p.add_argument("--official-commit", default=None, help="its commit, when PATH is not a git checkout")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time compiled NeoBERT (with --official: torch.compile of the model; else neoembed.compile's layers)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also NeoBERT replayed from CUDA graphs over length buckets (neoembed.compile.enable_cuda_graphs)",
    )
    p.add_argument(
        "--lengths",
        default=None,
        help="comma-separated fixed lengths to time (default: all the mode's); 'none' for the variable-length part only",
    )
    p.add_argument(
        "--case",
        action="append",
        default=[],
        help="with --official: only the cases whose name starts with this",
    )
    args = p.parse_args()
    if args.official is not None:
        official_comparison(args.official, args.reps or 5, args.compile, args.official_commit, args.case)
        return
    device = args.device
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:  # one batch of 65,536 tokens per length: enough to fill an H100, and the suite's time box holds
        lengths, batches, reps, budget = [512, 1024, 2048, 4096, 8192], [8, 16, 32, 64, 128], 3, 2**16
        n_var = 60
    elif args.quick:
        lengths, batches, reps, budget = [512, 1024], [1, 2, 4], 2, 2048
        n_var = 6
    else:
        lengths, batches, reps, budget = [512, 1024, 2048, 4096], [1, 2, 4, 8], 3, 8192
        n_var = 40
    reps = args.reps or reps
    if args.lengths is not None:
        lengths = [] if args.lengths == "none" else [int(x) for x in args.lengths.split(",")]
    print(f"matrix-multiply rate ({dtype}) ...", flush=True)
    mm = matmul_rate(device, dtype, 8192 if cuda else 2048)
    print(f"  {mm / 1e9:.1f} GFLOP/s", flush=True)

    models = {
        "NeoBERT": build("neobert", device, dtype),
        "ModernBERT-base": build("modernbert", device, dtype),
        "BERT-base": build("bert", device, dtype),
    }
    if args.compile:
        from neoembed.compile import compile_layers

        models["NeoBERT compiled"] = build("neobert", device, dtype)
        # dynamic shapes from the start: one compilation serves every length (the first call pays it)
        compile_layers(models["NeoBERT compiled"], dynamic=True)
    if modernbert_flash(device, dtype):
        models["ModernBERT-base (flash-attn)"] = models.pop("ModernBERT-base")
    if 8192 in lengths:
        models["NeoBERT (YaRN x2)"] = build("neobert", device, dtype, yarn=True)
    # the real variable-length batches first: short, and a run cut at its time box still records them
    print("real variable-length batches ...", flush=True)
    var_models = {
        "NeoBERT padded": build("neobert", device, dtype, padding_free=False),
        "NeoBERT padding-free": models["NeoBERT"],
        **(
            {"NeoBERT CUDA graphs": graphed(build("neobert", device, dtype, padding_free=False))}
            if args.cuda_graphs
            else {}
        ),
        # not the compiled layers: their shapes change with every batch here, and each run they lost to eager
        # (throughput_cuda.md) while their compilation took most of the GPU suite's box for this step
        **{k: v for k, v in models.items() if k.startswith("ModernBERT")},
        "BERT-base": models["BERT-base"],
    }
    variable = variable_length(var_models, real_texts(), device, n_var, 32, reps)
    stem = f"throughput_{'cuda' if cuda else 'cpu'}{'_quick' if args.quick else ''}"
    stem += (
        "_L" + ("_".join(map(str, lengths)) or "none") if args.lengths is not None else ""
    )  # a subset: beside the record
    record(stem, device, dtype, [], variable, mm, mm)
    del var_models["NeoBERT padded"]
    print("fixed lengths ...", flush=True)
    fixed = fixed_length(models, lengths, batches, device, reps, budget, lambda rows: record(
        stem, device, dtype, rows, variable, mm, mm))  # fmt: skip
    md, j = record(
        stem, device, dtype, fixed, variable, mm, matmul_rate(device, dtype, 8192 if cuda else 2048)
    )
    plot(json.loads(j.read_text()), j.with_suffix(".png"))
    print("\n".join(md))
    print(f"wrote {j}, {j.with_suffix('.md')}, {j.with_suffix('.png')}")


def record(stem, device, dtype, fixed, variable, mm, mm_after) -> tuple[list[str], Path]:
    """Write the rows measured so far (called after each part, so that a cut run keeps them)."""
    var = {r["model"]: r["tokens_per_s"] for r in variable}
    neo512 = next((r for r in fixed if r["model"] == "NeoBERT" and r["length"] == 512), None)
    summary = {
        "matmul_gflops_before_after": [mm / 1e9, mm_after / 1e9],
        "padding_free_over_padded_variable_length": var["NeoBERT padding-free"] / var["NeoBERT padded"],
        "neobert_512_share_of_matmul_rate": (neo512["gflops"] * 1e9 / max(mm, mm_after)) if neo512 else None,
    }
    payload = {
        "header": header(),
        "device": device,
        "dtype": str(dtype),
        "flops_formula": "tokens * (2 * linear params + layers * 4 * L_attended * hidden)",
        "fixed_length": fixed,
        "variable_length": variable,
        "summary": summary,
    }
    md = [
        "| model | length | batch | tokens/s | GFLOP/s | share of the matmul rate |",
        "|---|---|---|---|---|---|",
    ]
    md += [
        f"| {r['model']} | {r['length']} | {r['batch']} | {r['tokens_per_s']:.0f} | {r['gflops']:.1f} | "
        f"{100 * r['gflops'] * 1e9 / mm:.0f}% |"
        for r in fixed
    ]
    md += ["", "| real variable-length text (random order, batches of 32) | real tokens/s | first pass |"]
    md += ["|---|---|---|"] + [
        f"| {r['model']} | {r['tokens_per_s']:.0f} | {r['first_pass_tokens_per_s']:.0f} |" for r in variable
    ]
    md += [
        "",
        f"- matrix-multiply rate ({dtype}), before / after: {mm / 1e9:.1f} / {mm_after / 1e9:.1f} GFLOP/s",
        f"- padding-free / padded on real variable-length text: **{summary['padding_free_over_padded_variable_length']:.2f}x**",
    ]
    if neo512:
        md.append(
            f"- NeoBERT at 512 tokens: **{100 * summary['neobert_512_share_of_matmul_rate']:.0f}%** of the "
            "matrix-multiply rate"
        )
    j, _ = write_results(stem, payload, "\n".join(md) + "\n")
    return md, j


if __name__ == "__main__":
    main()
