"""The unified contrastive trainer, on the run loop that CDE, pre-training and GLUE run on (:mod:`neoembed.loop`).

What is ours: the InfoNCE losses (``neoembed.losses``), the power-law dataset sampler
(``neoembed.data.sampler``), per-dataset batch sizes, the data checks before the model loads, the holdout, and
the saved model (its query prompt, its model card). Batches and the step are :mod:`neoembed.train.engine`'s
(sentence-transformers' collator, samplers and losses under accelerate); the run guarantees are the loop's:
the output folder is checked first (:func:`neoembed.runs.prepare_output_dir`: never silently reused),
checkpoints are written to a staging folder, sealed with a checksum marker and renamed (a kill never leaves half
of one to resume from; a full disk ends in a clear error), a resume is exact, ``metrics.jsonl`` and TensorBoard
are trimmed to the resumed step, SIGTERM / Ctrl-C checkpoint and exit 143 / 130, a NaN loss stops before the
update, a loss stuck at 0 is reported.

    neoembed train tiny                       # a shipped recipe by name
    neoembed train my.yaml steps=500 batch_size=64 optimizer.lr=2e-5
    neoembed train my.yaml --resume           # continue from the newest complete checkpoint
    accelerate launch --num_processes 2 -m neoembed train my.yaml
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
from pathlib import Path

import torch

from neoembed.adapters import (
    add_lora,
    count_parameters,
    merge_lora,
    require_peft,
    save_adapter,
)
from neoembed.data.cards import (
    DataCardError,
    card_fingerprints,
    check_instruction_overrides,
    explain_data_errors,
    load_recipe_cards,
    local_data_paths,
    prepare_card,
)
from neoembed.data.check import require_hub
from neoembed.data.sampler import check_contrast, dataset_probabilities, plan_no_duplicates
from neoembed.instructions import instruction_prefix
from neoembed.loop import RunLoop, adamw, check_engine
from neoembed.losses import MaskTally, build_loss
from neoembed.model_card import base_model_name, best_checkpoint_sentence, training_prompts
from neoembed.modeling.positions import position_limit
from neoembed.recipe import RecipeError, resolve_recipe_path
from neoembed.runs import (
    TrainingStopped,
    check_output_flags,
    check_pair_counts,
    check_trackers,
    check_weight_files,
    launched_main,
    model_fingerprint,
    prepare_output_dir,
    resume_defaults,
    resume_settings,
    save_final_model,
)
from neoembed.sentence import record_matryoshka_dims
from neoembed.train.engine import batches, place_model_in_loss, unified_step
from neoembed.train.holdout import (
    check_same_holdout,
    held_card_names,
    holdout_record,
    split_holdout,
    write_holdout_tasks,
)
from neoembed.train.recipe import UnifiedRecipe

__all__ = ["TrainingStopped", "prepare_datasets", "train"]

logger = logging.getLogger(__name__)


def prepare_datasets(recipe: UnifiedRecipe, recipe_dir: Path | None = None, reports: dict | None = None):
    """Resolve, load and check every card before training: returns (DatasetDict, cards, per-dataset batch sizes).
    ``reports`` (a dict, optional) receives each card's DropReport (rows kept and dropped, full size) by name."""
    from datasets import DatasetDict

    search = [Path(resolve_recipe_path(d, recipe_dir)) for d in recipe.card_dirs]
    loaded = load_recipe_cards(recipe.datasets, search, scored=recipe.distillation is not None)  # cards first
    require_hub([card for card, _ in loaded])  # no network: one probe and a clear error, not retries per card
    check_instruction_overrides(recipe.instruction_overrides, [card for card, _ in loaded])
    out, cards, sizes, lines = {}, [], {}, {}
    for entry, (card, folder) in zip(recipe.datasets, loaded, strict=True):
        if card.name in recipe.instruction_overrides:
            card = card.model_copy(update={"instruction": recipe.instruction_overrides[card.name]})
        with explain_data_errors(card, folder):  # a bad byte surfaces only when the rows are read
            pairs, report = prepare_card(
                card,
                folder,
                entry.max_rows,
                entry.max_negatives,
                recipe.template,
                recipe.instructions,
                recipe.seed,
            )
        if reports is not None:
            reports[card.name] = report
        # counted in the card's batched map (pairs["query"] would walk every row in Python)
        check_pair_counts(card.name, len(pairs), report.same_as_query, report.distinct_pairs)
        if recipe.distillation is not None and report.negatives_per_query == 0:  # else at the first step
            raise DataCardError(
                f"card {card.name}: distillation compares each row's positive with its hard negatives, and "
                "these rows carry none: score a card with hard negatives (neoembed mine, then neoembed score)"
            )
        bs = recipe.dataset_batch_size(entry, report.negatives_per_query)
        _check_batch(card.name, bs, len(pairs), report.negatives_per_query)
        out[card.name], sizes[card.name], lines[card.name] = pairs, bs, report
        cards.append((card, folder))
    _log_cards(lines, sizes, recipe.alpha, {name: len(rows) for name, rows in out.items()})
    return DatasetDict(out), cards, sizes


def _log_cards(reports: dict, sizes: dict[str, int], alpha: float, loaded: dict[str, int]) -> None:
    """One line per card: rows kept and dropped by reason, batch, pi_i (of the full sizes, as the sampler
    draws). A card that lost rows (all counted, and allowed by the card) is a warning."""
    probabilities = dataset_probabilities([reports[n].full_size or loaded[n] for n in reports], alpha)
    for (name, report), pi in zip(reports.items(), probabilities, strict=True):
        bs, texts = sizes[name], sizes[name] * (2 + reports[name].negatives_per_query)
        (logger.warning if report.dropped else logger.info)(
            "card %s: %s; %d queries per step (%d texts); pi %.4f", name, report.line(), bs, texts, pi
        )


def _check_batch(name: str, bs: int, rows: int, negatives: int) -> None:
    if bs > rows:
        raise DataCardError(
            f"card {name}: batch size {bs} is larger than the dataset ({rows} usable rows); "
            "lower batch_size (or this dataset's batch_size) or add data"
        )
    if bs == 1 and negatives == 0:  # InfoNCE over one candidate is log(1) = 0 at every step
        raise DataCardError(
            f"card {name}: a batch of 1 query without hard negatives leaves its positive nothing to be contrasted "
            "with (the loss is 0 and nothing trains): raise batch_size, or use a card with hard negatives"
        )


def _query_prompt(recipe: UnifiedRecipe, cards) -> str:
    """The prefix every training query carried ("" when cards differ or instructions are off)."""
    instructions = [card.instruction if recipe.instructions else None for card, _ in cards]
    return training_prompts(instructions, recipe.template)["query"]


def _objective_notes(recipe: UnifiedRecipe) -> str:
    """The model card's sentences on what the run optimised: the loss, its options, GradCache, LoRA."""
    contrastive = "GTE's improved contrastive loss" if recipe.improved_contrastive else "InfoNCE"
    contrastive += f" (cosine similarity, temperature {recipe.temperature})"
    d = recipe.distillation
    if d is None:
        said = f"Unified contrastive recipe: {contrastive}."
    else:
        teacher = (
            f"{d.loss} distillation from the rows' teacher scores (weight {d.weight}, student temperature "
            f"{d.student_temperature}, teacher temperature {d.teacher_temperature})"
        )
        said = (
            f"Distillation alone: {teacher}; no contrastive term."
            if d.infonce_weight == 0
            else f"{contrastive} weighted {d.infonce_weight}, plus {teacher}."
        )
    fn = recipe.false_negatives
    if fn is not None and (d is None or d.infonce_weight > 0):
        said += f" Suspected false negatives masked ({fn.mode} margin {fn.margin}, scope {fn.scope})."
    if recipe.loss.name == "cached_infonce":
        size = recipe.loss.mini_batch_num_tokens
        size = f"{size} tokens" if size else f"{recipe.loss.mini_batch_size} texts"
        said += f" GradCache in mini-batches of {size} (the gradients of the whole batch)."
    if recipe.adapter is not None:
        a = recipe.adapter
        said += (
            f" Trained as a LoRA adapter (rank {a.r}, alpha {a.alpha}), merged into these weights; the adapter "
            "alone is in `adapter/`."
        )
    if recipe.matryoshka is not None:
        dims = ", ".join(str(d) for d, _ in recipe.matryoshka.pairs())
        said += f" Matryoshka dimensions {dims}: load with `truncate_dim=` one of them."
    return said


def _model_card(
    recipe: UnifiedRecipe,
    cards,
    output: Path,
    batch_sizes: dict | None = None,
    trained: int | None = None,
    best: dict | None = None,
) -> None:
    """README.md: ``batch_sizes`` each dataset's queries per step, ``trained`` the steps the run made (default:
    the recipe's), ``best`` keep_best's record."""
    from neoembed.model_card import model_card_text
    from neoembed.record import atomic_write_text

    datasets = []
    for card, _ in cards:
        src = card.source.hub.id if card.source.hub else f"local: {card.source.local.path}"
        lic = card.license or "unknown"
        if card.research_only and "research" not in lic.lower():
            lic += " (research use only)"
        datasets.append({"name": card.name, "source": src, "license": lic})
    sizes = set((batch_sizes or {}).values())
    if recipe.batch_texts is not None:  # each dataset's queries per step follow from its negatives
        batch = f"{recipe.batch_texts} texts per step (query, positive and hard negatives)"
        if batch_sizes:  # a dataset's own batch_size stands beside the rule: each one's, as trained
            batch += " with queries per step " + ", ".join(f"{n} {b}" for n, b in batch_sizes.items())
    elif len(sizes) > 1:
        batch = "batch size per dataset: " + ", ".join(f"{n} {b}" for n, b in batch_sizes.items())
    else:
        batch = f"batch size {sizes.pop() if sizes else recipe.batch_size}"
    notes = (
        f"{_objective_notes(recipe)} Dataset sampling alpha {recipe.alpha}, {batch}, max length "
        f"{recipe.max_length}, seed {recipe.seed}.{best_checkpoint_sentence(best)}"
    )
    trained = recipe.steps if trained is None else trained
    steps = f"{trained}" + (f" of the {recipe.steps} planned" if trained < recipe.steps else "")
    config = output / "config.json"
    neobert = config.is_file() and json.loads(config.read_text()).get("model_type") == "neobert"
    instructions = [c.instruction if recipe.instructions else None for c, _ in cards]
    text = model_card_text(
        output.name,
        base_model_name(recipe.model),
        datasets,
        steps=steps,
        notes=notes,
        neobert=neobert,
        query_prompt=_query_prompt(recipe, cards),
        prefixed=any(instruction_prefix(i, recipe.template) for i in instructions),
        # the folder as the recipe names it, from where training ran (its name alone would load from nowhere);
        # an absolute path stays a name (a card names no machine's paths; push_to_hub writes the hub id)
        load_as=output.as_posix() if not output.is_absolute() else None,
    )
    atomic_write_text(output / "README.md", text)


def _record_extra(recipe: UnifiedRecipe, cards, reports: dict, datasets, batch_sizes: dict, holdout: dict) -> dict:
    """What the unified trainer adds to the loop's ``run_record.json``."""
    return {
        "base_model": base_model_name(recipe.model),  # the model card's hub id (None: a local model)
        "cards": {  # query_prompt: the text before each of the card's queries (its instruction, or an override's)
            c.name: {
                "pinned": c.pinned,
                "license": c.license,
                "query_prompt": instruction_prefix(c.instruction, recipe.template) if recipe.instructions else "",
                "data": reports[c.name].as_dict(),
            }
            for c, _ in cards
        },
        "negatives_per_query": {n: d.num_columns - 2 for n, d in datasets.items()},
        "batch_size": batch_sizes,  # queries per step of each dataset
        "holdout": holdout,  # eval.holdout: each card's held-out rows (indices, seed, hash of texts)
    }


def _accelerator(recipe: UnifiedRecipe):
    """accelerate with the recipe's precision (autocast, and fp16's loss scaling) and every process joined."""
    from neoembed.loop import accelerator

    return accelerator(mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[recipe.precision])


def _check_checkpoint_format(checkpoint: Path | None) -> None:
    """A checkpoint of the unified trainer before it ran on the loop (transformers' layout: no ``state/``)
    holds no state the loop can restore: refused with what to do, before the model loads."""
    if checkpoint is not None and not (checkpoint / "state").is_dir():
        raise RecipeError(
            f"{checkpoint} was written by an earlier neoembed (transformers' checkpoint layout), which this "
            "version cannot resume: its weights load as a model (set model= to it and start a new run in another "
            "output_dir), or finish the run with the neoembed version that started it"
        )


def _oom_advice(recipe: UnifiedRecipe, error: BaseException) -> TrainingStopped:
    return TrainingStopped(
        "out of memory: enable GradCache with loss.name=cached_infonce loss.mini_batch_size=32 (same loss, "
        "memory of one mini-batch; --resume continues this run from its last checkpoint with it), lower "
        f"batch_size, or shorten max_length (now {recipe.max_length}). ({error})"
    )


def train(
    recipe: UnifiedRecipe,
    recipe_dir: Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    evaluator=None,
    progress: bool = True,
) -> Path:
    """Run the unified recipe; returns the output folder (final model, metrics, run record, model card).

    The output folder must be new or empty, unless ``resume`` (continue the run it holds, from its newest
    complete checkpoint) or ``overwrite`` (clear it); see :func:`neoembed.runs.prepare_output_dir`. A recipe with
    ``eval:`` needs ``evaluator``: ``MtebEvaluator(recipe.eval, recipe_dir, holdout_task_paths(recipe, recipe_dir))``
    (eval.training's, train.holdout's; ``neoembed train`` passes it: evaluation sits above training). Raises
    :class:`~neoembed.runs.TrainingInterrupted` after checkpointing on SIGTERM / Ctrl-C."""
    from neoembed.recipe import seed_everything
    from neoembed.sentence import load

    _check_extras(recipe, evaluator, resume)
    seed_everything(recipe.seed)
    output = Path(recipe.output_dir)
    # before the data: a big card takes minutes
    check_output_flags(output, overwrite=overwrite, resume=resume, command="train")
    # bad data, a used output folder and truncated weights fail before the model loads
    datasets, cards, batch_sizes, reports, held, holdout = _training_data(recipe, recipe_dir)
    full_sizes = [reports[name].full_size or len(datasets[name]) for name in datasets]
    no_duplicates = _batch_plans(recipe, datasets, batch_sizes)
    # the base model by content too: a resume loads its tokenizer and configuration beside the checkpoint's weights
    data = card_fingerprints(cards) | {"model_fingerprint": model_fingerprint(recipe.model)}
    settings = resume_settings(recipe, per_process_batch=True) | data
    checkpoint = prepare_output_dir(
        output, command="train", overwrite=overwrite, resume=resume, settings=settings,
        defaults=resume_defaults(recipe, per_process_batch=True) | data,  # a run from before these keys resumes
        main_process=launched_main(), inputs=(recipe.model, *local_data_paths(cards)),
    )  # fmt: skip
    _check_checkpoint_format(checkpoint)
    check_same_holdout(output, holdout, resuming=checkpoint is not None)
    check_weight_files(recipe.model)
    acc = _accelerator(recipe)  # after the folder's checks: a resume on another process count is named there
    # fp32 weights whatever the folder was saved in: the recipe's precision is autocast's, over fp32 weights
    model = load(
        recipe.model, pooling=recipe.pooling, dtype="fp32", compile=recipe.compile, device=str(acc.device)
    )
    final = (_training_length(model, recipe), _query_prompt(recipe, cards))  # what the saved model carries
    _add_adapter(model, recipe)
    seed_everything(recipe.seed)
    tally = MaskTally()  # what false-negative masking drops, logged with each metrics row
    loss_fn = build_loss(recipe.loss.name, model, recipe, tally)
    model.train()
    optimizer = adamw(model, recipe.optimizer)
    wrapped, optimizer = acc.prepare(model, optimizer)
    place_model_in_loss(loss_fn, model, wrapped)
    loader, sampler = batches(
        acc, model, datasets, batch_sizes, no_duplicates,
        alpha=recipe.alpha, steps=recipe.steps, full_sizes=full_sizes, seed=recipe.seed,
    )  # fmt: skip
    loop = RunLoop(
        acc,
        recipe,
        output,
        optimizer=optimizer,
        parameters=wrapped.parameters,
        settings=settings | {"model_fingerprint": model_fingerprint(recipe.model)},  # a hub id's commit: cached now
        progress=progress,
        nan_advice="Lower optimizer.lr, or use bf16/fp32 instead of fp16",
        evaluate=_evaluation(evaluator, model, output, final),
        save_model=functools.partial(_save_checkpoint_model, model, recipe, final),
    )
    if acc.is_main_process:
        write_holdout_tasks(output, held, cards, recipe)
    data_files = [f for f in local_data_paths(cards) if f.is_file()]
    extra = _record_extra(recipe, cards, reports, datasets, batch_sizes, holdout)
    loop.start(checkpoint, "train", data_files=data_files, extra=extra)
    names = list(datasets.keys())
    try:
        loop.run(*unified_step(acc, loss_fn, loader, sampler, names, batch_sizes, loop.step, tally))
    except torch.OutOfMemoryError as e:
        raise _oom_advice(recipe, e) from None
    loop.finish(lambda: _save_final(recipe, model, cards, output, loop, final, batch_sizes))
    return output


def _set_final(model, limit: int | None, query_prompt: str) -> tuple:
    """Give ``model`` what the final model is saved with: the base model's token limit (``max_length`` is for the
    training batches) and the query instruction as its ``query`` prompt; returns what it replaced."""
    before = (model.max_seq_length, model.prompts)
    model.prompts = {**model.prompts, "query": query_prompt, "document": ""}
    model.max_seq_length = limit
    return before


@contextlib.contextmanager
def _as_final(model, final: tuple):
    """``model`` as the final model (:func:`_set_final`), so that a score taken during training and a
    checkpoint's scores are the scores of the model they stand for."""
    before = _set_final(model, *final)
    try:
        yield model
    finally:
        model.max_seq_length, model.prompts = before


def _evaluation(evaluator, model, output: Path, final: tuple):
    """``evaluate(step)`` for the loop: the evaluator (``neoembed.eval.training``) on the model being trained, as
    the final model would be saved."""
    if evaluator is None:
        return None

    def evaluate(step: int) -> dict:
        with _as_final(model, final):
            return evaluator(model, output_path=str(output / "eval"), steps=step)

    return evaluate


def _save_checkpoint_model(model, recipe: UnifiedRecipe, final: tuple, folder: Path) -> None:
    """The model at a checkpoint, loadable as it is (``neoembed mteb --model RUN/checkpoint-N``) and as the final
    model would be saved; with an adapter, a merged copy, so that the model being trained keeps its adapter."""
    with _as_final(model, final):
        if recipe.adapter is not None:
            model = copy.deepcopy(model)
            merge_lora(model)
        model.save(str(folder))
    if recipe.matryoshka is not None:  # a checkpoint exported or loaded keeps its nested dimensions too
        record_matryoshka_dims(folder, recipe.matryoshka.dims)


def _batch_plans(recipe: UnifiedRecipe, datasets: dict, batch_sizes: dict) -> dict[str, bool]:
    """Per dataset, whether its batches hold no text twice (:func:`plan_no_duplicates`), after refusing a
    dataset that leaves InfoNCE nothing to contrast (:func:`check_contrast`; distillation learns from the
    teacher's scores)."""
    for name, dataset in datasets.items():
        if recipe.distillation is None:
            check_contrast(dataset, name, recipe.mask_duplicates)
    return {n: plan_no_duplicates(recipe.no_duplicates, d, batch_sizes[n], n) for n, d in datasets.items()}


def _add_adapter(model, recipe: UnifiedRecipe) -> None:
    """The recipe's LoRA adapter (``adapter:``) on ``model``, if it asks for one."""
    if recipe.adapter is not None:
        a = recipe.adapter
        add_lora(model, a.r, a.alpha, a.dropout, a.target_modules)
        logger.info("LoRA adapter: %d of %d parameters train", *count_parameters(model))


def _training_data(recipe: UnifiedRecipe, recipe_dir: Path | None):
    """Every card loaded and checked, with its report and batch size, and the holdout's rows taken out (with
    what the run record keeps of them)."""
    held_card_names(recipe, recipe_dir)  # an unknown eval.holdout card fails before any data loads
    reports: dict = {}
    datasets, cards, batch_sizes = prepare_datasets(recipe, recipe_dir, reports)
    sizes = {name: len(d) for name, d in datasets.items()}
    datasets, held = split_holdout(recipe, datasets, cards, batch_sizes)
    return datasets, cards, batch_sizes, reports, held, holdout_record(recipe, held, sizes, datasets)


def _check_first_module(recipe: UnifiedRecipe) -> None:
    """A local sentence-transformers folder whose first module is a StaticEmbedding, refused before the data or
    the model load (see :func:`_refuse_static`)."""
    modules, first = Path(str(recipe.model)) / "modules.json", ""
    with contextlib.suppress(OSError, ValueError, TypeError, IndexError, KeyError, AttributeError):
        first = str(json.loads(modules.read_text())[0]["type"]).rsplit(".", 1)[-1]  # unreadable: load tells
    _refuse_static(first, recipe, first == "StaticEmbedding")


def _training_length(model, recipe: UnifiedRecipe) -> int | None:
    """The recipe's max_length set on the loaded model for training; returns the model's own. A first module
    whose token limit cannot be set (a read-only max_seq_length) is a static model, refused here for a model
    known only once loaded (a hub id)."""
    limit = getattr(type(model[0]), "max_seq_length", None)
    _refuse_static(type(model[0]).__name__, recipe, isinstance(limit, property) and limit.fset is None)
    base = model.max_seq_length
    model.max_seq_length = recipe.max_length
    return base


def _refuse_static(kind: str, recipe: UnifiedRecipe, static: bool) -> None:
    """The unified trainer trains models that read padded token sequences (its losses find repeated texts from
    token ids and attention masks, and max_length truncates them); a StaticEmbedding model reads a bag of token
    vectors with neither, and has no max_seq_length to set."""
    if static:
        raise RecipeError(
            f"model {recipe.model} is a static-embedding model (its first module is a {kind}: one vector per "
            "token, no positions, no max_seq_length): neoembed train trains transformer encoders only. Train "
            "it with sentence-transformers' own SentenceTransformerTrainer (e.g. MultipleNegativesRankingLoss), "
            "or set model: to a transformer encoder"
        )


def _check_max_length(recipe: UnifiedRecipe) -> None:
    """A ``max_length`` beyond a local model's learned positions fails at the first long text, deep in the
    embedding lookup: refuse it here, naming the key (RoPE models such as NeoBERT extrapolate: a warning)."""
    config = Path(str(recipe.model)) / "config.json"
    if not config.is_file():
        return
    limit, fails = position_limit(json.loads(config.read_text()))
    if limit is None or recipe.max_length <= limit:
        return
    if fails:
        raise RecipeError(
            f"max_length={recipe.max_length} exceeds the {limit} positions of model {recipe.model} "
            "(config.json max_position_embeddings): lower max_length"
        )
    logger.warning(
        "max_length=%d is longer than the %d tokens model %s supports (rotary positions extrapolate; "
        "quality beyond its length is not measured)",
        recipe.max_length,
        limit,
        recipe.model,
    )


def _check_extras(recipe: UnifiedRecipe, evaluator, resume: bool = False) -> None:
    """The engine, trackers (and the tracked runs a resume continues), PEFT and the evaluator a recipe needs:
    checked before data or the model load."""
    check_engine("unified")
    check_trackers(recipe.report_to, Path(recipe.output_dir), resume)
    _check_first_module(recipe)
    _check_max_length(recipe)
    recipe.check_matryoshka_width()
    if recipe.adapter is not None:
        require_peft()
    if recipe.eval is not None and evaluator is None:
        raise ValueError(
            "the recipe has an eval: block but no evaluator was given: pass "
            "evaluator=neoembed.eval.training.MtebEvaluator(recipe.eval, recipe_dir), or run neoembed train"
        )


def _save_final(recipe: UnifiedRecipe, model, cards, output: Path, loop, final: tuple, batch_sizes: dict) -> None:
    """The final model, all or nothing (:func:`neoembed.runs.save_final_model`): with keep_best, the best
    checkpoint's weights (loaded back by the loop); a LoRA adapter alone in ``adapter/``, then merged into the
    saved weights; the query instruction as the saved ``query`` prompt and the base model's max_seq_length (the
    recipe's max_length was for training); then the model card."""

    def save(folder: Path) -> None:
        _set_final(model, *final)  # first: the adapter folder loads as the same model as the merged one
        saved = [folder]
        if recipe.adapter is not None:
            saved.append(save_adapter(model, folder / "adapter"))
            merge_lora(model)
        model.save(str(folder))
        for written in saved if recipe.matryoshka is not None else ():
            record_matryoshka_dims(written, recipe.matryoshka.dims)

    model.eval()
    save_final_model(output, save, loop.step)
    _model_card(recipe, cards, output, batch_sizes, loop.step, loop.best_record())
