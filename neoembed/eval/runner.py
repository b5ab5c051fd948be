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
from collections.abc import Collection
from pathlib import Path

import torch

from neoembed.eval.cde import task_context
from neoembed.eval.config import (
    PRECISION_NAMES,
    QUERY_PROMPT_NONE,
    QUERY_PROMPT_SAVED,
    EvalConfig,
    EvalReport,
)
from neoembed.eval.local_data import data_fingerprint
from neoembed.eval.rescore import check_rescore, rescore_fields, scoring_model
from neoembed.eval.resolve import Unresolvable, is_registered, resolve_tasks, task_folders
from neoembed.instructions import (
    SHIPPED_SETS,
    load_instruction_set,
    paper_type_instruction,
    task_prompts,
)
from neoembed.record import atomic_write_text, write_run_record
from neoembed.runs import claim_results_dir

__all__ = ["EvalConfig", "EvalReport", "resolve_tasks", "run_mteb", "task_folders"]

logger = logging.getLogger(__name__)
PRECISIONS = dict(zip(PRECISION_NAMES, (torch.float16, torch.bfloat16, None), strict=True))
EMBEDDING_PRECISIONS = ("fp32", "int8", "binary")


def _is_cde(model) -> bool:
    from neoembed.cde.model import ContextualSentenceTransformer

    return isinstance(model, ContextualSentenceTransformer)


def _load_model(cfg: EvalConfig):
    from neoembed.loading import load
    from neoembed.sentence import set_max_seq_length

    if cfg.backend == "onnx":
        model = load(cfg.model, truncate_dim=cfg.truncate_dim, backend="onnx", file_name=cfg.onnx_file)
    else:
        device = cfg.device or ("cpu" if cfg.quantize else None)  # int8 kernels are CPU ones
        # fp32 weights whatever dtype the folder was saved in: the precision is autocast's over them, and the
        # results say fp32 only where the model ran in fp32
        model = load(
            cfg.model, device=device, dtype="fp32", truncate_dim=cfg.truncate_dim, quantize=cfg.quantize
        )
    if cfg.max_length:
        set_max_seq_length(model, cfg.max_length, cfg.model)
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


def _task_context(
    cfg: EvalConfig, model, task, output: Path, seen: dict, max_batch_tokens: int | None, data: str | None
):
    """A CDE model's context for ``task`` ("null" or a seeded corpus sample); None for other models. ``seen``
    collects the sample drawn (``seen["cde_context"]``: the texts' count and the positions drawn); ``data``: the
    task's local data fingerprint, part of the cached context's key."""
    if not _is_cde(model):
        return None
    if cfg.cde_context == "null":
        return "null"
    cache = output / "cde_context"
    context, seen["cde_context"] = task_context(
        model, task, cfg.seed, cache, str(cfg.model), max_batch_tokens, data
    )
    return context


def _mteb_wrapper(
    model,
    prompts: dict[str, str],
    context,
    precision: str = "fp32",
    seen: dict | None = None,
    max_batch_tokens=None,
    name: str | None = None,
):
    """mteb's sentence-transformers wrapper for one task, encoding under ``precision``'s autocast while
    similarities and metrics stay in float32 (an autocast around the whole evaluation would also run
    ``model.similarity``'s matmul in float16, reordering near-tied neighbours). With a CDE ``context``, every
    encode call of this task carries it as ``dataset_embeddings`` (nothing is left on the model). ``seen``
    collects the width of the embeddings mteb scored (``seen["dims"]``: every width met) and how many texts it
    encoded as queries, documents or neither (``seen["encoded"]``). With
    ``max_batch_tokens``, every encode call fills its batches to that many tokens (:mod:`neoembed.batching`).
    ``name``: the model's name in mteb's results where mteb finds none (:func:`mteb_model_name`)."""
    from mteb.models import SentenceTransformerEncoderWrapper

    from neoembed.progress import library_noise

    class _Wrapper(SentenceTransformerEncoderWrapper):
        def encode(self, inputs, **kwargs):
            if context is not None:
                kwargs["dataset_embeddings"] = context
            if max_batch_tokens is not None:
                kwargs["max_batch_tokens"] = max_batch_tokens
            with _autocast(precision, str(model.device)):
                out = super().encode(inputs, **kwargs)
            if seen is not None:
                seen.setdefault("dims", set()).add(int(out.shape[-1]))
                _note_degenerate(out, seen)
                kind = getattr(kwargs.get("prompt_type"), "value", None) or "other"
                encoded = seen.setdefault("encoded", {})
                encoded[kind] = encoded.get(kind, 0) + int(out.shape[0])
            return out

    # mteb warns and logs when given prompts (neoembed chose them; the summary's first line says which), when a
    # model has no generic query/document prompts, and about its own deprecated calls: not the user's to act on
    with library_noise(SentenceTransformerEncoderWrapper.__module__):
        wrapper = _Wrapper(model, model_prompts=prompts)
    if name is not None and wrapper.mteb_model_meta.name == "no_model_name/available":
        # mteb names a local model "no_model_name/available" in its results' folders and JSON
        wrapper.mteb_model_meta = wrapper.mteb_model_meta.model_copy(update={"name": name})
    return wrapper


def _note_degenerate(out, seen: dict) -> None:
    """What a NaN score would come from: non-finite embeddings (``seen["non_finite"]``), or every text of every
    call given one embedding (``seen["varied"]`` stays False: all similarities equal, a correlation undefined)."""
    emb = torch.as_tensor(out)
    if not seen.get("non_finite") and not bool(torch.isfinite(emb).all()):
        seen["non_finite"] = True
    if not seen.get("varied") and len(emb) > 1 and not bool((emb == emb[:1]).all()):  # once seen, never again
        seen["varied"] = True
    seen.setdefault("varied", False)


def mteb_model_name(model: str) -> str:
    """How mteb's own results name the model scored: its hub id (the packaged all-MiniLM-L6-v2's too), else
    ``local/<folder label>`` (mteb's names are ``org/name``; a path of this machine is no name;
    :func:`neoembed.hub.folder_label`: a run's ``model`` or ``checkpoint-N`` folder named by its run)."""
    import re

    from neoembed.hub import PACKAGED_MINILM, folder_label, model_name

    text = str(model).rstrip("/")
    if text in PACKAGED_MINILM or model_name(text) == PACKAGED_MINILM[0]:
        return PACKAGED_MINILM[1]
    if not Path(text).exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", text):
        return text
    return f"local/{folder_label(text)}"


def _evaluate_task(
    cfg: EvalConfig, model, task, prompts: dict, precision: str, output: Path, seen: dict, data: str | None
):
    """(mteb's task result, main score) of one task; raises when the task cannot run or scores NaN. ``seen``
    collects what the scored embeddings were (see :func:`_mteb_wrapper`); ``data``: the task's local data
    fingerprint (:func:`~neoembed.eval.local_data.data_fingerprint`, taken once per run)."""
    import mteb
    from mteb.cache import ResultCache

    if isinstance(task, Unresolvable):
        raise task.error
    from neoembed.batching import default_max_batch_tokens

    tokens = cfg.max_batch_tokens or default_max_batch_tokens(model.device, model.max_seq_length)
    context = _task_context(cfg, model, task, output, seen, tokens, data)
    wrapper = _mteb_wrapper(model, prompts, context, precision, seen, tokens, mteb_model_name(cfg.model))
    wrapper = scoring_model(wrapper, cfg, task)
    with torch.inference_mode():
        result = mteb.evaluate(
            wrapper,
            task,
            cache=ResultCache(output / "mteb"),
            overwrite_strategy="always",
            # encoding bars' redraws are noise in a log; mteb's search wrappers read the encode_kwargs' setting
            encode_kwargs={"batch_size": cfg.batch_size, "show_progress_bar": sys.stderr.isatty()},
            show_progress_bar=sys.stderr.isatty(),
        )
    task_result = result.task_results[0]
    score = float(task_result.get_score())
    if score != score:  # NaN
        raise FloatingPointError(f"the main score is NaN: {_why_nan(seen)}")
    return task_result, score


def backend_label(cfg: EvalConfig) -> str:
    """How the model ran: ``torch`` (``torch:int8`` quantized), or ``onnx:<graph file>`` (an int8 graph scores
    differently from fp32)."""
    if cfg.backend == "torch":
        return f"torch:{cfg.quantize}" if cfg.quantize else "torch"
    return f"onnx:{cfg.onnx_file or 'model.onnx'}"


def _why_nan(seen: dict) -> str:
    if seen.get("non_finite"):
        return "the model produced non-finite embeddings"
    if seen.get("varied") is False:
        return (
            "every text got the same embedding, so every similarity is equal (texts cut to the same tokens: is "
            "--max-length shorter than the prompt?)"
        )
    return "the metric is undefined on these scores (equal similarities, or one label only)"


def _check_settings(cfg: EvalConfig) -> None:
    """The run's own settings, checked before any model loads or task runs."""
    if cfg.embedding_precision not in EMBEDDING_PRECISIONS:
        raise ValueError(
            f"embedding_precision {cfg.embedding_precision!r}: choose one of {', '.join(EMBEDDING_PRECISIONS)}"
        )
    check_rescore(cfg)
    if cfg.cde_context not in ("corpus", "null"):
        raise ValueError(f"cde_context must be 'corpus' or 'null', got {cfg.cde_context!r}")


def query_prompt_text(spec: str, model) -> str:
    """The prompt before the queries of a task that gives no instruction: for ``"saved"`` the model's own saved
    ``query`` prompt (sentence-transformers' ``model.prompts["query"]``; "" where it saved none), "" for
    ``"none"``, else ``spec`` itself, a prefix used as written (as a sentence-transformers prompt is)."""
    if spec == QUERY_PROMPT_NONE:
        return ""
    if spec == QUERY_PROMPT_SAVED:
        return (getattr(model, "prompts", None) or {}).get("query") or ""
    return spec


def _query_prompt_source(spec: str) -> str:
    return spec if spec in (QUERY_PROMPT_SAVED, QUERY_PROMPT_NONE) else "given"


def scoring_settings(cfg: EvalConfig, label: str, model=None, precision: str | None = None) -> dict:
    """The run's settings that change a score, as every result records them: a finished result is reused only
    under the same ones (:mod:`neoembed.eval.reuse`). Before the model loads (``model`` None), those known then.
    The width, length and saved prompt are read from the model itself, so a model loaded by the caller is
    described as it is."""
    from neoembed.eval.rescore import rescore_label

    settings = {
        "instructions": label,
        "backend": backend_label(cfg),
        "embedding_precision": cfg.embedding_precision,
        "rescore": rescore_label(cfg.rescore, cfg.rescore_docs),
        "truncate_dim": cfg.truncate_dim,
    }
    if precision or cfg.precision:
        settings["precision"] = precision or cfg.precision
    if model is None:
        if cfg.max_length:
            settings["max_length"] = cfg.max_length
        if cfg.query_prompt != QUERY_PROMPT_SAVED:
            settings["query_prompt"] = query_prompt_text(cfg.query_prompt, None)
        return settings
    settings["truncate_dim"] = getattr(model, "truncate_dim", None)
    settings["max_length"] = getattr(model, "max_seq_length", None)
    settings["query_prompt"] = query_prompt_text(cfg.query_prompt, model)
    if _is_cde(model):
        settings["cde_context"] = cfg.cde_context
        if cfg.cde_context != "null":  # the seed draws the context sample from each task's texts
            settings["cde_seed"] = cfg.seed
    return settings


def _check_given_model(cfg: EvalConfig, model) -> None:
    """A model loaded by the caller must be the one ``cfg`` describes where the run would record ``cfg``'s value."""
    half = {p.dtype for p in model.parameters()} & {torch.float16, torch.bfloat16}
    if half:  # the record's precision is autocast's over fp32 weights; half weights score as themselves
        name = str(half.pop()).removeprefix("torch.")
        raise ValueError(
            f"the model given holds {name} weights: its scores would be {name}'s whatever precision the run "
            "records. Load it in fp32 (neoembed.load(..., dtype='fp32')) and set the precision with precision="
        )
    width = getattr(model, "truncate_dim", None)
    if cfg.truncate_dim is not None and width != cfg.truncate_dim:
        raise ValueError(
            f"truncate_dim {cfg.truncate_dim}, but the model given embeds with truncate_dim {width}: load it with "
            f"neoembed.load(..., truncate_dim={cfg.truncate_dim}), or leave truncate_dim out"
        )


def _warn_untrained_null(cfg: EvalConfig, model) -> None:
    """``--cde-context null`` on a CDE model trained with ``context.dropout`` 0: training never put the null vector
    in a context slot, so the second stage never learned to read it; the scores say little of the model."""
    if cfg.cde_context != "null" or not _is_cde(model) or model.cde.context_dropout > 0:
        return
    logger.warning(
        "--cde-context null: %s was trained with context.dropout %s (context_dropout in its cde_config.json): no "
        "training step put its null context vector in a context slot, so the vector was never learned nor the "
        "model taught to read it, and these scores do not measure the model without a corpus. Score with "
        "--cde-context corpus, or train with context.dropout above 0 (recipes/cde.yaml: 0.05) for a model that "
        "also works without one",
        cfg.model,
        model.cde.context_dropout,
    )


def _check_batch_tokens(cfg: EvalConfig, model) -> None:
    """A batch of ``max_batch_tokens`` must hold the longest text the model takes: refused before any task runs."""
    longest = getattr(model, "max_seq_length", None)
    if cfg.max_batch_tokens is not None and longest and cfg.max_batch_tokens < longest:
        raise ValueError(
            f"--max-batch-tokens {cfg.max_batch_tokens} is below the model's max length {longest}: its longest texts "
            f"would fit no batch; raise --max-batch-tokens to at least {longest}, or lower --max-length"
        )


def _task_instruction(task, card_instruction: str | None, label: str, instruction_map: dict) -> str | None:
    """The instruction a task gets: the set's (or its card's), else the set's for its type; None for none."""
    name, ttype = task.metadata.name, task.metadata.type
    instruction = None if label == "none" else instruction_map.get(name, card_instruction)
    return instruction if instruction is not None else paper_type_instruction(ttype, label)


def _warn_unused_instructions(label: str, instruction_map: dict, plan: list) -> None:
    """An instructions file is the user's: a key that names no task (a typo) is never used, and the task it meant
    is encoded without an instruction. Both are said; the shipped sets cover tasks this run may not have."""
    if label in SHIPPED_SETS or not instruction_map:
        return
    import difflib

    here, said = [task.metadata.name for task, _ in plan], []
    for key in [k for k in instruction_map if k not in here and not is_registered(k)]:
        close = difflib.get_close_matches(key, here, n=1, cutoff=0.6)
        said.append(f"instructions file {label}: {key!r} names no task (of this run, or of mteb)"
                    f"{f'; did you mean {close[0]!r}?' if close else ''}: its instruction is never used")  # fmt: skip
    if bare := [name for (task, instruction), name in zip(plan, here, strict=True) if not instruction]:
        said.append(f"instructions file {label} gives no instruction for {', '.join(bare)} (nor do their cards or "
                    "task types): encoded without one")  # fmt: skip
    for line in [x for x in said if x not in _SAID]:  # once a process: training's evaluations come here each time
        logger.warning(line)
    _SAID.update(said)


_SAID: set[str] = set()


def _task_prompts(cfg: EvalConfig, task, instruction: str | None, query_prompt: str) -> dict[str, str]:
    """The prompts mteb gets for ``task``: its instruction's; where it gives none, ``query_prompt`` before the
    queries of a retrieval or reranking task. Symmetric tasks (STS, pair classification, classification,
    clustering) encode every text alike with no prompt, as mteb and sentence-transformers' ``encode`` do."""
    name, ttype = task.metadata.name, task.metadata.type
    prompts = task_prompts(name, ttype, instruction, cfg.template, registered=is_registered(name))
    if not instruction:
        prompts = {k: query_prompt if k.endswith("-query") else v for k, v in prompts.items()}
    return prompts


def _score_task(
    cfg: EvalConfig, model, task, instruction, prompts: dict, settings: dict, output: Path, data: str | None
) -> dict:
    """One task scored: its result entry, which states every setting that produced the score and, for a task
    served from local files, their fingerprint ``data``."""
    seen: dict = {}
    t0 = time.perf_counter()
    task_result, score = _evaluate_task(cfg, model, task, prompts, settings["precision"], output, seen, data)
    dims = sorted(seen.get("dims", ()))
    return {
        "task": task.metadata.name,
        "type": task.metadata.type,
        "main_score_name": task.metadata.main_score,
        "main_score": score,
        "wall_time_s": round(time.perf_counter() - t0, 3),
        **settings,
        **rescore_fields(cfg, task),
        "query_prompt_source": _query_prompt_source(cfg.query_prompt),
        "instruction": instruction,
        "prompts": prompts,
        **({"data_fingerprint": data} if data else {}),
        **({"differs_from_mteb": why} if (why := getattr(task, "neoembed_differs", None)) else {}),
        **_context_sample(seen),
        "embedding_dim": dims[0] if len(dims) == 1 else dims,  # the width of the embeddings mteb scored
        "texts_encoded": dict(sorted(seen.get("encoded", {}).items())),  # how much a score rests on
        **({"own_task": True} if _own_task(task) else {}),
        "model": cfg.model,
        "mteb": _task_result_dict(task_result),
    }


def _own_task(task) -> bool:
    """A task of the user's own card (an mteb task's name is scored as the mteb task, whatever its data)."""
    return getattr(task, "card_fields", None) is not None and not is_registered(task.metadata.name)


def _context_sample(seen: dict) -> dict:
    """What a CDE result records of its context sample: the positions drawn among the texts
    :func:`neoembed.eval.cde.task_context_texts` lists, and how many it lists (none for other models, or null)."""
    sample = seen.get("cde_context")
    if sample is None:
        return {}
    return {"cde_context_n_texts": sample["n_texts"], "cde_context_indices": sample["indices"]}


def _record_extra(cfg: EvalConfig, settings: dict, device: str, model) -> dict:
    """The run record's own fields: the settings every result of the folder holds (checked before any task ran),
    the tasks this run scored and those it reused."""
    extra = {
        **settings,
        "query_prompt_source": _query_prompt_source(cfg.query_prompt),
        "rescore": cfg.rescore,
        "rescore_docs": cfg.rescore_docs if cfg.rescore else None,
        "rescore_label": settings["rescore"],
        "device": device,
        "tasks": [],
        "reused": [],
    }
    if _is_cde(model):
        extra["cde_n_context"] = model.n_context
    return extra


def run_mteb(cfg: EvalConfig, model=None) -> EvalReport:
    """Evaluate ``cfg.model`` (or an already loaded ``model``, left as it was given) on the configured tasks.

    A finished task's result is reused only when it was scored with this run's settings (:func:`scoring_settings`,
    its instruction and prompts); a folder that holds results of other settings is refused, or with
    ``cfg.overwrite`` cleared of them (:func:`neoembed.eval.reuse.check_reuse`)."""
    from neoembed.eval.reuse import changed_data, check_reuse
    from neoembed.recipe import seed_everything

    seed_everything(cfg.seed)
    output = Path(cfg.output)
    claim_results_dir(output, str(cfg.model), cfg.overwrite)  # one model's scores per folder, never a mix
    label, instruction_map = load_instruction_set(cfg.instructions)
    tasks = resolve_tasks(cfg)
    if tasks and all(isinstance(t, Unresolvable) for t, _ in tasks):  # nothing to run: bad input, exit 2
        raise tasks[0][0].error
    _check_settings(cfg)
    data = {t.metadata.name: data_fingerprint(t) for t, _ in tasks}
    stale = {} if cfg.overwrite else changed_data(output, data)
    _require_hub(cfg, tasks, output, stale)
    plan = [(task, _task_instruction(task, card, label, instruction_map)) for task, card in tasks]
    _warn_unused_instructions(label, instruction_map, plan)
    if model is None:
        if not cfg.overwrite:  # results of other settings are refused before the model loads
            instructions = {t.metadata.name: {"instruction": i} for t, i in plan}
            check_reuse(output, scoring_settings(cfg, label), instructions, overwrite=False)
        model = _load_model(cfg)
    else:
        _check_given_model(cfg, model)
    _check_batch_tokens(cfg, model)
    _warn_untrained_null(cfg, model)
    prompts = getattr(model, "prompts", None)
    try:
        return _run_plan(cfg, model, plan, label, output, (data, stale))
    finally:  # mteb's wrapper replaces the model's prompts with the task's
        if prompts is not None:
            model.prompts = prompts


def _require_hub(cfg: EvalConfig, tasks: list, output: Path, stale: Collection[str] = ()) -> None:
    """The tasks this run scores with data from the hub (named or a benchmark's, without --data-dir; results
    not reused, or ``stale``: scored on other data): when the hub cannot be reached, one probe says so before the
    model loads, where each task would retry for about 20 s and fail. With ``HF_HUB_OFFLINE`` set, nothing is
    probed (the datasets cache serves)."""
    from neoembed.data.check import hub_unreachable_reason
    from neoembed.data.errors import HubUnreachable, hub_offline_mode

    if cfg.data_dir is not None or hub_offline_mode():
        return
    named = {s for s in cfg.tasks or [] if Path(s).suffix not in (".yaml", ".yml") and not Path(s).is_dir()}
    names = [t.metadata.name for t, _ in tasks if not isinstance(t, Unresolvable)]
    hub = [
        n
        for n in names
        if (n in named or not cfg.tasks)
        and (cfg.overwrite or n in stale or not (output / f"{n}.json").is_file())
    ]
    if not hub or (down := hub_unreachable_reason()) is None:
        return
    shown = ", ".join(hub[:5]) + (f" and {len(hub) - 5} more" if len(hub) > 5 else "")
    raise HubUnreachable(
        f"the Hugging Face hub cannot be reached ({down}); {len(hub)} task(s) of this run load their data from "
        f"it: {shown}. Connect to the network, set HF_HUB_OFFLINE=1 to load them from your datasets cache, or "
        "serve tasks from local folders with --data-dir DIR (docs/evaluation.md)"
    )


def _run_plan(cfg: EvalConfig, model, plan: list, label: str, output: Path, data: tuple) -> EvalReport:
    """Score ``plan``'s tasks into ``output``; ``data``: (task -> its data fingerprint, the tasks whose results
    were scored on other data, with the fingerprint each records)."""
    from neoembed.eval.reuse import check_reuse
    from neoembed.progress import bar as progress_bar

    device = str(model.device)
    precision = _precision(cfg, device)
    if precision != "fp32" and not device.startswith("cuda"):
        logger.warning(
            "running %s autocast on CPU (slow); the paper's fp16 evaluation ran on GPUs", precision
        )
    settings = scoring_settings(cfg, label, model, precision)
    prompts = {t.metadata.name: _task_prompts(cfg, t, i, settings["query_prompt"]) for t, i in plan}
    per_task = {t.metadata.name: {"instruction": i, "prompts": prompts[t.metadata.name]} for t, i in plan}
    check_reuse(output, settings, per_task, overwrite=cfg.overwrite)
    fingerprints, stale = data
    for name, was in stale.items():
        logger.warning(
            "%s: its data differ from those its result in %s was scored on (data fingerprint %s, now %s: its "
            "files changed, or its task card's columns, main_score or splits, or the result is older than the "
            "record of a card's fields): scoring it again",
            name,
            output,
            was or "none (the hub's data, or local data before neoembed recorded them)",
            fingerprints[name] or "none (the hub's data)",
        )
    report = EvalReport()
    record_extra = _record_extra(cfg, settings, device, model)
    for task, instruction in progress_bar(plan, desc="mteb tasks", unit="task"):
        name = task.metadata.name
        target = output / f"{name}.json"
        reuse = target.is_file() and not cfg.overwrite and name not in stale  # settings: check_reuse said so
        if reuse:
            report.skipped.append(name)
            record_extra["reused"].append(name)
            continue
        if name in stale:  # a score of other data is not this run's, even where scoring it again fails
            target.unlink(missing_ok=True)
        try:
            entry = _score_task(
                cfg, model, task, instruction, prompts[name], settings, output, fingerprints[name]
            )
        except Exception as e:
            logger.error("task %s failed: %s", name, e if str(e) else type(e).__name__)
            report.failed[name] = f"{type(e).__name__}: {e}"
            (output / "failures").mkdir(exist_ok=True)
            atomic_write_text(output / "failures" / f"{name}.txt", traceback.format_exc())
            continue
        atomic_write_text(target, json.dumps(entry, indent=2) + "\n")
        report.scores[name] = entry
        record_extra["tasks"].append(name)
    _write_record(cfg, output, record_extra)
    return report


def _write_record(cfg: EvalConfig, output: Path, extra: dict) -> None:
    data_files = []
    if cfg.data_dir is not None:
        data_files = [
            p for p in Path(cfg.data_dir).rglob("*") if p.is_file() and p.stat().st_size < 512 << 20
        ]
    write_run_record(
        output,
        "mteb",
        recipe=json.loads(json.dumps(vars(cfg), default=str)),  # paths as text; None, numbers, lists as themselves
        seed=cfg.seed,
        data_files=data_files,
        extra=extra,
    )
