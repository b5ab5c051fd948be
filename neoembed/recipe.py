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
import difflib
import random
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    Discriminator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Tag,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from neoembed.config import StrictModel, load_yaml
from neoembed.instructions import DEFAULT_INSTRUCTION_SET, check_template

__all__ = [
    "AdapterConfig",
    "DatasetEntry",
    "DatasetList",
    "EvalSettings",
    "Holdout",
    "KeepBest",
    "Fraction",
    "OptimizerConfig",
    "Recipe",
    "RecipeError",
    "RunSettings",
    "OutputDir",
    "StrictModel",
    "Template",
    "apply_overrides",
    "check_keep_best",
    "check_keep_best_scores",
    "kind_union",
    "load_recipe",
    "resolve_recipe_path",
    "resolve_named_file",
    "seed_everything",
]


class RecipeError(ValueError):
    """A recipe (or data card) that does not validate; the message says what to change."""


#: a fraction in [0, 1] / in [0, 1): dropout rates, schedule ratios, Adam's betas
Fraction = Annotated[float, Field(ge=0, le=1)]
Beta = Annotated[float, Field(ge=0, lt=1)]
#: a contrastive temperature: cosine / tau stays a finite logit in fp16 (|1 / 0.001| = 1000; below that the
#: softmax is a hard max and the loss explodes), and above 10 every logit is ~0 and nothing is learned
Temperature = Annotated[float, Field(ge=1e-3, le=10)]
#: a run's output folder: an empty string would be the current folder, written into and cleared by --overwrite
OutputDir = Annotated[str, Field(min_length=1)]
#: a seed every generator accepts (NumPy takes 0 .. 2**32 - 1)
Seed = Annotated[int, Field(ge=0, lt=2**32)]
#: an instruction template: ``{instruction}``, then a final ``{text}``, no other field (checked at load, not when
#: the first row is formatted, where an unknown field read as an error of the data file)
Template = Annotated[str, AfterValidator(check_template)]


class Recipe(StrictModel):
    """Base of every recipe schema. ``seed`` seeds Python, NumPy and torch at the start of a run."""

    seed: Seed


class OptimizerConfig(StrictModel):
    """AdamW, for every trainer (the one optimizer config). ``warmup_steps`` and ``schedule`` drive the
    contrastive trainers' schedule; pre-training follows NeoBERT's own schedule, set in its ``schedule:`` block,
    and rejects these two keys."""

    lr: PositiveFloat = 1e-4
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    eps: NonNegativeFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.01
    warmup_steps: NonNegativeInt = 0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    grad_clip: PositiveFloat = 1.0  # the largest gradient norm


class DatasetEntry(StrictModel):
    """One training set of a contrastive recipe: a data card (shipped name or path) and per-dataset settings."""

    card: str
    batch_size: PositiveInt | None = None  # default: the recipe's batch_size
    max_rows: PositiveInt | None = None
    max_negatives: NonNegativeInt | None = None


def _non_empty(entries: list[DatasetEntry]) -> list[DatasetEntry]:
    if not entries:
        raise ValueError("at least one dataset is needed")
    return entries


#: a contrastive recipe's ``datasets``: at least one entry
DatasetList = Annotated[list[DatasetEntry], AfterValidator(_non_empty)]

R = TypeVar("R", bound=BaseModel)


def _field_names(model: type[BaseModel], loc: tuple) -> list[str]:
    """The valid keys at the nested location ``loc`` of ``model`` (best effort). A field with an alias is
    written by its alias (a card's ``schema:``, the field ``schema_``), in ``loc`` and in the keys listed."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int) or current is None:
            continue
        fields = _keys(current)
        if part not in fields:
            return []
        current = _first_model(fields[part].annotation)
    return sorted(_keys(current))


def _keys(model: Any) -> dict:
    """A model's fields by the key a file writes them with."""
    return {f.alias or name: f for name, f in (getattr(model, "model_fields", None) or {}).items()}


def _first_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _first_model(arg)
        if found is not None:
            return found
    return None


def format_validation_error(
    err: ValidationError, schema: type[BaseModel], source: str, strip: str | None = None
) -> str:
    """One line per error, naming the key and (for unknown keys) the valid ones; ``strip``: the union tag that
    pydantic puts before the locations of a :func:`kind_union` member."""
    lines = [f"invalid {schema.__name__} in {source}:"]
    for e in err.errors():
        loc = tuple(e["loc"])
        if strip is not None and loc[:1] == (strip,):
            loc = loc[1:]
        where = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            valid = _field_names(schema, loc)
            lines.append(f"  - unknown key '{where}'. Valid keys here: {', '.join(valid) or '(none)'}")
        elif e["type"] == "missing":
            lines.append(f"  - missing required key '{where}'")
        elif not loc:  # a check across keys: its input is the whole recipe, which the message already names
            lines.append(f"  - {e['msg']}")
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
    if path.is_file():
        return path
    roots = [Path(str(resources.files("neoembed"))) / folder, Path(__file__).resolve().parent.parent / folder]
    candidates = [root / f"{name_or_path}{s}" for root in roots for s in ("", *suffixes)]
    for c in candidates:
        if c.is_file():  # before a folder of that name here (./glue/mrpc, GLUE's data, is not recipe glue/mrpc)
            return c
    if path.exists():
        return path
    available = sorted({p.stem for root in roots if root.is_dir() for p in root.glob("*.y*ml")})
    raise RecipeError(
        f"{folder[:-1].replace('_', ' ')} {str(name_or_path)!r} not found: it is neither a file nor a shipped name. "
        f"Shipped names: {', '.join(available) or '(none)'}"
    )


def kind_union(*schemas: type[BaseModel]) -> Any:
    """The schemas as one pydantic union discriminated by their ``kind`` field (a recipe without ``kind`` is the
    first schema's). Validated after the overrides, so ``kind=cde`` on the command line picks the CDE schema."""
    kinds = [schema.model_fields["kind"].default for schema in schemas]

    def kind_of(value: Any) -> str | None:
        return value.get("kind", kinds[0]) if isinstance(value, dict) else getattr(value, "kind", None)

    members = tuple(Annotated[schema, Tag(kind)] for schema, kind in zip(schemas, kinds, strict=True))
    return Annotated[Union[members], Discriminator(kind_of)]  # noqa: UP007  (a runtime tuple of members)


def _union_member(schema: Any, data: dict) -> tuple[type[BaseModel] | None, str | None]:
    """For a :func:`kind_union`: the schema the data's kind selects, and that kind (for error messages)."""
    union = getattr(schema, "__origin__", None)
    members = [getattr(m, "__origin__", m) for m in getattr(union, "__args__", ())]
    if not members:
        return None, None
    kind = data.get("kind", members[0].model_fields["kind"].default)
    return next(((m, kind) for m in members if m.model_fields["kind"].default == kind), (None, kind))


def resolve_recipe_path(value: str | None, recipe_dir: str | Path | None) -> str | None:
    """A path written in a recipe (model, tokenizer, data, card folders): a relative path that exists in the
    working directory is used as it is, else one that exists beside the recipe file is taken from there, else the
    value is kept (a hub id, or a folder yet to be made). The one rule for every path a recipe holds."""
    if value is None or recipe_dir is None or Path(value).is_absolute() or Path(value).exists():
        return value
    beside = Path(recipe_dir) / value
    return str(beside.resolve()) if beside.exists() else value


def load_recipe(
    source: str | Path | dict,
    schema: type[R] | Any,
    overrides: list[str] | tuple[str, ...] | None = None,
    where: str = "<mapping>",
) -> R:
    """Load a recipe (path, shipped name or mapping), apply overrides, validate against ``schema`` (a recipe
    class, or a :func:`kind_union` of them); ``where`` names a mapping's origin in errors."""
    if isinstance(source, dict):
        data = source
    else:
        path = resolve_named_file(source, "recipes")
        if path.is_dir():
            yamls = sorted(p.name for p in path.glob("*.yaml"))
            raise RecipeError(
                f"{path} is a folder, not a recipe file: name a .yaml file"
                + (f" (it holds {', '.join(yamls[:5])}{', ...' if len(yamls) > 5 else ''})" if yamls else "")
            )
        try:
            data = load_yaml(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"{path} is not valid YAML ({e}); fix the line it names") from None
        except UnicodeDecodeError as e:
            raise RecipeError(f"{path} is not UTF-8 text ({e}): is it a recipe?") from None
        if not isinstance(data, dict):
            raise RecipeError(
                f"{path} must hold a mapping (key: value lines) at the top level, got a {type(data).__name__}"
            )
        where = str(path)
    if overrides:  # a bad value given on the command line is not the file's
        where += f" with {' '.join(overrides)}"
    data = apply_overrides(data, overrides)
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            _check_command(schema, data, where)
            raise RecipeError(format_validation_error(e, schema, where)) from None
    try:
        return TypeAdapter(schema).validate_python(data)
    except ValidationError as e:
        _check_command(schema, data, where)
        member, kind = _union_member(schema, data)
        if member is None:
            raise RecipeError(f"invalid recipe in {where}: {e.errors()[0]['msg']}") from None
        raise RecipeError(format_validation_error(e, member, where, strip=kind)) from None


#: what each kind of recipe is, and the command that runs it
_RECIPE_KINDS = {
    "unified": ("a training recipe", "neoembed train RECIPE"),
    "cde": ("a CDE training recipe", "neoembed train RECIPE"),
    "pretrain": ("a pre-training recipe", "neoembed pretrain RECIPE"),
    "glue": ("a GLUE recipe", "neoembed glue TASK --model MODEL --recipe RECIPE"),
}


def _check_command(schema: Any, data: dict, where: str) -> None:
    """A recipe that failed validation because it is another command's (its ``kind``, or without one its
    distinctive keys, say so) is refused by naming that command, not by the keys this schema lacks."""
    kind = data.get("kind")
    if kind is None:  # the keys only one kind of recipe has
        keys = (("task", "glue"), ("datasets", "unified"), ("data", "pretrain"))
        kind = next((k for key, k in keys if key in data), None)
    members = [getattr(m, "__origin__", m) for m in getattr(getattr(schema, "__origin__", None), "__args__", ())]
    own = {m.model_fields["kind"].default if "kind" in m.model_fields else "glue" for m in members or [schema]}
    if kind in _RECIPE_KINDS and kind not in own:
        what, command = _RECIPE_KINDS[kind]
        raise RecipeError(f"{where} is {what}, not one this command runs: run it with `{command}`")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def given_on_command_line(ctx, values: dict) -> dict:
    """The options of ``values`` that the command line set (the others keep --config's or the defaults);
    ``ctx``: the command's typer context."""
    # by name: typer carries its own copy of click, whose ParameterSource is not click's
    return {k: v for k, v in values.items() if getattr(ctx.get_parameter_source(k), "name", "") == "COMMANDLINE"}


def _paths_beside(value, folder: Path):
    """A --config file's value with its relative paths resolved as a recipe's are (:func:`resolve_recipe_path`):
    the working folder's first, else the one beside the file."""
    if isinstance(value, str):
        return resolve_recipe_path(value, folder)
    if isinstance(value, list):
        return [resolve_recipe_path(v, folder) if isinstance(v, str) else v for v in value]
    return value


def command_settings(schema, config_file: Path | None, given: dict, overrides: list[str]):
    """A command's settings (``neoembed mine``, ``neoembed mteb``): ``schema`` validated from --config's mapping,
    the options ``given`` on the command line and ``key=value`` overrides, in that order of precedence (lowest
    first); errors name the key (exit 2), and a key both given as an option and overridden is refused."""
    data: dict = {}
    if config_file is not None:
        try:
            data = load_yaml(Path(config_file).read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"--config {config_file} is not valid YAML ({e})") from None
        if not isinstance(data, dict):
            raise RecipeError(f"--config {config_file} must hold key: value lines, got a {type(data).__name__}")
        data = {k: _paths_beside(v, Path(config_file).parent) for k, v in data.items()}
    twice = sorted({o.split("=", 1)[0].strip() for o in overrides if "=" in o} & set(given))
    if twice:
        raise RecipeError(f"{', '.join(twice)} set both as an option and as key=value: keep one")
    where = "the options and key=value" + (f" over --config {config_file}" if config_file is not None else "")
    return load_recipe({**data, **given}, schema, overrides, where=where)


# ------------------------------------------------------------------------------------------ evaluation
class Holdout(StrictModel):
    """``eval.holdout``: ``rows`` rows of each of ``cards`` (default: every training card), drawn with ``seed``, are
    taken out of training (with every training row that shares a query or positive with them) and scored as a local
    retrieval task, ``OUTPUT/eval/holdout-<card>/`` (see :mod:`neoembed.train.holdout`)."""

    rows: PositiveInt = 200
    seed: int = 0
    cards: list[str] | None = None


class EvalSettings(StrictModel):
    """Evaluation during training (``eval:``): every ``steps`` steps the model is scored on ``tasks`` (task folders,
    task cards or mteb task names, as ``neoembed mteb --tasks`` takes them; paths relative to the recipe) by the
    code of ``neoembed mteb``; ``metric`` (``main_score`` or any score mteb reports, e.g. ``ndcg_at_10``) is logged
    per task and averaged as ``eval_<metric>``."""

    steps: PositiveInt
    tasks: list[str] = []
    metric: str = "main_score"
    instructions: str = DEFAULT_INSTRUCTION_SET
    batch_size: PositiveInt = 32
    holdout: Holdout | None = None  # the unified recipe: a held-out slice of its training cards, also scored

    @model_validator(mode="after")
    def _something_to_score(self):
        if not self.tasks and self.holdout is None:
            raise ValueError("eval: needs tasks (task folders, cards or mteb names), a holdout, or both")
        return self


class KeepBest(StrictModel):
    """``keep_best:``: the checkpoint with the best logged ``metric`` (an evaluation score such as ``ndcg_at_10``,
    logged by ``eval:``, or one task's ``<task>_<metric>``) stays out of ``save_total_limit``'s rotation and becomes the final model.
    With ``patience``, the run stops early after that many evaluations in a row without a new best (transformers'
    ``EarlyStoppingCallback``: a tie is no improvement)."""

    metric: str
    mode: Literal["max", "min"] = "max"
    patience: PositiveInt | None = None

    @model_validator(mode="before")
    @classmethod
    def _a_mapping(cls, value):
        if not isinstance(value, dict | KeepBest):  # ``keep_best=true`` read as a switch
            raise ValueError(
                "keep_best names the score to keep the best checkpoint by: {metric: main_score} (eval.metric, the "
                "mean over eval.tasks, or '<task>_<metric>' for one task's; optionally mode: max or min, patience: "
                "N evaluations without a new best)"
            )
        return value


def check_keep_best(recipe: Any, example: str = "eval: {steps: N, tasks: [...], metric: ...}") -> None:
    """``keep_best`` needs an ``eval:`` block, and a checkpoint at every step it evaluates (``eval.steps`` a
    multiple of ``save_steps``; the last step is always both): the best step must be one there is a checkpoint
    of, or the final model would be another step's while the record names the best."""
    if recipe.keep_best is None:
        return
    if recipe.eval is None:
        raise ValueError(
            f"keep_best: {{metric: {recipe.keep_best.metric}}} compares evaluation scores: add an eval: block that "
            f"logs it ({example}), or remove keep_best"
        )
    every, save = recipe.eval.steps, recipe.save_steps
    if every % save:
        raise ValueError(
            f"keep_best makes the best evaluated step the final model, so every evaluated step needs a checkpoint: "
            f"eval.steps {every} must be a multiple of save_steps {save} (step {every} is evaluated, not saved). "
            f"Set save_steps: {every}, or eval.steps: {-(-every // save) * save}"
        )
    metric, keep = getattr(recipe.eval, "metric", None), recipe.keep_best.metric
    if metric is not None and keep != metric and not keep.endswith(f"_{metric}"):  # else found after training
        raise ValueError(
            f"keep_best.metric {keep!r} is not a score eval: logs: eval.metric {metric!r} (the mean over tasks) or "
            f"'<task>_{metric}' (one task's); set keep_best.metric to one of them, or eval.metric to what you want"
        )


def check_keep_best_scores(recipe: Any, task_names: list[str]) -> None:
    """``keep_best.metric`` is one of the scores the evaluation will log: ``eval.metric`` (the mean over tasks)
    or ``<task>_<eval.metric>`` for a task it scores. Known once the tasks resolve, before training: at the first
    evaluation, a misspelt task name would cost the steps before it."""
    keep = getattr(recipe, "keep_best", None)
    metric = getattr(getattr(recipe, "eval", None), "metric", None)
    if keep is None or metric is None:
        return
    logged = [metric] + [f"{name}_{metric}" for name in task_names]
    if keep.metric in logged:
        return
    close = difflib.get_close_matches(keep.metric, logged, n=1, cutoff=0.6)
    raise ValueError(
        f"keep_best.metric {keep.metric!r} is not a score the evaluation logs"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + f"; it logs: {', '.join(logged)}"
    )


# ------------------------------------------------------------------------------------------ run settings
#: a run's number format; torch.compile of the backbone's layers (neoembed.compile): true = "default", the
#: CUDA-graph modes being for encoding at fixed shapes, not for training; the trackers (transformers' integrations)
Precision = Literal["fp32", "bf16", "fp16"]
CompileSetting = bool | Literal["default", "max-autotune-no-cudagraphs"]
Tracker = Literal["tensorboard", "wandb", "mlflow", "trackio"]


class RunSettings(Recipe):
    """The settings of a run that every training recipe has (unified, CDE, pre-training), defined once; they stay
    top-level keys of the recipe. A recipe redeclares a default where its kind of run differs (pre-training's
    steps, precision and intervals; each kind's ``output_dir``)."""

    steps: PositiveInt = 2000
    precision: Precision = "fp32"
    # off by default: on the quickstart's job on a GPU it costs more than it saves (train_defaults_cuda.md)
    compile: CompileSetting = False
    save_steps: PositiveInt = 500
    # null keeps every checkpoint; 0 is refused (transformers reads it as "no limit" too)
    save_total_limit: PositiveInt | None = 3
    logging_steps: PositiveInt = 10
    # each tracker an optional extra: pip install -e '.[mlflow]'. The run is named after output_dir's folder; a
    # resumed run continues the same tracked run (ids kept in OUTPUT/trackers.json)
    report_to: list[Tracker] = []
    output_dir: OutputDir = "runs/unified"
    keep_best: KeepBest | None = None  # see check_keep_best


class AdapterConfig(StrictModel):
    """``adapter:``: train a LoRA adapter (PEFT) instead of every weight. The final model is saved merged (an
    ordinary checkpoint) and the adapter alone in ``OUTPUT/adapter/`` (PEFT's layout). ``target_modules`` null:
    NeoBERT's qkv, wo, w12, w3, or PEFT's defaults for other encoders."""

    type: Literal["lora"] = "lora"
    r: PositiveInt = 16
    alpha: PositiveFloat = 32
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | None = None
