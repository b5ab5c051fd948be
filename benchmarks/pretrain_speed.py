"""Pre-training throughput: padded batches vs packed (padding-free) batches, same documents, same real tokens.

The corpus is real text available offline: the plain-text documentation (pydoc) of Python's standard-library
modules, tokenized with NeoBERT's WordPiece tokenizer (``../shared/fixtures/neobert-tiny-official``) and cut
into fragments of at most ``seq_length`` tokens. Every step takes the next documents (shuffled) until
``tokens_per_step`` real tokens, then runs one full training step (MLM forward on the masked positions,
backward; the AdamW step, identical in both modes, runs untimed) either

* padded: one document per row, padded to the longest row, ``padding_free=False`` (attention with a key mask);
* packed: the same documents in one row with per-document positions and ``cu_seqlens``.

Throughput is real (non-padding) tokens per second of forward + backward; the two modes alternate step by
step so that drift on a shared machine hits both alike. On CUDA, bf16 autocast and the model FLOPs utilisation
(6 x non-embedding parameters x tokens + attention's 12 x layers x width x sum(len^2), over ``--peak-tflops``).

    cd benchmarks && python pretrain_speed.py --quick            # CPU, about 2 minutes (4 x 256)
    cd benchmarks && python pretrain_speed.py --device cuda      # NeoBERT 28 x 768, L = 1,024, bf16
"""

from __future__ import annotations

import argparse
import pydoc
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHARED, header, sync, write_results  # noqa: E402

TOKENIZER = SHARED / "fixtures" / "neobert-tiny-official"
STDLIB = (
    "abc argparse ast asyncio base64 bisect calendar cmd collections colorsys contextlib copy csv dataclasses "
    "datetime decimal difflib doctest email enum fileinput fnmatch fractions ftplib functools getopt gettext glob "
    "gzip hashlib heapq hmac html http imaplib inspect io ipaddress itertools json logging lzma mailbox math "
    "mimetypes multiprocessing numbers operator optparse os pathlib pickle pkgutil platform plistlib poplib pprint "
    "queue random re sched secrets selectors shelve shlex shutil signal smtplib socket sqlite3 ssl statistics "
    "string struct subprocess tarfile tempfile textwrap threading timeit tokenize traceback types typing unittest "
    "urllib uuid warnings weakref xml zipfile zlib"
).split()


def write_pydoc_corpus(folder: Path, modules=STDLIB) -> int:
    """One .txt file per documented object of the standard-library modules (the module itself, each public
    class and function): pydoc's plain-text documentation, so lengths range from a line to many pages."""
    import inspect

    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in modules:
            try:
                module = __import__(name)
            except Exception:  # a module missing on this Python build
                continue
            objects = [(name, module)] + [
                (f"{name}.{attr}", obj)
                for attr, obj in sorted(vars(module).items())
                if not attr.startswith("_")
                and (inspect.isclass(obj) or inspect.isfunction(obj))
                and getattr(obj, "__module__", None) == module.__name__
                and inspect.getdoc(obj)
            ]
            for qual, obj in objects:
                try:
                    text = pydoc.render_doc(obj, title="%s", renderer=pydoc.plaintext)
                except Exception:
                    continue
                (folder / f"{qual}.txt").write_text(text, encoding="utf8")
                n += 1
    return n


def _model(args, padding_free: bool):
    from neoembed.modeling import NeoBERTConfig, NeoBERTForMaskedLM

    torch.manual_seed(0)
    cfg = NeoBERTConfig(
        hidden_size=args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=args.width // 64,
        intermediate_size=args.width * 4,
        max_length=4096,
        padding_free=padding_free,
    )
    return NeoBERTForMaskedLM(cfg).to(args.device)


def _flops(model, lengths: list[int]) -> float:
    cfg = model.config
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if "encoder.weight" not in n)
    tokens = sum(lengths)
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * sum(n * n for n in lengths)
    return 6 * non_embedding * tokens + attention


def run(args) -> dict:
    from transformers import AutoTokenizer

    from neoembed.pretrain.data import ShardedCorpus, preprocess
    from neoembed.pretrain.masking import mask_tokens, step_generator
    from neoembed.pretrain.packing import DocumentStream, collate_packed, collate_padded
    from neoembed.pretrain.trainer import MLMObjective

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    with tempfile.TemporaryDirectory() as tmp:
        n_files = write_pydoc_corpus(Path(tmp) / "txt")
        preprocess(str(Path(tmp) / "txt"), Path(tmp) / "shards", tok, progress=False)
        corpus = ShardedCorpus(Path(tmp) / "shards")
        stream = DocumentStream(corpus, seed=0)
        fragments = []
        while stream.epoch == 0:
            fragments.append(stream.single_document(args.seq_length))
    lengths_all = np.array([len(f) for f in fragments])
    rng = np.random.default_rng(0)
    steps = []
    order = rng.permutation(len(fragments))
    k = 0
    for _ in range(args.steps + args.warmup):
        batch, total = [], 0
        while total < args.tokens_per_step:
            f = fragments[order[k % len(order)]]
            k += 1
            batch.append(f)
            total += len(f)
        steps.append(batch)
    special = sorted(set(tok.all_special_ids))
    modes = ("padded", "packed")
    models = {mode: _model(args, padding_free=(mode == "packed")) for mode in modes}
    objectives = {mode: MLMObjective(m) for mode, m in models.items()}
    opts = {mode: torch.optim.AdamW(m.parameters(), lr=1e-4) for mode, m in models.items()}
    times = {mode: [] for mode in modes}
    flops, real, padded_slots = 0.0, 0, 0
    for i, docs in enumerate(steps):
        flat = torch.from_numpy(np.concatenate(docs))
        ids, labels = mask_tokens(flat, special, tok.mask_token_id, len(tok), generator=step_generator(0, i))
        cuts = np.cumsum([len(d) for d in docs])[:-1]
        ids_d, lab_d = np.split(ids.numpy(), cuts), np.split(labels.numpy(), cuts)
        for mode in modes if i % 2 == 0 else modes[::-1]:  # alternate the order: drift on shared CPUs cancels
            if mode == "packed":
                batch = collate_packed([[d] for d in ids_d])
                lab = collate_packed([[d] for d in lab_d]).input_ids
            else:
                batch = collate_padded(ids_d, tok.pad_token_id)
                lab = collate_padded(lab_d, -100).input_ids
            inputs = {
                key: (v.to(args.device) if isinstance(v, torch.Tensor) else v)
                for key, v in batch.model_inputs().items()
            }
            lab = lab.to(args.device)
            sync(args.device)
            t0 = time.perf_counter()
            with torch.autocast(
                args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.device != "cpu"
            ):
                loss_sum, n, _ = objectives[mode](lab, **inputs)
            (loss_sum / n).backward()
            sync(args.device)
            if i >= args.warmup:
                times[mode].append(time.perf_counter() - t0)
            opts[mode].step()  # identical in both modes: not timed
            opts[mode].zero_grad(set_to_none=True)
        if i >= args.warmup:
            real += sum(len(d) for d in docs)
            padded_slots += len(docs) * max(len(d) for d in docs)
            flops += _flops(models["packed"], [len(d) for d in docs])
    results = {}
    for mode in modes:
        total_time = sum(times[mode])
        results[mode] = {
            "tokens_per_s": real / total_time,
            "seconds_per_step": total_time / len(times[mode]),
            "model_tflops_per_s": flops / total_time / 1e12,
        }
        if args.device != "cpu":
            results[mode]["mfu"] = flops / total_time / (args.peak_tflops * 1e12)
    results["padded"]["padding_fraction"] = 1 - real / padded_slots
    results["packed_over_padded"] = results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
    return {
        "header": header(),
        "settings": vars(args),
        "corpus": {
            "source": f"pydoc plain text of {n_files} standard-library modules, classes and functions",
            "fragments": len(fragments),
            "mean_length": float(lengths_all.mean()),
            "median_length": float(np.median(lengths_all)),
            "share_at_seq_length": float((lengths_all == args.seq_length).mean()),
        },
        "results": results,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="CPU-sized model and steps")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=None)
    p.add_argument("--tokens-per-step", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100 SXM: 989)"
    )
    args = p.parse_args()
    small = args.quick or args.device == "cpu"
    defaults = (
        {"layers": 4, "width": 256, "seq_length": 512, "tokens_per_step": 4096, "steps": 8}
        if small
        else {"layers": 28, "width": 768, "seq_length": 1024, "tokens_per_step": 65536, "steps": 20}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    out = run(args)
    r = out["results"]
    stem = "pretrain_speed_cpu_quick" if args.device == "cpu" else "pretrain_speed_cuda"
    c = out["corpus"]
    md = (
        f"Model {args.layers} x {args.width}, fragments of at most {args.seq_length} tokens, "
        f"~{args.tokens_per_step:,} real tokens per step, {args.steps} timed steps (after {args.warmup}). Corpus: "
        f"{c['source']}, {c['fragments']} fragments, mean length {c['mean_length']:.0f}, median "
        f"{c['median_length']:.0f}, {100 * c['share_at_seq_length']:.0f}% at the cap.\n\n"
        "| mode | real tokens/s | s/step | model TFLOP/s |"
        + (" MFU |" if args.device != "cpu" else "")
        + "\n"
        "|---|---|---|---|" + ("---|" if args.device != "cpu" else "") + "\n"
    )
    for mode in ("padded", "packed"):
        row = r[mode]
        md += f"| {mode} | {row['tokens_per_s']:,.0f} | {row['seconds_per_step']:.3f} | {row['model_tflops_per_s']:.3f} |"
        md += f" {100 * row['mfu']:.1f}% |\n" if args.device != "cpu" else "\n"
    md += f"\nPacked / padded: **{r['packed_over_padded']:.2f}x** (padding in the padded batches: "
    md += f"{100 * r['padded']['padding_fraction']:.0f}%).\n"
    j, m = write_results(stem, out, md)
    print(md)
    print(f"wrote {j} and {m}")


if __name__ == "__main__":
    main()
