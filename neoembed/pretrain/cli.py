"""``neoembed preprocess``, ``neoembed pretrain`` and ``neoembed ppl`` (heavy imports inside the commands)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def _ints(text: str | None, option: str) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(
            f"{option} takes comma-separated integers such as 1024,2048; got {text!r}"
        ) from None


def preprocess_command(
    source: Annotated[
        str,
        typer.Argument(
            help="Text/JSONL file or folder (read recursively; hidden files and folders, names starting with "
            "'.', skipped), hub:ID[:CONFIG] (streamed), or a corpus card (e.g. refinedweb)."
        ),
    ],
    out: Annotated[Path, typer.Argument(help="Output shard folder (rerun the same command to resume).")],
    tokenizer: Annotated[
        str, typer.Option("--tokenizer", help="Tokenizer folder or hub id (uncased WordPiece of NeoBERT).")
    ] = "chandar-lab/NeoBERT",
    column: Annotated[str, typer.Option("--column", help="Text column of JSON rows.")] = "text",
    max_docs: Annotated[
        int | None, typer.Option("--max-docs", min=1, help="Stop after this many documents.")
    ] = None,
    shard_tokens: Annotated[
        int, typer.Option("--shard-tokens", min=1, help="Tokens per shard file.")
    ] = 50_000_000,
    min_lengths: Annotated[
        str | None,
        typer.Option("--min-lengths", help="Build subsets of documents longer than these, e.g. 1024,2048."),
    ] = None,
) -> None:
    """Tokenize a corpus into shards, report length statistics, build length-filtered subsets.

    One document per file: .txt, .md, .rst (the whole file, however many lines).
    One document per row: JSON lines (.jsonl, .jsonl.gz) and .json arrays, the text in --column.
    One document per line of a text file: write it as JSON lines, one {"text": "..."} a line."""
    from neoembed.hub import check_model_source
    from neoembed.runs import output_lock

    # 10,10 is one subset: built and said once
    lengths = tuple(dict.fromkeys(_ints(min_lengths, "--min-lengths")))
    if lengths and min(lengths) < 1:  # "longer than 0" is every document, "-5" a folder named gt-5
        raise typer.BadParameter(
            f"--min-lengths needs positive lengths such as 1024,2048; got {min_lengths!r}"
        )
    check_model_source(tokenizer, tokenizer=True)  # offline or a typo: said before transformers imports
    with output_lock(out, what="OUT"):
        _preprocess(source, out, tokenizer, column, max_docs, shard_tokens, lengths)


def _preprocess(source, out: Path, tokenizer, column, max_docs, shard_tokens, lengths) -> None:
    import json

    from neoembed.pretrain.data import load_tokenizer, preprocess
    from neoembed.runs import OutputDirError

    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "meta.json").is_file())):
        raise OutputDirError(
            f"{out} is not empty and holds no shards of an earlier preprocess run (no meta.json): choose a new "
            "output folder (rerunning the same command on its own folder resumes it)"
        )
    tok = load_tokenizer(tokenizer)
    fresh = not out.exists()
    try:
        stats = preprocess(
            source, out, tok, column=column, shard_tokens=shard_tokens, max_docs=max_docs, min_lengths=lengths
        )
    except Exception as e:
        # any error, a bug included, leaves no folder behind: its meta.json would refuse the rerun on corrected
        # files. Ctrl-C and SIGTERM are not Exceptions: their folder stays, and the same command resumes it
        _drop_unstarted(out, fresh)
        if not isinstance(e, (FileNotFoundError, KeyError, ValueError, OSError)):
            raise  # reported by neoembed.cli.main: an unexpected error, or a truncated file's EOFError
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(stats, indent=2))
    for n in lengths:
        info = json.loads((out / "subsets" / f"gt{n}" / "subset.json").read_text())
        typer.echo(
            f"subset {out / 'subsets' / f'gt{n}'}: {info['documents']} documents, {info['tokens']:,} tokens"
        )
        # pre-training refuses an empty corpus: say so now, with the lengths there are
        if not info["documents"]:
            typer.echo(
                f"warning: no document is longer than {n} tokens (the longest has {stats.get('max', 0)}): "
                f"this subset cannot be pre-trained on; pick a smaller --min-lengths",
                err=True,
            )


def _drop_unstarted(out: Path, fresh: bool) -> None:
    """A refused preprocess leaves nothing behind: the folder it created is removed while it holds no shard
    (one with shards is kept: rerunning the command resumes it)."""
    import shutil

    if fresh and out.is_dir() and not any(out.glob("shard-*")):
        shutil.rmtree(out, ignore_errors=True)


def pretrain_command(
    recipe: Annotated[
        str, typer.Argument(help="Recipe YAML path or shipped name (pretrain-tiny, pretrain-stage1…).")
    ],
    overrides: Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides.")] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the newest complete checkpoint, exactly.")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace the run in a non-empty output_dir.")
    ] = False,
) -> None:
    """Pre-train NeoBERT with masked language modelling (packed, padding-free).

    Exit codes: 0 done, 1 stopped (NaN loss, disk full), 2 bad input, 130 / 143 interrupted by Ctrl-C / SIGTERM
    after checkpointing (continue with --resume)."""
    from neoembed.hub import check_model_source
    from neoembed.pretrain.recipe import PretrainRecipe
    from neoembed.recipe import load_recipe, resolve_named_file

    # errors (bad recipe: exit 2; a stopped run: 1; a signal: 130 / 143) are reported by neoembed.cli.main
    path = resolve_named_file(recipe, "recipes")
    parsed = resolve_recipe_paths(load_recipe(path, PretrainRecipe, overrides or []), path.parent)
    check_model_source(parsed.tokenizer, tokenizer=True)  # offline or a typo: said before torch loads
    from neoembed.pretrain.trainer import pretrain
    from neoembed.runs import output_lock

    with output_lock(parsed.output_dir):
        out = pretrain(parsed, resume=resume, overwrite=overwrite)
    from neoembed.runs.lock import launched_main

    if launched_main():  # once per launch, not per process
        typer.echo(f"done: {out}")


def resolve_recipe_paths(recipe, recipe_dir: Path):
    """Tokenizer, init_from, data and eval paths: the working directory first, then the recipe's folder."""
    from neoembed.recipe import resolve_recipe_path as _near_recipe

    data = recipe.data.model_copy(
        update={
            "sources": [
                s.model_copy(update={"path": _near_recipe(s.path, recipe_dir)}) for s in recipe.data.sources
            ]
        }
    )
    model = recipe.model.model_copy(update={"init_from": _near_recipe(recipe.model.init_from, recipe_dir)})
    update = {"tokenizer": _near_recipe(recipe.tokenizer, recipe_dir), "data": data, "model": model}
    if recipe.eval is not None:  # the held-out shards too
        sources = [
            s.model_copy(update={"path": _near_recipe(s.path, recipe_dir)}) for s in recipe.eval.sources
        ]
        update["eval"] = recipe.eval.model_copy(update={"sources": sources})
    return recipe.model_copy(update=update)


def ppl_command(
    model: Annotated[str, typer.Option("--model", help="Masked-LM checkpoint folder or hub id.")],
    data: Annotated[str, typer.Option("--data", help="Shard folder from preprocess, or text/JSONL files.")],
    lengths: Annotated[
        str, typer.Option("--lengths", help="Comma-separated lengths.")
    ] = "512,1024,2048,4096",
    out: Annotated[
        Path, typer.Option("--out", help="Output folder for ppl.json and ppl.png (new or empty).")
    ] = Path("ppl"),
    max_docs: Annotated[int, typer.Option("--max-docs", min=1, help="Documents scored.")] = 16,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Masked copies per forward.")] = 32,
    column: Annotated[str, typer.Option("--column", help="Text column of JSON rows.")] = "text",
    device: Annotated[
        str | None, typer.Option("--device", help="cpu / cuda (default: cuda if available).")
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace the results in a non-empty --out folder.")
    ] = False,
) -> None:
    """Pseudo-perplexity against sequence length (JSON + PNG plot). The model must have its masked-LM head."""
    from neoembed.runs import output_lock

    with output_lock(out, what="--out"):
        _ppl(model, data, lengths, out, max_docs, batch_size, column, device, overwrite)


def _check_model_folder(folder: Path, model: str) -> None:
    """A folder without a model's or a tokenizer's files, said by what it is rather than by the loader's error."""
    if (folder / "state").is_dir() and not (folder / "config.json").is_file():
        raise ValueError(
            f"--model {model} is a training checkpoint (its state/ is what --resume continues from), not a model: "
            "give the run's folder once the run has finished (its final model)"
        )
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {model} holds no model (no config.json): give a masked-LM checkpoint's folder")
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        raise ValueError(
            f"--model {model} has no tokenizer (tokenizer.json, tokenizer_config.json or vocab.txt): give the "
            "folder its model was saved with"
        )


def _load_mlm(folder, dev, model: str):
    """The masked-LM model of ``folder`` (``model``: as the user named it); one without the head's weights (an
    encoder or embedding model) is refused: a random head scores chance-level pseudo-perplexity, not the model's."""
    import json

    from transformers.utils import logging as hf_logging

    from neoembed.modeling import NeoBERTForMaskedLM

    config = Path(folder) / "config.json"
    kind = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if kind is not None and kind != "neobert":
        raise ValueError(
            f"--model {model} is a {kind} model: ppl scores NeoBERT checkpoints with their "
            "masked-LM head (the output of `neoembed pretrain`, or the official NeoBERT)"
        )
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report of the missing head: refused below, in one line
    try:
        net, info = NeoBERTForMaskedLM.from_pretrained(str(folder), output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(k for k in info["missing_keys"] if k.startswith("decoder."))
    if missing:
        raise ValueError(
            f"--model {model} has no masked-LM head (its weights lack {', '.join(missing)}): "
            "pseudo-perplexity needs the pre-training head; give the final model of `neoembed pretrain` (or the "
            "official NeoBERT), not an encoder or embedding model"
        )
    return net.to(dev)


def _ppl(model, data, lengths, out, max_docs, batch_size, column, device, overwrite) -> None:
    import torch
    from transformers import AutoTokenizer

    from neoembed.modeling.convert import resolve_checkpoint
    from neoembed.pretrain.data import ShardedCorpus, iter_documents
    from neoembed.pretrain.ppl import pseudo_perplexity, write_ppl
    from neoembed.runs import check_device, check_weight_files, prepare_output_dir

    check_device(device)
    wanted = _ints(lengths, "--lengths")
    if not wanted or min(wanted) < 1:
        raise typer.BadParameter(f"--lengths needs positive lengths such as 512,1024; got {lengths!r}")
    if not Path(data).exists():
        raise FileNotFoundError(
            f"--data {data} does not exist: give a shard folder from preprocess, or text files"
        )
    prepare_output_dir(
        out, overwrite=overwrite, resume=False, what="--out", clearable=("ppl.json",), resumable=False
    )
    from neoembed.hub import resolve_packaged

    folder = resolve_checkpoint(resolve_packaged(model))
    from neoembed.cde.model import is_cde_folder

    if is_cde_folder(folder) or is_cde_folder(folder.parent):  # two encoders, no masked-LM head to score with
        raise ValueError(
            f"--model {model} is a CDE model (an embedding model of two stages) or one of its stages, which has "
            "no masked-LM head: give the final model of neoembed pretrain (or any masked-LM checkpoint)"
        )
    _check_model_folder(folder, model)
    check_weight_files(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    net = _load_mlm(folder, dev, model)
    if dev.type == "cuda":
        net = net.to(torch.bfloat16)
    if (Path(data) / "meta.json").is_file() or (Path(data) / "subset.json").is_file():
        docs = ShardedCorpus(data)
        documents = (docs[i] for i in range(len(docs)))
    else:
        documents = (
            tok(t, add_special_tokens=True, verbose=False)["input_ids"] for t in iter_documents(data, column)
        )
    special = sorted(set(tok.all_special_ids))
    result = pseudo_perplexity(net, documents, list(wanted), special, tok.mask_token_id, max_docs, batch_size)
    result.update(model=str(model), data=str(data))
    j, png = write_ppl(result, out, title=Path(str(model)).name)
    for r in result["lengths"]:
        typer.echo(
            f"L={r['length']:>6}: pseudo-perplexity {r['pseudo_perplexity']:.3f} ({r['scored_tokens']} tokens)"
        )
    typer.echo(f"wrote {j} and {png}")
