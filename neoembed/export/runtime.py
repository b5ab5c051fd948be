"""Serving an exported ONNX graph through sentence-transformers, without Optimum.

``SentenceTransformer(path, backend="onnx")`` reaches ONNX Runtime through Optimum's ``ORTModel``; Optimum's
ONNX package (``optimum-onnx`` 0.1) requires ``transformers<4.58`` and does not import under transformers 5, and
it knows no ``neobert`` architecture. :class:`OnnxTransformer` is sentence-transformers' own ``Transformer``
module (tokenizer, ``max_seq_length``, the saved config) whose model is an ONNX Runtime session over the file
sentence-transformers would load (``onnx/model.onnx`` or ``model_kwargs={"file_name": ...}``); Pooling and
Normalize stay the folder's own modules, as with sentence-transformers' ONNX backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from sentence_transformers.base.modules import Transformer

import neoembed.modeling  # noqa: F401  (registers NeoBERT with the Auto classes: the folder's config loads)
from neoembed.sentence import EmbeddingModel

ONNX_SUBFOLDER = "onnx"
DEFAULT_FILE = "model.onnx"
OUTPUT_NAME = "last_hidden_state"
# the ``type`` strings sentence-transformers writes (or has written) in ``modules.json`` for its Transformer
TRANSFORMER_TYPES = (
    "sentence_transformers.models.Transformer",
    "sentence_transformers.base.modules.Transformer",
    "sentence_transformers.base.modules.transformer.Transformer",
    "sentence_transformers.sentence_transformer.modules.Transformer",
)


def onnx_file(folder: str | Path, file_name: str | None = None) -> Path:
    """The ONNX file of an exported folder: ``onnx/<file_name>`` (``onnx/model.onnx`` by default)."""
    name = file_name or DEFAULT_FILE
    root = Path(folder)
    for candidate in (root / name, root / ONNX_SUBFOLDER / Path(name).name):
        if candidate.is_file():
            return candidate
    found = sorted(p.name for p in (root / ONNX_SUBFOLDER).glob("*.onnx"))
    raise FileNotFoundError(
        f"{root / ONNX_SUBFOLDER / name} does not exist; the folder's ONNX files are {found or 'none'}: "
        "pass one of them as model_kwargs={'file_name': ...}, or export with `neoembed export`"
    )


def session_options(threads: int | None = None):
    """ONNX Runtime options: as many intra-op threads as torch uses (the caller's setting), all graph
    optimizations on, and no spin-waiting between runs: idle ORT threads that spin take the cores from torch (or
    another session) in the same process."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class OrtEncoder(torch.nn.Module):
    """An ONNX Runtime session behind the interface sentence-transformers' Transformer calls: ``forward`` takes
    the tokenizer's tensors and returns ``{"last_hidden_state": (B, L, D)}``."""

    def __init__(self, path: Path, config: Any, provider: str | None = None) -> None:
        super().__init__()
        import onnxruntime as ort

        providers = [provider] if provider else ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(path), session_options(), providers=providers)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.config = config
        self.path = path

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> dict[str, torch.Tensor]:
        given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        feed = {}
        for name in self.input_names:
            value = given.get(name)
            if value is None and name == "token_type_ids":
                value = torch.zeros_like(input_ids)
            feed[name] = np.ascontiguousarray(value.detach().cpu().numpy().astype(np.int64))
        hidden = self.session.run([OUTPUT_NAME], feed)[0]
        return {OUTPUT_NAME: torch.from_numpy(hidden)}


class OnnxTransformer(Transformer):
    """sentence-transformers' Transformer whose ``backend="onnx"`` runs the exported graph in ONNX Runtime
    directly (see the module docstring for why not through Optimum)."""

    def _load_model(
        self, model_name_or_path, transformer_task, config, backend, is_peft_model, **model_kwargs
    ):
        if backend != "onnx":
            return super()._load_model(
                model_name_or_path, transformer_task, config, backend, is_peft_model, **model_kwargs
            )
        path = onnx_file(model_name_or_path, model_kwargs.get("file_name"))
        return OrtEncoder(path, config, model_kwargs.get("provider"))


def onnx_module_classes() -> dict[str, type]:
    """``modules.json`` types mapped to :class:`OnnxTransformer`, for sentence-transformers' module loading."""
    return dict.fromkeys(TRANSFORMER_TYPES, OnnxTransformer)


class OnnxEmbeddingModel(EmbeddingModel):
    """An :class:`~neoembed.sentence.EmbeddingModel` whose Transformer module is :class:`OnnxTransformer`."""

    _module_classes = onnx_module_classes()


def load_onnx(
    path: str | Path, file_name: str | None = None, prompts: dict[str, str] | None = None
) -> OnnxEmbeddingModel:
    """An exported folder (``neoembed export``) served by ONNX Runtime: ``file_name`` picks the graph in
    ``onnx/`` (``model.onnx``, ``model_qint8_<isa>.onnx``)."""
    onnx_file(path, file_name)  # a missing file fails here, naming the folder's graphs
    model_kwargs = {"file_name": file_name} if file_name else None
    model = OnnxEmbeddingModel(str(path), device="cpu", backend="onnx", model_kwargs=model_kwargs)
    if prompts:
        model.prompts = {**model.prompts, **prompts}
    return model
