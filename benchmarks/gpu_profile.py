"""Where the GPU time of full-size NeoBERT goes, and which attention kernel is fastest (#42).

    python benchmarks/gpu_profile.py --device cuda --out DIR    # profiles into DIR; the record into results/
    python benchmarks/gpu_profile.py --quick                     # CPU: a 2 x 64 model, the same code paths

Three parts, each in this one process on random weights (speed does not depend on them):

* ``forward``: the torch profiler's top kernels, with their share of the device time, for a bf16 forward of
  full-size NeoBERT (28 x 768) over 32 x 512 tokens, eager and with its layers compiled (neoembed.compile);
* ``train`` and ``gradcache``: the same for one full-size training step (InfoNCE, B = 32 queries + 32 positives
  of 512 tokens, bf16 autocast, AdamW), eager, plain and through GradCache (mini-batches of 8: 7.7x the plain
  step's time in the first H100 run, where one extra forward should cost about 1.3x);
* ``attention``: the attention kernels a packed batch can run, on 32 real texts of ../shared/data (the
  lengths of a batch ``encode`` sees), 12 heads x 64, bf16: SDPA over the padded batch, torch's varlen kernel,
  FlexAttention with a document mask (compiled), flash-attn's varlen kernel where it is installed. Each is
  checked against a float32 per-text SDPA reference (relative error, beside SDPA's own bf16 error) and timed
  (median of CUDA-synchronised runs).

The profiles (``DIR/profile_*.txt``) list kernels by total device time; the record
(``benchmarks/results/gpu_profile_<device>.{json,md}``) keeps each profile's top kernels and the attention table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHARED, header, median_time, real_texts, write_results  # noqa: E402

TOKENIZER = SHARED / "fixtures" / "neobert-tiny-official"
QUICK = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
TOP = 12


def _activities(device: str):
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])


def top_kernels(fn, device: str, steps: int = 3) -> tuple[list[dict], str]:
    """Profile ``steps`` calls of ``fn`` (after two warm-ups): the top device kernels with their share, and the
    profiler's full table."""
    from torch.profiler import profile

    fn(), fn()
    if device == "cuda":
        torch.cuda.synchronize()
    with profile(activities=_activities(device)) as prof:
        for _ in range(steps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    attr = "device_time_total" if device == "cuda" else "self_cpu_time_total"
    if device == "cuda":  # kernels only: the device time of operators would count each kernel twice
        rows = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        rows = rows or [e for e in events if getattr(e, attr, 0) > 0 and not e.key.startswith("aten::")]
    else:
        rows = list(events)
    total = sum(getattr(e, attr) for e in rows) or 1.0
    rows.sort(key=lambda e: getattr(e, attr), reverse=True)
    top = [
        {
            "kernel": e.key[:110],
            "calls": e.count // steps,
            "ms_per_step": getattr(e, attr) / 1e3 / steps,
            "share": getattr(e, attr) / total,
        }
        for e in rows[:TOP]
    ]
    sort_by = "cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return top, prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=110)


def _model(config: dict, device: str, dtype, compiled: bool):
    from neoembed.compile import compile_layers
    from neoembed.modeling import NeoBERTConfig, NeoBERTModel

    torch.manual_seed(0)
    with torch.device(device):  # random initialisation on the GPU: seconds faster than on the CPU
        model = NeoBERTModel(NeoBERTConfig(**config)).to(dtype=dtype).eval()
    if compiled:
        compile_layers(model, True)
    return model


def forward_profile(config, device, dtype, batch, length, compiled) -> tuple[list[dict], str, float]:
    model = _model(config, device, dtype, compiled)
    ids = torch.randint(1000, 20000, (batch, length), device=device)
    mask = torch.ones_like(ids)

    def fn():
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask)

    top, table = top_kernels(fn, device)
    seconds = median_time(fn, device, 5)
    return top, table, batch * length / seconds


def train_profile(config, device, batch, length, cached: bool) -> tuple[list[dict], str]:
    import train_step_cuda

    args = argparse.Namespace(length=length, batch=batch, mini=8, compile=False)
    with tempfile.TemporaryDirectory() as folder:
        train_step_cuda.build_backbone(folder, config, device)
        run, _ = train_step_cuda.contrastive_step(folder, args, torch.device(device), cached=cached)
        return top_kernels(run, device, steps=2)


# ---------------------------------------------------------------------------------------------- attention
def packed_batch(n_texts: int, heads: int, head_dim: int, device: str, dtype):
    """q, k, v (T, H, Dh) for the token counts of ``n_texts`` real texts, and their lengths."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    texts = real_texts(4000)[::97][:n_texts]
    lengths = [len(ids) for ids in tok(texts, truncation=True, max_length=512)["input_ids"]]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), heads, head_dim, generator=g).to(device, dtype) for _ in range(3))
    return q, k, v, lengths


def reference(q, k, v, lengths) -> torch.Tensor:
    """Per text, float32 SDPA: what every kernel must compute."""
    outs = [
        F.scaled_dot_product_attention(*(t.float().transpose(0, 1)[None] for t in parts))[0].transpose(0, 1)
        for parts in zip(*(t.split(lengths) for t in (q, k, v)), strict=True)
    ]
    return torch.cat(outs)


def attention_kernels(q, k, v, lengths) -> dict:
    """name -> fn() returning the packed (T, H, Dh) output, for every kernel that loads here."""
    device, n = q.device, max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device, dtype=torch.int32)
    B, T = len(lengths), q.shape[0]
    pos = torch.cat([torch.arange(x, device=device) for x in lengths])
    row = torch.repeat_interleave(torch.arange(B, device=device), torch.tensor(lengths, device=device))
    kernels = {}

    def padded():
        buf = q.new_zeros(3, B, n, *q.shape[1:])
        for i, t in enumerate((q, k, v)):
            buf[i, row, pos] = t
        mask = torch.arange(n, device=device)[None] < torch.tensor(lengths, device=device)[:, None]
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in buf), attn_mask=mask[:, None, None])
        return out.transpose(1, 2)[row, pos]

    kernels["SDPA, padded batch"] = padded
    try:
        from torch.nn.attention.varlen import varlen_attn

        kernels["torch varlen_attn"] = lambda: varlen_attn(q, k, v, cu, cu, n, n)
    except ImportError:
        pass
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = row

        def same_text(b, h, qi, ki):
            return doc[qi] == doc[ki]

        block_mask = create_block_mask(same_text, None, None, T, T, device=str(device))
        flex = torch.compile(flex_attention, dynamic=False)

        def flex_run():
            out = flex(*(x.transpose(0, 1)[None] for x in (q, k, v)), block_mask=block_mask)
            return out[0].transpose(0, 1)

        kernels["FlexAttention, document mask"] = flex_run
    except Exception as e:  # noqa: BLE001 - a kernel that does not load here is reported, not fatal
        print(f"FlexAttention unavailable: {type(e).__name__}: {e}", flush=True)
    try:
        from flash_attn import flash_attn_varlen_func

        kernels["flash-attn varlen"] = lambda: flash_attn_varlen_func(q, k, v, cu, cu, n, n)
    except ImportError:
        pass
    return kernels


def attention_table(device: str, dtype, n_texts: int, heads: int, head_dim: int) -> list[dict]:
    q, k, v, lengths = packed_batch(n_texts, heads, head_dim, device, dtype)
    ref = reference(q, k, v, lengths)
    rows = []
    for name, fn in attention_kernels(q, k, v, lengths).items():
        try:
            with torch.inference_mode():
                out = fn()
                err = float((out.float() - ref).norm() / ref.norm())
                seconds = median_time(lambda fn=fn: fn(), device, 20, warmup=3)
        except Exception as e:  # noqa: BLE001 - one kernel's failure must not hide the others' figures
            print(f"  {name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            rows.append({"kernel": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        rows.append(
            {"kernel": name, "ms": seconds * 1e3, "rel_error_vs_fp32": err, "real_tokens": sum(lengths)}
        )
        print(f"  {name:32s} {seconds * 1e3:8.3f} ms  rel. error {err:.2e}", flush=True)
    return rows


def _kernel_md(title: str, top: list[dict]) -> list[str]:
    md = [f"**{title}**", "", "| kernel | calls/step | ms/step | share |", "|---|---|---|---|"]
    md += [
        f"| `{r['kernel']}` | {r['calls']} | {r['ms_per_step']:.3f} | {100 * r['share']:.1f}% |" for r in top
    ]
    return md + [""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="CPU: a 2 x 64 model, short inputs (checks the code)")
    p.add_argument("--out", default=None, help="folder for the profilers' full tables")
    p.add_argument(
        "--parts",
        default="forward,train,gradcache,attention,compiled",
        help="comma-separated, run in this order: forward, train, gradcache, attention, compiled (the forward)",
    )
    args = p.parse_args()
    device = "cpu" if args.quick else args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config, batch, length = (QUICK, 2, 64) if args.quick else ({}, 32, 512)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    payload, md, parts = (
        {"header": header(), "device": device, "dtype": str(dtype)},
        [],
        args.parts.split(","),
    )
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown part(s) {sorted(unknown)}; valid: {list(PARTS)}")
    stem = "gpu_profile_cpu_quick" if args.quick else f"gpu_profile_{device}"
    for part in parts:
        md += PARTS[part](args, device, dtype, config, batch, length, payload, out)
        write_results(
            stem, payload, "\n".join(md)
        )  # after each part: a run cut at its time limit keeps the first
    print("\n".join(md))


def _forward_part(compiled: bool):
    def part(args, device, dtype, config, batch, length, payload, out) -> list[str]:
        name = f"forward_{batch}x{length}" + ("_compiled" if compiled else "")
        print(f"profiling {name} ...", flush=True)
        top, table, rate = forward_profile(config, device, dtype, batch, length, compiled)
        payload[name] = {"top": top, "tokens_per_s": rate}
        if out:
            (out / f"profile_{name}.txt").write_text(table)
        return _kernel_md(f"{name}: {rate:,.0f} tokens/s", top)

    return part


def _attention_part(args, device, dtype, config, batch, length, payload, out) -> list[str]:
    print("attention kernels on a packed batch of real texts ...", flush=True)
    rows = attention_table(device, dtype, 4 if args.quick else 32, 2 if args.quick else 12, 64)
    payload["attention"] = rows
    md = ["**attention on 32 real texts, packed** (relative error against a float32 per-text reference)", "",
          "| kernel | ms | rel. error |", "|---|---|---|"]  # fmt: skip
    return md + [f"| {r['kernel']} | {r['ms']:.3f} | {r['rel_error_vs_fp32']:.1e} |" if "ms" in r
                 else f"| {r['kernel']} | failed: {r['error']} | |" for r in rows] + [""]  # fmt: skip


def _train_part(cached: bool):
    def part(args, device, dtype, config, batch, length, payload, out) -> list[str]:
        name = "train_step_gradcache" if cached else "train_step"
        print(f"profiling {name} ...", flush=True)
        top, table = train_profile(config, device, batch, length, cached)
        payload[name] = {"top": top}
        if out:
            (out / f"profile_{name}.txt").write_text(table)
        what = " through GradCache (mini-batches of 8)" if cached else ""
        return _kernel_md(f"{name}: B = {batch} queries + {batch} positives, {length} tokens{what}", top)

    return part


PARTS = {"forward": _forward_part(False), "train": _train_part(False), "gradcache": _train_part(True),
         "attention": _attention_part, "compiled": _forward_part(True)}  # fmt: skip


if __name__ == "__main__":
    main()
