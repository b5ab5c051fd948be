"""The CDE recipe: a typed schema for ``neoembed train`` with ``kind: cde``."""

from __future__ import annotations

from typing import Literal

from pydantic import PositiveInt, model_validator

from neoembed.instructions import DEFAULT_TEMPLATE
from neoembed.losses import MatryoshkaConfig
from neoembed.recipe import (
    AdapterConfig,
    DatasetList,
    EvalSettings,
    Fraction,
    OptimizerConfig,
    OutputDir,
    RunSettings,
    StrictModel,
    Temperature,
    Template,
    check_keep_best,
)

__all__ = ["CDERecipe", "ClusteringConfig", "ContextConfig", "FilteringConfig"]


class ContextConfig(StrictModel):
    n_context: PositiveInt = 512  # N context documents per model (saved with it)
    n_soft_prompt: PositiveInt = 4
    exclude_prompt: bool = False  # pool without the instruction prefix (prompts given as ST prompts)
    dropout: Fraction = 0.0  # training-time fraction of context vectors replaced by the learned null context


class ClusteringConfig(StrictModel):
    enabled: bool = True  # False: random single-source batches (the ablation)
    teacher: str = "sentence-transformers/all-MiniLM-L6-v2"  # any sentence-transformers model
    cluster_size: PositiveInt | None = None  # default: the batch size
    dims: PositiveInt | None = 128  # SVD reduction of teacher embeddings; null keeps them whole
    niter: PositiveInt = 20
    tour: bool = False  # greedy nearest-centroid order of clusters instead of a random order
    cache_dir: str | None = "~/.cache/neoembed/cde"  # null: no cache (a resume embeds again)


class FilteringConfig(StrictModel):
    enabled: bool = True
    threshold: float | None = None  # None: mask documents scoring >= the query's positive


class CDERecipe(RunSettings):
    """Contextual document embeddings: contextual batches, a two-stage contextual model, InfoNCE over in-batch
    documents and hard negatives with false negatives filtered, two-stage GradCache."""

    kind: Literal["cde"] = "cde"
    model: str  # backbone of both stages (any Hugging Face encoder or sentence-transformers folder)
    max_length: PositiveInt = 512
    datasets: DatasetList
    card_dirs: list[str] = []
    batch_size: PositiveInt = 512  # global: every process takes batch_size / processes of each batch
    temperature: Temperature = 0.02  # 1 / 50: the reference implementation's fixed logit scale
    mask_duplicates: bool = True
    # several processes: each scores its queries against the documents of every process (with gradients),
    # so the loss and gradients equal one process's at the global batch; off: against its own share only
    gather_across_devices: bool = False
    chunk_size: PositiveInt | None = None  # two-stage GradCache chunk; None = plain backpropagation
    matryoshka: MatryoshkaConfig | None = None  # {dims: [...], weights: [...]}: the loss at nested dimensions
    context: ContextConfig = ContextConfig()
    clustering: ClusteringConfig = ClusteringConfig()
    filtering: FilteringConfig = FilteringConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    output_dir: OutputDir = "runs/cde"
    eval: EvalSettings | None = (
        None  # scored as `neoembed mteb` scores a CDE model (a corpus sample as context)
    )
    # LoRA on both stages' encoders; the head (MLP, soft prompt, null context) trains fully; saved merged
    adapter: AdapterConfig | None = None
    template: Template = DEFAULT_TEMPLATE
    instructions: bool = True  # the card's instruction before every query
    prompts: dict[str, str] = {"query": "", "document": ""}  # stored with the model; "document" prefixes
    # documents and context documents in training

    @model_validator(mode="after")
    def _check(self):
        if self.batch_size < 2:
            raise ValueError("batch_size must be >= 2 (in-batch negatives)")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError("chunk_size must be >= 1 or null")
        if self.context.n_context < 1:
            raise ValueError("context.n_context must be >= 1")
        if not 0.0 <= self.context.dropout < 1.0:
            raise ValueError("context.dropout must lie in [0, 1)")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0")
        if self.eval is not None and self.eval.holdout is not None:
            raise ValueError("eval.holdout is the unified recipe's; a CDE recipe evaluates on eval.tasks")
        check_keep_best(self)
        return self
