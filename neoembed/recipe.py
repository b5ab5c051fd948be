"""Typed recipes: YAML -> validated, frozen config objects.

Every command that trains or evaluates is driven by a recipe. A recipe schema is a pydantic model that
subclasses :class:`Recipe` (so every recipe has a ``seed``). Unknown keys are errors that name the key
and the valid ones; ``key.sub=value`` command-line overrides are applied to the raw mapping *before*
validation, so they go through exactly the same checks as the file.

    >>> from neoembed.recipe import Recipe, load_recipe
    >>> class Tiny(Recipe):
    ...     lr: float = 1e-4
    >>> load_recipe({"seed": 1, "lr": 0.1}, Tiny, ["lr=0.5"]).lr
    0.5
"""

from __future__ import annotations

import copy
import random
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "Recipe",
    "RecipeError",
    "StrictModel",
    "apply_overrides",
    "load_recipe",
    "resolve_named_file",
    "seed_everything",
]


class RecipeError(ValueError):
    """A recipe (or data card) that does not validate; the message says what to change."""


class StrictModel(BaseModel):
    """Base of every typed config: unknown keys are rejected, objects are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Recipe(StrictModel):
    """Base of every recipe schema. ``seed`` seeds Python, NumPy and torch at the start of a run."""

    seed: int


R = TypeVar("R", bound=BaseModel)


def _field_names(model: type[BaseModel], loc: tuple) -> list[str]:
    """The valid keys at the nested location ``loc`` of ``model`` (best effort)."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int) or current is None:
            continue
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        annotation = fields[part].annotation
        current = _first_model(annotation)
    fields = getattr(current, "model_fields", None)
    return sorted(fields) if fields else []


def _first_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _first_model(arg)
        if found is not None:
            return found
    return None


def format_validation_error(err: ValidationError, schema: type[BaseModel], source: str) -> str:
    lines = [f"invalid {schema.__name__} in {source}:"]
    for e in err.errors():
        loc = tuple(e["loc"])
        where = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            valid = _field_names(schema, loc)
            lines.append(f"  - unknown key '{where}'. Valid keys here: {', '.join(valid) or '(none)'}")
        elif e["type"] == "missing":
            lines.append(f"  - missing required key '{where}'")
        else:
            lines.append(f"  - '{where}': {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...] | None) -> dict:
    """Return a copy of ``data`` with ``key.sub=value`` overrides applied (values parsed as YAML)."""
    out = copy.deepcopy(data)
    for item in overrides or ():
        if "=" not in item:
            raise RecipeError(f"override {item!r} is not of the form key.sub=value")
        key, value = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise RecipeError(f"override {item!r} has an empty key")
        node = out
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise RecipeError(f"override {item!r}: '{p}' is not a mapping in the recipe")
            node = nxt
        node[parts[-1]] = _parse_value(value)
    return out


def resolve_named_file(name_or_path: str | Path, folder: str, suffixes=(".yaml", ".yml")) -> Path:
    """Resolve a path, or a bare name shipped in the package's ``folder`` (``recipes`` / ``data_cards``).

    Installed wheels carry the folders inside the package; an editable checkout has them at the
    repository's top level. Both are searched.
    """
    path = Path(name_or_path)
    if path.exists():
        return path
    roots = [Path(str(resources.files("neoembed"))) / folder, Path(__file__).resolve().parent.parent / folder]
    candidates = [root / f"{name_or_path}{s}" for root in roots for s in ("", *suffixes)]
    for c in candidates:
        if c.is_file():
            return c
    available = sorted({p.stem for root in roots if root.is_dir() for p in root.glob("*.y*ml")})
    raise RecipeError(
        f"{folder[:-1].replace('_', ' ')} {str(name_or_path)!r} not found: it is neither a file nor a shipped name. "
        f"Shipped names: {', '.join(available) or '(none)'}"
    )


def load_recipe(
    source: str | Path | dict, schema: type[R], overrides: list[str] | tuple[str, ...] | None = None
) -> R:
    """Load a recipe (path, shipped name or mapping), apply overrides, validate against ``schema``."""
    if isinstance(source, dict):
        data, where = source, "<mapping>"
    else:
        path = resolve_named_file(source, "recipes")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"{path} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise RecipeError(f"{path} must hold a mapping at the top level, got {type(data).__name__}")
        where = str(path)
    data = apply_overrides(data, overrides)
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise RecipeError(format_validation_error(e, schema, where)) from None


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
