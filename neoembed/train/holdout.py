"""A held-out slice of the training cards (``eval.holdout``), scored during training as a retrieval task.

The slice is drawn per card with the holdout's seed (and the card's name) from the rows the card gave (after its
filters and ``max_rows``), so the same recipe on the same data gives the same slice on every run and every
resume. The held-out queries and positives are then found nowhere in training: every training row of every card
whose query, positive or a hard negative is one of those texts is dropped too (queries are compared without
their instruction, so one card's held-out positive is not trained on as another card's query).

Each card's slice is written as a local retrieval task in ``OUTPUT/eval/holdout-<card>/`` (``task.yaml``,
``queries.jsonl``, ``corpus.jsonl``, ``qrels/test.jsonl``): the held-out queries, with the card's instruction
(``task.yaml``'s ``instruction``, applied by ``neoembed mteb`` as to any task card), against a corpus of the
held-out positives and their hard negatives, each query's positive relevant. ``neoembed mteb --model
OUTPUT/checkpoint-N --tasks OUTPUT/eval/holdout-<card>`` scores a checkpoint exactly as the evaluation during
training did. The run record keeps each slice's identity: rows, seed, row indices and a hash of its texts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import zlib
from pathlib import Path

import numpy as np
import yaml

from neoembed.data.cards import DataCardError, find_card, load_card
from neoembed.instructions import instruction_prefix
from neoembed.recipe import RecipeError, resolve_recipe_path
from neoembed.record import RUN_RECORD

__all__ = [
    "check_same_holdout",
    "held_card_names",
    "holdout_record",
    "holdout_task_names",
    "holdout_task_paths",
    "split_holdout",
    "write_holdout_tasks",
]

logger = logging.getLogger(__name__)


def _holdout(recipe):
    return recipe.eval.holdout if recipe.eval is not None else None


def held_card_names(recipe, recipe_dir: Path | None = None) -> list[str]:
    """The cards the holdout takes rows from (default: every training card), by the names in their card files;
    an unknown name is refused here, before any data or model loads."""
    h = _holdout(recipe)
    if h is None:
        return []
    search = [Path(resolve_recipe_path(d, recipe_dir)) for d in recipe.card_dirs]
    names = [load_card(find_card(entry.card, search))[0].name for entry in recipe.datasets]  # card files only
    unknown = sorted(set(h.cards or []) - set(names))
    if unknown:
        raise RecipeError(f"eval.holdout.cards names {unknown}, not cards of this recipe; valid: {names}")
    return list(dict.fromkeys(h.cards)) if h.cards else names


def holdout_task_paths(recipe, recipe_dir: Path | None = None) -> list[str]:
    """The task folders the holdout will write (absolute: the evaluator is built before the run folder exists)."""
    root = Path(recipe.output_dir).resolve() / "eval"
    return [str(root / f"holdout-{name}") for name in held_card_names(recipe, recipe_dir)]


def holdout_task_names(recipe, recipe_dir: Path | None = None) -> list[str]:
    """The mteb names of the holdout's tasks (their scores are logged as ``<name>_<metric>``)."""
    return [HOLDOUT_TASK.format(name) for name in held_card_names(recipe, recipe_dir)]


#: a held-out slice's task name (its folder is ``eval/holdout-<card>``)
HOLDOUT_TASK = "Holdout-{}"


def _raw_queries(ds, card, recipe) -> list[str]:
    """The card's queries without the instruction prefix training put before them."""
    prefix = instruction_prefix(card.instruction if recipe.instructions else None, recipe.template)
    return [q[len(prefix) :] if q.startswith(prefix) else q for q in ds["query"]]


def _draw(name: str, size: int, rows: int, seed: int) -> list[int]:
    """``rows`` row indices of a card of ``size`` rows, sorted; the same for the same seed and card name."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return sorted(rng.permutation(size)[:rows].tolist())


def split_holdout(recipe, datasets: dict, cards, batch_sizes: dict[str, int]):
    """``(training datasets, held)``: each held card's slice (``held[name]``: ``indices`` into the card's rows and
    ``rows``, a Dataset with the queries without instruction) out of training, and out of every card the rows
    that share a query or positive with any slice."""
    h = _holdout(recipe)
    if h is None:
        return datasets, {}
    by_name = {card.name: card for card, _ in cards}
    unknown = sorted(set(h.cards or []) - set(datasets))
    if unknown:
        raise RecipeError(
            f"eval.holdout.cards names {unknown}, not cards of this recipe; valid: {sorted(datasets)}"
        )
    held, texts = {}, set()
    for name in dict.fromkeys(h.cards or datasets):
        ds = datasets[name]
        if len(ds) - h.rows < batch_sizes[name]:
            raise DataCardError(
                f"card {name}: {len(ds)} rows cannot give eval.holdout.rows={h.rows} and still fill a batch of "
                f"{batch_sizes[name]}: lower eval.holdout.rows, or name other cards in eval.holdout.cards"
            )
        indices = _draw(name, len(ds), h.rows, h.seed)
        rows = ds.select(indices)
        rows = rows.remove_columns("query").add_column("query", _raw_queries(rows, by_name[name], recipe))
        held[name] = {"indices": indices, "rows": rows}
        texts |= set(rows["query"]) | set(rows["positive"])
    out = {}
    for name, ds in datasets.items():
        taken = set(held[name]["indices"]) if name in held else set()
        columns = [_raw_queries(ds, by_name[name], recipe)] + [ds[c] for c in ds.column_names if c != "query"]
        keep = [
            i for i, row in enumerate(zip(*columns, strict=True)) if i not in taken and texts.isdisjoint(row)
        ]
        if len(keep) < batch_sizes[name]:
            raise DataCardError(
                f"card {name}: {len(keep)} of its {len(ds)} rows are left for training once the holdout's rows and "
                f"every row sharing a text with them are out, fewer than its batch of {batch_sizes[name]}: lower "
                "eval.holdout.rows, or name other cards in eval.holdout.cards"
            )
        out[name] = ds if len(keep) == len(ds) else ds.select(keep)
        _say_lost(name, len(ds), len(taken), len(keep))
    return out, held


def _say_lost(name: str, rows: int, held: int, kept: int) -> None:
    """A card's rows lost to the holdout, said: rows sharing a text with held-out ones (a query asked in several
    rows, one positive for several queries; of any held card) go too, which can take many times the held count."""
    if kept == rows:
        return
    shared = rows - held - kept
    said = f"{shared:,} rows that share a query, positive or hard negative with held-out rows"
    if held:
        said = f"{held:,} held-out rows" + (f" and {said}" if shared else "")
    (logger.warning if shared > held else logger.info)(
        "card %s: eval.holdout takes %s out of training: %s of its %s rows train",
        name,
        said,
        f"{kept:,}",
        f"{rows:,}",
    )


def holdout_record(recipe, held: dict, datasets_before: dict[str, int], datasets_after: dict) -> dict:
    """What the run record keeps of the holdout: per card the seed, the rows' indices among the card's rows, a
    hash of their texts, and per card how many rows training lost to it."""
    if not held:
        return {}
    cards = {}
    for name, h in held.items():
        rows = h["rows"]
        texts = "\n".join(f"{q}\t{p}" for q, p in zip(rows["query"], rows["positive"], strict=True))
        cards[name] = {
            "rows": len(rows),
            "queries": len(set(rows["query"])),  # the task's queries: one per distinct text
            "seed": recipe.eval.holdout.seed,
            "indices": h["indices"],
            "texts_sha256": hashlib.sha256(texts.encode()).hexdigest(),
        }
    removed = {n: datasets_before[n] - len(d) for n, d in datasets_after.items()}
    return {"cards": cards, "rows_out_of_training": removed}


def check_same_holdout(output: Path, record: dict, resuming: bool = True) -> None:
    """On resume: the slice must be the one the run started with (the same data gives the same slice; changed
    data would put rows already trained on into the evaluation)."""
    path = Path(output) / RUN_RECORD
    if not resuming or not record or not path.is_file():
        return
    before = json.loads(path.read_text()).get("holdout") or {}
    for name, card in record["cards"].items():
        old = (before.get("cards") or {}).get(name, {})
        if old.get("texts_sha256") != card["texts_sha256"]:
            raise DataCardError(
                f"card {name}: the held-out rows differ from those of the run being resumed ({path}): its data "
                "changed since, and rows already trained on would be scored. Resume with the data the run started "
                "with, or start a new run (another output_dir)"
            )
        if "queries" not in old and card["queries"] < card["rows"]:
            raise DataCardError(
                f"card {name}: the run being resumed ({path}) scored its held-out task as one query per row, as "
                f"neoembed did before a query asked in several rows became one query with all its positives; its "
                f"{card['rows']} rows hold {card['queries']} distinct queries, so the scores logged so far do not "
                "compare with the ones to come (nor keep_best's choice): start a new run (another output_dir, or "
                "--overwrite)"
            )


def write_holdout_tasks(output: Path, held: dict, cards, recipe) -> None:
    """Each held-out slice as a local retrieval task folder ``output/eval/holdout-<card>/``."""
    instructions = {card.name: card.instruction for card, _ in cards}
    for name, h in held.items():
        rows, folder = h["rows"], Path(output) / "eval" / f"holdout-{name}"
        corpus: dict[str, str] = {}  # text -> id: a text shared by rows is one document
        # text -> id: a query asked in several rows is one query with each of its positives relevant (as one
        # query per row, each would count its own row's positive alone and the others' as misses)
        asked: dict[str, str] = {}
        qrels: dict[tuple[str, str], dict] = {}
        negatives = [c for c in rows.column_names if c not in ("query", "positive")]
        for row in rows:
            for text in [row["positive"]] + [row[c] for c in negatives if row[c]]:
                corpus.setdefault(text, f"d{len(corpus)}")
            qid = asked.setdefault(row["query"], f"q{len(asked)}")
            pair = (qid, corpus[row["positive"]])
            qrels[pair] = {"query-id": qid, "corpus-id": pair[1], "score": 1}
        queries = [{"_id": i, "text": t} for t, i in asked.items()]
        docs = [{"_id": i, "title": "", "text": t} for t, i in corpus.items()]
        files = (("queries.jsonl", queries), ("corpus.jsonl", docs), ("qrels/test.jsonl", list(qrels.values())))
        for file, lines in files:
            (folder / file).parent.mkdir(parents=True, exist_ok=True)
            (folder / file).write_text(
                "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines), "utf8"
            )
        task = {"name": HOLDOUT_TASK.format(name), "type": "Retrieval", "data": ".", "eval_splits": ["test"]}
        if recipe.instructions and instructions.get(name):
            task["instruction"] = instructions[name]
        task["description"] = (
            f"{len(rows)} rows of training card {name} held out of training (eval.holdout, seed "
            f"{recipe.eval.holdout.seed}), {len(queries)} distinct queries: each query against the held-out "
            "positives and hard negatives, its own positives relevant."
        )
        (folder / "task.yaml").write_text(yaml.safe_dump(task, sort_keys=False), encoding="utf8")
