"""What one ``neoembed mteb`` run takes (:class:`EvalConfig`) and what it gives back (:class:`EvalReport`), and
the command's settings as ``--config FILE`` and ``--set key=value`` give them (:class:`MtebSettings`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import NonNegativeInt, PositiveInt, field_validator

from neoembed.config import StrictModel
from neoembed.instructions import DEFAULT_INSTRUCTION_SET, DEFAULT_TEMPLATE

#: the autocast precisions of the encoder (``--precision``), by name
PRECISION_NAMES = ("fp16", "bf16", "fp32")

__all__ = ["QUERY_PROMPT_NONE", "QUERY_PROMPT_SAVED", "EvalConfig", "EvalReport", "MtebSettings"]

QUERY_PROMPT_SAVED, QUERY_PROMPT_NONE = "saved", "none"


@dataclass
class EvalConfig:
    model: str
    output: Path
    tasks: list[str] | None = None
    task_types: list[str] | None = None
    benchmark: str | None = None
    precision: str | None = None  # None: fp16 on CUDA, fp32 on CPU
    instructions: str = DEFAULT_INSTRUCTION_SET
    template: str = DEFAULT_TEMPLATE
    batch_size: int = 32
    max_batch_tokens: int | None = None  # tokens per encoding batch (None: the device's, neoembed.batching)
    max_length: int | None = None
    data_dir: Path | None = None
    overwrite: bool = False
    seed: int = 42
    device: str | None = None
    cde_context: str = "corpus"  # CDE models: "corpus" (a seeded sample of each task's texts) or "null"
    truncate_dim: int | None = None  # evaluate the first truncate_dim dimensions (a Matryoshka model)
    embedding_precision: str = "fp32"  # "int8" / "binary": scores on quantized embeddings (mteb's wrapper)
    rescore: int | None = None  # retrieval / reranking: N x 10 nearest codes rescored (neoembed.eval.rescore)
    rescore_docs: str = "quantized"  # rescore against the "quantized" documents or the "float" ones
    backend: str = "torch"  # "onnx": a folder written by neoembed export, served by ONNX Runtime
    onnx_file: str | None = None  # the graph in its onnx/ folder (default model.onnx), e.g. an int8 one
    quantize: str | None = None  # "int8": the torch model's linear layers in dynamic int8 (CPU)
    # where a task gives no instruction, the prompt before its queries: "saved" (the model's own saved "query"
    # prompt, sentence-transformers' model.prompts["query"]), "none" (no prompt) or the text itself
    query_prompt: str = QUERY_PROMPT_SAVED


@dataclass
class EvalReport:
    scores: dict[str, dict] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


class MtebSettings(StrictModel):
    """``neoembed mteb``'s settings, one key per option (``--task-types`` is ``task_types``): a ``--config`` file
    holds any of them, ``--set key=value`` sets one. The values are checked as the options are (exit 2)."""

    model: str | None = None
    tasks: list[str] | None = None  # a list, or names separated by commas as --tasks takes them
    task_types: list[str] | None = None
    benchmark: str | None = None
    precision: str | None = None
    instructions: str = DEFAULT_INSTRUCTION_SET
    query_prompt: str = QUERY_PROMPT_SAVED
    batch_size: PositiveInt = 32
    max_batch_tokens: PositiveInt | None = None
    max_length: PositiveInt | None = None
    truncate_dim: PositiveInt | None = None
    data_dir: Path | None = None
    output: Path | None = None
    overwrite: bool = False
    seed: NonNegativeInt = 42
    device: str | None = None
    cde_context: str = "corpus"
    embedding_precision: str = "fp32"
    rescore: PositiveInt | None = None
    rescore_docs: str = "quantized"
    backend: str = "torch"
    onnx_file: str | None = None
    quantize: str | None = None

    @field_validator("tasks", "task_types", mode="before")
    @classmethod
    def _names(cls, v):
        """Names separated by commas (``--tasks STS12,STS13``); one naming nothing (``','``) is refused rather
        than read as "every task"."""
        if not isinstance(v, str):
            return v
        names = [n.strip() for n in v.split(",") if n.strip()]
        if not names:
            raise ValueError(
                f"{v!r} names nothing: give comma-separated names, or leave it out for the default"
            )
        return names
