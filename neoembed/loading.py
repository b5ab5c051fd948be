"""``neoembed.load``: one entry point for every kind of model neoembed reads.

A saved CDE folder (its ``modules.json`` names the contextual module; one holding LoRA adapters alone names their
base encoder in ``cde_adapter.json``) loads as a :class:`~neoembed.cde.model.ContextualSentenceTransformer`; anything else goes to :func:`neoembed.sentence.load`
(bi-encoders, official NeoBERT checkpoints, any Hugging Face encoder); a LoRA adapter saved alone
(``adapter_config.json``, no ``modules.json``) loads its base model and applies the adapter. This module sits above both
``sentence.py`` and ``cde/``, so that neither imports the other's floor upward (``docs/architecture.md``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from neoembed.adapters import check_adapter_base, is_adapter_folder, load_adapter
from neoembed.cde.model import ContextualSentenceTransformer, is_cde_folder, load_cde
from neoembed.compile import resolve_compile_mode
from neoembed.config import check_prompts, check_switches
from neoembed.export.runtime import load_onnx
from neoembed.export.torch_int8 import QUANTIZE, quantize_int8
from neoembed.runs.checks import check_device
from neoembed.sentence import (
    EmbeddingModel,
    apply_speedups,
    named_weight_errors,
    resolve_dtype,
    resolve_packaged,
    set_max_seq_length,
    set_truncate_dim,
)
from neoembed.sentence import load as load_bi_encoder

__all__ = ["load"]


def load(
    name_or_path: str | Path,
    *args: Any,
    prompts: dict[str, str] | None = None,
    truncate_dim: int | None = None,
    backend: str = "torch",
    file_name: str | None = None,
    quantize: str | None = None,
    **kwargs: Any,
) -> EmbeddingModel | ContextualSentenceTransformer:
    """Load an embedding model as a SentenceTransformer; the arguments are :func:`neoembed.sentence.load`'s, and
    ``truncate_dim``: embed with the first ``truncate_dim`` dimensions (sentence-transformers' ``truncate_dim``; a
    Matryoshka-trained model lists its dims in ``config_sentence_transformers.json``, ``matryoshka_dims``).

    ``backend="onnx"`` serves a folder written by ``neoembed export`` with ONNX Runtime (``file_name``: the
    graph in its ``onnx/`` folder, e.g. ``model_qint8_avx512_vnni.onnx``; default ``model.onnx``); see
    :mod:`neoembed.export.runtime`. ``quantize="int8"`` (torch backend, CPU) serves the encoder's linear layers in
    dynamic int8 (:mod:`neoembed.export.torch_int8`), NeoBERT still padding-free.

    Each kind takes the arguments that mean something for it, and refuses the others by name (never dropped): an
    ONNX export takes ``prompts``, ``truncate_dim``, ``file_name`` and ``max_seq_length``; a CDE folder
    :data:`CDE_OPTIONS`, ``prompts`` and ``truncate_dim``; a bi-encoder everything :func:`neoembed.sentence.load`
    takes. Remote code runs only where ``trust_remote_code=True`` is passed.
    """
    if not isinstance(name_or_path, str | os.PathLike):
        raise TypeError(
            f"load: the model is a folder or a hub id (a str or a path), got {type(name_or_path).__name__} "
            f"{name_or_path!r}"
        )
    if backend not in ("torch", "onnx"):
        raise ValueError(f"unknown backend {backend!r}: choose 'torch' or 'onnx'")
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"quantize={quantize!r}: choose one of {', '.join(QUANTIZE)} (or None)")
    if quantize is not None and backend != "torch":
        raise ValueError(
            "quantize is for the torch backend; an ONNX export chooses its int8 graph with file_name="
            "'model_qint8_<isa>.onnx'"
        )
    if file_name is not None and backend != "onnx":
        raise ValueError(
            f"file_name={file_name!r} picks the graph of an ONNX export: pass backend='onnx' with it"
        )
    check_device(_named(args, kwargs).get("device"), flag="device")  # torch's own error is an AssertionError
    check_prompts(prompts)  # every kind merges them into its own (a str or a number failed only at encode)
    if str(name_or_path).startswith("packaged:"):  # the packaged all-MiniLM-L6-v2 (neoembed[quickstart])
        name_or_path = resolve_packaged(str(name_or_path))
    if backend == "onnx":
        return _load_export(name_or_path, _named(args, kwargs), file_name, prompts, truncate_dim)
    if not str(name_or_path).strip():  # Path("") is the working folder
        raise ValueError("load: the model name is empty: give a model folder or a hub id")
    if quantize:  # the int8 layers take and give fp32 around their int8 products, whatever the folder was saved in
        options = _named(args, kwargs)
        if resolve_dtype(options.get("dtype")) not in (None, resolve_dtype("fp32")):
            raise ValueError(
                f"quantize='int8' computes in fp32 around its int8 products: drop dtype={options['dtype']!r}"
            )
        args, kwargs = (), {**options, "dtype": "fp32"}
    path = Path(name_or_path)
    check_adapter_base(path)
    if is_adapter_folder(path):  # a LoRA adapter saved alone: its base model, then the adapter on it
        model = load_adapter(
            path, lambda base: load(base, *args, prompts=prompts, truncate_dim=truncate_dim, **kwargs)
        )
        return quantize_int8(model) if quantize else model
    if not (path.exists() and is_cde_folder(path)):
        model = load_bi_encoder(name_or_path, *args, prompts=prompts, **kwargs)
        set_truncate_dim(model, truncate_dim)
        return quantize_int8(model) if quantize else model
    if quantize:
        raise ValueError(f"quantize='int8' serves bi-encoders; {path} is a CDE model")
    return _load_cde_folder(path, _named(args, kwargs), prompts, truncate_dim)


def _load_export(name_or_path, options: dict, file_name: str | None, prompts, truncate_dim: int | None):
    """An ONNX export, with the options that act on it in Python; the others refused by name."""
    allowed = ("prompts", "truncate_dim", "file_name", "max_seq_length")
    _refuse(name_or_path, "an ONNX export", options, allowed=allowed)
    model = load_onnx(name_or_path, file_name=file_name, prompts=prompts)
    set_truncate_dim(model, truncate_dim)
    if options.get("max_seq_length") is not None:  # the tokenizer's cut
        set_max_seq_length(model, options["max_seq_length"], name_or_path)
    return model


def _load_cde_folder(path: Path, options: dict, prompts, truncate_dim: int | None) -> ContextualSentenceTransformer:
    """A saved CDE model with :data:`CDE_OPTIONS`; the others refused by name."""
    _refuse(path, "a CDE model", options, allowed=(*CDE_OPTIONS, "prompts", "truncate_dim"))
    check_switches(bucketing=options.get("bucketing"), cuda_graphs=options.get("cuda_graphs"))
    dtype = resolve_dtype(options.get("dtype"))
    compile_mode = resolve_compile_mode(options.get("compile", False))
    with named_weight_errors(path):
        model = load_cde(
            path, device=options.get("device"), model_kwargs={"dtype": dtype} if dtype is not None else None
        )
    if prompts:
        model.prompts = {**model.prompts, **prompts}
    if options.get("max_seq_length") is not None:
        model.cde.max_seq_length = int(options["max_seq_length"])
    set_truncate_dim(model, truncate_dim)
    return apply_speedups(model, compile_mode, options.get("bucketing"), options.get("cuda_graphs", False))


#: what ``load`` takes for a CDE folder besides ``prompts`` and ``truncate_dim`` (the rest builds a bi-encoder)
CDE_OPTIONS = ("max_seq_length", "dtype", "device", "compile", "bucketing", "cuda_graphs")
#: ``neoembed.sentence.load``'s positional parameters after the model, as ``load`` passes them on
POSITIONAL = ("pooling", "max_seq_length", "dtype", "device")


def _named(args: tuple, kwargs: dict) -> dict:
    if len(args) > len(POSITIONAL):
        raise TypeError(f"load takes at most {len(POSITIONAL)} positional options ({', '.join(POSITIONAL)})")
    return {**dict(zip(POSITIONAL, args, strict=False)), **kwargs}


#: switches off by default: passing them off asks for nothing a kind could refuse
OFF_BY_DEFAULT = ("compile", "cuda_graphs", "trust_remote_code")


def _refuse(name_or_path, kind: str, options: dict, allowed: tuple[str, ...]) -> None:
    """Options a kind of model has no use for are an error naming them, not silently dropped."""
    bad = sorted(
        k
        for k, v in options.items()
        if k not in allowed and v is not None and not (k in OFF_BY_DEFAULT and v is False)
    )
    if bad:
        raise ValueError(
            f"{name_or_path} is {kind}, which does not take {', '.join(bad)}: it takes "
            f"{', '.join(allowed)}. Drop {'them' if len(bad) > 1 else 'it'}"
        )
