"""``neoembed data check CARD...``: a card's paths against its declared schema (offline), the declared schema against
the live dataset (hub reachable), then the rows the data gives, with every dropped row counted.

Exit code 2 when a card named is neither a file nor a shipped name (bad input, as in every command); 1 when
any card is invalid, its paths cannot work, the live dataset differs from the declared schema, the
hub rejects the card's repository, config or split, or the data loses more rows than the card expects (a card with
``expected_loss: unknown`` never fails for that: its measured share is printed with how to pin it). A hub that
cannot be reached at all is not the card's fault: the card is then checked against its declared schema only.
Whether the hub can be reached is found once per run (one short probe, or the first card that cannot connect),
so a run without network takes seconds, not the hub client's retries for every card.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from neoembed.data.check import HubStatus

app = typer.Typer(help="Data cards: validate and inspect.", no_args_is_help=True)


@app.command("check")
def check_command(
    cards: Annotated[list[str], typer.Argument(help="Card files or shipped card names.")],
    sample: Annotated[int, typer.Option("--sample", min=0, help="Rows to show per card.")] = 1,
    max_rows: Annotated[
        int | None, typer.Option("--max-rows", min=1, help="Load a seeded random sample of this many rows.")
    ] = None,
    load: Annotated[
        bool, typer.Option("--load/--no-load", help="Load the rows (hub cards: when reachable).")
    ] = True,
    offline: Annotated[
        bool, typer.Option("--offline", help="Check against the declared schemas only.")
    ] = False,
) -> None:
    """Check each card: schema (offline), live features (hub reachable), rows kept and dropped per reason."""
    from neoembed.data.cards import DataCardError, find_card, hub_offline_mode, load_card
    from neoembed.data.check import HubStatus

    hub = HubStatus("offline mode" if offline or hub_offline_mode() else None)
    failures = missing = 0
    for name in cards:
        try:
            path = find_card(name)
        except DataCardError as e:
            typer.echo(f"NOT FOUND {name}: {e}", err=True)
            missing += 1
            continue
        try:
            card, folder = load_card(path)
        except DataCardError as e:
            typer.echo(f"INVALID {name}: {e}", err=True)
            failures += 1
            continue
        failures += not _check_card(card, folder, hub, load, max_rows, sample)
    if failures or missing:
        typer.echo(f"{failures + missing} of {len(cards)} card(s) failed", err=True)
        raise typer.Exit(2 if missing else 1)  # a card that is not there is bad input, as everywhere


def _check_card(card, folder, hub: HubStatus, load: bool, max_rows: int | None, sample: int) -> bool:
    """Print one card's checks; False when the card fails."""
    from neoembed.data.cards import UNKNOWN
    from neoembed.data.check import offline_problems

    # pinned: a local file, or a hub dataset at a named revision (not the latest, which moves)
    pin = "source pinned" if card.pinned else "source revision unpinned"
    typer.echo(f"{card.name}: card valid ({pin}; licence: {card.license or 'not stated'})")
    problems = offline_problems(card)
    for p in problems:
        typer.echo(f"   SCHEMA: {p}", err=True)
    if problems:
        return False
    if card.schema_ is not None:
        typer.echo(f"   paths match the declared schema ({len(card.schema_.features)} features)")
    if card.expected_loss == UNKNOWN:
        typer.echo(
            "   expected_loss: unknown (no published share): dropped rows are counted and never stop a run"
        )
    if card.source.hub is not None:
        down = hub.unreachable()
        if down is not None:
            typer.echo(f"   hub unreachable ({down}): checked against the declared schema only")
            return True
        reached = _live(card)
        if reached is None:
            hub.found_unreachable()
        if reached is not True:
            return reached is None  # None: unreachable (not the card's fault); False: a card error
    return _rows(card, folder, hub, max_rows, sample) if load else True


def _live(card) -> bool | None:
    from neoembed.data.cards import is_unreachable
    from neoembed.data.check import NOTE, live_differences

    try:
        diffs = live_differences(card)
    except Exception as e:
        if is_unreachable(e):
            typer.echo(f"   hub unreachable ({type(e).__name__}): checked against the declared schema only")
            return None
        typer.echo(
            f"   HUB ERROR for {card.source.hub.id!r} (config {card.source.hub.config}, split "
            f"{card.source.hub.split}): {type(e).__name__}: {e}. Fix the card's source.",
            err=True,
        )
        return False
    notes = [d for d in diffs if d.startswith(NOTE)]
    for note in notes:
        typer.echo(f"   {note}")
    diffs = [d for d in diffs if not d.startswith(NOTE)]
    for d in diffs:
        typer.echo(f"   LIVE SCHEMA DIFFERS: {d}", err=True)
    if diffs:
        typer.echo("   update the card's schema: (and its columns) from the dataset's page", err=True)
        return False
    typer.echo(
        "   live features match the declared schema" if not notes else "   live split matches the card"
    )
    return True


def _shown(value, width: int = 80) -> str:
    """A sample's value, its first ``width`` characters; a cut text says so ("...about caf" read as a broken é)."""
    text = str(value)
    return f"{text[:width]!r}" + ("..." if len(text) > width else "")


def _rows(card, folder, hub: HubStatus, max_rows: int | None, sample: int) -> bool:
    from neoembed.data.cards import DataCardError, HubUnreachable, explain_data_errors, prepare_card

    try:
        with explain_data_errors(card, folder):  # the datasets library's errors name no file: say which
            pairs, report = prepare_card(card, folder, max_rows, warn=False)  # the share is printed below
    except HubUnreachable as e:
        hub.found_unreachable()
        typer.echo(f"   hub unreachable: rows not loaded ({e})")
        return True
    except DataCardError as e:
        typer.echo(f"   DATA ERROR: {e}", err=True)
        return False
    sampled = f" (read from a seeded sample of {report.full_size:,} rows)" if report.sampled else ""
    typer.echo(f"   {report.line()}{sampled}")  # the rows kept, once
    typer.echo(f"   columns {pairs.column_names}")
    if hint := report.pin_hint():
        typer.echo(f"   WARNING: {hint}")
    for note in _row_notes(card, report):
        typer.echo(f"   NOTE: {note}")
    for row in pairs.select(range(min(sample, len(pairs)))):
        typer.echo("   " + " | ".join(f"{k}: {_shown(v)}" for k, v in row.items()))
    return True


def _row_notes(card, report) -> list[str]:
    """What the kept rows say that training would only warn about later, or never: pairs repeated or with the
    query equal to its positive (training warns when most are), rows a smaller ``max_negatives`` would keep,
    and a local card whose ``size:`` is not its data's row count (sampling uses the count)."""
    from neoembed.data.cards import UNKNOWN

    notes = []
    kept = report.rows_kept
    repeats = kept - report.distinct_pairs if report.distinct_pairs else 0  # 0: not counted
    if repeats:
        notes.append(f"{repeats} of {kept} pairs repeat another pair (in one batch they mask each other)")
    if report.same_as_query:
        notes.append(f"{report.same_as_query} of {kept} pairs have the query equal to its positive")
    if report.expected_loss != UNKNOWN and (hint := report.negatives_hint()):  # unknown: in the warning
        notes.append(hint)
    counted = report.full_size if report.sampled else report.rows_read
    if card.source.local is not None and card.size is not None and counted and card.size != counted:
        notes.append(
            f"the card declares size: {card.size:,}, its data holds {counted:,} rows (sampling weighs the count: "
            "correct or drop size:)"
        )
    return notes


def init_command(
    data: Annotated[
        Path, typer.Argument(help="Your pairs or triplets: .jsonl(.gz), .json, .csv or .parquet.")
    ],
    out: Annotated[Path, typer.Option("--out", help="Folder for the card and the recipe.")] = Path("."),
    model: Annotated[
        str, typer.Option("--model", help="The model the recipe fine-tunes (hub id or folder).")
    ] = "sentence-transformers/all-MiniLM-L6-v2",
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace a card or recipe already there.")
    ] = False,
    holdout: Annotated[
        int | None,
        typer.Option(
            "--holdout",
            help="Keep N rows out of training and score them at the last step (eval.holdout), and the base model "
            "on the same rows with the command printed.",
        ),
    ] = None,
) -> None:
    """Write a commented starter data card and training recipe for DATA (columns recognised by name)."""
    from neoembed.data.cards import load_card
    from neoembed.data.starter import write_starter
    from neoembed.recipe import load_recipe

    # bad input is refused here, before the recipe's import below loads torch
    starter = write_starter(data, out, model=model, overwrite=overwrite, holdout=holdout)
    load_card(starter.card)  # what was written validates as it stands
    from neoembed.train.recipe import UnifiedRecipe

    load_recipe(starter.recipe, UnifiedRecipe)
    cols = starter.columns
    card, recipe = shlex.quote(str(starter.card)), shlex.quote(str(starter.recipe))
    typer.echo(
        f"{starter.rows} rows: query={cols['query']}, positive={cols['positive']}, "
        f"negatives={cols['negatives'] or 'none (in-batch only)'}\n"
        f"wrote {starter.card} and {starter.recipe}; edit the instruction and licence, then:\n"
        f"  neoembed data check {card}\n  neoembed train {recipe}"
    )
    if starter.holdout:
        task = shlex.quote(f"runs/{starter.name}/eval/holdout-{starter.name}")
        typer.echo(
            f"{starter.holdout} rows are held out and scored at the last step (runs/{starter.name}/metrics.jsonl), "
            "and rows sharing a query, positive or negative with them are not trained on either (the training log "
            "says how many); once training has started, score the base model on the same rows:\n"
            f"  neoembed mteb --model {shlex.quote(model)} --tasks {task} --output results/base"
        )
