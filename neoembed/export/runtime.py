"""Serving an exported ONNX graph through sentence-transformers, without Optimum.

``SentenceTransformer(path, backend="onnx")`` reaches ONNX Runtime through Optimum's ``ORTModel``; Optimum's
ONNX package (``optimum-onnx`` 0.1) requires ``transformers<4.58`` and does not import under transformers 5, and
it knows no ``neobert`` architecture. :class:`OnnxTransformer` is sentence-transformers' own ``Transformer``
module (tokenizer, ``max_seq_length``, the saved config) whose model is an ONNX Runtime session over the file
sentence-transformers would load (``onnx/model.onnx`` or ``model_kwargs={"file_name": ...}``); Pooling and
Normalize stay the folder's own modules, as with sentence-transformers' ONNX backend.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sentence_transformers.base.modules import Transformer

import neoembed.modeling  # noqa: F401  (registers NeoBERT with the Auto classes: the folder's config loads)
from neoembed.runs.checks import require_module
from neoembed.sentence import EmbeddingModel

ONNX_SUBFOLDER = "onnx"
DEFAULT_FILE = "model.onnx"
OUTPUT_NAME = "last_hidden_state"
# the inputs of a packed graph (``neoembed export`` writes ``onnx/model_packed*.onnx``): rows holding several
# sequences each, ``segment_ids`` 1, 2, … per sequence of a row and 0 on the row's unused tail
PACKED_INPUTS = ("input_ids", "position_ids", "segment_ids")
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
    # by the names alone: a hub cache snapshot's files are links into its blobs/ folder and belong to it
    if Path(name).is_absolute() or ".." in Path(os.path.normpath(name)).parts:
        # another folder's graph would run on this folder's tokenizer and pooling: a wrong width, or wrong vectors
        raise ValueError(
            f"file_name={name!r} is not a file of {root}: name a graph of its {ONNX_SUBFOLDER}/ folder (such as "
            f"{DEFAULT_FILE!r}), or load the folder that holds {name}"
        )
    for candidate in (root / name, root / ONNX_SUBFOLDER / Path(name).name):
        if candidate.is_file():
            return candidate
    found = sorted(p.name for p in (root / ONNX_SUBFOLDER).glob("*.onnx"))
    if not found and (root / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{root} is a LoRA adapter saved alone, which has no graph of its own: export the model with the "
            f"adapter merged (neoembed train writes it beside {root.name}/: neoembed export {root.resolve().parent} "
            "OUT), then load OUT with backend='onnx'"
        )
    if not found:
        from neoembed.hub import model_name

        named = model_name(str(root))  # the packaged copy by its name, not the folder it is installed in
        raise FileNotFoundError(
            f"{named} holds no ONNX export ({ONNX_SUBFOLDER}/{name} does not exist there): export it first "
            f"(neoembed export {named} OUT), then load OUT with backend='onnx'"
        )
    raise FileNotFoundError(
        f"{root / ONNX_SUBFOLDER / name} does not exist; the folder's ONNX files are {found}: "
        "name one of them (--onnx-file NAME on the command line; file_name=NAME in neoembed.load; "
        "model_kwargs={'file_name': NAME} in sentence-transformers)"
    )


def session_options(threads: int | None = None):
    """ONNX Runtime options: as many intra-op threads as torch uses (the caller's setting), all graph
    optimizations on, and threads that spin-wait between the ops of a run but stop when the run returns
    (``session.force_spinning_stop``): small batches are short runs of many small ops, where waking sleeping
    threads for each op costs, and threads left spinning after a run take the cores from torch (or another
    session) in the same process."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


def pack_rows(
    input_ids: np.ndarray, attention_mask: np.ndarray
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """A padded batch's real tokens laid into rows of the batch's own length, longest sequence first, each into the
    first row with room (first-fit decreasing): the packed graph's feed, and for every real token its flat index
    in the ``(B, L)`` grid and in the ``(R, L)`` rows. A sequence keeps its tokens in order, positions 0, 1, …"""
    batch, length = input_ids.shape
    mask = attention_mask.astype(bool)
    lengths = mask.sum(1)
    row_of, start_of, segment_of = (np.empty(batch, np.int64) for _ in range(3))
    free: list[int] = []  # room left in each row
    count: list[int] = []  # sequences in each row: a sequence's segment id is its rank in its row, from 1
    for i in np.argsort(-lengths, kind="stable"):
        row = next((r for r, room in enumerate(free) if room >= lengths[i]), len(free))
        if row == len(free):
            free.append(length)
            count.append(0)
        row_of[i], start_of[i] = row, length - free[row]
        free[row] -= lengths[i]
        count[row] += 1
        segment_of[i] = count[row]
    within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    src = np.flatnonzero(mask)  # row-major: sequence by sequence, each in order
    dst = np.repeat(row_of * length + start_of, lengths) + within
    feed = {name: np.zeros((len(free), length), np.int64) for name in PACKED_INPUTS}
    feed["input_ids"].flat[dst] = input_ids.flat[src]
    feed["position_ids"].flat[dst] = within
    feed["segment_ids"].flat[dst] = np.repeat(segment_of, lengths)
    return feed, src, dst


class OrtEncoder(torch.nn.Module):
    """An ONNX Runtime session behind the interface sentence-transformers' Transformer calls: ``forward`` takes
    the tokenizer's tensors and returns ``{"last_hidden_state": (B, L, D)}``. A packed graph (inputs
    :data:`PACKED_INPUTS`) gets the batch's real tokens packed into rows (:func:`pack_rows`), and its output is laid
    back into the padded grid, zeros at padding."""

    def __init__(self, path: Path, config: Any, provider: str | None = None) -> None:
        super().__init__()
        import onnxruntime as ort

        providers = [provider] if provider else ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(path), session_options(), providers=providers)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.packed = set(self.input_names) == set(PACKED_INPUTS)
        self.config = config
        self.path = path

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> dict[str, torch.Tensor]:
        if self.packed:
            return {OUTPUT_NAME: self._run_packed(input_ids.cpu().numpy(), attention_mask.cpu().numpy())}
        given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        feed = {}
        for name in self.input_names:
            value = given.get(name)
            if value is None and name == "token_type_ids":
                value = torch.zeros_like(input_ids)
            feed[name] = np.ascontiguousarray(value.detach().cpu().numpy().astype(np.int64))
        hidden = self.session.run([OUTPUT_NAME], feed)[0]
        return {OUTPUT_NAME: torch.from_numpy(hidden)}

    def _run_packed(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> torch.Tensor:
        feed, src, dst = pack_rows(input_ids, attention_mask)
        hidden = self.session.run([OUTPUT_NAME], feed)[0]
        out = np.zeros((input_ids.size, hidden.shape[-1]), hidden.dtype)
        out[src] = hidden.reshape(-1, hidden.shape[-1])[dst]
        return torch.from_numpy(out.reshape(*input_ids.shape, -1))


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
    require_module("onnxruntime", "onnx", "backend='onnx'")
    onnx_file(path, file_name)  # a missing file fails here, naming the folder's graphs
    model_kwargs = {"file_name": file_name} if file_name else None
    model = OnnxEmbeddingModel(str(path), device="cpu", backend="onnx", model_kwargs=model_kwargs)
    if prompts:
        model.prompts = {**model.prompts, **prompts}
    return model
