"""NeoBERT (or any Hugging Face encoder) as a sentence-transformers model.

``neoembed.load`` returns a :class:`EmbeddingModel`, a :class:`~sentence_transformers.SentenceTransformer`
with input checks and a finiteness check on its outputs. What it saves is a plain sentence-transformers folder
built from stock modules (Transformer -> Pooling -> optional Normalize). For NeoBERT, ``config.json`` carries
``model_type: neobert`` and an ``auto_map`` to ``configuration_neobert.py`` / ``modeling_neobert.py`` (which
imports ``attention_neobert.py`` and ``layout_neobert.py``), written beside the weights: the folder loads with ``SentenceTransformer(path)``
in a process that imported ``neoembed``, and with ``trust_remote_code=True`` where neoembed is not installed.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Transformer
from sentence_transformers.base.modules.normalize import Normalize
from sentence_transformers.sentence_transformer.modules import Pooling

import neoembed.modeling  # noqa: F401  (registers NeoBERT with the Auto classes)
from neoembed.config import check_positive_int, check_prompts, check_switches
from neoembed.encode_checks import (
    NonFiniteEmbeddingError,
    TruncationWarning,
    check_encodable,
    check_finite,
    check_items,
    check_truncate_dim,
    empty_result,
    warn_truncation,
)
from neoembed.hub import model_kind, resolve_packaged
from neoembed.instructions import DEFAULT_TEMPLATE, instruction_prefix
from neoembed.model_card import LOADING_HEADING, PACKAGED_MINILM, base_model_name, with_loading_section
from neoembed.modeling.positions import position_limit
from neoembed.pooling import POOLING_MODES, pooling_mode, pooling_name
from neoembed.record import readable_weights

__all__ = [
    "POOLING_MODES",
    "DTYPES",
    "EmbeddingModel",
    "NonFiniteEmbeddingError",
    "TruncationWarning",
    "build_prompts",
    "convert_to_sentence_transformer",
    "load",
    "PACKAGED_MINILM",
    "pooling_mode",
    "resolve_packaged",
    "resolve_dtype",
    "set_max_seq_length",
]

logger = logging.getLogger(__name__)

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def build_prompts(
    query_instruction: str | None = None,
    document_instruction: str | None = None,
    template: str = DEFAULT_TEMPLATE,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """Sentence-transformers prompts for an instruction pair: ``{"query": ..., "document": ...}``.

    The paper puts the task instruction before queries and nothing before documents; ``extra`` adds more
    named prompts (for instance mteb's per-task keys ``"<TaskName>-query"`` / ``"<TaskName>"``)."""
    for name, given in (("query_instruction", query_instruction), ("document_instruction", document_instruction)):
        if not isinstance(given, str | None):
            raise TypeError(f"build_prompts: {name} must be a string or None, got {given!r}")
    prompts = {
        "query": instruction_prefix(query_instruction, template),
        "document": instruction_prefix(document_instruction, template),
    }
    prompts.update(extra or {})
    return prompts


_ENCODE = inspect.signature(SentenceTransformer.encode)


class EmbeddingModel(SentenceTransformer):
    """A SentenceTransformer that refuses bad input and non-finite output with a clear message.

    - an empty list returns an empty array of shape (0, dim);
    - a non-string item raises ``TypeError`` naming its index;
    - text longer than ``max_seq_length`` is truncated, with one warning per call;
    - NaN or inf embeddings raise :class:`NonFiniteEmbeddingError` with advice."""

    def encode(self, inputs, *args, **kwargs):  # type: ignore[override]
        if isinstance(inputs, np.ndarray) and inputs.ndim == 1:  # an array of strings, as a list
            inputs = inputs.tolist()
        items = [inputs] if isinstance(inputs, str) else inputs
        if isinstance(items, Sequence):
            call = _ENCODE.bind_partial(self, inputs, *args, **kwargs).arguments
            if call.get("truncate_dim") is not None:
                check_truncate_dim(call["truncate_dim"], self.get_embedding_dimension(), self.truncate_dim)
            if len(items) == 0 and call.get("output_value", "sentence_embedding") == "sentence_embedding":
                width = call.get("truncate_dim") or self.get_embedding_dimension() or 0
                return empty_result(
                    width, call.get("precision"), call.get("convert_to_tensor", False),
                    call.get("convert_to_numpy", True),
                )  # fmt: skip
            check_items(items)
            if not isinstance(call.get("prompt"), str | None):
                raise TypeError(f"prompt must be a string (the text put before each input), got {call['prompt']!r}")
        try:
            if isinstance(items, Sequence):
                prompt = self._resolve_prompt(call.get("prompt"), call.get("prompt_name"))
                warn_truncation(self.tokenizer, items, self.max_seq_length, prompt)
            return super().encode(inputs, *args, **kwargs)  # _inference checks the embeddings' finiteness
        except TypeError as e:  # the Rust tokenizer's only word on text it cannot take
            if "TextEncodeInput" in str(e) and isinstance(items, Sequence):
                check_encodable(items)
            raise

    # sentence-transformers keeps no key of config_sentence_transformers.json it does not know: a saved copy
    # (export, push_to_hub) would drop the Matryoshka dimensions the model was trained for
    def _parse_model_config(self, model_config: dict) -> None:
        super()._parse_model_config(model_config)
        self.matryoshka_dims = model_config.get(MATRYOSHKA_KEY)

    def _get_model_config(self) -> dict:
        dims = getattr(self, "matryoshka_dims", None)
        return super()._get_model_config() | ({MATRYOSHKA_KEY: dims} if dims else {})

    def get_model_kwargs(self) -> list[str]:
        # ``max_batch_tokens`` travels through sentence-transformers' ``encode`` to :meth:`_inference`
        return [*super().get_model_kwargs(), "max_batch_tokens"]

    def _inference(self, inputs, *, max_batch_tokens: int | None = None, **kwargs):
        """sentence-transformers' loop (``batch_size`` texts a batch), or with ``max_batch_tokens=N``
        (``encode(texts, max_batch_tokens=N)``) batches filled to ``N`` tokens, longest texts first: see
        :mod:`neoembed.batching`. Sentence embeddings only: other outputs keep count batches."""
        if max_batch_tokens is None or kwargs.get("output_value") != "sentence_embedding":
            out = super()._inference(inputs, **kwargs)
        else:
            from neoembed.batching import encode_token_budget

            kwargs.pop("output_value")
            out = encode_token_budget(self, inputs, max_batch_tokens, **kwargs)
        # every encode comes here (its process pool and distributed evaluation too), before it quantizes: a NaN
        # has no int8 or binary code
        check_finite(out)
        return out

    def save(self, path, *args, **kwargs) -> None:
        """sentence-transformers' ``save``, refusing an int8-quantized model before it writes anything (its
        dynamic int8 layers have no weights to save: the save failed half-way, leaving configs without weights),
        and leaving the weights readable as the folder's other files (:func:`neoembed.record.readable_weights`)."""
        from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

        if any(isinstance(m, DynamicQuantizedLinear) for m in self.modules()):
            raise ValueError(
                "this model is int8-quantized (quantize='int8'), which serves and does not save: save the model "
                "it was loaded from and load that with quantize='int8', or `neoembed export --quantize int8`"
            )
        super().save(path, *args, **kwargs)
        readable_weights(path)

    def _create_model_card(self, path, model_name=None, train_datasets="deprecated") -> None:
        # sentence-transformers writes its generated card, or the card the model was loaded with (a trainer's,
        # naming the data and their licences); the loading section is then written for where the model now
        # lives (the hub id on push_to_hub), so that its code runs as shown
        super()._create_model_card(path, model_name, train_datasets)
        readme = Path(path) / "README.md"
        if not readme.is_file():
            return
        text = readme.read_text(encoding="utf8")
        neobert = _is_neobert(self)
        if neobert or LOADING_HEADING in text:
            model_id = self.model_card_data.model_id or model_name or str(path)
            readme.write_text(with_loading_section(text, model_id, neobert, self.prompts.get("query")), "utf8")


def _is_neobert(model: SentenceTransformer) -> bool:
    first = model[0]
    config = getattr(getattr(first, "auto_model", None), "config", None)
    return getattr(config, "model_type", None) == "neobert"


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {sorted(DTYPES)}") from None


def _own_module_classes(name_or_path: str) -> dict:
    """The ``neoembed.*`` module types a local folder's ``modules.json`` names, resolved to the installed classes:
    neoembed's own code, which needs no ``trust_remote_code`` (sentence-transformers asks for it for any type
    outside its namespace; the flag stays for third-party code). A type neoembed no longer has is an error."""
    import importlib

    path = Path(name_or_path) / "modules.json"
    if not path.is_file():
        return {}
    classes = {}
    for ref in {str(m.get("type", "")) for m in json.loads(path.read_text())}:
        if ref.startswith("neoembed."):
            module, _, name = ref.rpartition(".")
            try:
                classes[ref] = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                raise ValueError(
                    f"{path} names the module type {ref!r}, which this version of neoembed does not have: save "
                    "the model again with the version that wrote it"
                ) from None
    return classes


def _refuse_building_options(name_or_path: str, **given) -> None:
    """``normalize`` and ``tokenizer`` build a model from a plain checkpoint; a saved folder would ignore them."""
    bad = [f"{k}={v!r}" for k, v in given.items() if v not in (None, False)]
    if bad:
        raise ValueError(
            f"{name_or_path} is a saved sentence-transformers model, which keeps its own modules and tokenizer: "
            f"{', '.join(bad)} would be ignored. They apply when building from a plain checkpoint; drop them "
            "(or append a Normalize module to the loaded model yourself)"
        )


def _check_saved_pooling(model: SentenceTransformer, name_or_path: str, pooling: str | None) -> None:
    """A ``pooling`` other than the saved folder's own is refused: it would be silently ignored. A model without
    a Pooling module (a StaticEmbedding) pools inside its one module: there is nothing to compare."""
    pooler = next((m for m in model if isinstance(m, Pooling)), None)
    if pooling is None or pooler is None:
        return
    own = pooling_name(pooler.pooling_mode)
    if pooler.pooling_mode != pooling_mode(pooling):
        raise ValueError(
            f"{name_or_path} is a saved sentence-transformers model that pools by {own!r}; pooling="
            f"{pooling!r} would be ignored. Drop pooling (the model's own), or set pooling={own!r}"
        )


def load(
    name_or_path: str | Path,
    pooling: str | None = None,
    max_seq_length: int | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    *,
    normalize: bool = False,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    include_prompt: bool = True,
    tokenizer: str | None = None,
    padding_free: bool | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    compile: bool | str = False,
    bucketing: bool | None = None,
    cuda_graphs: bool = False,
) -> EmbeddingModel:
    """Load a bi-encoder as a SentenceTransformer (:func:`neoembed.load` also loads CDE models).

    Args:
        name_or_path: an official NeoBERT checkpoint (folder or hub id such as ``chandar-lab/NeoBERT``), a
            bi-encoder saved by neoembed, a sentence-transformers folder, or any Hugging Face encoder.
        pooling: ``"mean"`` (the paper's "avg", the default) or ``"cls"``, for building from a plain checkpoint. A
            saved sentence-transformers folder pools as it was saved: a different ``pooling`` is refused, as are
            ``normalize`` and ``tokenizer`` (they build a model; the folder already is one).
        max_seq_length: defaults to the model's maximum (4,096 for NeoBERT).
        dtype: ``"fp32"``, ``"fp16"``, ``"bf16"`` (or a torch dtype) for the weights.
        normalize: append a Normalize module (unit-length embeddings).
        prompts / default_prompt_name: sentence-transformers prompts (see :func:`build_prompts`); merged into
            the prompts a saved model already has.
        include_prompt: whether pooling includes the prompt's tokens.
        tokenizer: a tokenizer folder or hub id for checkpoints saved without tokenizer files.
        padding_free: NeoBERT only: override ``config.padding_free`` (default: the checkpoint's, True); True for
            another model is refused (it runs padded batches).
        attn_implementation: ``"sdpa"``, ``"eager"`` or ``"flash_attention_2"``.
        trust_remote_code: for third-party models with remote code. Never switched on implicitly: neoembed's own
            modules are imported as installed code (a folder naming ``neoembed.*`` module types needs no remote
            code).
        compile / bucketing: ``torch.compile`` the backbone's layers in place (False, True or a mode name; off by
            default) and pad batches to length buckets; see :mod:`neoembed.compile`. On CUDA, the modes with CUDA
            graphs compile without torch's and record the whole forward as ``cuda_graphs`` does.
        cuda_graphs: replay the backbone's inference forward from CUDA graphs recorded per length bucket, no
            compiler (:func:`neoembed.compile.enable_cuda_graphs`; short texts stop waiting on the host).

    Loading changes no process-wide setting (the torch thread count is the caller's: ``torch.set_num_threads``).
    """
    from neoembed.compile import resolve_compile_mode

    compile_mode = resolve_compile_mode(compile)  # a bad value fails before anything is loaded
    check_switches(bucketing=bucketing, cuda_graphs=cuda_graphs)
    mode = pooling_mode(pooling or "mean")
    given = (("dtype", resolve_dtype(dtype)), ("attn_implementation", attn_implementation))
    model_kwargs = {k: v for k, v in given if v is not None}
    name_or_path = str(name_or_path)
    with named_weight_errors(name_or_path):
        if model_kind(name_or_path, tokenizer) == "sentence":
            _refuse_building_options(name_or_path, normalize=normalize, tokenizer=tokenizer)
            model = EmbeddingModel._load_with_module_classes(
                name_or_path,
                _own_module_classes(name_or_path),
                device=device,
                model_kwargs=model_kwargs or None,
                trust_remote_code=trust_remote_code,
            )
            _check_saved_pooling(model, name_or_path, pooling)
            _prompt_options(model, prompts, default_prompt_name, include_prompt)
        else:
            model = _built(
                name_or_path, model_kwargs, trust_remote_code, tokenizer, max_seq_length, device, normalize,
                (mode, include_prompt), prompts, default_prompt_name,
            )  # fmt: skip
    check_vocab(model, name_or_path)
    if max_seq_length is not None:
        set_max_seq_length(model, max_seq_length, name_or_path)
    _set_padding_free(model, padding_free, name_or_path)
    return apply_speedups(model, compile_mode, bucketing, cuda_graphs)


def _set_padding_free(model: SentenceTransformer, padding_free: bool | None, name) -> None:
    """NeoBERT's layout; True for another model is refused (False asks for the padded batches it runs)."""
    if padding_free and not _is_neobert(model):
        raise ValueError(
            f"padding_free is NeoBERT's option; {name} is not a NeoBERT model and runs padded batches"
        )
    if padding_free is not None and _is_neobert(model):
        model[0].auto_model.config.padding_free = bool(padding_free)


def set_max_seq_length(model: SentenceTransformer, max_seq_length: int, name) -> None:
    """``model.max_seq_length = max_seq_length``, refused past learned absolute positions, where the first long
    text would fail deep in the embedding lookup, and kept with a warning past NeoBERT's supported length
    (:func:`position_limit`; ``neoembed train`` checks its ``max_length`` by the same rule)."""
    check_positive_int(max_seq_length, "max_seq_length", " of tokens")
    config = getattr(getattr(model[0], "auto_model", None), "config", None)
    limit, fails = position_limit(config)
    if limit is not None and max_seq_length > limit and fails:
        raise ValueError(
            f"max_seq_length={max_seq_length} (--max-length on the command line) exceeds the {limit} "
            f"positions of {name} (its config's max_position_embeddings): use at most {limit}"
        )
    if limit is not None and max_seq_length > limit:
        logger.warning(
            "max_seq_length=%d (--max-length on the command line) is longer than the %d tokens %s supports "
            "(trained at %d%s): rotary positions extrapolate past it, and quality there is not measured",
            max_seq_length, limit, name, config.max_length,
            "" if limit == config.max_length else ", times its RoPE scaling's factor",
        )  # fmt: skip
    model.max_seq_length = max_seq_length


#: the key of ``config_sentence_transformers.json`` listing a Matryoshka-trained model's dimensions
MATRYOSHKA_KEY = "matryoshka_dims"


def matryoshka_dims(folder: str | Path) -> list[int] | None:
    """The Matryoshka dimensions a saved model was trained at (None when it was not)."""
    config = Path(folder) / "config_sentence_transformers.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get(MATRYOSHKA_KEY)


def record_matryoshka_dims(folder: str | Path, dims: list[int]) -> None:
    """Write ``dims`` into a saved model's ``config_sentence_transformers.json`` (sentence-transformers
    ignores the key; load with ``truncate_dim=`` one of them)."""
    config = Path(folder) / "config_sentence_transformers.json"
    data = json.loads(config.read_text()) if config.is_file() else {}
    data[MATRYOSHKA_KEY] = sorted(dims, reverse=True)
    config.write_text(json.dumps(data, indent=2) + "\n")


def set_truncate_dim(model, truncate_dim: int | None) -> None:
    """Embed with the first ``truncate_dim`` dimensions (None: all); a value beyond the width is an error."""
    if truncate_dim is None:
        return
    before, model.truncate_dim = model.truncate_dim, None  # the full width, not an earlier truncation's
    width = model.get_embedding_dimension()
    try:
        model.truncate_dim = check_truncate_dim(truncate_dim, width)
    except ValueError:
        model.truncate_dim = before
        raise
    dims = getattr(model, "matryoshka_dims", None)
    if dims and truncate_dim not in dims and truncate_dim != width:
        logger.warning(
            "truncate_dim=%d is not one of the dimensions this model was trained at (%s): the loss shaped only "
            "those prefixes of its embeddings",
            truncate_dim, ", ".join(map(str, dims)),
        )  # fmt: skip


def _prompt_options(model, prompts, default_prompt_name, include_prompt) -> None:
    """Merge ``load``'s prompt options into a saved sentence-transformers model's own."""
    check_prompts(prompts)
    if prompts:
        model.prompts = {**model.prompts, **prompts}
    if default_prompt_name is not None and default_prompt_name not in model.prompts:
        raise ValueError(
            f"default_prompt_name {default_prompt_name!r} is not one of the model's prompts "
            f"{sorted(model.prompts)}: name one of them, or add it with prompts={{...}}"
        )
    if default_prompt_name is not None:
        model.default_prompt_name = default_prompt_name
    if not include_prompt:
        model.set_pooling_include_prompt(False)


@contextlib.contextmanager
def named_weight_errors(name_or_path: str | Path):
    """Around reading a model: safetensors' own error (a truncated or corrupt weights file, which it reports
    without a file name) becomes a ``ValueError`` naming the model and the unreadable file (exit 2)."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        path = Path(name_or_path)
        files = sorted(path.rglob("*.safetensors")) if path.is_dir() else []
        broken = [str(f) for f in files if not _readable_safetensors(f)] or [str(name_or_path)]
        raise ValueError(
            f"model {name_or_path}: weights file {', '.join(broken)} cannot be read ({e}): it is truncated or "
            "corrupt - copy or save the model again"
        ) from None


def _readable_safetensors(path: Path) -> bool:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
        return True
    except (SafetensorError, OSError):
        return False


def check_vocab(model: SentenceTransformer, name_or_path: str | Path) -> None:
    """Refuse a tokenizer whose ids do not fit the model's embedding table (a tokenizer swapped in from another
    model): each such id would fail deep inside the first forward pass with an index error naming neither."""
    first = model[0] if len(model) else None
    tok = getattr(first, "tokenizer", None)
    config = getattr(getattr(first, "auto_model", None), "config", None)
    vocab = getattr(config, "vocab_size", None)
    if tok is None or not isinstance(vocab, int):
        return
    if len(tok) > vocab:
        raise ValueError(
            f"model {name_or_path}: its tokenizer has {len(tok):,} tokens but the model's embedding table has "
            f"{vocab:,} rows (config.json vocab_size): ids >= {vocab:,} cannot be embedded - use the tokenizer "
            "the model was trained with"
        )


def _built(
    name_or_path, model_kwargs, trust_remote_code, tokenizer, max_seq_length, device, normalize, pooling,
    prompts, default_prompt_name,
) -> EmbeddingModel:  # fmt: skip
    """A bi-encoder built from a plain checkpoint: Transformer -> Pooling (``pooling``: its mode and whether it
    includes the prompt's tokens) -> optional Normalize."""
    check_prompts(prompts)
    transformer = _transformer(name_or_path, model_kwargs, trust_remote_code, tokenizer, max_seq_length)
    mode, include_prompt = pooling
    pooler = Pooling(transformer.get_embedding_dimension(), mode, include_prompt=include_prompt)
    model = EmbeddingModel(
        modules=[transformer, pooler, *([Normalize()] if normalize else [])],
        device=device,
        prompts=prompts,
        default_prompt_name=default_prompt_name,
        similarity_fn_name="cosine",
    )
    model.model_card_data.base_model = base_model_name(name_or_path)
    return model


def _transformer(name_or_path: str, model_kwargs: dict, trust_remote_code: bool, tokenizer, max_seq_length):
    """sentence-transformers' Transformer module over a plain Hugging Face checkpoint."""
    trust = {"trust_remote_code": True} if trust_remote_code else None
    return Transformer(
        name_or_path,
        model_kwargs={**model_kwargs, **trust} if trust else model_kwargs,
        config_kwargs=trust,
        processor_kwargs=trust,
        tokenizer_name_or_path=tokenizer,
        max_seq_length=max_seq_length,
    )


def apply_speedups(
    model: EmbeddingModel, compile_mode: str | None, bucketing: bool | None, cuda_graphs: bool = False
) -> EmbeddingModel:
    """Apply ``load``'s ``compile``, ``bucketing`` and ``cuda_graphs`` settings to a loaded model."""
    from neoembed.compile import GRAPHED_MODES, compile_layers, enable_bucketing, enable_cuda_graphs

    if compile_mode in GRAPHED_MODES and model.device.type == "cuda" and not cuda_graphs:
        if bucketing is False:
            raise ValueError(
                f"compile={compile_mode!r} records CUDA graphs per length bucket: drop bucketing=False"
            )
        # compiled layers inside one recorded graph per shape (why not torch's own graphs: GRAPHED_MODES)
        compile_layers(model, GRAPHED_MODES[compile_mode], dynamic=True)
        model.neoembed_cuda_graphs = enable_cuda_graphs(model)
        return model
    if cuda_graphs:
        if compile_mode is not None or bucketing:
            raise ValueError(
                "cuda_graphs records the eager forward and buckets lengths itself: use it without compile and "
                "bucketing (compile='reduce-overhead' is the compiled way to CUDA graphs)"
            )
        model.neoembed_cuda_graphs = enable_cuda_graphs(model)  # runners: .remove() each to go eager again
        return model
    if bucketing is None:
        bucketing = compile_mode == "reduce-overhead"
    if bucketing:
        model.neoembed_bucketing = enable_bucketing(model)  # handles: .remove() each to stop bucketing
    if compile_mode is not None:
        if model.device.type == "cpu" and not bucketing:
            # on CPU the padding-free layout's attention groups the batch's sequences by their lengths, which a
            # compiled layer specialises on: one recompilation per new set of lengths (seen with
            # TORCH_LOGS=recompiles), eager again after torch's recompile limit
            for backbone in (m for m in model.modules() if getattr(m, "config", None) is not None):
                if getattr(backbone.config, "model_type", None) == "neobert":
                    backbone.config.padding_free = False
        # encoding sees a new shape in almost every batch: symbolic shapes from the first compilation
        n = compile_layers(model, compile_mode, dynamic=True)
        logger.info("compiled %d layers (mode %s)", n, compile_mode)
    return model


def convert_to_sentence_transformer(src: str | Path, dst: str | Path, pooling: str | None = None) -> str:
    """An official (or neoembed) NeoBERT checkpoint -> a sentence-transformers folder; returns a report.
    ``pooling``: mean (the default) or cls; a sentence-transformers ``src`` keeps its own unless another is
    asked for, which is refused (see :func:`load`)."""
    from neoembed.modeling.convert import require_config, resolve_checkpoint

    folder = resolve_checkpoint(src)
    require_config(folder)  # a CDE model keeps its encoders in subfolders: say so before loading it
    model = load(str(folder), pooling=pooling)
    if not _is_neobert(model):
        raise ValueError(
            f"{src} is not a NeoBERT checkpoint (model_type={model[0].auto_model.config.model_type!r})"
        )
    model.model_card_data.base_model = base_model_name(src)
    model.save(str(dst))
    files = sorted(p.name for p in Path(dst).iterdir())
    pooler = next((m for m in model if isinstance(m, Pooling)), None)
    pooled = pooling_name(pooler.pooling_mode) if pooler is not None else None
    return (
        f"converted {src} -> {dst} (sentence-transformers: Transformer -> Pooling[{pooled}])\n"
        f"  files: {', '.join(files)}\n"
        f"  loads with neoembed.load({str(dst)!r}), or SentenceTransformer(path, trust_remote_code=True) without neoembed"
    )
