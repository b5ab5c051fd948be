"""Faster execution of an unchanged model: ``torch.compile`` of its repeated layers, and length buckets for
CUDA graphs.

Why the layers and not the whole forward: a NeoBERT block is where the memory-bound work sits, some twenty
small kernels per layer in eager mode (float32 up/down casts around RMSNorm, RoPE's unflatten/stack/flatten,
SwiGLU's chunk, silu and product, transposes around attention). Inductor fuses them between the matrix
products. The model's own forward also checks its input and builds the attention layout on the host (it reads
lengths with ``.tolist()``); inside a compiled region each of those would be a graph break, so it stays eager,
and every layer runs one compiled graph (the layers share their code, so they share the graph).

The layers are compiled *in place* (``nn.Module.compile``): parameter names, ``state_dict`` and saving are
unchanged, and the modeling file is not touched — the same code runs eagerly when compilation is off.

Which layers: those the model names in ``_no_split_modules`` (transformers' own list of blocks that must stay on
one device: ``NeoBERTBlock``, ``BertLayer``, ``ModernBertEncoderLayer``, ...), so any Hugging Face encoder
inside a SentenceTransformer (or both stages of a CDE model) is covered.

Length buckets: CUDA graphs (compile's ``"reduce-overhead"`` mode) replay a recorded launch sequence for one
shape; a batch of sentences comes in a new (batch, length) shape almost every time. :func:`enable_bucketing`
pads each batch up to the next length bucket (and its batch size up to the next power of two) before the
backbone and cuts the output back, so few shapes recur and their graphs are reused. Padded keys are masked,
so the embeddings equal the unbucketed ones (tested to float32 rounding).

CUDA graphs without compilation: :func:`enable_cuda_graphs` records the backbone's whole inference forward, eager
as it is, once per bucketed shape, and replays it. Small batches of short texts are bound by the host launching
some twenty kernels per layer; a replay launches them all at once. Recording a shape costs two forwards (no
compiler), so it pays from the first encode.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Mapping, Sequence

import torch
from torch import nn

__all__ = [
    "COMPILE_MODES",
    "DEFAULT_LENGTH_BUCKETS",
    "GRAPHED_MODES",
    "BucketingHandle",
    "CudaGraphs",
    "bucket_batch",
    "bucket_length",
    "compile_layers",
    "enable_bucketing",
    "enable_cuda_graphs",
    "graph_key",
    "length_buckets_for",
    "pad_to_buckets",
    "repeated_layers",
    "resolve_compile_mode",
]

# torch.compile's modes. "reduce-overhead" adds CUDA graphs; the "max-autotune" modes search matmul/kernel
# configurations at compile time (minutes, for a few % more), "max-autotune" with CUDA graphs too.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The modes that add torch's CUDA graphs, and the same mode without them. Per compiled layer those graphs fail
# on a CUDA model: its layers share one compiled graph, and each call's input is the output of the previous
# call of the same graph, which torch's graph trees overwrite before it is read (reduce-overhead on an H200,
# torch 2.11: "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run").
# neoembed.load compiles the layers without them and records the whole forward with CudaGraphs instead.
GRAPHED_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}

# Powers of two and the 1.5x steps between them (16, 32, 48, 64, 96, ..., 6144, 8192): a batch's length grows by
# at most half (a 33-token batch padded to 48), with 18 shapes up to 8,192 tokens.
DEFAULT_LENGTH_BUCKETS = tuple(sorted({2**k for k in range(4, 14)} | {3 * 2**k for k in range(4, 12)}))


def resolve_compile_mode(compile: bool | str | None) -> str | None:
    """``False``/``None`` -> None (eager); ``True`` -> ``"default"``; a mode name -> itself."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return "default"
    if isinstance(compile, str) and compile in COMPILE_MODES:
        return compile
    raise ValueError(
        f"compile={compile!r} is not a compile setting; use False, True (= 'default') or one of {list(COMPILE_MODES)}"
    )


def repeated_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose class a Hugging Face model under it names in ``_no_split_modules``."""
    from transformers import PreTrainedModel

    names: set[str] = set()
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            names.update(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def compile_layers(model: nn.Module, compile: bool | str = True, dynamic: bool | None = None) -> int:
    """Compile the repeated layers of ``model`` in place with inductor; returns how many were compiled.

    ``dynamic=None`` is torch's own choice (static shapes first, symbolic after the first shape change); pass
    True when shapes vary from the start (encoding) to skip the first, static compilation. Compilation is lazy:
    the first call of each new graph pays it (tens of seconds), later calls run the fused kernels.
    """
    mode = resolve_compile_mode(compile)
    if mode is None:
        return 0
    layers = repeated_layers(model)
    if not layers:
        raise ValueError(
            f"compile: found no repeated layers in {type(model).__name__} (no Hugging Face model under it names "
            "any in _no_split_modules); load the model without compile, or compile it yourself with torch.compile"
        )
    for layer in layers:
        layer.compile(mode=mode, dynamic=dynamic)
    return len(layers)


def bucket_length(n: int, buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS) -> int:
    """The smallest bucket >= n (``buckets`` sorted ascending). A length above the last bucket is an error:
    callers cap their buckets at the model's maximum length, which input is truncated to."""
    if n < 1:
        raise ValueError(f"a sequence length must be >= 1, got {n}")
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(
            f"length {n} exceeds the largest bucket {buckets[-1]}: add a bucket >= {n} or truncate the input"
        )
    return int(buckets[i])


def bucket_batch(n: int) -> int:
    """The next power of two >= n: the batch sizes that CUDA graphs are recorded for."""
    if n < 1:
        raise ValueError(f"a batch size must be >= 1, got {n}")
    return 1 << (n - 1).bit_length()


def length_buckets_for(max_length: int, buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS) -> tuple[int, ...]:
    """``buckets`` below ``max_length``, then ``max_length`` itself: every truncated input fits one."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    return tuple(sorted({b for b in buckets if b < max_length} | {max_length}))


def _given(value) -> bool:
    """Whether a keyword argument was really passed (not None, not an integer 0 such as a prefix of 0)."""
    return value is not None and not (isinstance(value, int) and value == 0)


def _pad_to(t: torch.Tensor, rows: int, cols: int, value: int) -> torch.Tensor:
    B, L = t.shape
    if (B, L) == (rows, cols):
        return t
    out = t.new_full((rows, cols), value)
    out[:B, :L] = t
    return out


PAD_KEYS = {"input_ids": None, "attention_mask": 0, "token_type_ids": 0}  # None: the model's pad token
PASSTHROUGH_KEYS = ("inputs_embeds", "position_ids", "cu_seq_lens_q")


def pad_to_buckets(
    inputs: dict, buckets: Sequence[int], pad_token_id: int
) -> tuple[dict, tuple[int, int]] | tuple[None, None]:
    """``inputs`` with ``input_ids``, ``attention_mask`` (and ``token_type_ids``) padded to ``(bucket_batch(B),
    bucket_length(L))``, and the original ``(B, L)``; ``(None, None)`` when the input is not plain token input
    (``inputs_embeds``, packed input or given positions pass through untouched)."""
    ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
    plain = (
        isinstance(ids, torch.Tensor)
        and ids.dim() == 2
        and isinstance(mask, torch.Tensor)
        and not any(_given(inputs.get(k)) for k in PASSTHROUGH_KEYS)
    )
    if not plain:
        return None, None
    B, L = ids.shape
    rows, cols = bucket_batch(B), bucket_length(L, buckets)
    out = dict(inputs)
    for key, value in PAD_KEYS.items():
        if isinstance(inputs.get(key), torch.Tensor):
            # padded rows and columns have attention_mask 0: no real token attends to them
            out[key] = _pad_to(inputs[key], rows, cols, pad_token_id if value is None else value)
    return out, (B, L)


def _cut(t, B: int, L: int):
    return t[:B, :L] if isinstance(t, torch.Tensor) and t.dim() >= 2 else t


class BucketingHandle:
    """Pads the (batch, length) input of one module up to buckets and cuts its output back.

    Registered as a forward pre-hook and hook, so the model, its parameter names and its saving are unchanged;
    :meth:`remove` takes both away. Two kinds of module:

    * a sentence-transformers ``Transformer`` (``features`` dict in and out): its ``token_embeddings`` are cut back
      and the original ``input_ids`` / ``attention_mask`` put back into the features for pooling;
    * a Hugging Face model called as ``model(input_ids=..., attention_mask=...)``: ``last_hidden_state`` (and
      ``hidden_states``) are cut back.
    """

    def __init__(self, module: nn.Module, buckets: Sequence[int], pad_token_id: int, features: bool):
        self.buckets = tuple(buckets)
        self.pad_token_id = pad_token_id
        self.features = features
        self._pending: list[tuple[dict, tuple[int, int]] | None] = []  # per call in flight (calls may nest)
        self._hooks = [
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post, with_kwargs=True),
        ]

    def _pre(self, module, args, kwargs):
        inputs = (
            args[0] if self.features and args and isinstance(args[0], Mapping) else kwargs
        )  # BatchEncoding too
        padded, shape = (
            (None, None)
            if (args and not self.features)
            else pad_to_buckets(inputs, self.buckets, self.pad_token_id)
        )
        if padded is None:
            self._pending.append(None)
            return None
        self._pending.append(({k: inputs[k] for k in PAD_KEYS if k in inputs}, shape))
        return ((padded, *args[1:]), kwargs) if self.features else (args, padded)

    def _post(self, module, args, kwargs, output):
        pending = self._pending.pop()
        if pending is None:
            return None
        originals, (B, L) = pending
        if self.features:
            output["token_embeddings"] = _cut(output["token_embeddings"], B, L)
            if output.get("all_layer_embeddings") is not None:
                output["all_layer_embeddings"] = tuple(_cut(h, B, L) for h in output["all_layer_embeddings"])
            output.update(originals)  # pooling reads the caller's own mask
            return output
        if isinstance(output, tuple):
            return (_cut(output[0], B, L), *output[1:])
        output.last_hidden_state = _cut(output.last_hidden_state, B, L)
        if getattr(output, "hidden_states", None) is not None:
            output.hidden_states = tuple(_cut(h, B, L) for h in output.hidden_states)
        return output

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _bucketing_targets(model: nn.Module) -> list[tuple[nn.Module, nn.Module, bool]]:
    """(module to hook, its Hugging Face model, whether it takes a features dict) for every outermost
    sentence-transformers Transformer or Hugging Face model under ``model``. sentence-transformers calls its
    Hugging Face model's ``forward`` directly (no hooks run there), hence the Transformer module is hooked."""
    from transformers import PreTrainedModel

    found: list[tuple[nn.Module, nn.Module, bool]] = []
    covered: set[int] = set()
    for m in model.modules():
        if id(m) in covered:
            continue
        auto = getattr(m, "auto_model", None)
        if isinstance(auto, PreTrainedModel):
            found.append((m, auto, True))
        elif isinstance(m, PreTrainedModel):
            found.append((m, m, False))
        else:
            continue
        covered.update(id(s) for s in m.modules())
    return found


def _padded_backbones(model: nn.Module, buckets: Sequence[int], max_length: int | None, caller: str):
    """The length buckets capped at ``max_length`` (default: a SentenceTransformer's ``max_seq_length``, else
    the largest bucket), and (module, backbone, takes features, pad id) for every backbone under ``model``, a
    NeoBERT switched to its padded layout (the padding-free one packs the real tokens into a sequence whose
    length changes with every batch, which fixed shapes are there to avoid)."""
    targets = _bucketing_targets(model)
    if not targets:
        raise ValueError(
            f"{caller}: no sentence-transformers Transformer or Hugging Face model in {type(model).__name__}"
        )
    limit = max_length or getattr(model, "max_seq_length", None) or max(buckets)
    out = []
    for module, backbone, features in targets:
        config = backbone.config
        if getattr(config, "model_type", None) == "neobert":
            config.padding_free = False
        pad = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else 0
        out.append((module, backbone, features, pad))
    return length_buckets_for(int(limit), sorted(buckets)), out


def enable_bucketing(
    model: nn.Module, buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS, max_length: int | None = None
) -> list[BucketingHandle]:
    """Bucket the input of every backbone under ``model`` (see :class:`BucketingHandle`); ``buckets`` are capped
    at ``max_length`` and a NeoBERT is switched to its padded layout (:func:`_padded_backbones`)."""
    capped, targets = _padded_backbones(model, buckets, max_length, "enable_bucketing")
    return [BucketingHandle(module, capped, pad, features) for module, _, features, pad in targets]


def graph_key(inputs: dict[str, torch.Tensor]) -> tuple:
    """What a recorded graph is specific to: the inputs' shapes and dtypes, inference mode, and the autocast
    state of their device (a graph recorded under fp16 autocast replays fp16 kernels, asked for or not)."""
    device = next(iter(inputs.values())).device.type
    autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device)
    shapes = tuple((k, *v.shape, v.dtype) for k, v in sorted(inputs.items()))
    return (*shapes, torch.is_inference_mode_enabled(), autocast)


class CudaGraphs:
    """The inference forward of one Hugging Face backbone, recorded as a CUDA graph per bucketed input shape.

    Installed as the backbone's ``forward`` (an instance attribute: parameters, ``state_dict`` and saving are
    unchanged; :meth:`remove` restores the class's). A call is replayed when it is plain token input on CUDA
    without gradients (``input_ids`` and a 2-D ``attention_mask``, no hidden states or attentions asked for);
    anything else (training, CPU, packed or prefix input) runs the eager forward. The input is padded to
    ``(bucket_batch(B), bucket_length(L))`` and the output cut back and copied out of the graph's buffer. A
    backbone whose forward cannot be recorded (it reads the device on the host, as unpadding models do) is
    switched back to eager with a warning on its first shape.
    """

    def __init__(self, backbone: nn.Module, buckets: Sequence[int], pad_token_id: int):
        self.backbone = backbone
        self.buckets = tuple(buckets)
        self.pad_token_id = pad_token_id
        self.eager = backbone.forward  # the class's forward, bound
        self.graphs: dict[tuple, tuple[dict, torch.Tensor, torch.cuda.CUDAGraph]] = {}
        self.replays = 0
        self.failed: str | None = None
        self._pool = None  # one memory pool for every shape: replays never overlap
        self._recorded_with = None
        backbone.forward = self

    def _weights(self) -> tuple:
        """Where the weights live: ``.to()``, ``.half()`` and the like replace every parameter, and a graph
        replays the addresses it was recorded with."""
        first = next(self.backbone.parameters())
        return first.data_ptr(), first.dtype, first.device

    def __call__(self, *args, **kwargs):
        inputs = None if args or self.failed else self._replayable(kwargs)
        if inputs is None:
            return self.eager(*args, **kwargs)
        padded, (B, L) = pad_to_buckets(inputs, self.buckets, self.pad_token_id)
        weights = self._weights()
        if weights != self._recorded_with:  # moved or cast since: the graphs read freed memory
            self.graphs.clear()
            self._pool, self._recorded_with = None, weights
        key = (*graph_key(padded), self.backbone.training)  # dropout is recorded in or out
        if key not in self.graphs:
            recorded = self._record(padded)
            if recorded is None:
                return self.eager(*args, **kwargs)
            self.graphs[key] = recorded
        static_in, static_out, graph = self.graphs[key]
        for name, tensor in padded.items():
            static_in[name].copy_(tensor)
        graph.replay()
        self.replays += 1
        hidden = _cut(static_out, B, L).clone()  # the buffer is the next replay's output
        if kwargs.get("return_dict", getattr(self.backbone.config, "return_dict", True)) is False:
            return (hidden,)
        from transformers.modeling_outputs import BaseModelOutput

        return BaseModelOutput(last_hidden_state=hidden)

    def _replayable(self, kwargs: dict) -> dict | None:
        """The token tensors of a call that a graph can replay, or None."""
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        flags = ("output_hidden_states", "output_attentions")
        if (
            torch.is_grad_enabled()
            or not isinstance(ids, torch.Tensor)
            or ids.device.type != "cuda"
            or not isinstance(mask, torch.Tensor)
            or mask.dim() != 2
            or ids.shape[-1] > self.buckets[-1]
            or any(kwargs.get(f) for f in flags)
            or any(_given(kwargs.get(k)) for k in PASSTHROUGH_KEYS)
            or set(kwargs) - set(PAD_KEYS) - {"return_dict", *flags}
            or torch.cuda.is_current_stream_capturing()
        ):
            return None
        return {k: kwargs[k] for k in PAD_KEYS if isinstance(kwargs.get(k), torch.Tensor)}

    def _record(self, padded: dict):
        """(static inputs, static output, graph) for this shape, or None when the forward cannot be recorded."""
        static_in = {k: v.clone() for k, v in padded.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):  # warm-up off the main stream, as torch.cuda.graph asks
                for _ in range(2):
                    self.eager(**static_in, return_dict=True)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                static_out = self.eager(**static_in, return_dict=True).last_hidden_state
        except RuntimeError as e:
            torch.cuda.synchronize()
            self.failed = f"{type(self.backbone).__name__}'s forward cannot be recorded as a CUDA graph ({e})"
            warnings.warn(f"{self.failed}; it runs eagerly", stacklevel=4)
            return None
        self._pool = graph.pool()
        return static_in, static_out, graph

    def remove(self) -> None:
        """Back to the eager forward; the recorded graphs and their memory are released."""
        self.backbone.__dict__.pop("forward", None)
        self.graphs.clear()
        self._pool = None


def enable_cuda_graphs(
    model: nn.Module, buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS, max_length: int | None = None
) -> list[CudaGraphs]:
    """Replay every backbone under ``model`` from CUDA graphs recorded per length bucket (see :class:`CudaGraphs`).

    ``model`` must be on CUDA; buckets and layout as in :func:`enable_bucketing`."""
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cuda"}:
        raise ValueError(
            f"enable_cuda_graphs: CUDA graphs need the model on a CUDA device, it is on {sorted(devices)}"
        )
    capped, targets = _padded_backbones(model, buckets, max_length, "enable_cuda_graphs")
    return [CudaGraphs(backbone, capped, pad) for _, backbone, _, pad in targets]
