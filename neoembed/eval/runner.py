"""Run mteb tasks on a model: hub or local data, the paper's instructions as prompts, fp16/bf16/fp32, robust runs.

Each finished task writes ``OUTPUT/<task>.json`` (atomically): main score, every metric mteb reports, wall
time, precision and instruction set. mteb's own per-task JSON goes to ``OUTPUT/mteb/``. Tasks already present
are skipped unless ``overwrite``; a failing task is logged and the others still run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from neoembed.eval.cde import task_context
from neoembed.eval.local_data import LocalDataError, is_data_file, point_task_at
from neoembed.eval.task_cards import (
    CARD_FILE,
    DATASET_CARD_FILE,
    build_card_task,
    dataset_card_task,
    load_task_card,
)
from neoembed.instructions import (
    DEFAULT_INSTRUCTION_SET,
    DEFAULT_TEMPLATE,
    load_instruction_set,
    paper_type_instruction,
    task_prompts,
)
from neoembed.record import atomic_write_text, write_run_record
from neoembed.runs import claim_results_dir

__all__ = ["EvalConfig", "EvalReport", "resolve_tasks", "run_mteb", "task_folders"]

logger = logging.getLogger(__name__)
PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}
EMBEDDING_PRECISIONS = ("fp32", "int8", "binary")


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


@dataclass
class EvalReport:
    scores: dict[str, dict] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


class _Unresolvable:
    """Stands in for a task folder that could not be turned into a task; fails when run."""

    def __init__(self, name: str, error: Exception):
        from types import SimpleNamespace

        self.metadata = SimpleNamespace(name=name, type="?", main_score=None)
        self.error = error


def _task_from_dir(name: str, folder: Path):
    """A task folder: its task card, else its dataset card (an mteb task's data or a task of its type), else
    the data of the mteb task the folder is named after."""
    import mteb

    if (folder / CARD_FILE).is_file():
        card, data = load_task_card(folder)
        return build_card_task(card, data), card.instruction
    card = None
    if (folder / DATASET_CARD_FILE).is_file():
        mteb_name, card = dataset_card_task(folder)
        if mteb_name is None:
            return build_card_task(card, folder.resolve()), card.instruction
        name = mteb_name
    try:
        task = mteb.get_task(name)
    except Exception as e:  # mteb raises KeyError/ValueError for unknown names
        raise LocalDataError(
            f"{folder}: {name!r} is not an mteb task name, and the folder has no {CARD_FILE} task card "
            f"(or {DATASET_CARD_FILE} dataset card) saying what task it holds ({e})"
        ) from None
    task = point_task_at(task, folder)
    if card is None or task.metadata.type != card.type:
        return task, None
    try:  # mteb's loader expects the hub dataset's own columns; the folder may hold its card's layout
        task.load_data()
    except Exception as e:
        logger.warning(
            "%s: mteb's loader for %s does not read this folder (%s: %s); reading it as a %s task in the "
            "layout of its %s, with the task's splits and main score",
            folder,
            name,
            type(e).__name__,
            e,
            card.type,
            DATASET_CARD_FILE,
        )
        update = {"eval_splits": list(task.metadata.eval_splits), "main_score": task.metadata.main_score}
        if card.type == "STS":
            update["score_range"] = (getattr(task, "min_score", 0.0), getattr(task, "max_score", 5.0))
        return build_card_task(card.model_copy(update=update), folder.resolve()), card.instruction
    return task, None


def _is_group(folder: Path) -> bool:
    """Whether ``folder`` holds task folders (each with its own card) rather than one task's files."""
    if any((folder / f).is_file() for f in (CARD_FILE, DATASET_CARD_FILE, "README.md")):
        return False
    if any(p.is_file() and is_data_file(p) for p in folder.iterdir()):
        return False
    subfolders = [p for p in folder.iterdir() if p.is_dir()]
    return any(
        (p / CARD_FILE).is_file() or (p / DATASET_CARD_FILE).is_file() or _is_group(p) for p in subfolders
    )


def _find_task_folders(data_dir: Path, skip: bool):
    for folder in sorted(p for p in data_dir.iterdir() if p.is_dir()):
        if _is_group(folder):
            yield from _find_task_folders(folder, skip)
            continue
        if skip and (folder / DATASET_CARD_FILE).is_file() and not (folder / CARD_FILE).is_file():
            try:
                dataset_card_task(folder)
            except LocalDataError as e:  # training data, say: not a task to run
                logger.warning("skipped %s: %s", folder, e)
                continue
        yield folder


def task_folders(data_dir: str | Path, skip_non_tasks: bool = True) -> dict[str, Path]:
    """Task name -> folder under ``data_dir``: its sub-folders that hold a task, and those of sub-folders that only
    group tasks (``data/mteb/STS13``, ``data/eval/MSRP``). Folders whose dataset card describes something other
    than an evaluation task (training pairs) are skipped with a warning, unless ``skip_non_tasks`` is False."""
    found: dict[str, Path] = {}
    for folder in _find_task_folders(Path(data_dir), skip_non_tasks):
        if folder.name in found:
            raise LocalDataError(
                f"two task folders are named {folder.name}: {found[folder.name]} and {folder}"
            )
        found[folder.name] = folder
    return found


def resolve_tasks(cfg: EvalConfig) -> list[tuple[object, str | None]]:
    """(mteb task, card instruction or None) for the run; with a data dir, tasks come from its folders."""
    import mteb

    out = []
    if cfg.data_dir is not None:
        data_dir = Path(cfg.data_dir)
        if not data_dir.is_dir():
            raise LocalDataError(f"--data-dir {data_dir} does not exist")
        found = task_folders(
            data_dir, skip_non_tasks=not cfg.tasks
        )  # a task asked for by name is never skipped
        names = cfg.tasks or list(found)
        if not names:
            raise LocalDataError(
                f"--data-dir {data_dir} has no task folders (one folder per task, named after it)"
            )
        for name in names:
            folder = found.get(name, data_dir / name)
            if not folder.is_dir():
                raise LocalDataError(
                    f"task {name}: expected its data in {folder} (split files such as test.jsonl.gz, config "
                    f"folders such as corpus/ queries/ qrels/, or a {CARD_FILE} task card)"
                )
            try:
                out.append(_task_from_dir(name, folder))
            except (LocalDataError, ValueError) as e:  # unusable folder: a failed task, not a failed run
                out.append((_Unresolvable(name, e), None))
    else:
        for spec in cfg.tasks or []:
            p = Path(spec)
            if p.suffix in (".yaml", ".yml") and p.name != DATASET_CARD_FILE:
                card, data = load_task_card(p)
                out.append((build_card_task(card, data), card.instruction))
            elif p.is_dir() or p.name == DATASET_CARD_FILE:
                folder = p if p.is_dir() else p.parent
                out.append(_task_from_dir(folder.name, folder))
        names = [
            t for t in cfg.tasks or [] if Path(t).suffix not in (".yaml", ".yml") and not Path(t).is_dir()
        ]
        if names or not cfg.tasks:
            bench = mteb.get_benchmark(cfg.benchmark or "MTEB(eng, v1)") if not names else None
            selected = mteb.get_tasks(tasks=names) if names else list(bench.tasks)
            out.extend((t, None) for t in selected)
    if cfg.task_types:
        wanted = set(cfg.task_types)
        out = [(t, i) for t, i in out if t.metadata.type in wanted or isinstance(t, _Unresolvable)]
    return out


def _is_registered(name: str) -> bool:
    import mteb

    try:
        mteb.get_task(name)
    except Exception:  # unknown to mteb: a local task card
        return False
    return True


def _is_cde(model) -> bool:
    from neoembed.cde.model import ContextualSentenceTransformer

    return isinstance(model, ContextualSentenceTransformer)


def _load_model(cfg: EvalConfig):
    from neoembed.loading import load

    if cfg.backend == "onnx":
        model = load(cfg.model, truncate_dim=cfg.truncate_dim, backend="onnx", file_name=cfg.onnx_file)
    else:
        device = cfg.device or ("cpu" if cfg.quantize else None)  # int8 kernels are CPU ones
        model = load(cfg.model, device=device, truncate_dim=cfg.truncate_dim, quantize=cfg.quantize)
    if cfg.max_length:
        model.max_seq_length = cfg.max_length
    return model


def _precision(cfg: EvalConfig, device: str) -> str:
    if cfg.precision:
        if cfg.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {cfg.precision!r}; valid: {list(PRECISIONS)}")
        return cfg.precision
    return "fp16" if device.startswith("cuda") else "fp32"


def _autocast(precision: str, device: str):
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu", dtype=dtype)


def _task_result_dict(result) -> dict:
    for attr in ("to_dict", "model_dump"):
        if hasattr(result, attr):
            return json.loads(json.dumps(getattr(result, attr)(), default=str))
    return {}


def _task_context(cfg: EvalConfig, model, task, output: Path):
    """A CDE model's context for ``task`` ("null" or a seeded corpus sample); None for other models."""
    if not _is_cde(model):
        return None
    if cfg.cde_context == "null":
        return "null"
    return task_context(model, task, cfg.seed, output / "cde_context", str(cfg.model))


def _mteb_wrapper(model, prompts: dict[str, str], context, precision: str = "fp32", max_batch_tokens=None):
    """mteb's sentence-transformers wrapper for one task, encoding under ``precision``'s autocast while
    similarities and metrics stay in float32 (an autocast around the whole evaluation would also run
    ``model.similarity``'s matmul in float16, reordering near-tied neighbours). With a CDE ``context``, every
    encode call of this task carries it as ``dataset_embeddings`` (nothing is left on the model). With
    ``max_batch_tokens``, every encode call fills its batches to that many tokens (:mod:`neoembed.batching`)."""
    from mteb.models import SentenceTransformerEncoderWrapper

    class _Wrapper(SentenceTransformerEncoderWrapper):
        def encode(self, inputs, **kwargs):
            if context is not None:
                kwargs["dataset_embeddings"] = context
            if max_batch_tokens is not None:
                kwargs["max_batch_tokens"] = max_batch_tokens
            with _autocast(precision, str(model.device)):
                return super().encode(inputs, **kwargs)

    with warnings.catch_warnings():  # mteb nags when a model has no generic query/document prompts
        warnings.simplefilter("ignore", UserWarning)
        return _Wrapper(model, model_prompts=prompts)


def _compressed(wrapper, embedding_precision: str):
    """mteb's CompressionWrapper around ``wrapper`` for int8 / binary embeddings (fp32: the wrapper as is).

    int8 maps each dimension to 256 levels between the ranges seen on the task's embeddings; binary keeps the
    sign bits (mteb scores them with Hamming-equivalent similarities)."""
    if embedding_precision == "fp32":
        return wrapper
    from mteb.models import CompressionWrapper
    from mteb.types import OutputDType

    dtype = OutputDType.INT8 if embedding_precision == "int8" else OutputDType.BINARY
    return CompressionWrapper(wrapper, dtype)


def _rescores(cfg: EvalConfig, task) -> bool:
    """Whether ``task`` runs with rescoring: asked for, and a task type with a search to rescore."""
    from neoembed.eval.rescore import RESCORE_TYPES

    return bool(cfg.rescore) and task.metadata.type in RESCORE_TYPES


def _rescore_fields(cfg: EvalConfig, task) -> dict:
    """What a task's result says of rescoring (``rescore``: the run's setting, the same for every task)."""
    from neoembed.eval.rescore import rescore_label

    fields = {"rescore": rescore_label(cfg.rescore, cfg.rescore_docs)}
    if cfg.rescore:
        fields |= {
            "rescore_multiplier": cfg.rescore,
            "rescore_docs": cfg.rescore_docs,
            "rescore_applied": _rescores(cfg, task),
        }
    return fields


def _evaluate_task(cfg: EvalConfig, model, task, prompts: dict, precision: str, output: Path):
    """(mteb's task result, main score) of one task; raises when the task cannot run or scores NaN."""
    import mteb
    from mteb.cache import ResultCache

    if isinstance(task, _Unresolvable):
        raise task.error
    from neoembed.batching import default_max_batch_tokens

    tokens = cfg.max_batch_tokens or default_max_batch_tokens(model.device, model.max_seq_length)
    wrapper = _mteb_wrapper(model, prompts, _task_context(cfg, model, task, output), precision, tokens)
    if _rescores(cfg, task):
        from neoembed.eval.rescore import rescoring_search_model

        wrapper = rescoring_search_model(wrapper, cfg.embedding_precision, cfg.rescore, cfg.rescore_docs)
    else:
        wrapper = _compressed(wrapper, cfg.embedding_precision)
    with torch.inference_mode():
        result = mteb.evaluate(
            wrapper,
            task,
            cache=ResultCache(output / "mteb"),
            overwrite_strategy="always",
            encode_kwargs={"batch_size": cfg.batch_size},
            show_progress_bar=sys.stderr.isatty(),  # encoding bars' redraws are noise in a log
        )
    task_result = result.task_results[0]
    score = float(task_result.get_score())
    if score != score:  # NaN
        raise FloatingPointError("the main score is NaN: the model produced non-finite embeddings")
    return task_result, score


def _check_rescore(cfg: EvalConfig) -> None:
    from neoembed.quantization import RESCORE_DOCS

    if cfg.rescore is None:
        return
    if cfg.rescore < 1:
        raise ValueError(f"rescore {cfg.rescore}: the multiplier is 1 or more (candidates = N x 10)")
    if cfg.embedding_precision == "fp32":
        raise ValueError(
            "rescore needs quantized documents: add --embedding-precision int8 or binary (fp32 has nothing to rescore)"
        )
    if cfg.rescore_docs not in RESCORE_DOCS:
        raise ValueError(f"rescore_docs {cfg.rescore_docs!r}: choose one of {', '.join(RESCORE_DOCS)}")


def backend_label(cfg: EvalConfig) -> str:
    """How the model ran: ``torch`` (``torch:int8`` quantized), or ``onnx:<graph file>`` (an int8 graph scores
    differently from fp32)."""
    if cfg.backend == "torch":
        return f"torch:{cfg.quantize}" if cfg.quantize else "torch"
    return f"onnx:{cfg.onnx_file or 'model.onnx'}"


def _record_extra(cfg: EvalConfig, label: str, precision: str, device: str) -> dict:
    """The run record's own fields; a bad ``embedding_precision`` fails here, before any task runs."""
    if cfg.embedding_precision not in EMBEDDING_PRECISIONS:
        raise ValueError(
            f"embedding_precision {cfg.embedding_precision!r}: choose one of {', '.join(EMBEDDING_PRECISIONS)}"
        )
    _check_rescore(cfg)
    return {
        "instructions": label,
        "precision": precision,
        "backend": backend_label(cfg),
        "embedding_precision": cfg.embedding_precision,
        "rescore": cfg.rescore,
        "rescore_docs": cfg.rescore_docs if cfg.rescore else None,
        "device": device,
        "tasks": [],
    }


def run_mteb(cfg: EvalConfig, model=None) -> EvalReport:
    """Evaluate ``cfg.model`` (or an already loaded ``model``) on the configured tasks."""
    from neoembed.progress import bar as progress_bar
    from neoembed.recipe import seed_everything

    seed_everything(cfg.seed)
    output = Path(cfg.output)
    claim_results_dir(output, str(cfg.model), cfg.overwrite)  # one model's scores per folder, never a mix
    label, instruction_map = load_instruction_set(cfg.instructions)
    tasks = resolve_tasks(cfg)
    if tasks and all(isinstance(t, _Unresolvable) for t, _ in tasks):  # nothing to run: bad input, exit 2
        raise tasks[0][0].error
    model = model if model is not None else _load_model(cfg)
    device = str(model.device)
    precision = _precision(cfg, device)
    if precision != "fp32" and not device.startswith("cuda"):
        logger.warning(
            "running %s autocast on CPU (slow); the paper's fp16 evaluation ran on GPUs", precision
        )
    report = EvalReport()
    if cfg.cde_context not in ("corpus", "null"):
        raise ValueError(f"cde_context must be 'corpus' or 'null', got {cfg.cde_context!r}")
    record_extra = _record_extra(cfg, label, precision, device)
    if cfg.truncate_dim is not None:
        record_extra["truncate_dim"] = cfg.truncate_dim
    if _is_cde(model):
        record_extra["cde_context"] = cfg.cde_context
        record_extra["cde_n_context"] = model.n_context
    for task, card_instruction in progress_bar(tasks, desc="mteb tasks", unit="task"):
        name, ttype = task.metadata.name, task.metadata.type
        target = output / f"{name}.json"
        if target.is_file() and not cfg.overwrite:
            report.skipped.append(name)
            continue
        instruction = None if label == "none" else instruction_map.get(name, card_instruction)
        if instruction is None:
            instruction = paper_type_instruction(ttype, label)
        prompts = task_prompts(name, ttype, instruction, cfg.template, registered=_is_registered(name))
        t0 = time.perf_counter()
        try:
            task_result, score = _evaluate_task(cfg, model, task, prompts, precision, output)
        except Exception as e:
            logger.error("task %s failed: %s", name, e)
            report.failed[name] = f"{type(e).__name__}: {e}"
            (output / "failures").mkdir(exist_ok=True)
            atomic_write_text(output / "failures" / f"{name}.txt", traceback.format_exc())
            continue
        entry = {
            "task": name,
            "type": ttype,
            "main_score_name": task.metadata.main_score,
            "main_score": score,
            "wall_time_s": round(time.perf_counter() - t0, 3),
            "precision": precision,
            "backend": backend_label(cfg),
            "embedding_precision": cfg.embedding_precision,
            **_rescore_fields(cfg, task),
            "instructions": label,
            "instruction": instruction,
            "model": cfg.model,
            **({"cde_context": cfg.cde_context} if _is_cde(model) else {}),
            "mteb": _task_result_dict(task_result),
        }
        atomic_write_text(target, json.dumps(entry, indent=2) + "\n")
        report.scores[name] = entry
        record_extra["tasks"].append(name)
    data_files = []
    if cfg.data_dir is not None:
        data_files = [
            p for p in Path(cfg.data_dir).rglob("*") if p.is_file() and p.stat().st_size < 512 << 20
        ]
    write_run_record(
        output,
        "mteb",
        recipe={k: str(v) for k, v in vars(cfg).items()},
        seed=cfg.seed,
        data_files=data_files,
        extra=record_extra,
    )
    return report
