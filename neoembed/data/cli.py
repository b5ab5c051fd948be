"""``neoembed data check CARD...``: validate data cards; load them when the data is reachable."""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(help="Data cards: validate and inspect.", no_args_is_help=True)


@app.command("check")
def check_command(
    cards: Annotated[list[str], typer.Argument(help="Card files or shipped card names.")],
    sample: Annotated[int, typer.Option("--sample", help="Rows to show per card.")] = 1,
    max_rows: Annotated[int | None, typer.Option("--max-rows", help="Load at most this many rows.")] = None,
) -> None:
    """Validate each card, then load its data (row count and a sample), or say why the data is unreachable."""
    from neoembed.data.cards import DataCardError, build_pairs, find_card, load_card, load_rows

    failures = 0
    for name in cards:
        try:
            card, folder = load_card(find_card(name))
        except DataCardError as e:
            typer.echo(f"INVALID {name}: {e}", err=True)
            failures += 1
            continue
        pin = "" if card.pinned else " (revision unpinned)"
        typer.echo(f"ok {card.name}: schema valid{pin}; licence: {card.license or 'not stated'}")
        try:
            rows = load_rows(card, folder, max_rows)
            pairs = build_pairs(card, rows)
        except DataCardError as e:
            msg = str(e)
            if card.source.hub is not None and (
                "hub" in msg.lower() or "connect" in msg.lower() or "offline" in msg.lower()
            ):
                typer.echo(f"   data not checked: the Hugging Face hub is unreachable ({card.source.hub.id})")
            else:
                typer.echo(f"   DATA ERROR: {msg}", err=True)
                failures += 1
            continue
        typer.echo(f"   {len(pairs)} rows; columns {pairs.column_names}")
        for row in pairs.select(range(min(sample, len(pairs)))):
            typer.echo("   " + " | ".join(f"{k}: {str(v)[:80]!r}" for k, v in row.items()))
    if failures:
        raise typer.Exit(1)
