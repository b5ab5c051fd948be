"""A held-out slice of the training cards (``eval.holdout``), scored during training as a reranking task.

The slice is drawn per card with the holdout's seed from the rows the card gave (after its filters), so the same
recipe gives the same slice on every run and every resume. Training keeps neither the held-out rows nor any row
that shares a text with them (a repeated question or answer would otherwise be trained on). Each card's slice is
written as a reranking task card in ``OUTPUT/eval/holdout-<card>/`` (``task.yaml`` and ``test.jsonl``): each
held-out query, with the card's instruction, against its positive, its own hard negatives and the other held-out
positives. ``neoembed mteb --model OUTPUT/checkpoint-N --tasks OUTPUT/eval/holdout-<card>/task.yaml`` scores a
checkpoint on it exactly as the evaluation during training did.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import yaml

from neoembed.data.cards import DataCardError
from neoembed.recipe import RecipeError

__all__ = ["holdout_task_paths", "split_holdout", "write_holdout_tasks"]


def _holdout(recipe):
    return recipe.eval.holdout if recipe.eval is not None else None


def _card_names(recipe) -> list[str]:
    """The recipe's training cards as the holdout names them: a card's name, or its file's stem for a path."""
    return [Path(entry.card).stem for entry in recipe.datasets]


def holdout_task_paths(recipe) -> list[str]:
    """The task cards the holdout will write (absolute: the evaluator is built before the run folder exists)."""
    h = _holdout(recipe)
    if h is None:
        return []
    root = Path(recipe.output_dir).resolve() / "eval"
    return [str(root / f"holdout-{name}" / "task.yaml") for name in (h.cards or _card_names(recipe))]


def split_holdout(recipe, datasets, batch_sizes: dict[str, int]):
    """``(training datasets, held-out datasets)``: the holdout's rows out of each card it names."""
    h = _holdout(recipe)
    if h is None:
        return datasets, {}
    unknown = sorted(set(h.cards or []) - set(datasets))
    if unknown:
        raise RecipeError(f"eval.holdout.cards names {unknown}, not cards of this recipe; valid: {sorted(datasets)}")
    held = {}
    for name in h.cards or list(datasets):
        ds = datasets[name]
        chosen = np.sort(np.random.default_rng(h.seed).permutation(len(ds))[: h.rows])
        if len(ds) - h.rows < batch_sizes[name]:
            raise DataCardError(
                f"card {name}: {len(ds)} rows cannot give eval.holdout.rows={h.rows} and still fill a batch of "
                f"{batch_sizes[name]}: lower eval.holdout.rows, or name other cards in eval.holdout.cards"
            )
        held[name] = ds.select(chosen.tolist())
        texts = set(held[name]["query"]) | set(held[name]["positive"])
        taken = set(chosen.tolist())
        keep = [
            i
            for i, (q, p) in enumerate(zip(ds["query"], ds["positive"], strict=True))
            if i not in taken and q not in texts and p not in texts
        ]
        if len(keep) < batch_sizes[name]:
            raise DataCardError(
                f"card {name}: {len(keep)} rows share no text with its {h.rows} held-out rows, fewer than its batch "
                f"of {batch_sizes[name]}: lower eval.holdout.rows"
            )
        datasets[name] = ds.select(keep)
    return datasets, held


def write_holdout_tasks(output: Path, held: dict, cards, recipe) -> dict:
    """Write each held-out slice as a reranking task card; returns what the run record keeps of them."""
    instructions = {card.name: card.instruction for card, _ in cards}
    record = {}
    for name, ds in held.items():
        folder = Path(output) / "eval" / f"holdout-{name}"
        folder.mkdir(parents=True, exist_ok=True)
        negatives = [c for c in ds.column_names if c not in ("query", "positive")]
        positives = ds["positive"]
        with (folder / "test.jsonl").open("w", encoding="utf8") as f:
            for i, row in enumerate(ds):
                own = [row[c] for c in negatives if row[c]]
                others = [p for j, p in enumerate(positives) if j != i and p != row["positive"]]
                f.write(json.dumps({"query": row["query"], "positive": [row["positive"]], "negative": own + others}))
                f.write("\n")
        task = {"name": f"Holdout-{name}", "type": "Reranking", "data": ".", "eval_splits": ["test"]}
        if recipe.instructions and instructions.get(name):
            task["instruction"] = instructions[name]
        task["description"] = f"{len(ds)} rows of training card {name} held out of training (seed {recipe.eval.holdout.seed})."
        (folder / "task.yaml").write_text(yaml.safe_dump(task, sort_keys=False))
        digest = hashlib.sha256("\n".join(ds["query"]).encode()).hexdigest()[:16]
        record[name] = {"rows": len(ds), "seed": recipe.eval.holdout.seed, "queries_sha256": digest}
    return record
