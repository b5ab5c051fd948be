"""The pre-training recipe: a typed schema for ``neoembed pretrain`` (defaults are the paper's stage 1)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from neoembed.recipe import (
    Fraction,
    OptimizerConfig,
    OutputDir,
    Precision,
    RunSettings,
    StrictModel,
    check_keep_best,
)

__all__ = [
    "BatchConfig",
    "DataConfig",
    "DataSource",
    "MaskingConfig",
    "ModelConfig",
    "PretrainEval",
    "OptimizerConfig",
    "PretrainRecipe",
    "ScheduleConfig",
]


class ModelConfig(StrictModel):
    """Either start from an existing checkpoint (``init_from``: continued pre-training, stage 2) or from a
    random model with the NeoBERT config keys in ``config`` (defaults: NeoBERT, 28 x 768)."""

    init_from: str | None = None
    config: dict = {}
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    gradient_checkpointing: bool = False

    @model_validator(mode="after")
    def _one_origin(self):
        if self.init_from is not None and self.config:
            raise ValueError(
                "model.init_from and model.config exclude each other: a checkpoint brings its own config"
            )
        return self


class DataSource(StrictModel):
    """A shard folder made by ``neoembed preprocess`` (or one of its ``subsets/gtN``) and its sampling weight."""

    path: str
    weight: float = 1.0

    @field_validator("weight")
    @classmethod
    def _positive(cls, v):
        if v <= 0:
            raise ValueError(f"a source's weight must be > 0, got {v}")
        return v


class DataConfig(StrictModel):
    """Sources are drawn per step with probability proportional to their weight (the whole step from one)."""

    sources: list[DataSource]
    seq_length: PositiveInt = 1024
    packing: Literal["packed", "padded"] = "packed"
    cross_document_attention: bool = False  # packed only: the flawed variant (M6 ablation), for comparison
    shuffle: bool = True

    @field_validator("sources")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("at least one data source is needed (a folder made by `neoembed preprocess`)")
        return v

    @model_validator(mode="after")
    def _packed_only(self):
        if self.cross_document_attention and self.packing == "padded":  # a padded row holds one document
            raise ValueError(
                "cross_document_attention lets packed documents attend to each other; padded rows hold one "
                "document each: set packing: packed, or remove cross_document_attention"
            )
        return self


class MaskingConfig(StrictModel):
    rate: float = 0.2
    scheme: Literal["mask", "bert"] = "mask"  # mask: 100% [MASK] (NeoBERT); bert: 80/10/10

    @field_validator("rate")
    @classmethod
    def _rate(cls, v):
        if not 0 < v < 1:
            raise ValueError(f"masking rate must lie in (0, 1), got {v}; NeoBERT uses 0.2, BERT 0.15")
        return v


class BatchConfig(StrictModel):
    """Sequences per process per micro-step; the global batch is micro_batch_size x grad_accumulation x
    processes sequences of seq_length tokens."""

    micro_batch_size: PositiveInt = 32
    grad_accumulation: PositiveInt = 1

    @property
    def sequences(self) -> int:
        """Sequences of one optimizer step on one process."""
        return self.micro_batch_size * self.grad_accumulation


class ScheduleConfig(StrictModel):
    warmup_steps: NonNegativeInt = 2000
    decay_fraction: Fraction = 0.9
    final_ratio: Fraction = 0.1


class PretrainEval(StrictModel):
    """``eval:``: every ``steps`` steps, the masked-LM loss, accuracy and perplexity (exp of the loss) on
    ``sequences`` sequences of held-out shards (``sources``, never trained on), packed and masked once with the
    recipe's settings and a fixed seed, so that every evaluation sees the same tokens; logged as ``eval_mlm_loss``,
    ``eval_mlm_accuracy``, ``eval_mlm_perplexity``. With ``ppl_texts``, also the pseudo-perplexity of the first
    ``ppl_texts`` held-out documents of at least ``ppl_length`` tokens (each token masked in turn, as ``neoembed
    ppl --lengths ppl_length --max-docs ppl_texts`` scores them), ``eval_pseudo_perplexity``."""

    steps: PositiveInt
    sources: list[DataSource] = Field(min_length=1)
    sequences: PositiveInt = 64
    ppl_texts: NonNegativeInt = 0  # held-out documents scored by pseudo-perplexity (0: none)
    ppl_length: PositiveInt = 128  # their first ppl_length tokens (at most data.seq_length)


class PretrainRecipe(RunSettings):
    kind: Literal["pretrain"] = "pretrain"
    model: ModelConfig = ModelConfig()
    tokenizer: str = "chandar-lab/NeoBERT"
    data: DataConfig
    masking: MaskingConfig = MaskingConfig()
    batch: BatchConfig = BatchConfig()
    optimizer: OptimizerConfig = OptimizerConfig(lr=6e-4, weight_decay=0.1)  # the paper's AdamW
    schedule: ScheduleConfig = ScheduleConfig()
    # the run settings (RunSettings) where pre-training's differ; keep_best's metric: mlm_loss (mode: min) or
    # mlm_accuracy
    steps: PositiveInt = 1_000_000
    precision: Precision = "bf16"
    save_steps: PositiveInt = 10_000
    logging_steps: PositiveInt = 100
    output_dir: OutputDir = "runs/pretrain"
    eval: PretrainEval | None = None

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step packs on one process."""
        return self.batch.sequences * self.data.seq_length

    @model_validator(mode="after")
    def _consistent(self):
        misplaced = sorted({"warmup_steps", "schedule"} & self.optimizer.model_fields_set)
        if misplaced:
            raise ValueError(
                f"optimizer.{misplaced[0]} is the contrastive trainers' setting; pre-training's warm-up and decay "
                "are set under schedule: (warmup_steps, decay_fraction, final_ratio)"
            )
        end = self.schedule.decay_fraction * self.steps
        if end <= self.schedule.warmup_steps:
            raise ValueError(
                f"schedule.decay_fraction * steps = {end:g} must exceed schedule.warmup_steps = "
                f"{self.schedule.warmup_steps}: lower the warm-up or raise steps"
            )
        masked = self.masking.rate * self.tokens_per_step
        if masked < 1:  # most steps would mask no token: a loss of 0 and no gradient, logged as training
            raise ValueError(
                f"masking.rate {self.masking.rate:g} x data.seq_length {self.data.seq_length} x the sequences of a "
                f"step per process ({self.batch.sequences}) = {masked:.2g} masked tokens expected per step: most "
                "steps would mask none and train nothing. Raise masking.rate (NeoBERT uses 0.2, BERT 0.15)"
            )
        if self.eval is not None:
            trained = {s.path for s in self.data.sources} & {s.path for s in self.eval.sources}
            if trained:
                raise ValueError(
                    f"eval.sources {sorted(trained)} are also in data.sources: evaluation needs held-out shards "
                    "(preprocess a separate set of documents)"
                )
            if self.eval.ppl_texts and self.eval.ppl_length > self.data.seq_length:
                raise ValueError(
                    f"eval.ppl_length {self.eval.ppl_length} exceeds data.seq_length {self.data.seq_length}: lower it "
                    "(pseudo-perplexity at longer lengths: neoembed ppl --lengths)"
                )
        check_keep_best(self, "eval: {steps: N, sources: [{path: HELD_OUT_SHARDS}]}")
        return self
