"""The pre-training loop: masked language modelling on packed token shards, with accelerate.

One optimizer step, top to bottom:

1. choose the step's data source (probability ∝ weight, seeded by (seed, step): stage 2's 0.2 / 0.4 / 0.4
   mixture of the full corpus and the >1,024 / >2,048 subsets);
2. every process reads the same *global* batch (``micro_batch_size x grad_accumulation x processes``
   sequences) from that source's :class:`~neoembed.pretrain.packing.DocumentStream` and masks it with a
   generator seeded by (seed, step) — cheap next to the forward pass, and it makes the data a pure function
   of (recipe, step): one process and two processes see the same tokens, and a resumed run the same batches;
3. each process runs its own micro-batches (``(process, micro-step)`` owns a fixed slice); the loss of a
   micro-batch is its summed cross-entropy over masked tokens divided by the masked tokens of the *global*
   batch, so the accumulated, all-reduced gradient is that of the global token mean however the batch is
   split;
4. the step's loss and masked accuracy are all-reduced (one small tensor, which also carries the stop flag
   of SIGTERM / Ctrl-C); a NaN/inf loss stops before the weights change;
5. clip the gradient norm, AdamW step, the learning rate of :mod:`~neoembed.pretrain.schedule`.

Checkpoints (``checkpoint-N/``) hold accelerate's state (model, optimizer, RNG of every process) plus
``trainer_state.json`` (step, scheduler, the position of every data stream). They are written to
``.checkpoint-N.partial``, sealed with a checksum marker and renamed (:mod:`neoembed.runs`), so a kill never
leaves half a checkpoint to resume from. SIGTERM / Ctrl-C checkpoint and exit 143 / 130.

    neoembed pretrain pretrain-tiny      # the shipped tiny tokenizer and shards: seconds on CPU
    accelerate launch --num_processes 8 -m neoembed pretrain pretrain-stage1 data.sources='[{path: rw}]'
    neoembed pretrain pretrain-stage1 ... --resume
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from neoembed.compile import compile_layers
from neoembed.loop import RunLoop, StepOutput, accelerator, adamw, check_engine
from neoembed.pretrain.masking import IGNORE_INDEX, mask_tokens, step_generator
from neoembed.pretrain.packing import DocumentStream, collate_packed, collate_padded
from neoembed.pretrain.recipe import PretrainRecipe
from neoembed.pretrain.schedule import lr_lambda
from neoembed.runs import (
    TrainingStopped,
    check_output_flags,
    check_weight_files,
    prepare_output_dir,
    resume_defaults,
    resume_settings,
    save_final_model,
)

__all__ = ["MLMObjective", "TrainingStopped", "choose_source", "pretrain"]

logger = logging.getLogger(__name__)

EVAL_SEED = 1_000_000_007  # the held-out sequences' order and masks: apart from every training step's seed


class MLMObjective(nn.Module):
    """Masked-LM loss that runs the decoder on the masked positions only (20% of the tokens).

    Returns the *summed* cross-entropy, the number of masked tokens and the number predicted correctly; the
    caller normalises. Equals ``NeoBERTForMaskedLM(labels=...).loss`` times the count (tested).
    """

    def __init__(self, mlm):
        super().__init__()
        self.mlm = mlm

    def forward(self, labels: torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.mlm.model(**inputs).last_hidden_state  # (B, L, D) or (1, T, D)
        chosen = labels != IGNORE_INDEX
        logits = self.mlm.decoder(hidden[chosen]).float()  # (n_masked, V)
        target = labels[chosen]
        loss_sum = F.cross_entropy(logits, target, reduction="sum")
        correct = (logits.argmax(-1) == target).sum()
        return loss_sum, chosen.sum(), correct


# ----------------------------------------------------------------------------------------------- helpers
def _check_vocab(vocab_size: int | None, recipe: PretrainRecipe, tokenizer) -> None:
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(
            f"the model's vocabulary ({vocab_size}) is smaller than tokenizer {recipe.tokenizer!r} ({len(tokenizer)} "
            "ids: its larger ids would index past the embedding): use the model's own tokenizer (recipe key "
            "'tokenizer'), or a larger model.config.vocab_size"
        )


def _planned_vocab(recipe: PretrainRecipe) -> int | None:
    """The vocabulary size the model will have, read before it loads (its config.json, or model.config)."""
    m = recipe.model
    if m.init_from is None:
        return m.config.get("vocab_size")
    from neoembed.modeling.convert import resolve_checkpoint

    config = Path(resolve_checkpoint(m.init_from)) / "config.json"
    return json.loads(config.read_text()).get("vocab_size") if config.is_file() else None


def _build_model(recipe: PretrainRecipe, tokenizer):
    from neoembed.modeling import NeoBERTConfig, NeoBERTForMaskedLM

    m = recipe.model
    if m.init_from is not None:
        from neoembed.modeling.convert import resolve_checkpoint

        model = NeoBERTForMaskedLM.from_pretrained(  # fp32 whatever it was saved in: precision is autocast's
            str(resolve_checkpoint(m.init_from)), attn_implementation=m.attn_implementation, dtype=torch.float32
        )
    else:
        cfg = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, **m.config}
        config = NeoBERTConfig(**cfg)
        config._attn_implementation = m.attn_implementation
        model = NeoBERTForMaskedLM(config)
    _check_vocab(model.config.vocab_size, recipe, tokenizer)
    if recipe.data.seq_length > model.config.max_sequence_length:
        raise ValueError(
            f"data.seq_length={recipe.data.seq_length} exceeds the model's maximum "
            f"{model.config.max_sequence_length}: raise model.config.max_length (from scratch) or lower seq_length"
        )
    if recipe.data.packing == "padded":
        model.config.padding_free = False
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    compile_layers(model, recipe.compile)  # no-op when recipe.compile is false
    return model


def choose_source(seed: int, step: int, probabilities: np.ndarray) -> int:
    """The data source of a step: drawn with the given probabilities from a generator seeded by (seed, step)."""
    if len(probabilities) == 1:
        return 0
    return int(np.random.default_rng([seed, step, 1]).choice(len(probabilities), p=probabilities))


def _global_batch(recipe: PretrainRecipe, stream: DocumentStream, n_sequences: int):
    """``n_sequences`` sequences, each a list of fragments (one fragment per sequence when padded)."""
    L = recipe.data.seq_length
    if recipe.data.packing == "packed":
        return [stream.packed_sequence(L) for _ in range(n_sequences)]
    return [[stream.single_document(L)] for _ in range(n_sequences)]


def _mask_global(recipe, sequences, special_ids, mask_id, vocab_size, step):
    """Mask the global batch in one draw; returns (corrupted, labels) in the same fragment structure."""
    fragments = [f for seq in sequences for f in seq]
    flat = torch.from_numpy(np.concatenate(fragments))
    corrupted, labels = mask_tokens(
        flat,
        special_ids,
        mask_id,
        vocab_size,
        recipe.masking.rate,
        recipe.masking.scheme,
        generator=step_generator(recipe.seed, step),
    )
    cuts = np.cumsum([len(f) for f in fragments])[:-1]
    c_frags, l_frags = np.split(corrupted.numpy(), cuts), np.split(labels.numpy(), cuts)
    out_c, out_l, k = [], [], 0
    for seq in sequences:
        out_c.append(c_frags[k : k + len(seq)])
        out_l.append(l_frags[k : k + len(seq)])
        k += len(seq)
    return out_c, out_l, int((labels != IGNORE_INDEX).sum())


def _micro_batch(recipe, corrupted, labels, pad_id, device):
    """Model inputs and labels for a list of sequences (packed: one row; padded: one row per document)."""
    if recipe.data.packing == "packed":
        batch = collate_packed(corrupted, recipe.data.cross_document_attention)
        lab = collate_packed(labels, recipe.data.cross_document_attention).input_ids
    else:
        batch = collate_padded([s[0] for s in corrupted], pad_id)
        lab = collate_padded([s[0] for s in labels], IGNORE_INDEX).input_ids
    inputs = {
        k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.model_inputs().items()
    }
    return inputs, lab.to(device), batch.num_tokens


# ------------------------------------------------------------------------------------------------- setup
def _accelerator(recipe: PretrainRecipe):
    """An Accelerator for the recipe, refusing launches where the processes would not train together."""
    check_engine("pretrain")
    acc = accelerator(
        mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[recipe.precision],
        gradient_accumulation_steps=recipe.batch.grad_accumulation,
    )
    if acc.distributed_type.value == "DEEPSPEED":
        # DeepSpeed's config must agree with the recipe; its micro-batch is set here because the streams are not
        # DataLoaders, whose batch size prepare() would read
        ds_config = acc.state.deepspeed_plugin.deepspeed_config
        for key, field, value in (
            ("gradient_accumulation_steps", "batch.grad_accumulation", recipe.batch.grad_accumulation),
            ("train_micro_batch_size_per_gpu", "batch.micro_batch_size", recipe.batch.micro_batch_size),
        ):
            if ds_config.get(key) not in (None, "auto", value):
                raise ValueError(
                    f"the DeepSpeed config's {key} is {ds_config[key]}, the recipe's {field} {value}: set "
                    f"deepspeed_config.{key} to {value} (or leave it out)"
                )
            ds_config[key] = value
    return acc


def _open_sources(recipe: PretrainRecipe):
    """Every source read as shards, one document stream per source, and the sources' normalised weights."""
    from neoembed.pretrain.data import ShardedCorpus

    corpora = [ShardedCorpus(s.path) for s in recipe.data.sources]
    per_step = recipe.tokens_per_step
    for source, corpus in zip(recipe.data.sources, corpora, strict=True):
        if len(corpus) == 0:  # a length subset no document reaches
            raise ValueError(
                f"source {source.path} holds no documents: remove it from data.sources (a subset of longer "
                "documents is empty when none is that long: build one with a lower length)"
            )
        if recipe.data.packing == "padded":  # one document a row: a step holds batch.sequences of them
            unit, held, needed = "documents", len(corpus), recipe.batch.sequences
        else:
            unit, held, needed = "tokens", int(corpus.lengths.sum()), per_step
        if held < needed:  # the step repeats the source within itself
            logger.warning(
                "source %s holds %d %s, fewer than one step takes per process (%d): each step repeats it about "
                "%.0f times. Add documents, or lower data.seq_length / batch.micro_batch_size",
                source.path, held, unit, needed, needed / held,
            )  # fmt: skip
    streams = [
        DocumentStream(c, seed=recipe.seed * 1000 + i, shuffle=recipe.data.shuffle)
        for i, c in enumerate(corpora)
    ]
    weights = np.array([s.weight for s in recipe.data.sources], dtype=np.float64)
    weights /= weights.sum()
    return corpora, streams, weights


def _load_tokenizer(recipe: PretrainRecipe, corpora):
    """The recipe's tokenizer, checked against the shards' vocabulary, and the ids masking leaves alone."""
    from neoembed.pretrain.data import load_tokenizer

    tokenizer = load_tokenizer(recipe.tokenizer)
    if tokenizer.mask_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError(f"tokenizer {recipe.tokenizer!r} has no [MASK] or [PAD] token; MLM needs both")
    _check_shard_vocab(corpora, recipe, tokenizer)
    return tokenizer, sorted(set(tokenizer.all_special_ids) | {tokenizer.pad_token_id})


def _check_shard_vocab(corpora, recipe: PretrainRecipe, tokenizer) -> None:
    """The shards were tokenized with the recipe's tokenizer (its size, then the vocabulary itself), and a
    checkpoint continued from was trained with it: an id must mean the token the model learned."""
    from neoembed.pretrain.data import vocab_sha256

    ours = vocab_sha256(tokenizer)
    for c in corpora:
        vocab, sha = c.meta.get("vocab_size"), c.meta.get("vocab_sha256")
        if (vocab is not None and vocab != len(tokenizer)) or (sha is not None and sha != ours):
            raise ValueError(
                f"shards {c.path} were tokenized with another vocabulary ({vocab} tokens) than the recipe's "
                f"tokenizer {recipe.tokenizer!r} ({len(tokenizer)}): set 'tokenizer' to the one used by preprocess"
            )
    theirs = _checkpoint_tokenizer(recipe)
    if theirs is not None and vocab_sha256(theirs) != ours:
        raise ValueError(
            f"model.init_from {recipe.model.init_from} was trained with its own tokenizer ({len(theirs)} tokens), "
            f"not the recipe's {recipe.tokenizer!r} ({len(tokenizer)}): its ids would mean other tokens. Set "
            f"tokenizer={recipe.model.init_from} and tokenize the shards with it (neoembed preprocess --tokenizer)"
        )


def _checkpoint_tokenizer(recipe: PretrainRecipe):
    """The tokenizer saved with ``model.init_from``, or None (none there: nothing to compare)."""
    if recipe.model.init_from is None:
        return None
    from neoembed.modeling.convert import resolve_checkpoint
    from neoembed.pretrain.data import load_tokenizer

    folder = Path(resolve_checkpoint(recipe.model.init_from))
    if not any((folder / f).is_file() for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json")):
        return None
    return load_tokenizer(str(folder))


def _global_sequences(recipe: PretrainRecipe, accelerator) -> int:
    """The sequences of one optimizer step over every process (announced once)."""
    b, accum, world = recipe.batch.micro_batch_size, recipe.batch.grad_accumulation, accelerator.num_processes
    n_global, L = recipe.batch.sequences * world, recipe.data.seq_length
    kind = "packed" if recipe.data.packing == "packed" else "at most (padded)"
    accelerator.print(
        f"effective batch: {n_global} sequences x {L} tokens = {n_global * L:,} tokens {kind} per step "
        f"(micro-batch {b} x accumulation {accum} x {world} processes); {recipe.steps:,} steps"
    )
    return n_global


def _stream_state(checkpoint: Path | None, streams, n_global: int, L: int):
    """What a checkpoint keeps of the data (every stream's position, the global batch) and how it is read back."""

    def trainer_state() -> dict:
        return {"streams": [st.state_dict() for st in streams], "global_sequences": n_global, "seq_length": L}

    def load_state(state: dict) -> None:
        if state["global_sequences"] != n_global or state["seq_length"] != L:
            raise ValueError(
                f"{checkpoint} was written with a global batch of {state['global_sequences']} x "
                f"{state['seq_length']} tokens, this run has {n_global} x {L}: an exact resume needs the same "
                "global batch"
            )
        for stream, st in zip(streams, state["streams"], strict=True):
            stream.load_state_dict(st)

    return trainer_state, load_state


def _run_record(corpora, model, n_global: int, L: int, held_out: HeldOut | None) -> tuple[list[Path], dict]:
    """The files the run record hashes (every shard folder's index files, the held-out ones too) and what it adds
    to the loop's record."""
    files = ("meta.json", "stats.json", "subset.json", "docs.npy")
    held = held_out.corpora if held_out is not None else []
    extra = {
        "global_batch_sequences": n_global,
        "global_batch_tokens": n_global * L,
        "data_fingerprints": {c.path.as_posix(): c.fingerprint for c in corpora},
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if held:
        extra["eval_data_fingerprints"] = {c.path.as_posix(): c.fingerprint for c in held}
    return [c.path / name for c in [*corpora, *held] for name in files], extra


# ------------------------------------------------------------------------------------------------- train
def pretrain(
    recipe: PretrainRecipe, resume: bool = False, progress: bool = True, overwrite: bool = False
) -> Path:
    """Run a pre-training recipe; returns the output folder (final model in the neoembed layout, tokenizer,
    ``metrics.jsonl``, ``run_record.json``, checkpoints). The folder must be new or empty unless ``resume`` or
    ``overwrite`` (:func:`neoembed.runs.prepare_output_dir`); SIGTERM / Ctrl-C raise
    :class:`~neoembed.runs.TrainingInterrupted` after the checkpoint."""
    from neoembed.recipe import seed_everything
    from neoembed.runs import check_trackers

    # a missing tracker, or a tracked run a resume cannot continue, fails before data or the model load
    check_trackers(recipe.report_to, Path(recipe.output_dir), resume)
    accelerator = _accelerator(recipe)
    output = Path(recipe.output_dir)
    # before the tokenizer and shards load
    check_output_flags(output, overwrite=overwrite, resume=resume, command="pretrain")
    seed_everything(recipe.seed)
    corpora, streams, weights = _open_sources(recipe)
    held = _open_held_out(recipe, corpora)
    tokenizer, special_ids = _load_tokenizer(recipe, corpora)
    _check_vocab(_planned_vocab(recipe), recipe, tokenizer)  # before the model loads
    # the shards by content, by their place in data.sources (a path changed is that key's difference): a resume
    # on other or edited shards is refused by name
    data = {f"data.sources.{i}.shards": c.content_key() for i, c in enumerate(corpora)}
    settings = resume_settings(recipe, per_process_batch=True) | data
    checkpoint = prepare_output_dir(
        output,
        command="pretrain",
        overwrite=overwrite,
        resume=resume,
        defaults=resume_defaults(recipe, per_process_batch=True) | data,  # a run from before data.* resumes
        settings=settings,
        main_process=accelerator.is_main_process,
    )
    if recipe.model.init_from is not None:
        check_weight_files(recipe.model.init_from)
    vocab_size = _planned_vocab(recipe) or len(tokenizer)
    held_out = _held_out(recipe, held, tokenizer, special_ids, vocab_size)  # errors before the model loads

    model = _build_model(recipe, tokenizer)
    optimizer = adamw(model, recipe.optimizer)
    s = recipe.schedule
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(s.warmup_steps, recipe.steps, s.decay_fraction, s.final_ratio)
    )
    objective, optimizer = accelerator.prepare(MLMObjective(model), optimizer)
    n_global, L = _global_sequences(recipe, accelerator), recipe.data.seq_length
    trainer_state, load_state = _stream_state(checkpoint, streams, n_global, L)
    loop = RunLoop(
        accelerator,
        recipe,
        output,
        optimizer=optimizer,
        scheduler=scheduler,
        parameters=objective.parameters,
        settings=settings,
        trainer_state=trainer_state,
        desc="pretrain",
        progress=progress,
        nan_advice="Lower optimizer.lr, raise schedule.warmup_steps, or use precision bf16/fp32 instead of fp16",
        evaluate=_mlm_evaluator(recipe, accelerator, objective, held_out, tokenizer, special_ids),
        eval_data=sorted(c.content_key() for c in held_out.corpora) if held_out is not None else None,
    )
    data_files, extra = _run_record(corpora, model, n_global, L, held_out)
    loop.start(checkpoint, "pretrain", data_files=data_files, extra=extra, load_state=load_state)
    loop.run(*_mlm_step(recipe, accelerator, objective, streams, weights, tokenizer, special_ids))

    def save_final() -> None:
        def write(folder: Path) -> None:
            accelerator.unwrap_model(objective).mlm.save_pretrained(folder)
            tokenizer.save_pretrained(folder)

        save_final_model(output, write, loop.step)

    loop.finish(save_final)
    accelerator.end_training()
    return output


@dataclass
class HeldOut:
    """What ``eval:`` scores, prepared once before the model loads: the held-out shards, their masked sequences,
    and the documents that pseudo-perplexity scores."""

    corpora: list
    corrupted: list
    labels: list
    ppl_documents: list


def _open_held_out(recipe: PretrainRecipe, corpora) -> list:
    """The ``eval.sources`` shards, which must be other documents than ``data.sources``: the recipe compares the
    paths as written, here the shards themselves (a path spelled another way, a copy of the training shards),
    before anything is written. [] without ``eval:``."""
    if recipe.eval is None:
        return []
    from neoembed.pretrain.data import ShardedCorpus

    trained, held = {c.fingerprint: c.path for c in corpora}, []
    for source in recipe.eval.sources:
        held.append(ShardedCorpus(source.path))
        if held[-1].fingerprint in trained:
            raise ValueError(
                f"eval.sources {source.path} holds the documents of data.sources {trained[held[-1].fingerprint]} "
                f"(same shards: fingerprint {held[-1].fingerprint}): evaluation needs held-out shards (preprocess "
                "a separate set of documents)"
            )
    return held


def _held_out(
    recipe: PretrainRecipe, corpora: list, tokenizer, special_ids, vocab_size: int
) -> HeldOut | None:
    """``eval.sequences`` sequences of the held-out shards, packed and masked with a fixed seed (the recipe's
    masking), and the first ``eval.ppl_texts`` documents of at least ``eval.ppl_length`` tokens; None without
    ``eval:``."""
    if recipe.eval is None:
        return None
    _check_shard_vocab(corpora, recipe, tokenizer)
    shares = np.array_split(np.arange(recipe.eval.sequences), len(corpora))
    sequences = [
        seq
        for i, (c, share) in enumerate(zip(corpora, shares, strict=True))
        for seq in _global_batch(recipe, DocumentStream(c, seed=EVAL_SEED + i, shuffle=False), len(share))
    ]
    corrupted, labels, _ = _mask_global(
        recipe, sequences, special_ids, tokenizer.mask_token_id, vocab_size, EVAL_SEED
    )
    return HeldOut(corpora, corrupted, labels, _ppl_documents(recipe, corpora))


def _ppl_documents(recipe: PretrainRecipe, corpora) -> list:
    """The held-out documents pseudo-perplexity scores (their first ``ppl_length`` tokens), in shard order, as
    ``neoembed ppl --data SHARDS --lengths ppl_length --max-docs ppl_texts`` picks them."""
    n, L = recipe.eval.ppl_texts, recipe.eval.ppl_length
    chosen = [torch.as_tensor(c[i][:L]) for c in corpora for i in np.flatnonzero(c.lengths >= L)[:n]][:n]
    if len(chosen) < n:
        raise ValueError(
            f"eval.ppl_texts {n}: the held-out shards have only {len(chosen)} documents of eval.ppl_length {L} "
            "tokens or more; lower either, or add held-out documents"
        )
    return chosen


def _mlm_evaluator(
    recipe: PretrainRecipe, accelerator, objective, held_out: HeldOut | None, tokenizer, special_ids
):
    """``evaluate(step)`` for the loop: masked-LM loss, accuracy and perplexity on the held-out sequences (the same
    tokens and masks every time), and the pseudo-perplexity of the held-out documents; None without ``eval:``."""
    if held_out is None:
        return None
    b = recipe.batch.micro_batch_size

    def mlm_sums(model) -> np.ndarray:
        sums = np.zeros(3)  # loss sum, masked tokens, correct
        for first in range(0, len(held_out.corrupted), b):
            inputs, lab, _ = _micro_batch(
                recipe,
                held_out.corrupted[first : first + b],
                held_out.labels[first : first + b],
                tokenizer.pad_token_id,
                accelerator.device,
            )
            sums += [float(x) for x in model(lab, **inputs)]
        return sums

    def evaluate(step: int) -> dict[str, float]:
        model = accelerator.unwrap_model(objective)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), accelerator.autocast():
                sums = mlm_sums(model)
                scores = _pseudo_perplexity(model.mlm, held_out.ppl_documents, special_ids, tokenizer)
        finally:
            model.train(was_training)
        loss = sums[0] / max(sums[1], 1)
        return {
            "mlm_loss": loss,
            "mlm_accuracy": sums[2] / max(sums[1], 1),
            "mlm_perplexity": math.exp(min(loss, 80)),
            **scores,
        }

    return evaluate


def _pseudo_perplexity(mlm, documents: list, special_ids, tokenizer) -> dict[str, float]:
    """``pseudo_perplexity``: each non-special token of each document masked in turn (neoembed ppl's measure)."""
    if not documents:
        return {}
    from neoembed.pretrain.ppl import pseudo_nll

    nll, count = 0.0, 0
    for doc in documents:
        s, n = pseudo_nll(mlm, doc, special_ids, tokenizer.mask_token_id)
        nll, count = nll + s, count + n
    return {"pseudo_perplexity": math.exp(min(nll / max(count, 1), 80))}


def _mlm_step(recipe: PretrainRecipe, accelerator, objective, streams, weights, tokenizer, special_ids):
    """The step function of pre-training (see the module doc, steps 1-4) and the row it logs."""
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    b, accum = recipe.batch.micro_batch_size, recipe.batch.grad_accumulation
    n_global = b * accum * world
    vocab_size = accelerator.unwrap_model(objective).mlm.config.vocab_size
    last = {"source": 0}

    def step_fn(step: int, stop_requested: bool) -> StepOutput:
        source = last["source"] = choose_source(recipe.seed, step, weights)
        sequences = _global_batch(recipe, streams[source], n_global)
        corrupted, labels, n_masked = _mask_global(
            recipe, sequences, special_ids, tokenizer.mask_token_id, vocab_size, step
        )
        scale = world * accum / max(n_masked, 1)  # backward divides by accum, DDP averages over world
        stats = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, correct, tokens, stop
        for m in range(accum):
            first = (m * world + rank) * b
            inputs, lab, n_tokens = _micro_batch(
                recipe,
                corrupted[first : first + b],
                labels[first : first + b],
                tokenizer.pad_token_id,
                device,
            )
            with accelerator.accumulate(objective):
                loss_sum, _, correct = objective(lab, **inputs)
                accelerator.backward(loss_sum * scale)
            stats[0] += loss_sum.detach().double()
            stats[1] += correct.double()
            stats[2] += n_tokens
        stats[3] = 1.0 if stop_requested else 0.0
        if world > 1:
            stats = accelerator.reduce(stats, reduction="sum")
        sums = {"loss": float(stats[0]), "n": n_masked, "correct": float(stats[1]), "tokens": float(stats[2])}
        return StepOutput(loss=sums["loss"] / max(n_masked, 1), stop=bool(stats[3] > 0), sums=sums)

    def row_fn(sums: dict, seconds: float, grad_norm, lr: float) -> dict:
        return {
            "loss": sums["loss"] / max(sums["n"], 1),
            "masked_accuracy": sums["correct"] / max(sums["n"], 1),
            "learning_rate": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": sums["tokens"] / max(seconds, 1e-9),
            "tokens": int(sums["tokens"]),
            "source": recipe.data.sources[last["source"]].path if len(streams) > 1 else None,
        }

    return step_fn, row_fn
