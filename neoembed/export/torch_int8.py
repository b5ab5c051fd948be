"""Dynamic int8 in torch: ``neoembed.load(path, quantize="int8")``, CPU serving without an export.

Every ``nn.Linear`` of the encoder becomes a dynamic int8 layer on PyTorch's quantized kernels (FBGEMM on x86):
int8 weights with one scale per output channel, the activations quantized to uint8 at each call over the rows it
gets. NeoBERT keeps its padding-free forward, so only real tokens are multiplied (the ONNX graphs get there only
packed, ``model_packed_qint8_<isa>.onnx``).

The scheme is the ONNX export's, so the two score alike: 8-bit activations, and 7-bit weights where the CPU's
``uint8 x int8`` products saturate (:func:`~neoembed.export.cpu.int8_saturates`), 8 bits elsewhere. PyTorch's own
dynamic layer does the reverse, 7-bit activations (``reduce_range=True``) and 8-bit weights: on real sentences
its distance to fp32 is at least 1.5 times this scheme's, which matches the ONNX int8 graph's
(``tests/test_export.py::test_torch_int8_as_close_to_fp32_as_the_onnx_int8_graph``).

It is PyTorch's eager quantization (``torch.ao.quantization.quantize_dynamic``), which PyTorch has marked for
migration to torchao; the ONNX int8 graphs are the export that does not depend on it.
"""

from __future__ import annotations

import warnings

import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

from neoembed.export.cpu import int8_saturates

__all__ = ["QUANTIZE", "Int8Linear", "quantize_int8"]

QUANTIZE = ("int8",)


class Int8Linear(DynamicQuantizedLinear):
    """PyTorch's dynamic int8 linear layer with full 8-bit activations (its own keeps 7); the weights' range is the
    quantization config's (7 bits where products saturate)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed_params._packed_params
        return torch.ops.quantized.linear_dynamic(x, packed, reduce_range=False).to(x.dtype)

    def _get_name(self) -> str:
        return "Int8Linear"


def _qconfig():
    from torch.ao.quantization import PerChannelMinMaxObserver, QConfig
    from torch.ao.quantization.observer import default_dynamic_quant_observer

    top = 64 if int8_saturates() else 128
    weight = PerChannelMinMaxObserver.with_args(
        dtype=torch.qint8, qscheme=torch.per_channel_symmetric, quant_min=-top, quant_max=top - 1
    )
    return QConfig(activation=default_dynamic_quant_observer, weight=weight)


def _encoder(model) -> torch.nn.Module:
    first = model[0] if len(model) else None
    encoder = getattr(first, "model", None) or getattr(first, "auto_model", None)
    if not isinstance(encoder, torch.nn.Module):
        raise ValueError(
            f"quantize='int8' needs a Transformer module first in the model; it starts with {type(first).__name__}"
        )
    return encoder


def quantize_int8(model):
    """Replace the linear layers of ``model[0]``'s transformer with :class:`Int8Linear`, in place; returns
    ``model``. LoRA adapters are merged first (an int8 model serves, it does not train). CPU only."""
    from neoembed.adapters import merge_lora

    if model.device.type != "cpu":
        raise ValueError(
            f"quantize='int8' runs on CPU (PyTorch's dynamic int8 kernels); the model is on {model.device}"
        )
    if any(type(m).__module__.startswith("peft.") for m in model.modules()):  # however it was applied
        merge_lora(model)
    encoder = _encoder(model)
    if not any(type(m) is torch.nn.Linear for m in encoder.modules()):
        raise ValueError(f"quantize='int8': {type(encoder).__name__} has no nn.Linear layer to quantize")
    if "x86" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "x86"
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        # PyTorch's notices about its eager quantization's future (see the module docstring), once per layer
        warnings.filterwarnings("ignore", message=r".*quantiz.*deprecated", category=UserWarning)
        warnings.filterwarnings(
            "ignore", message=r"torch\.ao\.quantization is deprecated", category=DeprecationWarning
        )
        quantize_dynamic(
            encoder.eval(),
            {torch.nn.Linear: _qconfig()},
            mapping={torch.nn.Linear: Int8Linear},
            inplace=True,
        )
    return model
