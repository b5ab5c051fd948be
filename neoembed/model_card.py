"""The model card a trained model is saved with: its base model by hub id, its training data and their licences,
how its queries were prompted, and how to load it with and without neoembed."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

from neoembed.hub import PACKAGED_MINILM, is_packaged_folder
from neoembed.instructions import instruction_prefix

LOADING_HEADING = "## Loading with and without neoembed"


def loading_section(model_id: str, neobert: bool = True, query_prompt: str | None = None) -> str:
    """The model card's section on loading ``model_id`` with and without neoembed; the note on the saved query
    prompt unless the model saves none (``query_prompt`` "": the usage section says how its queries go)."""
    if neobert:
        without = (
            "Without neoembed, the two NeoBERT files saved beside the weights are used:\n\n"
            "```python\nfrom sentence_transformers import SentenceTransformer\n"
            f'model = SentenceTransformer("{model_id}", trust_remote_code=True)\n```\n'
        )
        note = " (no remote code runs: neoembed provides the NeoBERT classes)"
    else:
        without = (
            "Without neoembed it is a stock sentence-transformers model:\n\n"
            "```python\nfrom sentence_transformers import SentenceTransformer\n"
            f'model = SentenceTransformer("{model_id}")\n```\n'
        )
        note = ""
    return (
        f"{LOADING_HEADING}\n\nWith neoembed installed{note}:\n\n"
        f'```python\nimport neoembed\nmodel = neoembed.load("{model_id}")\n'
        'embeddings = model.encode(["a sentence"])\n```\n\n' + without + ("\n" + PROMPT_NOTE if query_prompt != "" else "")
    )


#: the saved query prompt is applied by ``encode_query`` only; the RAG frameworks need to be told (#44)
PROMPT_NOTE = (
    "Queries take the model's saved `query` prompt (the instruction it was trained with): use "
    "`model.encode_query(...)` for queries and `model.encode_document(...)` for documents; plain `encode` adds no "
    "prompt. LangChain's `HuggingFaceEmbeddings` applies it only with "
    '`query_encode_kwargs={"prompt_name": "query"}`; LlamaIndex\'s `HuggingFaceEmbedding` replaces it with its own '
    "empty prompt unless the saved text is passed as `query_instruction` (neoembed's docs: integrations.md).\n"
)


def with_loading_section(card: str, model_id: str, neobert: bool = True, query_prompt: str | None = None) -> str:
    """``card`` with its loading section written for ``model_id``: replaced where present, else appended."""
    section = loading_section(model_id, neobert, query_prompt)
    start = card.find(LOADING_HEADING)
    if start < 0:
        return card.rstrip() + "\n\n" + section
    end = card.find("\n## ", start + len(LOADING_HEADING))
    rest = card[end + 1 :] if end >= 0 else ""
    return card[:start] + section + ("\n" + rest if rest else "")


#: a hub id: ``owner/name`` (how a model card's ``base_model`` must name a model on the hub)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def base_model_name(name_or_path: str | Path) -> str | None:
    """The hub id a model card's ``base_model`` names, from the model's own identity; None when it has none.

    In order: a packaged name (``packaged:all-MiniLM-L6-v2``) or the packaged copy's folder -> the hub id it
    copies; a name that is not a local path -> itself (the hub id the model was loaded by); a local folder -> its
    ``config.json``'s ``_name_or_path`` when that is a hub id (older transformers wrote the id it was loaded from).
    Never a folder's bare name (``model``) nor a path of the training machine: a local model without a hub id
    has no ``base_model``."""
    text = str(name_or_path)
    if text in PACKAGED_MINILM:
        return PACKAGED_MINILM[1]
    path = Path(text).expanduser()
    if not (path.exists() or path.is_absolute() or text.startswith((".", "~"))):
        return text
    if is_packaged_folder(path):
        return PACKAGED_MINILM[1]
    config = path / "config.json"
    try:
        named = json.loads(config.read_text(encoding="utf8")).get("_name_or_path")
    except (OSError, ValueError, AttributeError):  # no config.json (a CDE folder), or not a JSON object
        named = None
    if isinstance(named, str) and HUB_ID.fullmatch(named) and not Path(named).exists():
        return named
    return None


def based_on(base_model: str | None) -> str:
    """How a model card's text names the base model (:func:`base_model_name`'s answer)."""
    return f"`{base_model}`" if base_model else "a local model that names no hub id"


def training_prompts(instructions: Sequence[str | None], template: str) -> dict[str, str]:
    """The prompts a trained model keeps: ``query`` = the prefix its queries were trained with, when every card
    used the same one; ``document`` = "" (documents are trained without instruction). Cards with different
    instructions leave ``query`` empty: the caller passes ``prompt=`` per task, as in training."""
    prefixes = {instruction_prefix(i, template) for i in instructions}
    return {"query": prefixes.pop() if len(prefixes) == 1 else "", "document": ""}


def best_checkpoint_sentence(best: dict | None) -> str:
    """The model card's sentence on which checkpoint the final model is (``keep_best``'s record; "" without)."""
    if best is None:
        return ""
    return (
        f" The final model is the checkpoint of step {best['step']} of {best['last_step']}, the best by "
        f"eval_{best['metric']} ({best['mode']}): {best['value']:.6g}."
    )


def model_card_text(
    model_id: str,
    base_model: str | None,
    datasets: Sequence[dict[str, str]] = (),
    steps: int | str | None = None,
    scores: dict[str, float] | None = None,
    notes: str = "",
    neobert: bool = True,
    query_prompt: str | None = None,
    prefixed: bool = True,
    load_as: str | None = None,
) -> str:
    """A model card (README.md) naming the base model, the training data and their licences, the training
    length, scores, how queries were prompted (``query_prompt``: the saved ``query`` prompt; ``prefixed``: whether
    any training query carried a prefix) and how to load the model with and without neoembed (``load_as``: the
    name its loading code gives, default ``model_id``)."""
    lines = [
        "---",
        "library_name: sentence-transformers",
        "tags: [sentence-transformers, neoembed, feature-extraction, sentence-similarity]",
        *([f"base_model: {base_model}"] if base_model else []),
        "---",
        "",
        f"# {model_id}",
        "",
        f"A sentence-embedding model fine-tuned with neoembed from {based_on(base_model)}.",
        "",
        "## Training data",
        "",
    ]
    if datasets:
        lines += ["| dataset | source | licence |", "|---|---|---|"]
        for d in datasets:
            lic = d.get("license") or "unknown"
            lines.append(f"| {d.get('name', '?')} | {d.get('source', '')} | {lic} |")
        research_only = [
            d.get("name", "?") for d in datasets if "research" in str(d.get("license", "")).lower()
        ]
        if research_only:
            lines += ["", f"For research use only: {', '.join(research_only)} (see their licences)."]
    else:
        lines.append("Not recorded.")
    if steps is not None:
        lines += ["", f"Training steps: {steps}."]
    if scores:
        lines += ["", "## Scores", "", "| task | score |", "|---|---|"]
        lines += [
            f"| {k} | {v:.4f} |" if isinstance(v, float) and math.isfinite(v) else f"| {k} | {v} |"
            for k, v in scores.items()
        ]
    if notes:
        lines += ["", notes]
    if query_prompt is not None:
        lines += ["", _usage_section(query_prompt, prefixed)]
    lines += ["", loading_section(load_as or model_id, neobert, query_prompt)]
    return "\n".join(lines)


def _usage_section(query_prompt: str, prefixed: bool = True) -> str:
    if query_prompt:
        said = (
            f"Queries were trained with the prefix `{query_prompt!r}`, saved as the model's `query` prompt: "
            "`encode_query` adds it, `encode_document` adds nothing."
        )
    elif prefixed:
        said = (
            "Each training dataset's queries carried its own instruction (`run_record.json` gives each dataset's "
            "under `cards.<name>.query_prompt`), so no single `query` prompt is saved: pass `prompt=` with the "
            "instruction of your task."
        )
    else:
        said = "Queries were trained without a prefix, and none is saved: `encode_query` and `encode` embed alike."
    return (
        f"## Usage\n\n{said}\n\n```python\n"
        'query_embeddings = model.encode_query(["how do cats purr?"])\n'
        'document_embeddings = model.encode_document(["Cats purr by vibrating their vocal folds."])\n'
        "scores = model.similarity(query_embeddings, document_embeddings)\n```\n"
    )
