"""The unified contrastive recipe: a typed schema for ``neoembed train``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from neoembed.instructions import DEFAULT_TEMPLATE
from neoembed.losses import DistillationConfig, FalseNegativeConfig, LossConfig, MatryoshkaConfig
from neoembed.pooling import pooling_mode
from neoembed.recipe import (
    AdapterConfig,
    DatasetEntry,
    DatasetList,
    EvalSettings,
    Fraction,
    KeepBest,
    OptimizerConfig,
    RecipeError,
    RunSettings,
    Temperature,
    Template,
    check_keep_best,
)

__all__ = ["AdapterConfig", "DatasetEntry", "EvalSettings", "KeepBest", "OptimizerConfig", "UnifiedRecipe"]


class UnifiedRecipe(RunSettings):
    """InfoNCE with cosine similarity and temperature tau over in-batch and hard negatives; one dataset per
    step drawn with pi_i ∝ n_i^alpha; instructions before queries."""

    kind: Literal["unified"] = "unified"
    model: str
    pooling: str | None = None  # in pooling.POOLING_MODES; None: a saved model's own, else mean
    max_length: PositiveInt = 512
    datasets: DatasetList
    card_dirs: list[str] = []  # extra folders searched for card names (relative to the recipe file)
    # queries per step (each with its positive and hard negatives), the same for every dataset; or
    # texts per step instead (the released NeoBERT rule, get_bsz): a dataset whose rows carry k hard negatives gets
    # batch_texts // (2 + k) queries per step. A dataset's own batch_size wins over both global forms.
    batch_size: PositiveInt = 128
    batch_texts: int | None = Field(None, ge=2)
    temperature: Temperature = 0.07
    alpha: Fraction = 0.5  # 0: every dataset equally often, 1: in proportion to its rows
    mask_duplicates: bool = True
    # no text twice in one batch (sentence-transformers' NoDuplicatesBatchSampler); "auto": for the cards where
    # a text repeats across rows (a query with several positives, a mined negative that is another row's positive)
    no_duplicates: bool | Literal["auto"] = "auto"
    reduction: Literal["mean", "sum"] = "mean"
    # {name: infonce} or {name: cached_infonce, mini_batch_size: 32} (GradCache: same loss, memory of a mini-batch)
    loss: LossConfig = LossConfig()
    # infonce: encode each batch in groups of rows of similar length (same rows, fewer padding tokens; a
    # padding-free encoder, NeoBERT by default, has no padding to save and encodes each column at once)
    group_by_length: bool = True
    gather_across_devices: bool = False
    # drop from each query's denominator the candidates scoring above its positive minus a margin (neoembed.losses.masks)
    false_negatives: FalseNegativeConfig | None = None
    improved_contrastive: bool = False  # GTE: query-query and document-document terms in the denominator
    matryoshka: MatryoshkaConfig | None = None  # {dims: [...], weights: [...]}: nested-dimension loss
    # {loss: kl | margin_mse, weight, infonce_weight, ...}: distillation from the rows' teacher scores
    distillation: DistillationConfig | None = None
    optimizer: OptimizerConfig = OptimizerConfig()
    eval: EvalSettings | None = None
    adapter: AdapterConfig | None = None
    template: Template = DEFAULT_TEMPLATE
    instructions: bool = True  # False: no instruction before queries (an ablation)
    instruction_overrides: dict[str, str] = {}  # card name -> instruction replacing the card's own

    @field_validator("pooling")
    @classmethod
    def _registered_pooling(cls, v):
        if v is not None:
            pooling_mode(v)
        return v

    @model_validator(mode="before")
    @classmethod
    def _old_loss_keys(cls, data):
        """The loss's keys before it became a sub-config: refused with the new form (not silently ignored)."""
        if not isinstance(data, dict):
            return data
        name = data.get("loss") if isinstance(data.get("loss"), str) else None
        mini = data.get("cache_mini_batch_size")
        if name is None and mini is None:
            return data
        target = name or "cached_infonce"
        given, form, flags = [], f"{{name: {target}", f"loss.name={target}"
        if name is not None:
            given.append(f"loss: {name}")
        if mini is not None:
            given.append(f"cache_mini_batch_size: {mini}")
            form, flags = f"{form}, mini_batch_size: {mini}", f"{flags} loss.mini_batch_size={mini}"
        raise ValueError(
            f"{' and '.join(given)}: the loss is a sub-config now; write loss: {form}}} (on the command line: {flags})"
        )

    @model_validator(mode="before")
    @classmethod
    def _batch_size_null(cls, data):
        """``batch_size: null`` unsets it, so that a recipe of batch_size can switch to batch_texts from the command
        line (``batch_size=null batch_texts=512``); without batch_texts it would leave no batch rule."""
        if isinstance(data, dict) and "batch_size" in data and data["batch_size"] is None:
            if data.get("batch_texts") is None:
                raise ValueError("batch_size: null leaves no batch size: give batch_texts (texts per step) with it")
            data = {k: v for k, v in data.items() if k != "batch_size"}
        return data

    @model_validator(mode="after")
    def _one_batch_rule(self):
        if self.batch_texts is not None and "batch_size" in self.model_fields_set:
            raise ValueError(
                f"batch_size {self.batch_size} (queries per step) and batch_texts {self.batch_texts} (texts per step) "
                "are both set; keep one: batch_texts=null gives every dataset batch_size queries, or "
                "batch_size=null (a dataset's own batch_size still wins)"
            )
        return self

    @model_validator(mode="after")
    def _keep_best_needs_eval(self):
        check_keep_best(self)
        return self

    @model_validator(mode="after")
    def _distillation_needs_negatives(self):
        bare = [e.card for e in self.datasets if e.max_negatives == 0]
        if self.distillation is not None and bare:  # else the first step fails, after the model loads
            raise ValueError(
                f"distillation compares each row's positive with its hard negatives, and max_negatives: 0 trains "
                f"{', '.join(bare)} without any: remove max_negatives: 0 there, or train it in a run without "
                "distillation"
            )
        return self

    def check_matryoshka_width(self) -> None:
        """``matryoshka.dims`` against the model's embedding width where its local files say it, before any data
        or the model loads (the loss checks it again on the loaded model)."""
        from neoembed.hub import embedding_width

        if self.matryoshka is not None and (width := embedding_width(self.model)) is not None:
            self.matryoshka.check_width(width)

    def dataset_batch_size(self, entry: DatasetEntry, negatives: int | None) -> int | None:
        """Queries per step for ``entry``, whose rows carry ``negatives`` hard negatives each: its own
        batch_size, else batch_texts // (2 + negatives) (None while ``negatives`` is unknown), else batch_size.
        The trainer calls it with the negatives the rows gave, the dry run with those the card declares."""
        if entry.batch_size is not None:
            return entry.batch_size
        if self.batch_texts is None:
            return self.batch_size
        if negatives is None:
            return None
        width = 2 + negatives
        if width > self.batch_texts:
            raise RecipeError(
                f"dataset {entry.card}: each row is {width} texts (query, positive, {negatives} hard negatives), more "
                f"than batch_texts {self.batch_texts}: raise batch_texts to at least {width}, set max_negatives: "
                f"{self.batch_texts - 2} for it, or give it its own batch_size"
            )
        return self.batch_texts // width
