"""``neoembed train RECIPE --dry-run``: what a unified recipe would train on, without loading a model or hub data.

One line per dataset: rows (declared by the card, or counted for local data, with the rows training keeps of
them), pi_i ∝ n_i^alpha, the steps of the run expected to draw it, hard negatives per query, queries per step (and
texts per step), the instruction, the licence, pinned or not. Hub datasets are described from the cards' declared
schemas (nothing is downloaded; ``neoembed data check`` compares them with the live data).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from neoembed.card_schema import CardSchemaError, resolve_spec_type
from neoembed.data.cards import (
    DataCardError,
    check_instruction_overrides,
    explain_data_errors,
    load_card_rows,
    load_recipe_cards,
    prepare_card,
)

__all__ = ["PlanRow", "dry_run", "plan"]


@dataclass
class PlanRow:
    name: str
    rows: int | None
    rows_from: str  # "declared" | "counted" | "unknown"
    negatives: str
    instruction: str | None
    license: str | None
    pinned: bool
    probability: float | None = None
    steps: float | None = None
    batch: int | None = None  # queries per step (None: set by the negatives the rows carry)
    texts: int | None = None  # texts per step: batch x (2 + negatives)
    used: int | None = None  # rows trained on: max_rows of them where the entry sets it


def _negatives(card, max_negatives: int | None, rows=None) -> tuple[str, int | None]:
    """Negatives per query (text, and the count where it is known): a string column counts one; a list column
    as many as its rows carry (the trainer uses the count most rows have). Hub data is described by its declared
    schema (a list column's count unknown); local ``rows`` (a loaded dataset) by their own features, and a
    top-level list column's count read from its lengths."""
    if not card.columns.negatives or max_negatives == 0:
        return "0", 0
    if card.schema_ is not None:
        features = card.schema_.features
    elif rows is not None:
        from neoembed.data.check import compact_features

        features = compact_features(rows.features)
    else:
        features = None
    fixed, lists = 0, []
    for spec in card.columns.negatives:
        try:
            t = resolve_spec_type(spec, features) if features is not None else "string"
        except CardSchemaError as e:  # local rows without the path: the trainer would refuse them too
            raise DataCardError(f"card {card.name}: negatives: {e}") from None
        fixed, lists = (fixed + 1, lists) if not isinstance(t, list) else (fixed, [*lists, spec])
    if not lists:
        text, count = str(fixed), fixed if max_negatives is None else min(fixed, max_negatives)
    else:
        count = _list_count(rows, fixed, lists, max_negatives)  # capped already; None where unknown
        unknown = f"{fixed}+list" if fixed else "list (the count most rows carry)"
        text = f"{count} (lists)" if count is not None else unknown
    return (f"{text}, at most {max_negatives}" if max_negatives is not None else text), count


def _list_count(rows, fixed: int, lists: list[str], cap: int | None) -> int | None:
    """The trainer's negatives per query for local rows whose list columns are top-level (the count most rows
    carry, capped), from the Arrow list lengths; None for hub data or a nested path."""
    if rows is None or any(spec not in rows.column_names for spec in lists):
        return None
    import numpy as np
    import pyarrow.compute as pc

    from neoembed.data.pairs import _negatives_per_query

    table = rows.select_columns(lists).with_format("arrow")[:]  # the card's filter (an index) applied
    counts = np.full(len(table), fixed, dtype=np.int64)
    for spec in lists:
        counts += pc.fill_null(pc.list_value_length(table.column(spec)), 0).to_numpy()
    return _negatives_per_query(counts, cap)


def plan(recipe, recipe_dir: Path | None = None) -> list[PlanRow]:
    """The dry-run rows of a unified recipe (see the module docstring)."""
    from neoembed.recipe import resolve_recipe_path

    search = [Path(resolve_recipe_path(d, recipe_dir)) for d in recipe.card_dirs]  # as training resolves them
    loaded = load_recipe_cards(recipe.datasets, search, recipe.distillation is not None)
    check_instruction_overrides(recipe.instruction_overrides, [card for card, _ in loaded])
    out = []
    for entry, (card, folder) in zip(recipe.datasets, loaded, strict=True):
        problems = card.schema_problems()
        if problems:
            raise DataCardError(
                f"card {card.name}: its paths do not fit its declared schema: {'; '.join(problems)}"
            )
        local = kept = report = None
        if card.source.local is not None:  # local data is cheap to count, and counting is exact
            with explain_data_errors(card, folder):  # as training reads it: by file and line
                local = load_card_rows(card, folder)
                # the rows training keeps (max_rows, then rows without text or with too few negatives dropped),
                # prepared as the run prepares them (and kept in the card cache it then reads)
                pairs, report = prepare_card(
                    card, folder, entry.max_rows, entry.max_negatives, recipe.template, recipe.instructions,
                    recipe.seed, warn=False,
                )  # fmt: skip
                kept = len(pairs)
            rows, rows_from = local.full_size, "counted"
        else:
            declared = card.size or (card.schema_.num_rows if card.schema_ is not None else None)
            rows, rows_from = declared, "declared" if declared else "unknown"
        instruction = (
            recipe.instruction_overrides.get(card.name, card.instruction) if recipe.instructions else None
        )
        negatives, count = _negatives(card, entry.max_negatives, local.rows if local is not None else None)
        if report is not None and report.negatives_per_query != count:  # of the rows kept, as the run counts
            negatives, count = str(report.negatives_per_query), report.negatives_per_query
        batch = recipe.dataset_batch_size(entry, count)  # the trainer's rule, on the declared negatives
        texts = batch * (2 + count) if batch is not None and count is not None else None
        used = min(rows, entry.max_rows) if rows and entry.max_rows else rows  # pi_i counts the full size
        used = kept if kept is not None else used
        if batch is not None and used is not None and batch > used:  # the trainer refuses it after loading
            raise DataCardError(
                f"card {card.name}: batch size {batch} is larger than the dataset ({used} usable rows"
                f"{f' of {rows}' if used != rows else ''}); lower batch_size (or this dataset's batch_size) or add "
                "data"
            )
        out.append(
            PlanRow(
                card.name,
                rows,
                rows_from,
                negatives,
                instruction,
                card.license,
                card.pinned,
                batch=batch,
                texts=texts,
                used=used,
            )
        )
    known = [r for r in out if r.rows]
    # the sampler's formula (neoembed.data.sampler.dataset_probabilities), not imported: that module loads torch
    total = sum(r.rows**recipe.alpha for r in known)
    for r in known:
        r.probability = r.rows**recipe.alpha / total
        r.steps = r.probability * recipe.steps
    return out


def dry_run(recipe, recipe_dir: Path | None = None) -> str:
    """The dry run's text: a header, one line per dataset, and what was not known."""
    rows = plan(recipe, recipe_dir)
    lines = [
        f"dry run: {len(rows)} dataset{'s' if len(rows) != 1 else ''}, {recipe.steps} steps, pi_i ∝ n_i^{recipe.alpha}; no model loaded. Hub datasets "
        "are described by their cards' declared schemas and row counts (offline: nothing downloaded; "
        "`neoembed data check` compares them with the live datasets)."
    ]
    width = max(len(r.name) for r in rows)
    for r in rows:
        n = f"{r.rows:,} ({r.rows_from})" if r.rows else "unknown"
        n += f", {r.used:,} used" if r.used is not None and r.used != r.rows else ""
        pi = f"{r.probability:.4f}" if r.probability is not None else "  -   "
        steps = f"{r.steps:7.1f}" if r.steps is not None else "      -"
        batch = f"{r.batch} ({r.texts} texts)" if r.texts is not None else str(r.batch or "from rows")
        lines.append(
            f"{r.name:<{width}}  rows {n:<22} pi {pi}  steps {steps}/{recipe.steps}  negatives {r.negatives:<8} "
            f"batch {batch:<16} "
            f"{'pinned  ' if r.pinned else 'UNPINNED'}  licence: {r.license or 'not stated'}  "
            f"instruction: {r.instruction!r}"
        )
    holdout = getattr(getattr(recipe, "eval", None), "holdout", None)
    if holdout is not None:  # which rows go is known from their texts only, which the dry run does not read
        cards = ", ".join(holdout.cards) if holdout.cards else "every card"
        lines.append(
            f"eval.holdout: {holdout.rows:,} rows of {cards} held out, and every row sharing a query, positive or "
            "hard negative with them: not counted above; the run logs what each card keeps, and stops if a card "
            "is left with less than a batch"
        )
    unknown = [r.name for r in rows if not r.rows]
    if unknown:
        lines.append(
            f"row count unknown for {', '.join(unknown)}: they are left out of pi_i here; training counts their rows"
        )
    return "\n".join(lines)
