"""The unified contrastive recipe: a typed schema for ``neoembed train``."""

from __future__ import annotations

from typing import Literal

from pydantic import NonNegativeInt, PositiveFloat, PositiveInt, field_validator

from neoembed.instructions import DEFAULT_TEMPLATE
from neoembed.recipe import DatasetEntry, DatasetList, OptimizerConfig, Recipe

__all__ = ["DatasetEntry", "OptimizerConfig", "UnifiedRecipe"]


class UnifiedRecipe(Recipe):
    """InfoNCE with cosine similarity and temperature tau over in-batch and hard negatives; one dataset per
    step drawn with pi_i ∝ n_i^alpha; instructions before queries."""

    kind: Literal["unified"] = "unified"
    model: str
    pooling: str = "mean"  # a name in neoembed.sentence.POOLING_MODES
    max_length: PositiveInt = 512
    datasets: DatasetList
    card_dirs: list[str] = []  # extra folders searched for card names (relative to the recipe file)
    steps: PositiveInt = 2000
    batch_size: PositiveInt = 128
    temperature: PositiveFloat = 0.07
    alpha: float = 0.5
    mask_duplicates: bool = True
    reduction: Literal["mean", "sum"] = "mean"
    loss: str = "infonce"  # a name in neoembed.losses.LOSSES: infonce, cached_infonce (GradCache)
    cache_mini_batch_size: PositiveInt = 32  # cached_infonce: the GradCache mini-batch
    # infonce: encode each batch in groups of rows of similar length (same rows, fewer padding tokens)
    group_by_length: bool = True
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
