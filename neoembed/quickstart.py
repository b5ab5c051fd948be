"""``neoembed quickstart``: the whole pipeline, offline, in minutes on a laptop CPU.

1. Build a real retrieval set from the documentation that ships with Python: for every documented public
   function, class and method of a fixed list of standard-library modules, the one-line summary of its
   docstring is the query and the rest of the docstring (summary removed, so the answer is not in the
   query) is the document. Modules are split into train and test, so test documents come from modules
   never seen in training.
2. Evaluate nDCG@10 on the held-out modules with mteb's retrieval evaluator (a task card, see ``neoembed mteb``).
3. Fine-tune the backbone with the unified recipe (``recipes/quickstart.yaml``).
4. Evaluate again, print a before/after table, save the model, and show ``SentenceTransformer(path).encode``.

The backbone is the packaged all-MiniLM-L6-v2 (``pip install -e '.[quickstart]'``), a real pre-trained
encoder that installs offline.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import json
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["build_pydoc_retrieval", "quickstart_command"]

MODULES = (
    "abc argparse ast asyncio base64 bisect calendar cmath codecs collections concurrent.futures configparser "
    "contextlib copy csv dataclasses datetime decimal difflib dis email.message enum filecmp fnmatch fractions "
    "ftplib functools gettext glob graphlib gzip hashlib heapq hmac html.parser http.client http.cookies "
    "imaplib inspect io ipaddress itertools json locale logging lzma mailbox math mimetypes numbers operator "
    "optparse os os.path pathlib pickle pkgutil platform plistlib poplib pprint queue random re reprlib sched "
    "secrets selectors shelve shlex shutil signal smtplib socket socketserver sqlite3 ssl statistics string "
    "struct subprocess symtable sysconfig tarfile tempfile textwrap threading timeit tokenize tomllib trace "
    "traceback types typing unittest urllib.parse urllib.request uuid warnings wave weakref xml.dom.minidom "
    "xml.etree.ElementTree zipfile zipimport zoneinfo"
).split()
QUERY_INSTRUCTION = "Given a one-line summary of a Python function or class, retrieve its documentation."


def _split_docstring(doc: str) -> tuple[str, str] | None:
    """(summary line, rest) of a docstring, or None when either part is too thin to make a pair."""
    doc = inspect.cleandoc(doc)
    paragraphs = doc.split("\n\n", 1)
    summary = " ".join(paragraphs[0].split())
    rest = " ".join(paragraphs[1].split()) if len(paragraphs) > 1 else ""
    if len(summary.split()) < 4 or len(rest.split()) < 12 or summary.lower() in rest.lower():
        return None
    return summary, rest[:2000]


def _documented(module) -> list[tuple[str, str]]:
    out = []
    seen = set()
    for name, obj in inspect.getmembers(module):
        if name.startswith("_") or getattr(obj, "__module__", None) not in (module.__name__, None):
            continue
        if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
            continue
        members = [obj]
        if inspect.isclass(obj):
            members += [
                f
                for m, f in vars(obj).items()
                if not m.startswith("_") and (inspect.isfunction(f) or inspect.ismethoddescriptor(f))
            ]
        for o in members:
            doc = inspect.getdoc(o) if not inspect.isclass(o) or o.__doc__ else None
            if doc and id(o) not in seen:
                seen.add(id(o))
                pair = _split_docstring(doc)
                if pair:
                    out.append(pair)
    return out


def build_pydoc_retrieval(out_dir: str | Path, test_fraction: float = 0.2) -> dict:
    """Write ``train.jsonl`` (query, positive) and an mteb retrieval folder ``eval/PythonDocsRetrieval`` (corpus,
    queries, qrels, task card) from the standard library's documentation. Returns counts."""
    out_dir = Path(out_dir)
    train, test, modules_used = [], [], {"train": [], "test": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in MODULES:
            try:
                module = importlib.import_module(name)
            except Exception:  # a module missing from this Python build is simply skipped
                continue
            pairs = _documented(module)
            if not pairs:
                continue
            bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 1000 / 1000
            side = "test" if bucket < test_fraction else "train"
            modules_used[side].append(name)
            (test if side == "test" else train).extend(pairs)
    # no document (nor query) of the held-out modules may appear in training, even if another module shares it
    seen_docs: set[str] = {d for _, d in test}
    test_queries = {q for q, _ in test}
    train = [(q, d) for q, d in train if q not in test_queries and not (d in seen_docs or seen_docs.add(d))]
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "train.jsonl", "w") as f:
        for q, d in train:
            f.write(json.dumps({"query": q, "positive": d}) + "\n")
    task = out_dir / "eval" / "PythonDocsRetrieval"
    (task / "qrels").mkdir(parents=True, exist_ok=True)
    docs: dict[str, str] = {}
    with (
        open(task / "corpus.jsonl", "w") as fc,
        open(task / "queries.jsonl", "w") as fq,
        open(task / "qrels" / "test.jsonl", "w") as fr,
    ):
        for i, (q, d) in enumerate(test):
            doc_id = docs.setdefault(d, f"d{len(docs)}")
            fq.write(json.dumps({"_id": f"q{i}", "text": q}) + "\n")
            fr.write(json.dumps({"query-id": f"q{i}", "corpus-id": doc_id, "score": 1}) + "\n")
        for d, doc_id in docs.items():
            fc.write(json.dumps({"_id": doc_id, "title": "", "text": d}) + "\n")
    (task / "task.yaml").write_text(
        "name: PythonDocsRetrieval\ntype: Retrieval\neval_splits: [test]\n"
        f"instruction: {json.dumps(QUERY_INSTRUCTION)}\n"
        "description: Summary line -> rest of the docstring, for held-out standard-library modules.\n"
    )
    card = out_dir / "pydocs.yaml"
    card.write_text(
        "name: python_docs\nsource: {local: {path: train.jsonl, format: json}}\n"
        "columns: {query: query, positive: positive}\n"
        f"instruction: {json.dumps(QUERY_INSTRUCTION)}\n"
        "license: PSF-2.0 (Python documentation)\n"
        f"size: {len(train)}\n"
        "notes: Built by neoembed quickstart from the docstrings of the local Python installation.\n"
    )
    return {
        "train_pairs": len(train),
        "test_queries": len(test),
        "test_documents": len(docs),
        "train_modules": len(modules_used["train"]),
        "test_modules": modules_used["test"],
    }


def quickstart_command(
    output: Annotated[Path, typer.Option("--output", help="Where the data, model and results go.")] = Path(
        "runs/quickstart"
    ),
    steps: Annotated[
        int | None, typer.Option("--steps", min=1, help="Override the recipe's number of steps.")
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Backbone (default: packaged all-MiniLM-L6-v2).")
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an earlier quickstart's data, model and results.")
    ] = False,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue an interrupted quickstart in --output: its training from the newest checkpoint, "
            "with the --steps and --model it started with.",
        ),
    ] = False,
) -> None:
    """Build a retrieval set from Python's own documentation, fine-tune, and compare nDCG@10 before/after.
    --output must be new or empty, or hold an earlier quickstart (replaced with --overwrite, continued with
    --resume)."""
    t0 = time.perf_counter()  # before the command's own imports, so that "other" counts them
    from neoembed.runs import output_lock

    with output_lock(output, what="--output"):
        steps, model = _claim_output(output, overwrite, resume, steps, model)
        _run(output, steps, model, t0, resume)


MARKER = "quickstart.json"


def _claim_output(
    output: Path, overwrite: bool, resume: bool = False, steps: int | None = None, model: str | None = None
) -> tuple[int | None, str | None]:
    """A used --output is refused unless --overwrite or --resume, and cleared (--overwrite) or continued (--resume)
    only if a quickstart wrote it (its marker, or the run record of its model); the marker is written at once, so
    an interrupted quickstart is one too. Returns the --steps and --model to run with: a resume's are the
    marker's (:func:`_same_quickstart`)."""
    import json

    from neoembed.record import RUN_RECORD, atomic_write_text
    from neoembed.runs import OutputDirError, prepare_output_dir

    if resume and overwrite:
        raise OutputDirError("--resume and --overwrite exclude each other: continue the quickstart, or replace it")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        if not any((output / name).is_file() for name in (MARKER, f"model/{RUN_RECORD}")):
            raise OutputDirError(f"--output {output} holds files no quickstart wrote: choose a new --output")
        if resume:  # the training's own --resume checks model/ (its settings, its newest checkpoint)
            return _same_quickstart(output, steps, model)
        raise OutputDirError(
            f"--output {output} is not empty: pass --resume to continue the quickstart it holds, --overwrite to "
            "replace it (its data, model and results), or choose a new --output"
        )
    if resume:
        raise OutputDirError(f"--resume: --output {output} holds no quickstart to continue: start without --resume")
    prepare_output_dir(
        output,
        overwrite=overwrite,
        resume=False,
        what="--output",
        clearable=(MARKER, f"model/{RUN_RECORD}"),
    )
    marker = {"written_by": "neoembed quickstart", "steps": steps, "model": model}
    atomic_write_text(output / MARKER, json.dumps(marker) + "\n")
    return steps, model


def _same_quickstart(output: Path, steps: int | None, model: str | None) -> tuple[int | None, str | None]:
    """A resume continues the quickstart with the --steps and --model it started with (omitted: those): other
    ones would train its model on (training extends a run to more steps) and then find the results folders
    holding the first model's scores. A marker written before it recorded them is taken as it is."""
    import json

    import yaml

    from neoembed.hub import resolve_packaged
    from neoembed.recipe import resolve_named_file
    from neoembed.runs import OutputDirError

    try:
        then = json.loads((output / MARKER).read_text())
    except (OSError, ValueError):
        then = {}
    if not isinstance(then, dict) or not {"steps", "model"} <= then.keys():
        return steps, model
    # an option given as its default is the default (--model packaged:all-MiniLM-L6-v2 after none was given)
    default = yaml.safe_load(resolve_named_file("quickstart", "recipes").read_text(encoding="utf8"))
    was = {k: then[k] if then[k] is not None else default.get(k) for k in ("steps", "model")}

    def where(name) -> object:  # a folder by where it is, however it is spelt
        local = Path(resolve_packaged(str(name)))
        return local.resolve() if local.exists() else name

    if (steps is not None and steps != was["steps"]) or (model is not None and where(model) != where(was["model"])):
        said = " ".join(f"--{k} {then[k]}" for k in ("steps", "model") if then[k] is not None) or "the defaults"
        raise OutputDirError(
            f"--resume: the quickstart in {output} was started with {said}; it continues with those (omit --steps "
            "and --model, or give the same), or pass --overwrite to start again with the new ones"
        )
    return then["steps"], then["model"]


def _run(output: Path, steps: int | None, model: str | None, t0: float, resume: bool = False) -> None:
    from neoembed.eval.runner import EvalConfig, run_mteb
    from neoembed.runs import RunFinished, stopped_before_a_checkpoint
    from neoembed.train.trainer import train

    timings: dict[str, float] = {}
    typer.echo("1/4 building a retrieval set from the Python documentation on this machine ...")
    data = output / "data"
    with _stage(timings, "build data"):
        counts = build_pydoc_retrieval(data)
    typer.echo(
        f"    {counts['train_pairs']} training pairs from {counts['train_modules']} modules; "
        f"{counts['test_queries']} test queries over {counts['test_documents']} documents from held-out modules "
        f"({', '.join(counts['test_modules'][:8])}{', ...' if len(counts['test_modules']) > 8 else ''})"
    )
    recipe, recipe_path, label = _recipe(output, data, steps, model)
    backbone = recipe.model

    def evaluate(model_path: str, out: Path, instructions: str = "paper", loaded=None) -> float:
        cfg = EvalConfig(
            model=model_path,
            output=out,
            data_dir=data / "eval",
            precision="fp32",
            overwrite=not resume,  # a resumed quickstart keeps the scores it has (mteb's reuse checks them)
            instructions=instructions,
        )
        with _truncation_noted():
            report = run_mteb(cfg, model=loaded)
        if report.failed:
            raise typer.Exit(f"evaluation failed: {report.failed}")
        name = "PythonDocsRetrieval"
        if name in report.skipped:  # scored before this resume: its result file holds the score
            return json.loads((out / f"{name}.json").read_text())["main_score"]
        return report.scores[name]["main_score"]

    typer.echo(f"2/4 nDCG@10 of {label} before fine-tuning, without and with the query instruction ...")
    # the backbone was not trained with instructions: its fair baseline is its score without one
    from neoembed.loading import load

    with _stage(timings, "load backbone"):
        untrained = load(backbone)
    with _stage(timings, "evaluate before"):
        plain = evaluate(backbone, output / "results" / "before-no-instruction", "none", untrained)
        before = evaluate(backbone, output / "results" / "before", "paper", untrained)
    del untrained
    typer.echo(
        f"3/4 fine-tuning with the unified recipe ({recipe.steps} steps, batch {recipe.batch_size}) ..."
    )
    with _stage(timings, "train"):
        # --output was claimed above: model/ is new (or cleared with --overwrite), or continued (--resume; a
        # quickstart stopped before its training started has no model/ to continue: it starts there)
        model_dir = Path(recipe.output_dir)
        resume = resume and model_dir.is_dir() and any(model_dir.iterdir())
        if resume and stopped_before_a_checkpoint(model_dir):  # killed before its first save (save_steps 1000)
            typer.echo("   the training was stopped before its first checkpoint: it starts again")
            resume = False
        try:
            trained = train(recipe, recipe_dir=recipe_path.parent, overwrite=not resume, resume=resume)
        except RunFinished:  # --resume after the training finished (stopped while scoring it): score it now
            trained = Path(recipe.output_dir)
    typer.echo("4/4 nDCG@10 after fine-tuning ...")
    with _stage(timings, "evaluate after"):
        after = evaluate(str(trained), output / "results" / "after")

    _write_table(output / "results", label, recipe.steps, plain, before, after)
    from sentence_transformers import SentenceTransformer

    with _stage(timings, "reload + encode"):
        st = SentenceTransformer(str(trained))
        emb = st.encode(["Return the number of items in a container.", "Open a file and return a stream."])
    typer.echo(f"SentenceTransformer({str(trained)!r}).encode([...]) -> array of shape {emb.shape}")
    total = time.perf_counter() - t0
    timings["other (imports, setup)"] = total - sum(timings.values())
    typer.echo("stage timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    typer.echo(f"model saved in {trained}; total time {total:.0f} s")


@contextlib.contextmanager
def _truncation_noted():
    """The encoder's truncation warning says how to keep longer texts (a recipe's max_length, --max-length),
    which the quickstart has no way to set: its numbers are measured with the documents truncated. One line of
    its own instead; every other warning passes on."""
    from neoembed.encode_checks import TruncationWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TruncationWarning)
        yield
    if any(issubclass(w.category, TruncationWarning) for w in caught):
        typer.echo("    (documents longer than the model's max_seq_length are truncated, as in the quoted numbers)")
    for w in caught:
        if not issubclass(w.category, TruncationWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _recipe(output: Path, data: Path, steps: int | None, model: str | None):
    """The quickstart recipe on the data just built: (recipe, its file, the backbone's label)."""
    from neoembed.recipe import load_recipe, resolve_named_file
    from neoembed.sentence import PACKAGED_MINILM, resolve_packaged
    from neoembed.train.recipe import UnifiedRecipe

    recipe_path = resolve_named_file("quickstart", "recipes")
    overrides = [f"output_dir={output / 'model'}", f"datasets=[{{card: {data / 'pydocs.yaml'}}}]"]
    if steps is not None:
        overrides.append(f"steps={steps}")
    recipe = load_recipe(recipe_path, UnifiedRecipe, overrides)
    backbone = resolve_packaged(model or recipe.model)
    label = "all-MiniLM-L6-v2 (packaged)" if model is None and recipe.model in PACKAGED_MINILM else backbone
    return recipe.model_copy(update={"model": backbone}), recipe_path, label


def _write_table(results: Path, label: str, steps: int, plain: float, before: float, after: float) -> None:
    table = (
        "\n| model | query instruction | PythonDocsRetrieval nDCG@10 |\n|---|---|---|\n"
        f"| {label}, before | none | {100 * plain:.2f} |\n"
        f"| {label}, before | yes | {100 * before:.2f} |\n"
        f"| {label}, after {steps} steps | yes | {100 * after:.2f} |\n"
    )
    typer.echo(table)
    results.mkdir(parents=True, exist_ok=True)
    (results / "quickstart.md").write_text(table)


@contextmanager
def _stage(timings: dict[str, float], name: str):
    """Times one stage of the quickstart into ``timings`` (printed at the end: where the minutes go)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
