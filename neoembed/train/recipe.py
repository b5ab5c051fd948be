"""The unified contrastive recipe: a typed schema for ``neoembed train``."""

from __future__ import annotations

from typing import Literal

from pydantic import NonNegativeInt, PositiveFloat, PositiveInt, field_validator

from neoembed.instructions import DEFAULT_TEMPLATE
from neoembed.recipe import Recipe, StrictModel

__all__ = ["DatasetEntry", "OptimizerConfig", "UnifiedRecipe"]


class DatasetEntry(StrictModel):
    """One training set: a data card (shipped name or path) and optional per-dataset settings."""

    card: str
    batch_size: PositiveInt | None = None  # default: the recipe's batch_size
    max_rows: PositiveInt | None = None
    max_negatives: NonNegativeInt | None = None


class OptimizerConfig(StrictModel):
    lr: PositiveFloat = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup_steps: NonNegativeInt = 0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    grad_clip: float = 1.0


class UnifiedRecipe(Recipe):
    """InfoNCE with cosine similarity and temperature tau over in-batch and hard negatives; one dataset per
    step drawn with pi_i ∝ n_i^alpha; instructions before queries."""

    kind: Literal["unified"] = "unified"
    model: str
    pooling: Literal["mean", "cls"] = "mean"
    max_length: PositiveInt = 512
    datasets: list[DatasetEntry]
    card_dirs: list[str] = []  # extra folders searched for card names (relative to the recipe file)
    steps: PositiveInt = 2000
    batch_size: PositiveInt = 128
    temperature: PositiveFloat = 0.07
    alpha: float = 0.5
    mask_duplicates: bool = True
    reduction: Literal["mean", "sum"] = "mean"
    cache_mini_batch_size: PositiveInt | None = None  # GradCache mini-batch; None = plain loss
    gather_across_devices: bool = False
    optimizer: OptimizerConfig = OptimizerConfig()
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # torch.compile of the backbone's layers (neoembed.compile): true = "default"; the CUDA-graph modes are for
    # encoding at fixed shapes, not for training. Off by default: not yet measured to pay end to end on a GPU.
    compile: bool | Literal["default", "max-autotune-no-cudagraphs"] = False
    save_steps: PositiveInt = 500
    save_total_limit: NonNegativeInt | None = 3
    logging_steps: PositiveInt = 10
    report_to: list[Literal["tensorboard", "wandb"]] = []
    output_dir: str = "runs/unified"
    template: str = DEFAULT_TEMPLATE
    instructions: bool = True  # False: no instruction before queries (an ablation)
    instruction_overrides: dict[str, str] = {}  # card name -> instruction replacing the card's own

    @field_validator("datasets")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("at least one dataset is needed")
        return v
