"""The CDE training loop.

Why our own loop and not the sentence-transformers trainer: a CDE step runs two models on different inputs (the
context documents through the first stage, queries and documents through the second given the first's output),
and its GradCache must backpropagate through both stages in order (:mod:`neoembed.cde.gradcache`) — the
sentence-transformers losses see one model and one list of inputs.

One step:

1. the step's global batch comes from the contextual batches of the current epoch (a pure function of
   (seed, epoch, position), so a resumed run sees the same batches); every process takes its slice;
2. the context: a random N-subset of the global batch's documents (with the document prompt), drawn from a
   generator seeded by (seed, step), shared by every process and by the queries and documents of the step;
3. the loss: InfoNCE query → [positives of the slice, hard negatives of the slice], cosine / τ, with the
   teacher's false negatives and duplicate positives masked out of each query's denominator;
4. gradients (plain or two-stage GradCache), averaged over processes, clipped; AdamW; the learning-rate
   schedule of the unified recipe.

Checkpoints (``checkpoint-N/``: weights, optimizer, scheduler, RNG, position) are written to
``.checkpoint-N.partial``, sealed with a checksum marker and renamed (:mod:`neoembed.runs`); SIGTERM / Ctrl-C
checkpoint after the current step and exit 143 / 130; a NaN/inf loss stops before the update.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from pathlib import Path

import numpy as np
import torch

from neoembed.adapters import add_lora, count_parameters, merge_lora, require_peft
from neoembed.cde.batching import (
    ContextualBatches,
    cached_arrays,
    cached_clustering,
    cluster_pairs,
    clustering_key,
    reduce_dimensions,
    teacher_embeddings,
    teacher_identity,
)
from neoembed.cde.gradcache import TextStage, full_backprop_step, stages, two_stage_gradcache_step
from neoembed.cde.loss import cde_loss, gathered_documents, step_mask
from neoembed.cde.model import save_cde_adapter
from neoembed.cde.recipe import CDERecipe
from neoembed.compile import compile_layers
from neoembed.data.cards import (
    DataCardError,
    card_fingerprints,
    explain_data_errors,
    load_recipe_cards,
    local_data_paths,
    prepare_card,
)
from neoembed.data.check import require_hub
from neoembed.loop import RunLoop, StepOutput, accelerator, adamw, check_engine, mean_loss_and_stop
from neoembed.model_card import base_model_name, based_on, best_checkpoint_sentence, training_prompts
from neoembed.recipe import resolve_recipe_path
from neoembed.runs import (
    TrainingStopped,
    check_output_flags,
    check_pairs,
    check_weight_files,
    model_fingerprint,
    prepare_output_dir,
    require_module,
    resume_defaults,
    resume_settings,
    save_final_model,
)
from neoembed.sentence import record_matryoshka_dims, resolve_packaged

__all__ = ["TrainingStopped", "cde_loss", "prepare_sources", "train_cde"]

logger = logging.getLogger(__name__)


class Source:
    """One training source: texts and (when clustering or filtering) teacher embeddings."""

    def __init__(self, name: str, queries: list[str], positives: list[str], negatives: list[list[str]]):
        self.name, self.queries, self.positives, self.negatives = name, queries, positives, negatives
        self.k = len(negatives[0]) if negatives else 0
        self.teacher_q = self.teacher_d = self.teacher_n = None

    def __len__(self) -> int:
        return len(self.queries)


def prepare_sources(recipe: CDERecipe, recipe_dir: Path | None = None) -> tuple[list[Source], list]:
    """Load and check every card before training."""
    search = [Path(resolve_recipe_path(d, recipe_dir)) for d in recipe.card_dirs]
    loaded = load_recipe_cards(recipe.datasets, search)
    require_hub([card for card, _ in loaded])  # no network: one probe and a clear error, not retries per card
    sources, cards = [], []
    for entry, (card, folder) in zip(recipe.datasets, loaded, strict=True):
        if entry.batch_size is not None:
            raise DataCardError(
                f"card {card.name}: per-dataset batch_size is not supported by CDE (one global batch size)"
            )
        # a seeded sample of max_rows; every dropped row is counted against the card's expected_loss
        args = (entry.max_rows, entry.max_negatives, recipe.template, recipe.instructions, recipe.seed)
        with explain_data_errors(card, folder):  # a bad byte surfaces only when the rows are read
            pairs, _ = prepare_card(card, folder, *args)
        if len(pairs) < recipe.batch_size:
            raise DataCardError(
                f"card {card.name}: batch size {recipe.batch_size} is larger than the dataset ({len(pairs)} "
                "usable rows); lower batch_size or add data"
            )
        neg_cols = sorted(
            (c for c in pairs.column_names if c.startswith("negative_")), key=lambda c: int(c[9:])
        )
        negatives = [list(x) for x in zip(*(pairs[c] for c in neg_cols), strict=True)] if neg_cols else []
        check_pairs(card.name, pairs["query"], pairs["positive"], lambda text: text)
        sources.append(Source(card.name, pairs["query"], pairs["positive"], negatives))
        cards.append((card, folder))
    for source in sources:
        warn_small_context(source.name, recipe.batch_size * (1 + source.k), recipe.context.n_context)
    return sources, cards


def warn_small_context(name: str, documents: int, n_context: int) -> bool:
    """Say so (once per source, before training) when a batch holds fewer documents than the N context slots:
    each step's context is then drawn from them with replacement, so it repeats documents."""
    if documents >= n_context:
        return False
    logger.warning(
        "card %s: a batch holds %d documents (batch_size x (1 + negatives)) but context.n_context is %d: every "
        "context repeats documents (drawn with replacement, ~%.1f copies each). Raise batch_size, or lower "
        "context.n_context to at most %d",
        name, documents, n_context, n_context / documents, documents,
    )  # fmt: skip
    return True


def _batching(recipe: CDERecipe) -> str:
    """How the run's batches are made, as its summary line says: clustered, or random (clustering off, or every
    pair a cluster of its own, concatenated in random order)."""
    c, size = recipe.clustering, recipe.clustering.cluster_size or recipe.batch_size
    if not c.enabled or (size == 1 and not c.tour):
        return "random" if not c.enabled else "random: clusters of 1 pair"
    if size < recipe.batch_size and not c.tour:
        return f"clustered in clusters of {size}, ~{-(-recipe.batch_size // size)} a batch"
    return "clustered"


def _warn_small_clusters(recipe: CDERecipe) -> None:
    """Clusters smaller than a batch, concatenated in random order, put pieces of several unrelated clusters in
    each batch (a ``tour`` puts neighbouring ones together); clusters of one pair make random batches."""
    c, batch = recipe.clustering, recipe.batch_size
    size = c.cluster_size or batch
    if not c.enabled or c.tour or size >= batch:
        return
    what = (
        "every pair is a cluster of its own, so the contextual batches are random ones"
        if size == 1
        else f"each contextual batch holds pieces of {-(-batch // size)} or more clusters in random order, so its "
        "pairs are less alike than one cluster's"
    )
    logger.warning(
        "clustering.cluster_size %d is below batch_size %d: %s. Leave clustering.cluster_size unset (the batch "
        "size) for batches of one cluster each, or set clustering.tour: true to put neighbouring clusters together",
        size, batch, what,
    )  # fmt: skip


def _teacher_pass(recipe: CDERecipe, sources: list[Source], progress: bool, steps_left: bool = True):
    """Teacher embeddings of every source (cached with the clustering, the negatives' beside it) and the
    contextual batches; none where no step is left to train (a resume that only writes the final model)."""
    from sentence_transformers import SentenceTransformer

    clustered = recipe.clustering.enabled and steps_left
    need_teacher = steps_left and (recipe.clustering.enabled or recipe.filtering.enabled)
    teacher_id = teacher_identity(recipe.clustering.teacher) if need_teacher else None  # the weights too
    teacher, cache = None, recipe.clustering.cache_dir
    cache = Path(os.path.expanduser(cache)) if cache else None
    size = recipe.clustering.cluster_size or recipe.batch_size
    _warn_small_clusters(recipe)
    assignments, centroids, offsets, offset = [], [], [], 0
    for src in sources:
        offsets.append(offset)
        offset += len(src)
        if clustered and len(src) <= size:  # k = ceil(pairs / size) = 1
            logger.warning(
                "card %s: %d pairs and clustering.cluster_size %d make one cluster: its contextual batches are "
                "random ones. Lower clustering.cluster_size (default: the batch size)",
                src.name, len(src), size,
            )  # fmt: skip
        if not need_teacher:
            continue
        key = clustering_key(
            teacher=teacher_id,
            queries=src.queries,
            documents=src.positives,
            size=size,
            dims=recipe.clustering.dims,
            niter=recipe.clustering.niter,
            seed=recipe.seed,
        )

        def compute(src=src):
            nonlocal teacher
            if teacher is None:
                teacher = SentenceTransformer(resolve_packaged(recipe.clustering.teacher), device="cpu")
            q = teacher_embeddings(teacher, src.queries, progress=progress)
            d = teacher_embeddings(teacher, src.positives, progress=progress)
            rq, rd = (
                reduce_dimensions(q, recipe.clustering.dims),
                reduce_dimensions(d, recipe.clustering.dims),
            )
            assign, cents = cluster_pairs(rq, rd, size, seed=recipe.seed, niter=recipe.clustering.niter)
            return assign, cents, q, d

        assign, cents, q, d = cached_clustering(cache, key, compute)
        src.teacher_q, src.teacher_d = torch.from_numpy(q), torch.from_numpy(d)
        if recipe.filtering.enabled and src.k:
            flat = [t for row in src.negatives for t in row]

            def embed_negatives(flat=flat):
                nonlocal teacher
                if teacher is None:
                    teacher = SentenceTransformer(resolve_packaged(recipe.clustering.teacher), device="cpu")
                return (teacher_embeddings(teacher, flat, progress=progress),)

            negatives_key = clustering_key(teacher=teacher_id, negatives=flat)
            (n,) = cached_arrays(cache, negatives_key, embed_negatives, ("n",))
            src.teacher_n = torch.from_numpy(n).view(len(src), src.k, -1)
        assignments.append(assign)
        centroids.append(cents)
    if not clustered:  # random batches: one cluster per pair, shuffled per epoch
        assignments = [np.arange(len(s)) for s in sources]
        centroids = None
    return ContextualBatches(
        assignments,
        offsets,
        recipe.batch_size,
        seed=recipe.seed,
        tour=recipe.clustering.tour and clustered,
        centroids=centroids,
    ), offsets


def _locate(index: int, offsets: list[int]) -> tuple[int, int]:
    s = int(np.searchsorted(offsets, index, side="right") - 1)
    return s, index - offsets[s]


def _tokenize(tokenizer, texts: list[str], max_length: int, device) -> dict[str, torch.Tensor]:
    f = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return {"input_ids": f["input_ids"].to(device), "attention_mask": f["attention_mask"].to(device)}


def _model_card(recipe: CDERecipe, cards, steps: int, best: dict | None = None) -> str:
    base = base_model_name(recipe.model)
    lines = [
        "---",
        "library_name: sentence-transformers",
        "tags: [sentence-transformers, contextual-document-embeddings, neoembed]",
        *([f"base_model: {base}"] if base else []),
        "---",
        "",
        "# CDE model trained with neoembed",
        "",
        f"Two-stage contextual document embedding model (Morris & Rush, 2024) built on {based_on(base)}: "
        f"{recipe.context.n_context} context vectors, {recipe.context.n_soft_prompt} soft-prompt vectors, "
        f"{steps} steps, batch {recipe.batch_size}, temperature {recipe.temperature}"
        + (f", Matryoshka dimensions {recipe.matryoshka.dims}." if recipe.matryoshka else ".")
        + best_checkpoint_sentence(best),
        "",
        "## Usage",
        "",
        "```python",
        "import neoembed",
        "model = neoembed.load(PATH)",
        f"E = model.encode_context(corpus_sample)   # at least {recipe.context.n_context} documents of the corpus",
        'q = model.encode(queries, prompt_name="query", dataset_embeddings=E)',
        'd = model.encode(documents, prompt_name="document", dataset_embeddings=E)',
        'q0 = model.encode(queries, prompt_name="query", dataset_embeddings="null")  # no corpus',
        "```",
        "",
        "Without neoembed: `SentenceTransformer(PATH, trust_remote_code=True)`; the context is "
        '`model[0].encode_context(docs, prompt=model.prompts.get("document"))`.',
        "",
        "## Training data",
        "",
    ]
    for card, _ in cards:
        flag = " — research use only" if card.research_only else ""
        lines.append(f"- {card.name}: licence {card.license}{flag}")
    return "\n".join(lines) + "\n"


def _accelerator(recipe: CDERecipe):
    """The processes, checkpoints and RNG states of accelerate, for a model it does not wrap whole.

    The model is never ``prepare``d: the two-stage GradCache backpropagates through the stages in separate passes
    (the second stage's, then the first's), which one DDP wrapper around both cannot follow. Each stage gets its
    own DDP wrapper instead (:func:`_stages`)."""
    check_engine("cde")
    acc = accelerator(cpu=not torch.cuda.is_available())
    if recipe.batch_size % acc.num_processes:
        raise ValueError(
            f"batch_size {recipe.batch_size} is not a multiple of the {acc.num_processes} processes"
        )
    return acc


def _build_model(recipe: CDERecipe, device, cards=()):
    """The two-stage model on the recipe's backbone (layers compiled when ``recipe.compile``); its ``query`` prompt
    the recipe's, or else the prefix every query of ``cards`` trained with, as the unified trainer saves it."""
    from neoembed.cde.model import ContextualSentenceTransformer

    instructions = [card.instruction if recipe.instructions else None for card, _ in cards]
    query_prompt = training_prompts(instructions, recipe.template)["query"] if cards else ""

    model = ContextualSentenceTransformer.from_backbone(
        recipe.model,
        n_context=recipe.context.n_context,
        n_soft_prompt=recipe.context.n_soft_prompt,
        max_seq_length=recipe.max_length,
        exclude_prompt=recipe.context.exclude_prompt,
        context_dropout=recipe.context.dropout,
        prompts={**recipe.prompts, "query": recipe.prompts.get("query") or query_prompt},
        device=str(device),
    )
    if recipe.adapter is not None:  # before compiling: the adapter's layers are part of the compiled graph
        a = recipe.adapter
        add_lora(model, a.r, a.alpha, a.dropout, a.target_modules, train_heads=True)
        logger.info("LoRA adapter on both stages: %d of %d parameters train", *count_parameters(model))
    compile_layers(model, recipe.compile)  # both stages' layers; no-op when recipe.compile is false
    return model


def _stages(module, acc):
    """The model's two stages (:func:`neoembed.cde.gradcache.stages`), each in DDP across processes: its
    gradients reduced in DDP's buckets once a step. The text stage may leave the null context unused (context
    dropout off or nothing dropped this step), hence ``find_unused_parameters`` there; the buffers are constants
    (RoPE frequencies), so they are not broadcast before every chunk's forward."""
    if acc.num_processes == 1:
        return stages(module)
    from torch.nn.parallel import DistributedDataParallel

    ids = [acc.device.index] if acc.device.type == "cuda" else None

    def wrap(stage):
        unused = isinstance(stage, TextStage)
        return DistributedDataParallel(
            stage, device_ids=ids, find_unused_parameters=unused, broadcast_buffers=False
        )

    return stages(module, wrap)


def _run_record(
    recipe: CDERecipe, cards, sources: list[Source], module, per_epoch: int
) -> tuple[list[Path], dict]:
    """The files the run record hashes (the cards' local data) and what it adds to the loop's record."""
    data_files = [folder / card.source.local.path for card, folder in cards if card.source.local]
    extra = {
        "base_model": base_model_name(recipe.model),  # the model card's hub id (None: a local model)
        "steps_per_epoch": per_epoch,
        "sources": {s.name: len(s) for s in sources},
        "parameters": sum(p.numel() for p in module.parameters()),
        "negatives_per_query": {s.name: s.k for s in sources},
    }
    return data_files, extra


def _save_model(model, recipe: CDERecipe, folder: Path, training: bool = False) -> None:
    """The model as an ordinary CDE folder. With an adapter it is saved merged (loads anywhere, without PEFT),
    the final model also with the adapters alone in ``adapter/``; during training (a checkpoint) a merged copy is
    saved, so that the model being trained keeps its adapter."""
    saved = [folder]
    if recipe.adapter is not None:
        if training:
            model = copy.deepcopy(model)
        else:
            saved.append(save_cde_adapter(model, folder / "adapter"))
        merge_lora(model)
    model.save(str(folder))
    for written in saved if recipe.matryoshka is not None else ():
        record_matryoshka_dims(written, recipe.matryoshka.dims)


def _check_extras(recipe: CDERecipe, resume: bool = False) -> None:
    """Trackers (and the tracked runs a resume continues), faiss and PEFT the recipe needs: checked before
    data or the model load."""
    from neoembed.runs import check_trackers

    check_trackers(recipe.report_to, Path(recipe.output_dir), resume)
    _require_faiss(recipe)
    if recipe.adapter is not None:
        require_peft()


def _require_faiss(recipe: CDERecipe) -> None:
    if recipe.clustering.enabled:  # contextual batches come from faiss k-means
        require_module(
            "faiss", "faiss", "CDE training with clustering (clustering.enabled: false turns it off)"
        )


def _inputs_by_content(recipe: CDERecipe, cards) -> dict:
    """What a resume compares beside the recipe: the cards' data, the backbone (a resume loads its tokenizer and
    configuration beside the checkpoint's weights) and, where its embeddings make the batches or negatives, the
    teacher, each by content (a folder edited in place keeps its path)."""
    uses = recipe.clustering.enabled or recipe.filtering.enabled
    teacher = {"clustering.teacher_identity": teacher_identity(recipe.clustering.teacher)} if uses else {}
    return card_fingerprints(cards) | {"model_fingerprint": model_fingerprint(recipe.model)} | teacher


def train_cde(
    recipe: CDERecipe,
    recipe_dir: Path | None = None,
    resume: bool = False,
    progress: bool = True,
    overwrite: bool = False,
    evaluator=None,
) -> Path:
    """Run a CDE recipe; returns the output folder (the final model, metrics.jsonl, run record, checkpoints).
    The folder must be new or empty unless ``resume`` or ``overwrite`` (:func:`neoembed.runs.prepare_output_dir`);
    SIGTERM / Ctrl-C raise :class:`~neoembed.runs.TrainingInterrupted` after the checkpoint. ``evaluator``
    (``neoembed.eval.training.MtebEvaluator`` for the recipe's ``eval:``, passed in by ``neoembed train``) scores
    the model as ``neoembed mteb`` scores a CDE model, with a seeded corpus sample as each task's context."""
    from neoembed.recipe import seed_everything
    from neoembed.record import atomic_write_text

    _check_extras(recipe, resume)
    acc = _accelerator(recipe)
    seed_everything(recipe.seed)
    output = Path(recipe.output_dir)
    # before the data: a big card takes minutes
    check_output_flags(output, overwrite=overwrite, resume=resume, command="train")
    sources, cards = prepare_sources(recipe, recipe_dir)
    data = _inputs_by_content(recipe, cards)
    settings = resume_settings(recipe) | data
    checkpoint = prepare_output_dir(
        output, command="train", overwrite=overwrite, resume=resume, settings=settings,
        defaults=resume_defaults(recipe) | data,  # a run recorded before these keys resumes as before
        main_process=acc.is_main_process, inputs=(recipe.model, *local_data_paths(cards)),
    )  # fmt: skip
    check_weight_files(recipe.model)
    with acc.main_process_first():  # with a cache, the other processes read what the first one computed
        steps_left = checkpoint is None or int(checkpoint.name.split("-")[1]) < recipe.steps
        batches, offsets = _teacher_pass(recipe, sources, progress and acc.is_main_process, steps_left)
    per_epoch = batches.steps_per_epoch()
    if per_epoch == 0:
        raise DataCardError("no full batch: every source is smaller than the batch size")

    seed_everything(recipe.seed)
    model = _build_model(recipe, acc.device, cards)
    module = model.cde
    if recipe.matryoshka is not None:
        recipe.matryoshka.check_width(model.get_embedding_dimension())
    module.train()
    optimizer = adamw(module, recipe.optimizer)
    loop = RunLoop(
        acc,
        recipe,
        output,
        optimizer=optimizer,
        parameters=module.parameters,
        settings=settings | {"model_fingerprint": model_fingerprint(recipe.model)},  # a hub id's commit: cached now
        registered=(module, optimizer),
        desc="cde",
        progress=progress,
        nan_advice="Lower optimizer.lr or use precision bf16/fp32",
        evaluate=_evaluation(evaluator, model, module, output),
        save_model=functools.partial(
            _save_model, model, recipe, training=True
        ),  # checkpoint-N loads as a model
    )
    data_files, extra = _run_record(recipe, cards, sources, module, per_epoch)
    loop.start(checkpoint, "train-cde", data_files=data_files, extra=extra)
    batching = f"{per_epoch} contextual batches of {recipe.batch_size} per epoch ({_batching(recipe)})" if (
        steps_left) else "no batches (no step is left to train: the final model is written)"  # fmt: skip
    if acc.is_main_process:
        print(
            f"CDE: {len(sources)} source(s), {sum(map(len, sources))} pairs, {batching}, "
            f"N = {recipe.context.n_context}, {acc.num_processes} process(es), {recipe.steps} steps"
        )
    loop.run(*_cde_step(recipe, acc, module, sources, batches, offsets))

    def save_final() -> None:
        module.eval()
        save_final_model(output, functools.partial(_save_model, model, recipe), loop.step)
        atomic_write_text(output / "README.md", _model_card(recipe, cards, loop.step, loop.best_record()))

    loop.finish(save_final)
    return output


def _evaluation(evaluator, model, module, output: Path):
    """``evaluate(step)`` for the loop: the evaluator on the model being trained, its training mode put back
    (the evaluator restores the wrapper's flag, and the wrapper is not the module being trained)."""
    if evaluator is None:
        return None

    def evaluate(step: int) -> dict[str, float]:
        was_training = module.training
        try:
            return evaluator(model, output_path=str(output / "eval"), steps=step)
        finally:
            module.train(was_training)

    return evaluate


def _cde_step(recipe: CDERecipe, acc, module, sources: list[Source], batches: ContextualBatches, offsets):
    """The step function of CDE training (see the module doc, steps 1-4) and the row it logs."""
    world, rank, device = acc.num_processes, acc.process_index, acc.device
    autocast = _autocast(recipe.precision, device)
    model_stages = _stages(module, acc)
    tokenizer = module.tokenizer
    per_epoch = batches.steps_per_epoch()
    doc_prompt = recipe.prompts.get("document", "") or ""
    N, tau = recipe.context.n_context, recipe.temperature
    gather = recipe.gather_across_devices and world > 1
    epoch_cache: dict[int, list[list[int]]] = {}
    last = {"source": "", "epoch": 0}

    def step_fn(step: int, stop_requested: bool) -> StepOutput:
        nonlocal epoch_cache
        epoch, position = divmod(step, per_epoch)
        if epoch not in epoch_cache:
            epoch_cache = {epoch: batches.epoch(epoch)}
        global_batch = epoch_cache[epoch][position]
        s, _ = _locate(global_batch[0], offsets)
        src = sources[s]
        last.update(source=src.name, epoch=epoch)
        rows = [i - offsets[s] for i in global_batch]
        local = [i - offsets[s] for i in ContextualBatches.rank_slice(global_batch, rank, world)]
        all_docs = [src.positives[i] for i in rows]
        all_docs += [t for i in rows for t in (src.negatives[i] if src.k else [])]
        g = np.random.default_rng([recipe.seed, step, 7])
        pick = g.choice(len(all_docs), size=N, replace=len(all_docs) < N)
        context_texts = [doc_prompt + all_docs[j] for j in pick]
        q_texts = [src.queries[i] for i in local]
        d_texts = [doc_prompt + src.positives[i] for i in local]
        d_texts += [doc_prompt + t for i in local for t in (src.negatives[i] if src.k else [])]
        offset = rank * len(local) if gather else 0
        if gather:  # this process's rows of the global batch's mask: its queries against every document
            mask = step_mask(recipe, src, rows, [doc_prompt + t for t in all_docs], (offset, len(local)))
        else:
            mask = step_mask(recipe, src, local, d_texts)
        mask_dev = mask.to(device) if mask is not None else None
        dropped = None
        if recipe.context.dropout > 0:
            dropped = torch.from_numpy(g.random(N) < recipe.context.dropout).to(device)
        ctx = _tokenize(tokenizer, context_texts, recipe.max_length, device)
        qb = _tokenize(tokenizer, q_texts, recipe.max_length, device)
        db = _tokenize(tokenizer, d_texts, recipe.max_length, device)

        def loss_fn(q, d, mask=mask_dev):
            d = gathered_documents(d, len(local)) if gather else d
            if recipe.matryoshka is not None:  # nested dimensions, on the embeddings the step computed
                return recipe.matryoshka.loss(cde_loss, q, d, tau, mask, offset)
            return cde_loss(q, d, tau, mask, offset)

        with autocast:
            if recipe.chunk_size:
                loss = two_stage_gradcache_step(
                    module, ctx, qb, db, loss_fn, recipe.chunk_size, dropped, model_stages=model_stages
                )
            else:
                loss = full_backprop_step(module, ctx, qb, db, loss_fn, dropped, model_stages)
        stats = mean_loss_and_stop(float(loss), stop_requested, world, device)
        masked = float(mask.float().mean()) if mask is not None else 0.0
        return StepOutput(
            loss=float(stats[0]), stop=bool(stats[1] > 0), sums={"loss": float(stats[0]), "masked": masked}
        )

    def row_fn(sums: dict, seconds: float, grad_norm, lr: float) -> dict:
        peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
        return {
            "loss": sums["loss"] / sums["steps"],
            "learning_rate": lr,
            "grad_norm": grad_norm,
            "dataset": last["source"],
            "epoch": last["epoch"],
            "masked_fraction": sums["masked"] / sums["steps"],
            "samples_per_s": sums["steps"] * recipe.batch_size / max(seconds, 1e-9),
            "peak_memory_mib": round(peak, 1) if peak is not None else None,
            "world_size": world,
        }

    return step_fn, row_fn


def _autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(
        device_type=device.type, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    )
