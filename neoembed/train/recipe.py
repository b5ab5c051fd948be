"""The unified contrastive recipe: a typed schema for ``neoembed train``."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from neoembed.instructions import DEFAULT_TEMPLATE
from neoembed.recipe import DatasetEntry, DatasetList, OptimizerConfig, Recipe

__all__ = ["DatasetEntry", "OptimizerConfig", "UnifiedRecipe"]


class UnifiedRecipe(Recipe):
    """InfoNCE with cosine similarity and temperature tau over in-batch and hard negatives; one dataset per
    step drawn with pi_i ∝ n_i^alpha; instructions before queries."""

    kind: Literal["unified"] = "unified"
    model: str
    pooling: str = "mean"  # a name in neoembed.sentence.POOLING_MODES
    max_length: int = 512
    datasets: DatasetList
    card_dirs: list[str] = []  # extra folders searched for card names (relative to the recipe file)
    steps: int = 2000
    batch_size: int = 128
    temperature: float = 0.07
    alpha: float = 0.5
    mask_duplicates: bool = True
    reduction: Literal["mean", "sum"] = "mean"
    loss: str = "infonce"  # a name in neoembed.losses.LOSSES: infonce, cached_infonce (GradCache)
    cache_mini_batch_size: int = 32  # cached_infonce: the GradCache mini-batch
    gather_across_devices: bool = False
    optimizer: OptimizerConfig = OptimizerConfig()
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    save_steps: int = 500
    save_total_limit: int | None = 3
    logging_steps: int = 10
    report_to: list[Literal["tensorboard", "wandb"]] = []
    output_dir: str = "runs/unified"
    template: str = DEFAULT_TEMPLATE
    instructions: bool = True  # False: no instruction before queries (an ablation)
    instruction_overrides: dict[str, str] = {}  # card name -> instruction replacing the card's own

    @field_validator("pooling")
    @classmethod
    def _registered_pooling(cls, v):
        from neoembed.sentence import pooling_mode

        pooling_mode(v)
        return v

    @field_validator("loss")
    @classmethod
    def _registered_loss(cls, v):
        from neoembed.losses import check_loss_name

        return check_loss_name(v)
