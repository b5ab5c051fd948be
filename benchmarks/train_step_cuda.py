"""One training step of the full-size NeoBERT (28 x 768), timed, with its model FLOPs utilisation (MFU):

* ``unified``: InfoNCE over B queries and B positives of L tokens, plain backpropagation; ``unified-compiled``:
  the same with the backbone's layers compiled (neoembed.compile), in the same run;
* ``gradcache``: the same loss through GradCache (``CachedInfoNCELoss``, mini-batches of ``--mini``);
* ``cde``: a contextual (CDE) step at the paper's N = 512 context documents x L = 512 tokens, through the
  two-stage GradCache in chunks of ``--chunk`` (full backpropagation through 512 x 512 tokens does not fit), with
  its peak memory;
* ``cached-loss``: the scoring stage of GradCache alone (``CachedInfoNCELoss.calculate_loss`` with its backward)
  at B = ``--loss-batch`` (65,536) queries, 1 hard negative, d = 768, fp32 embeddings, beside
  sentence-transformers' ``CachedMultipleNegativesRankingLoss`` on the same tensors (mini-batches of
  ``--loss-mini``). Its FLOPs: 6 x B x 2B x d (logits, and both gradients).

Each step runs under bf16 autocast (float32 weights, as the trainers run ``precision: bf16``), forward + backward +
AdamW, ``--warmup`` untimed steps first, the median of ``--reps`` timed ones. With ``--compile`` every step's
backbone has its layers compiled (neoembed.compile, mode "default"); the warm-up steps pay the compilation.

FLOPs: a text of n tokens costs ``model_flops`` of benchmarks/_common.py forward (2 x linear parameters per token +
4 x n x width per token and layer); a training step counts 3 x its forward FLOPs (forward + backward), as the
issue's MFU target does. GradCache runs one more forward per text (not counted: it is the price of its memory).
CDE's second stage sees each text behind the N context vectors and the soft prompt (n + N + prompt tokens).
MFU = counted FLOPs / step time / the bf16 matrix-multiply rate measured in the same run (8,192^3), the issue's
measure; the share of ``--peak-tflops`` (H100 SXM dense bf16: 989) is listed beside it.

    python benchmarks/train_step_cuda.py --device cuda              # every step (unified also compiled)
    python benchmarks/train_step_cuda.py --quick                    # CPU: a 2 x 64 model, the same code and arithmetic

Results: benchmarks/results/train_step_<cuda|cpu_quick>[_compiled].{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHARED, header, matmul_rate, model_flops, sync, write_results  # noqa: E402

TOKENIZER = SHARED / "fixtures" / "neobert-tiny-official"
DEFAULT_STEPS = "unified,unified-compiled,gradcache,cde,cached-loss"
QUICK_CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}


def step_flops(
    backbone, kind: str, batch: int, length: int, n_context: int = 0, n_soft_prompt: int = 0
) -> float:
    """The FLOPs a training step counts (3 x forward) for ``kind`` in ("unified", "gradcache", "cde")."""
    if kind in ("unified", "gradcache"):
        forward = model_flops(backbone, 2 * batch * length, length)  # B queries + B positives
    elif kind == "cde":
        second = length + n_context + n_soft_prompt
        forward = model_flops(backbone, n_context * length, length) + model_flops(
            backbone, 2 * batch * second, second
        )
    elif kind == "cached-loss":
        return 6.0 * batch * 2 * batch * 768
    else:
        raise ValueError(f"unknown step {kind!r}; valid: unified, gradcache, cde, cached-loss")
    return 3.0 * forward


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak."""
    if seconds <= 0 or peak_flops <= 0:
        raise ValueError(f"seconds ({seconds}) and peak_flops ({peak_flops}) must be > 0")
    return flops / seconds / peak_flops


def _tokens(n: int, length: int, vocab: int, device) -> dict:
    g = torch.Generator().manual_seed(n * 7919 + length)
    ids = torch.randint(1000, min(vocab, 20000), (n, length), generator=g)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}


def build_backbone(folder: str, config: dict, device="cpu") -> None:
    from transformers import AutoTokenizer

    from neoembed.modeling import NeoBERTConfig, NeoBERTModel

    torch.manual_seed(0)
    with torch.device(device):  # random initialisation on the GPU: seconds faster than 250M values on the CPU
        NeoBERTModel(NeoBERTConfig(**config)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(TOKENIZER)).save_pretrained(folder)


def contrastive_step(folder: str, args, device, cached: bool, compiled: bool = False):
    """A closure running one unified (or GradCache) step, and the backbone whose FLOPs it counts."""
    import neoembed
    from neoembed.losses import CachedInfoNCELoss, InfoNCELoss

    model = neoembed.load(
        folder, max_seq_length=args.length, device=str(device), compile=args.compile or compiled
    )
    model.train()
    loss_fn = CachedInfoNCELoss(model, mini_batch_size=args.mini) if cached else InfoNCELoss(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = model[0].auto_model.config.vocab_size
    q, d = (
        _tokens(args.batch, args.length, vocab, device),
        _tokens(args.batch + 1, args.length, vocab, device),
    )
    d = {k: v[: args.batch] for k, v in d.items()}
    labels = torch.zeros(args.batch, device=device)

    # autocast wraps the model's forward, as accelerate's prepare() does in the trainers: GradCache re-embeds each
    # mini-batch inside loss.backward(), so an autocast block around the loss alone would replay it in float32
    model.forward = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")(
        model.forward
    )

    def run():
        loss = loss_fn([dict(q), dict(d)], labels)  # the loss writes its outputs into the dicts
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return run, model[0].auto_model


def cde_step(folder: str, args, device):
    """A closure running one CDE step (two-stage GradCache), and the backbone whose FLOPs it counts."""
    from neoembed.cde.gradcache import two_stage_gradcache_step
    from neoembed.cde.model import ContextualSentenceTransformer
    from neoembed.compile import compile_layers
    from neoembed.losses import info_nce

    model = ContextualSentenceTransformer.from_backbone(
        folder, n_context=args.n_context, max_seq_length=args.length, device=str(device)
    )
    compile_layers(model, args.compile)
    module = model.cde
    module.train()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-5)
    vocab = module.first_stage.config.vocab_size
    ctx = _tokens(args.n_context, args.length, vocab, device)
    q, d = (
        _tokens(args.batch, args.length, vocab, device),
        _tokens(args.batch + 1, args.length, vocab, device),
    )
    d = {k: v[: args.batch] for k, v in d.items()}

    def run():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            two_stage_gradcache_step(module, ctx, q, d, lambda a, b: info_nce(a, b, 0.02), args.chunk)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return run, module.first_stage, module.n_soft_prompt  # both stages have the same architecture


def cached_loss_step(args, device, impl: str):
    """A closure running GradCache's scoring stage alone (loss and the embeddings' gradients) at B =
    ``args.loss_batch`` with 1 hard negative: neoembed's or sentence-transformers' (``impl``), built as
    benchmarks/scale.py builds them for its CPU cells."""
    import scale

    g = torch.Generator(device=device).manual_seed(0)
    columns = (torch.randn(args.loss_batch, 768, device=device, generator=g) for _ in range(3))
    reps = [[m.requires_grad_() for m in c.split(args.loss_mini)] for c in columns]
    call = scale._loss_call("neoembed" if impl == "neoembed" else "st", "cached", reps, args.loss_mini)

    def run():
        for m in (m for column in reps for m in column):
            m.grad = None
        call()

    return run


def time_step(run, device, warmup: int, reps: int) -> tuple[float, float]:
    """Median seconds of ``run`` after ``warmup`` calls, and its peak device memory in GiB (CUDA; else 0)."""
    for _ in range(warmup):
        run()
    sync(device.type)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        sync(device.type)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return statistics.median(times), peak


def measure(kind: str, folder: str, args, device, rate: float) -> list[dict]:
    """Rows of one step kind (cached-loss: neoembed's and sentence-transformers' side by side)."""
    # the previous kind's model, optimizer state and closures sit in reference cycles: collect them before this
    # kind allocates (the first H100 run's CDE step ran out of memory with two 250M-parameter models still held)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base, compiled = kind.removesuffix("-compiled"), kind.endswith("-compiled")
    if compiled and base not in ("unified", "gradcache"):
        raise ValueError(
            f"'{kind}': only unified and gradcache have a compiled kind (--compile compiles all)"
        )
    if kind == "cde":
        run, backbone, soft = cde_step(folder, args, device)
        runs = {"cde": (run, step_flops(backbone, "cde", args.batch, args.length, args.n_context, soft))}
    elif kind == "cached-loss":
        flops = step_flops(None, "cached-loss", args.loss_batch, 0)
        runs = {
            f"cached-loss {impl}": (cached_loss_step(args, device, impl), flops)
            for impl in ("neoembed", "st")
        }
    else:
        run, backbone = contrastive_step(folder, args, device, cached=base == "gradcache", compiled=compiled)
        runs = {kind: (run, step_flops(backbone, base, args.batch, args.length))}
    rows = []
    for name, (run, flops) in runs.items():
        try:
            seconds, peak_gib = time_step(run, device, args.warmup, args.reps)
        except torch.OutOfMemoryError as e:
            print(f"{name}: out of memory ({str(e)[:120]})", flush=True)
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append({"step": name, "seconds": seconds, "gflop": flops / 1e9, "mfu": mfu(flops, seconds, rate),
                     "peak_memory_gib": peak_gib})  # fmt: skip
        print(f"{name:22s} {seconds * 1e3:9.1f} ms  {flops / seconds / 1e9:9.1f} GFLOP/s  "
              f"MFU {100 * rows[-1]['mfu']:5.1f}%  peak {peak_gib:.2f} GiB", flush=True)  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--quick", action="store_true", help="CPU: a 2 x 64 model, L = 64, N = 8 (checks the arithmetic)"
    )
    p.add_argument(
        "--steps",
        default=None,
        help="comma-separated: unified, unified-compiled, gradcache, gradcache-compiled, cde, cached-loss "
        "(default: all but gradcache-compiled, in this order; other steps name the record)",
    )
    p.add_argument("--compile", action="store_true", help="compile the backbone's layers (neoembed.compile)")
    p.add_argument("--batch", type=int, default=None, help="queries per step (default 32; quick 4)")
    p.add_argument("--length", type=int, default=None, help="tokens per text (default 512; quick 64)")
    p.add_argument("--mini", type=int, default=None, help="GradCache mini-batch (default 8)")
    p.add_argument("--n-context", type=int, default=None, help="CDE context documents (default 512; quick 8)")
    p.add_argument("--chunk", type=int, default=64, help="CDE two-stage GradCache chunk")
    p.add_argument("--loss-batch", type=int, default=None, help="cached-loss: B (default 65,536; quick 512)")
    p.add_argument(
        "--loss-mini", type=int, default=None, help="cached-loss: mini-batch (default 1,024; quick 64)"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM: 989)")
    args = p.parse_args()
    device = torch.device("cpu" if args.quick else args.device)
    args.batch_given, args.mini_given = args.batch is not None, args.mini is not None
    args.batch = args.batch or (4 if args.quick else 32)
    args.mini = args.mini or 8
    args.length = args.length or (64 if args.quick else 512)
    args.n_context = args.n_context or (8 if args.quick else 512)
    if args.quick:
        args.chunk, args.warmup, args.reps = 4, 1, 1
        args.mini = args.mini if args.mini_given else 2
    args.loss_batch = args.loss_batch or (512 if args.quick else 65536)
    args.loss_mini = args.loss_mini or (64 if args.quick else 1024)
    # MFU against the matrix-multiply rate measured here (on CPU float32: there is no spec sheet to quote)
    rate = matmul_rate(device.type, torch.bfloat16 if device.type == "cuda" else torch.float32, 8192 if
                       device.type == "cuda" else 1024)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        build_backbone(folder, QUICK_CONFIG if args.quick else {}, device)
        for kind in (args.steps or DEFAULT_STEPS).split(","):
            rows += measure(kind, folder, args, device, rate)
            # after every kind: a run cut at its time box keeps its rows
            md = record(args, device, rate, rows)
    print(md.read_text())


def record(args, device, rate: float, rows: list[dict]) -> Path:
    """Write the rows so far as this run's record."""
    peak = args.peak_tflops * 1e12 if device.type == "cuda" else rate
    keys = ("batch", "length", "mini", "n_context", "chunk", "compile", "loss_batch", "loss_mini")
    settings = {k: getattr(args, k) for k in keys}
    payload = {
        "header": header(),
        "device": str(device),
        "settings": settings,
        "peak_flops": peak,
        "matmul_rate_flops": rate,
        "rows": rows,
    }
    md = [
        f"Settings: {settings}; measured matmul rate {rate / 1e9:,.0f} GFLOP/s"
        + (
            f"; spec peak {peak / 1e9:,.0f} GFLOP/s"
            if device.type == "cuda"
            else " (CPU float32; a check of the code path and the arithmetic, not a speed record for any GPU)"
        ),
        "",
        "| step | ms | counted GFLOP | MFU (of the measured rate) | of the spec peak | peak memory GiB |",
        "|---|---|---|---|---|---|",
        *[
            f"| {r['step']} | {r['seconds'] * 1e3:.1f} | {r['gflop']:.1f} | {100 * r['mfu']:.1f}% | "
            f"{100 * r['gflop'] * 1e9 / r['seconds'] / peak:.1f}% | {r['peak_memory_gib']:.2f} |"
            for r in rows
        ],
        "",
        "cached-loss rows: fp32 embeddings (the loss's own precision), so their MFU is against the bf16 rate "
        "only for comparison.",
    ]
    stem = f"train_step_{'cpu_quick' if args.quick else device.type}{'_compiled' if args.compile else ''}"
    # a run with other settings than the defaults records beside the default record, not over it
    stem += "_" + args.steps.replace(",", "_") if args.steps else ""
    stem += (f"_b{args.batch}" if args.batch_given else "") + (f"_m{args.mini}" if args.mini_given else "")
    return write_results(stem, payload, "\n".join(md) + "\n")[1]


if __name__ == "__main__":
    main()
