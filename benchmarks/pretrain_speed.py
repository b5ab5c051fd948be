"""Pre-training throughput: padded batches vs packed (padding-free) batches, same documents, same real tokens.

The corpus is real text available offline: the plain-text documentation (pydoc) of Python's standard-library
modules, classes and functions, tokenized with NeoBERT's WordPiece tokenizer
(``../shared/fixtures/neobert-tiny-official``). Documents keep their real lengths: one is split only where it
exceeds the sequence length L (a 1,300-token document gives 1,024 + 276 at L = 1,024), as the trainer's padded
mode reads them. Every step takes the next fragments (shuffled) until ``tokens_per_step`` real tokens, then runs
one training step (MLM forward with the decoder on the masked positions only, backward; the AdamW step,
identical in both modes, runs untimed) either

* padded: one fragment per row, padded to the longest row, ``padding_free=False`` (attention with a key mask);
* packed: the same fragments in one row with per-document positions and ``cu_seqlens`` (attention per
  fragment: one SDPA call each on CPU, the varlen kernel on CUDA).

Throughput is real (non-padding) tokens per second of forward + backward. Each step runs ``--repeats`` times
per mode and its fastest time counts (the machine may be shared: contention only ever adds time), and the two
modes alternate step by step. On CUDA, bf16 autocast and the model FLOPs utilisation (6 x (encoder parameters
x tokens + decoder parameters x masked tokens) + attention's 12 x layers x width x sum(len^2), over
``--peak-tflops``).

    cd benchmarks && python pretrain_speed.py --quick            # CPU, 4 x 256, L = 512 and 1,024 (~5 min)
    cd benchmarks && python pretrain_speed.py --device cuda      # NeoBERT 28 x 768, L = 1,024, bf16
"""

from __future__ import annotations

import argparse
import math
import os
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
    with torch.device(args.device):  # random initialisation on the GPU: seconds faster than on the CPU
        return NeoBERTForMaskedLM(cfg)


def _flops(model, lengths: list[int], n_masked: int) -> float:
    cfg = model.config
    decoder = sum(p.numel() for p in model.decoder.parameters())
    encoder = sum(p.numel() for n, p in model.model.named_parameters() if n != "encoder.weight")
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * sum(n * n for n in lengths)
    return 6 * (encoder * sum(lengths) + decoder * n_masked) + attention


def _corpus(tok):
    """Documents of the pydoc corpus as token arrays, in corpus order, and how many files were written."""
    from neoembed.pretrain.data import ShardedCorpus, preprocess

    with tempfile.TemporaryDirectory() as tmp:
        n_files = write_pydoc_corpus(Path(tmp) / "txt")
        preprocess(str(Path(tmp) / "txt"), Path(tmp) / "shards", tok, progress=False)
        corpus = ShardedCorpus(Path(tmp) / "shards")
        documents = [np.array(corpus[i]) for i in range(len(corpus))]
    return documents, n_files


def _fragments(documents, seq_length: int) -> list[np.ndarray]:
    """Every document once, in a shuffled order, split only where it exceeds ``seq_length``."""
    from neoembed.pretrain.packing import DocumentStream

    stream = DocumentStream(documents, seed=0)
    fragments = []
    while stream.epoch == 0:
        fragments.append(stream.single_document(seq_length))
    return fragments


def run_length(args, tok, documents, seq_length: int) -> dict:
    from neoembed.pretrain.masking import IGNORE_INDEX, mask_tokens, step_generator
    from neoembed.pretrain.packing import collate_packed, collate_padded
    from neoembed.pretrain.trainer import MLMObjective

    fragments = _fragments(documents, seq_length)
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
    t_build = time.perf_counter()
    models = {mode: _model(args, padding_free=(mode == "packed")) for mode in modes}
    # progress on stdout: a run cut at its time box shows where its time went
    print(f"L={seq_length}: two models built in {time.perf_counter() - t_build:.1f} s", flush=True)
    objectives = {mode: MLMObjective(m) for mode, m in models.items()}
    opts = {mode: torch.optim.AdamW(m.parameters(), lr=1e-4) for mode, m in models.items()}
    times = {mode: [] for mode in modes}
    flops, real, padded_slots, n_docs = 0.0, 0, 0, 0
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
            best = math.inf
            for _ in range(args.repeats):  # same weights each time: the fastest run is the least disturbed
                opts[mode].zero_grad(set_to_none=True)
                sync(args.device)
                t0 = time.perf_counter()
                with torch.autocast(
                    args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.device != "cpu"
                ):
                    loss_sum, n, _ = objectives[mode](lab, **inputs)
                (loss_sum / n).backward()
                sync(args.device)
                best = min(best, time.perf_counter() - t0)
            if i >= args.warmup:
                times[mode].append(best)
            print(f"L={seq_length} step {i} {mode}: {best * 1e3:.1f} ms", flush=True)
            opts[mode].step()  # identical in both modes: not timed
            opts[mode].zero_grad(set_to_none=True)
        if i >= args.warmup:
            real += sum(len(d) for d in docs)
            padded_slots += len(docs) * max(len(d) for d in docs)
            n_docs += len(docs)
            flops += _flops(models["packed"], [len(d) for d in docs], int((labels != IGNORE_INDEX).sum()))
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
    return {
        "seq_length": seq_length,
        "fragments": len(fragments),
        "fragment_mean_length": float(lengths_all.mean()),
        "fragment_median_length": float(np.median(lengths_all)),
        "share_at_seq_length": float((lengths_all == seq_length).mean()),
        "fragments_per_step": n_docs / args.steps,
        "padding_fraction": 1 - real / padded_slots,
        "results": results,
        "packed_over_padded": results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"],
    }


def run(args) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    t0 = time.perf_counter()
    documents, n_files = _corpus(tok)
    print(f"corpus: {len(documents)} documents in {time.perf_counter() - t0:.1f} s", flush=True)
    doc_lengths = np.array([len(d) for d in documents])
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    by_length = [run_length(args, tok, documents, L) for L in args.seq_lengths]
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "header": header(),
        "settings": vars(args),
        "corpus": {
            "source": f"pydoc plain text of {n_files} standard-library modules, classes and functions",
            "documents": len(documents),
            "tokens": int(doc_lengths.sum()),
            "document_length_quantiles": {
                str(q): float(np.quantile(doc_lengths, q)) for q in (0.1, 0.25, 0.5, 0.75, 0.9)
            },
            "share_of_tokens_in_documents_longer_than": {
                str(L): float(doc_lengths[doc_lengths > L].sum() / doc_lengths.sum())
                for L in args.seq_lengths
            },
        },
        "load_average_1min": {"before": load_before, "after": load_after},
        "by_seq_length": by_length,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="CPU-sized model and steps")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--seq-lengths", default=None, help="comma-separated sequence lengths L, e.g. 512,1024")
    p.add_argument("--tokens-per-step", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="runs of each step per mode; the fastest counts")
    p.add_argument(
        "--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100 SXM: 989)"
    )
    args = p.parse_args()
    small = args.quick or args.device == "cpu"
    defaults = (
        {"layers": 4, "width": 256, "seq_lengths": "512,1024", "tokens_per_step": 4096, "steps": 8}
        if small
        else {"layers": 28, "width": 768, "seq_lengths": "1024", "tokens_per_step": 65536, "steps": 20}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.seq_lengths = [int(x) for x in str(args.seq_lengths).split(",")]
    out = run(args)
    stem = "pretrain_speed_cpu_quick" if args.device == "cpu" else "pretrain_speed_cuda"
    c = out["corpus"]
    q = c["document_length_quantiles"]
    gpu = args.device != "cpu"
    md = (
        f"Model {args.layers} x {args.width}, ~{args.tokens_per_step:,} real tokens per step, {args.steps} timed "
        f"steps (after {args.warmup}), fastest of {args.repeats} runs per step and mode. Corpus: {c['source']}: "
        f"{c['documents']:,} documents, {c['tokens']:,} tokens, document length quantiles 10/25/50/75/90%: "
        f"{q['0.1']:.0f} / {q['0.25']:.0f} / {q['0.5']:.0f} / {q['0.75']:.0f} / {q['0.9']:.0f} tokens. Documents "
        "keep their real lengths and are split only where they exceed L; since most *tokens* sit in long "
        "documents (module pages), many fragments are exactly L long.\n\n"
        "| L | fragments (at L) | fragments/step | padding in padded | mode | real tokens/s | s/step | model TFLOP/s |"
        + (" MFU |" if gpu else "")
        + "\n|---|---|---|---|---|---|---|---|"
        + ("---|" if gpu else "")
        + "\n"
    )
    for r in out["by_seq_length"]:
        for mode in ("padded", "packed"):
            row = r["results"][mode]
            md += (
                f"| {r['seq_length']} | {r['fragments']:,} ({100 * r['share_at_seq_length']:.0f}%) | "
                f"{r['fragments_per_step']:.1f} | {100 * r['padding_fraction']:.0f}% | {mode} | "
                f"{row['tokens_per_s']:,.0f} | {row['seconds_per_step']:.3f} | {row['model_tflops_per_s']:.3f} |"
            )
            md += f" {100 * row['mfu']:.1f}% |\n" if gpu else "\n"
    md += "\nPacked / padded: " + ", ".join(
        f"**{r['packed_over_padded']:.2f}x** at L = {r['seq_length']} "
        f"({100 * r['padding_fraction']:.0f}% padding)"
        for r in out["by_seq_length"]
    )
    la = out["load_average_1min"]
    if la["before"] is not None:
        md += f". 1-minute load average {la['before']:.1f} before, {la['after']:.1f} after"
    md += ".\n"
    j, m = write_results(stem, out, md)
    print(md)
    print(f"wrote {j} and {m}")


if __name__ == "__main__":
    main()
