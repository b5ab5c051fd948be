"""What ``neoembed data check`` verifies: a card's column paths against its declared schema (offline), the declared
schema against the live dataset's features (hub reachable, nothing downloaded), and the rows the data gives.

Only a hub that cannot be reached at all counts as "unreachable"; a missing repository, config or split, or a live
schema that differs from the declared one, is the card's fault and fails the check.
"""

from __future__ import annotations

from typing import Any

from neoembed.card_schema import TrainingCard
from neoembed.hub import hub_unreachable_reason  # noqa: F401  (its home before hub.py)

__all__ = [
    "NOTE",
    "HubStatus",
    "require_hub",
    "compact_features",
    "hub_unreachable_reason",
    "live_differences",
    "offline_problems",
    "schema_differences",
]

NOTE = "note: "  # a live finding that is not a difference (e.g. no published features)


def offline_problems(card: TrainingCard) -> list[str]:
    """Why the card's paths cannot work on its declared schema ([] = they can)."""
    if card.schema_ is None:
        if card.source.local is not None:
            return []
        return ["no declared schema: add a schema: block from the dataset's page (see data_cards/*.yaml)"]
    return card.schema_problems()


def compact_features(features) -> Any:
    """A ``datasets`` feature (or ``Features``) in the card's compact type notation (see ``neoembed.card_schema``)."""
    kind = type(features).__name__
    if isinstance(features, dict):  # Features, or a struct
        return {k: compact_features(v) for k, v in features.items()}
    if kind == "ClassLabel":
        return {"class_label": list(features.names)}
    if kind == "Value":
        return features.dtype
    if kind in ("Sequence", "List", "LargeList"):
        inner = compact_features(features.feature)
        if kind == "Sequence" and isinstance(inner, dict) and "class_label" not in inner:
            return {
                k: [v] for k, v in inner.items()
            }  # datasets' Sequence of a struct reads as a struct of lists
        return [inner]
    if isinstance(features, list) and len(features) == 1:  # [feature], the shorthand datasets accepts
        return [compact_features(features[0])]
    return kind


def schema_differences(declared: Any, live: Any, where: str = "") -> list[str]:
    """Every place where two compact types differ, with its path."""
    if (
        isinstance(declared, dict)
        and isinstance(live, dict)
        and "class_label" not in declared
        and "class_label" not in live
    ):
        out = []
        for k in declared.keys() - live.keys():
            out.append(f"{where + k}: declared ({_fmt(declared[k])}) but not in the live dataset")
        for k in live.keys() - declared.keys():
            out.append(f"{where + k}: in the live dataset ({_fmt(live[k])}) but not declared")
        for k in declared.keys() & live.keys():
            out += schema_differences(declared[k], live[k], f"{where}{k}.")
        return sorted(out)
    if isinstance(declared, list) and isinstance(live, list):
        return schema_differences(declared[0], live[0], f"{where[:-1]}[].")
    if declared != live:
        return [f"{where[:-1] or '(row)'}: declared {_fmt(declared)}, live {_fmt(live)}"]
    return []


def _fmt(t: Any) -> str:
    if isinstance(t, dict) and "class_label" in t:
        return f"class_label{t['class_label']}"
    return str(t)


def live_differences(card: TrainingCard, builder_fn=None) -> list[str]:
    """Differences between the card's declared schema and the live dataset: features, split, row count.

    ``builder_fn`` defaults to ``datasets.load_dataset_builder`` (reads the dataset's metadata, downloads no data).
    Raises what the hub raised; :func:`neoembed.data.cards.is_unreachable` tells the network failures apart.
    """
    if builder_fn is None:
        from datasets import load_dataset_builder as builder_fn
    hub, sch = card.source.hub, card.schema_
    builder = builder_fn(hub.id, hub.config, revision=hub.revision)
    info = builder.info
    out = []
    if info.features is None:  # JSON files without dataset_info: the features exist only once rows are read
        out.append(f"{NOTE}the hub publishes no features for this config: loading rows checks the paths")
    elif sch is not None:
        out += schema_differences(sch.features, compact_features(info.features))
    splits = info.splits or {}
    if splits and hub.split not in splits:
        out.append(f"split {hub.split!r} not in the live dataset (splits: {sorted(splits)})")
    elif sch is not None and sch.num_rows and hub.split in splits:
        live_n = splits[hub.split].num_examples
        if live_n and live_n != sch.num_rows:
            out.append(f"split {hub.split!r}: declared {sch.num_rows} rows, live {live_n}")
    return out


class HubStatus:
    """Whether the hub can be reached, found once per run (``data check``, training): by one probe before the
    first hub card, or by the first card whose requests fail to connect. Every later hub card is then spared the
    hub client's retries (about 40 s per card). ``down``: why the hub cannot be reached; None: not known to be."""

    def __init__(self, down: str | None = None):
        self.down = down
        self._probed = down is not None

    def found_unreachable(self) -> None:
        """A card's requests failed to connect: the cards after it are not tried."""
        self.down, self._probed = "found unreachable by an earlier card", True

    def unreachable(self) -> str | None:
        if not self._probed:
            self._probed = True
            self.down = hub_unreachable_reason()
        return self.down


def require_hub(cards: list[TrainingCard], hub: HubStatus | None = None) -> None:
    """Before a run loads any data: when some cards read the hub, one probe; an unreachable hub raises
    :class:`~neoembed.data.cards.HubUnreachable` at once, naming the hub, those cards and ``HF_HUB_OFFLINE``.

    With ``HF_HUB_OFFLINE`` set nothing is probed: the datasets load from the local cache (and a card missing
    from it fails at once, without retries)."""
    from huggingface_hub import constants

    from neoembed.data.cards import HubUnreachable, hub_offline_mode

    on_hub = [c for c in cards if c.source.hub is not None]
    if not on_hub or hub_offline_mode():
        return
    down = (hub or HubStatus()).unreachable()
    if down is None:
        return
    names = ", ".join(f"{c.name} ({c.source.hub.id})" for c in on_hub)
    raise HubUnreachable(
        f"the Hugging Face hub ({constants.ENDPOINT}) cannot be reached ({down}); {len(on_hub)} dataset(s) of "
        f"this run are on it: {names}. Connect to the network, or, if these datasets are in your local cache, "
        "set HF_HUB_OFFLINE=1 to load them from there without contacting the hub"
    )
