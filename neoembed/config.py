"""The one strict base of every typed config in neoembed (recipes, loss settings, data cards, mining), and the
YAML reader of every file they come from.

It sits on the lowest floor (pydantic and PyYAML only), so that every foundation module can build on it; so do the
plain checks of Python arguments that recipes' types make of their keys (a positive count, prompts, an on/off
switch).
"""

from __future__ import annotations

import numbers
import types
import typing
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

__all__ = ["StrictModel", "check_positive_int", "check_prompts", "check_switches", "load_yaml"]


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last, so a recipe with
    ``steps:`` twice ran with whichever came second, without a word."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base``: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
            except TypeError:  # an unhashable key: PyYAML's own check names it
                continue
            if repeated:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"found the key {key!r} twice",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """``text`` as YAML (safe types only); a key repeated in a mapping is a :class:`yaml.YAMLError` naming it
    and its line."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


class StrictModel(BaseModel):
    """Base of every typed config: unknown keys are rejected, objects are immutable, and no number may be NaN or
    infinite (``alpha=nan`` or ``lr=inf`` fail here, by key, not inside a run)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_switch_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads true as 1 for a number: ``steps=true`` trained one step
        if not isinstance(value, bool) or not info.field_name:
            return value
        leaves = _leaves(cls.model_fields[info.field_name].annotation)
        if any(t in (int, float) for t in leaves) and not any(t is bool or t is Any for t in leaves):
            raise ValueError(f"takes a number, not {str(value).lower()}")
        return value  # other types refuse a bool themselves


def _leaves(annotation: Any) -> list[Any]:
    """The types a field typed ``annotation`` takes: through ``Annotated`` and unions (``PositiveInt | None``);
    a literal's values as their types."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _leaves(args[0])
    if origin in (typing.Union, types.UnionType):
        return [t for a in args for t in _leaves(a)]
    if origin is typing.Literal:
        return [type(a) for a in args]
    return [annotation]


def check_positive_int(value: Any, what: str, unit: str = "") -> int:
    """``value`` as an int when it is a positive whole number (a bool is not), else an error naming ``what``: the
    check of a Python argument that a recipe's ``PositiveInt`` makes of its key."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} takes a positive whole number{unit}, not {value!r}")
    return int(value)


def check_prompts(prompts) -> None:
    """``prompts`` is None or a dict of prompt names to texts; anything else is a TypeError saying so."""
    if prompts is not None and not isinstance(prompts, dict):
        raise TypeError(
            f"prompts maps prompt names to texts, such as {{'query': 'query: '}}; got a {type(prompts).__name__}: "
            f"{prompts!r:.80}"
        )
    if bad := {k: v for k, v in (prompts or {}).items() if not (isinstance(k, str) and isinstance(v, str))}:
        raise TypeError(f"prompts map names to prompt texts (str to str); these are not: {bad}")


def check_switches(**switches: Any) -> None:
    """Each of ``switches`` (a name and its value) is True, False or None: ``bucketing="no"`` is truthy and switched
    bucketing on."""
    for name, value in switches.items():
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} is True, False or None; got {value!r}")
