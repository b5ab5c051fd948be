"""Export a sentence-transformers model (NeoBERT or any Hugging Face encoder) to ONNX, fp32 and dynamic int8.

The output is the saved sentence-transformers folder (modules.json, Pooling, Normalize, tokenizer, config,
weights) plus ``onnx/model.onnx`` (and ``onnx/model_qint8_<isa>.onnx``), where sentence-transformers' ONNX
backend looks. The graph maps ``input_ids`` / ``attention_mask`` (and ``token_type_ids`` where the tokenizer
makes them) to ``last_hidden_state`` with dynamic batch and length; Pooling and Normalize run as the saved
modules, as in sentence-transformers' own ONNX export.

Beside it, ``onnx/model_packed.onnx`` (and its int8 twin) is the padding-free form neoembed serves: a padded
batch's real tokens packed into rows, several sequences per row, attention kept within each sequence by a
block-diagonal mask (``neoembed.load(path, backend="onnx", file_name="model_packed.onnx")``). On the real MTEB
sentences of ``benchmarks/serving.py`` half the positions of a length-sorted batch of 32 are padding; packed, the
matrix products see the real tokens. It is written where the model takes ``position_ids`` and a 4-D mask
(checked on a probe batch), which sentence-transformers' ONNX backend never feeds: that backend loads
``model.onnx`` and ``model_qint8_<isa>.onnx``.

NeoBERT is traced in its padded layout (``padding_free=False``): the padding-free layout reads the lengths on
the host, which a static graph cannot do. The exporter is torch's ``torch.export``-based one (``dynamo=True``):
the TorchScript exporter has no ONNX op for the rotary embedding's ``view_as_complex``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from neoembed.cde.model import is_cde_folder
from neoembed.export.cpu import int8_saturates, isa_suffix
from neoembed.export.runtime import DEFAULT_FILE, ONNX_SUBFOLDER, OUTPUT_NAME, PACKED_INPUTS
from neoembed.hub import model_name
from neoembed.loading import load
from neoembed.progress import library_noise
from neoembed.record import readable_weights
from neoembed.runs import TrainingInterrupted
from neoembed.runs.checks import require_module
from neoembed.runs.signals import _FinalSaveSignals, _Signalled

logger = logging.getLogger(__name__)

FORMATS = ("onnx",)
QUANTIZATIONS = ("int8",)
EXPORT_RECORD = "export.json"
PACKED_FILE = "model_packed.onnx"


class ExportFolderError(ValueError):
    """OUT already holds something: an export is written into a new or empty folder, or with ``--overwrite`` over
    a finished export."""


class ExportInterrupted(TrainingInterrupted):
    """SIGINT / SIGTERM during ``neoembed export``: nothing was written to OUT (exit 130 / 143)."""

    label = "export stopped"

    def __init__(self, signal_name: str, out: Path):
        super().__init__(signal_name, None)
        self.args = (
            f"stopped by {signal_name}: no export was written to {out} (it is moved in only when complete); run "
            "the command again",
        )


def staging_folder(out: Path) -> Path:
    """Where an export is written before it is renamed to OUT: a hidden sibling, so a killed export leaves no
    folder at OUT (the next export into OUT removes it)."""
    out = Path(os.path.abspath(out))
    return out.parent / f".{out.name}.export-partial"


def check_output(out: Path, overwrite: bool = False) -> None:
    """Refuse an OUT that holds anything (another export, a model, a run); ``overwrite`` replaces a finished
    export (a folder with ``export.json``, which is written last) and nothing else."""
    if out.exists() and not out.is_dir():
        raise ExportFolderError(f"OUT {out} is a file: choose a new folder")
    if not (out.exists() and any(out.iterdir())):
        return
    finished = (out / EXPORT_RECORD).is_file()
    if overwrite and finished:
        return
    if overwrite:
        raise ExportFolderError(
            f"--overwrite: OUT {out} holds files but no {EXPORT_RECORD}, so it is not a finished neoembed export; "
            "neoembed replaces only its own exports: choose a new folder, or empty this one yourself"
        )
    other = "another export" if finished or (out / ONNX_SUBFOLDER).exists() else "files"
    raise ExportFolderError(
        f"OUT {out} already holds {other}: choose a new or empty folder"
        + (", or pass --overwrite to replace it" if finished else "")
    )


class _Backbone(torch.nn.Module):
    """The Transformer module's model as a function of tensors to the last hidden state."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state


def _input_names(model) -> tuple[str, ...]:
    produced = set(model[0].tokenizer.model_input_names)
    return tuple(n for n in ("input_ids", "attention_mask", "token_type_ids") if n in produced)


def _example(names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(1000, 2000, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    return tuple(given[n] for n in names)


def export_graph(model, path: Path) -> tuple[str, ...]:
    """Write the model's Transformer module as an ONNX graph (dynamic batch and length); returns its inputs."""
    auto = model[0].auto_model.eval()
    names = _input_names(model)
    with _padded_layout(auto):
        _save(_Backbone(auto), _example(names), names, path)
    return names


def export_packed_graph(model, path: Path) -> str | None:
    """Write the padding-free twin of :func:`export_graph`: rows of several sequences each (inputs
    ``PACKED_INPUTS``, see :func:`neoembed.export.runtime.pack_rows`), attention kept within each sequence. Written
    only where the model honours ``position_ids`` and a 4-D attention mask, checked on a probe batch against the
    padded model; returns why not otherwise (None when written)."""
    auto = model[0].auto_model.eval()
    packed = _Packed(auto, "token_type_ids" in _input_names(model))
    with _padded_layout(auto):
        reason = _packed_mismatch(auto, packed, _input_names(model))
        if reason is None:
            _save(packed, _packed_example(auto.config.vocab_size), PACKED_INPUTS, path)
    return reason


class _Packed(torch.nn.Module):
    """The model on packed rows: a block-diagonal mask from ``segment_ids`` (the unused tail, segment 0, attends
    to itself: no row of the mask is empty) and positions restarting at each sequence. Models whose positions
    start after the padding index (RoBERTa and its kin) get that offset."""

    def __init__(self, model: torch.nn.Module, token_types: bool) -> None:
        super().__init__()
        self.model, self.token_types = model, token_types
        padding_idx = getattr(getattr(model, "embeddings", None), "padding_idx", None)
        self.position_offset = 0 if padding_idx is None else padding_idx + 1

    def forward(self, input_ids, position_ids, segment_ids) -> torch.Tensor:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
        extra = {"token_type_ids": torch.zeros_like(input_ids)} if self.token_types else {}
        positions = position_ids + self.position_offset
        return self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, **extra
        ).last_hidden_state


def _packed_example(vocab_size: int) -> tuple[torch.Tensor, ...]:
    """Two rows of 16: one sequence of 16; sequences of 9 and 5 and a tail of 2 (ids within the vocabulary: the
    probe runs the model)."""
    ids = torch.randint(1, vocab_size, (2, 16))
    positions = torch.cat(
        [torch.arange(16), torch.arange(9), torch.arange(5), torch.zeros(2, dtype=torch.long)]
    )
    segments = torch.tensor([1] * 16 + [1] * 9 + [2] * 5 + [0] * 2)
    return ids, positions.view(2, 16), segments.view(2, 16)


def _packed_mismatch(auto, packed: _Packed, names: tuple[str, ...]) -> str | None:
    """None where the packed model gives the padded model's hidden states on the example, else why not."""
    ids, positions, segments = _packed_example(auto.config.vocab_size)
    lengths = [16, 9, 5]
    padded = torch.zeros(3, 16, dtype=torch.long)
    mask = torch.zeros(3, 16, dtype=torch.long)
    pieces = [ids[0], ids[1, :9], ids[1, 9:14]]
    for i, (piece, n) in enumerate(zip(pieces, lengths, strict=True)):
        padded[i, :n], mask[i, :n] = piece, 1
    try:
        with torch.no_grad():
            extra = {"token_type_ids": torch.zeros_like(padded)} if "token_type_ids" in names else {}
            expected = auto(input_ids=padded, attention_mask=mask, **extra).last_hidden_state
            got = packed(ids, positions, segments)
    except Exception as e:  # a model without position_ids or 4-D masks
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    want = torch.cat([expected[i, :n] for i, n in enumerate(lengths)])
    have = torch.cat([got[0], got[1, :14]])
    error = float((want - have).abs().max())
    scale = max(1.0, float(want.abs().max()))
    return None if error <= 1e-4 * scale else f"packed rows differ from the padded batch by {error:.2e}"


class _padded_layout:
    """NeoBERT traced in its padded layout (``padding_free=False``) for the duration of an export."""

    def __init__(self, auto) -> None:
        self.config = auto.config
        self.padding_free = getattr(self.config, "padding_free", None)

    def __enter__(self) -> None:
        if self.padding_free is not None:
            self.config.padding_free = False

    def __exit__(self, *exc) -> None:
        if self.padding_free is not None:
            self.config.padding_free = self.padding_free


def _save(module: torch.nn.Module, example: tuple, names: tuple[str, ...], path: Path) -> None:
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    with torch.no_grad(), library_noise("torch.onnx"):
        program = torch.onnx.export(
            module.eval(),
            example,
            dynamo=True,
            input_names=list(names),
            output_names=[OUTPUT_NAME],
            dynamic_shapes={name: {0: batch, 1: length} for name in names},
            optimize=True,
            verbose=False,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path), external_data=False)


def quantize_int8(src: Path, dst: Path) -> None:
    """ONNX Runtime's dynamic int8 quantization: weights int8 with one scale per output channel, activations
    quantized at run time. sentence-transformers' ``export_dynamic_quantized_onnx_model`` defaults to one scale per
    tensor, which on the quickstart's fine-tuned all-MiniLM-L6-v2 lost 0.7 to 1.9 points on six of the eight local
    tasks; per channel kept every task within 0.5 (``benchmarks/onnx_int8_quality.py``). Weights keep 7 bits
    where the CPU saturates (:func:`int8_saturates`)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with library_noise(""):  # its advice to pre-process, logged on the root logger, is for image models
        quantize_dynamic(
            str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True, reduce_range=int8_saturates()
        )


#: modules whose ``sentence_transformers.models.<Name>`` path every sentence-transformers release resolves: 2 to 5
#: define them there, 6 maps the old paths to its new modules (without a warning, for paths read from a model)
PORTABLE_MODULES = ("Transformer", "Pooling", "Normalize", "Dense")


def portable_module_types(modules_json: Path) -> None:
    """Rewrite ``modules.json`` with the ``sentence_transformers.models.*`` paths: sentence-transformers 6 writes
    paths of its own layout (``sentence_transformers.base.modules.normalize.Normalize``) that 5.x cannot import,
    and its ONNX backend runs only under 5.x (Optimum's ONNX package needs transformers < 4.58)."""
    modules = json.loads(modules_json.read_text())
    for module in modules:
        name = module["type"].rsplit(".", 1)[-1]
        if module["type"].startswith("sentence_transformers.") and name in PORTABLE_MODULES:
            module["type"] = f"sentence_transformers.models.{name}"
    modules_json.write_text(json.dumps(modules, indent=2) + "\n")


def export(
    model_path: str, out: str | Path, fmt: str = "onnx", quantize: str | None = None, overwrite: bool = False
) -> dict[str, Any]:
    """Export MODEL (anything :func:`neoembed.load` opens) to OUT; returns what was written (also in
    ``OUT/export.json``). All or nothing: the export is written into :func:`staging_folder` and renamed to OUT
    when complete (``overwrite``: replacing the finished export there), so an error, a signal or a kill leaves
    OUT as it was. SIGINT / SIGTERM stop it with :class:`ExportInterrupted` (exit 130 / 143)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown --format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(f"unknown --quantize {quantize!r}: choose one of {', '.join(QUANTIZATIONS)}")
    # torch's exporter needs onnx and onnxscript; the int8 pass is onnxruntime's
    for module in ("onnx", "onnxscript") + (("onnxruntime",) if quantize else ()):
        require_module(module, "onnx", "neoembed export" + (f" --quantize {quantize}" if quantize else ""))
    _refuse_cde(Path(model_path))
    _refuse_adapter(Path(model_path))
    name = Path(os.path.abspath(out)).name  # the model card names OUT as given ("." as the folder's name)
    out = Path(os.path.realpath(out))  # "." and a link to a folder are the folder they name
    check_output(out, overwrite)
    staged = staging_folder(out)
    with _FinalSaveSignals() as signals:
        try:
            shutil.rmtree(staged, ignore_errors=True)  # left by a killed export
            # fp32 whatever the folder was saved in: ONNX Runtime's CPU kernels have no bf16 MatMul
            model = load(model_path, device="cpu", dtype="fp32")
            record = _write(model, str(model_path), staged, fmt, quantize, name)
            signals.deferring = True  # a signal now waits until OUT is in place
            _move_in(staged, out)
        except _Signalled as e:
            shutil.rmtree(staged, ignore_errors=True)
            raise ExportInterrupted(e.name, out) from None
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
    if signals.received is not None:
        logger.warning(
            "%s received while the export was moved in: it is complete in %s", signals.received, out
        )
    return record


def _refuse_cde(path: Path) -> None:
    """A CDE folder (its adapters alone too: their modules.json names the same module) is two encoders and a
    per-corpus context: one graph cannot serve it."""
    if is_cde_folder(path):
        raise ValueError(
            f"{path} is a CDE model: neoembed export writes the graph of one encoder, and a CDE model encodes "
            "through two stages and a per-corpus context (docs/cde.md); serve it with neoembed.load"
        )


def _refuse_adapter(path: Path) -> None:
    """A LoRA adapter saved alone is applied to its base model as it loads: saved again, transformers writes the
    adapter alone (and with PEFT older than it wants, fails), so there is no graph of it to write. The merged model
    is what exports, and ``neoembed train`` writes it beside ``adapter/``."""
    if not (path / "adapter_config.json").is_file():
        return
    run = path.resolve().parent
    merged = (run / "modules.json").is_file() and any(run.glob("*.safetensors"))
    where = f": {run} holds it (written beside the adapter)" if merged else ""
    raise ValueError(
        f"{path} is a LoRA adapter saved alone (adapter_config.json), applied to its base model as it loads: "
        f"export the model with the adapter merged into its weights instead{where}"
    )


def _move_in(staged: Path, out: Path) -> None:
    """Move the finished export into OUT. A new OUT is the staged folder renamed; an existing one (empty, or a
    finished export under ``--overwrite``) is filled in place, since it may be the working directory or a link's
    target, which a rename would leave behind: its old entries are moved aside with ``export.json`` first, the
    new ones in with it last, so a kill between leaves no folder that passes for a finished export."""
    readable_weights(staged)
    if not out.is_dir():
        staged.rename(out)
        return
    aside = out.parent / f".{out.name}.export-old"
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir()
    first = sorted(out.iterdir(), key=lambda p: p.name != EXPORT_RECORD)
    for entry in first:
        entry.rename(aside / entry.name)
    for entry in sorted(staged.iterdir(), key=lambda p: p.name == EXPORT_RECORD):
        entry.rename(out / entry.name)
    staged.rmdir()
    shutil.rmtree(aside, ignore_errors=True)


def _write(model, model_path: str, out: Path, fmt: str, quantize: str | None, name: str) -> dict[str, Any]:
    if getattr(model[0], "auto_model", None) is None:
        raise ValueError(
            f"neoembed export writes the graph of a model whose first module is a transformer; {model_path}'s "
            f"is {type(model[0]).__name__}"
        )
    model.save(str(out), model_name=name)  # the card's loading code names OUT, not the staging folder
    portable_module_types(out / "modules.json")
    graph = out / ONNX_SUBFOLDER / DEFAULT_FILE
    logger.info("export: tracing %s (padded batches) ...", graph.name)  # each stage: seconds to minutes
    names = export_graph(model, graph)
    packed = graph.with_name(PACKED_FILE)
    logger.info("export: tracing %s (packed rows) ...", packed.name)
    not_packed = export_packed_graph(model, packed)
    graphs = [graph] if not_packed else [graph, packed]
    if quantize == "int8":
        for src in list(graphs):
            dst = src.with_name(f"{src.stem}_qint8_{isa_suffix()}.onnx")
            logger.info("export: quantizing %s to %s ...", src.name, dst.name)
            quantize_int8(src, dst)
            graphs.append(dst)
    record = {
        "model": model_name(model_path),  # the packaged copy by name, not a path of this machine
        "format": fmt,
        "quantize": quantize,
        "inputs": names,
        "files": [f"{ONNX_SUBFOLDER}/{g.name}" for g in graphs],
        "packed": not_packed is None,
    }
    if quantize == "int8":
        record["int8_weight_bits"] = 7 if int8_saturates() else 8
    if not_packed:
        record["packed_not_written"] = not_packed
    (out / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record
