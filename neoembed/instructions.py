"""Task instructions (prompts): one formatting rule shared by training and evaluation.

The paper puts a task instruction before the query and nothing before documents; tasks without
query/document sides (STS, classification, clustering, pair classification, summarisation) put the
task's instruction before every text. Instructions are stored as sentence-transformers prompts, so the
same strings reach ``encode_query`` / ``encode_document`` and mteb's per-task prompt lookup.

Two shipped evaluation sets (``neoembed mteb --instructions``):

* ``released`` (default): the evaluation configuration released with the NeoBERT code
  (``instructions_released.json``). It is the file the released evaluation code reads, so it is the set behind the
  published MTEB scores; it is the default so that a reproduction uses what produced Table 4.
* ``paper``: the paper's Tables 8-9 as printed (``instructions_paper.json``), expanded to MTEB(eng, v1)'s task names
  (the file says how). It differs from ``released`` in the clustering rows (Biorxiv/Medrxiv "main category" vs the
  printed "main and secondary category"; Reddit/StackExchange P2P), in SciDocsRR, and in the trailing "Query:" /
  "Review:"-style suffixes the tables leave out.
"""

from __future__ import annotations

import functools

DEFAULT_TEMPLATE = "{instruction} {text}"

__all__ = [
    "DEFAULT_TEMPLATE",
    "DEFAULT_INSTRUCTION_SET",
    "INSTRUCTION_SETS",
    "SHIPPED_SETS",
    "SIDED_TASK_TYPES",
    "format_with_instruction",
    "instruction_prefix",
    "load_instruction_set",
    "paper_type_instruction",
    "task_prompts",
]


@functools.lru_cache(maxsize=1024)  # called for every row a card builds: a few instructions and one template
def instruction_prefix(instruction: str | None, template: str = DEFAULT_TEMPLATE) -> str:
    """The text placed before every input for ``instruction`` (``""`` for no instruction).

    Sentence-transformers prompts are plain prefixes, so the template must end in ``{text}``.
    """
    if not instruction:
        return ""
    return check_template(template)[: -len("{text}")].format(instruction=instruction)


def check_template(template: str) -> str:
    """``template`` if it places an instruction before the text: it contains ``{instruction}``, ends with
    ``{text}`` (prompts are prefixes) and names no other field; else a ValueError saying which."""
    if "{instruction}" not in template or not template.endswith("{text}"):
        raise ValueError(
            f"instruction template {template!r} must contain '{{instruction}}' and end with '{{text}}' "
            "(prompts are prefixes)"
        )
    try:
        template[: -len("{text}")].format(instruction="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"instruction template {template!r} may name only {{instruction}} and a final {{text}} (got "
            f"{type(e).__name__}: {e}); write a literal brace as {{{{ or }}}}"
        ) from None
    return template


def format_with_instruction(instruction: str | None, text: str, template: str = DEFAULT_TEMPLATE) -> str:
    """``instruction`` + ``text`` following ``template``; the text alone when there is no instruction."""
    return instruction_prefix(instruction, template) + text


#: Task types whose inputs have a query side and a document side: the instruction goes on queries only.
SIDED_TASK_TYPES = frozenset({"Retrieval", "Reranking", "InstructionRetrieval", "InstructionReranking"})
#: The shipped evaluation sets (see the module docstring); ``DEFAULT_INSTRUCTION_SET`` is the one that produced
#: the paper's published scores.
SHIPPED_SETS = ("released", "paper")
INSTRUCTION_SETS = (*SHIPPED_SETS, "none")
DEFAULT_INSTRUCTION_SET = "released"


@functools.cache
def _shipped_set(name: str) -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent / f"instructions_{name}.json").read_text(encoding="utf8"))


def paper_type_instruction(task_type: str, set_name: str = DEFAULT_INSTRUCTION_SET) -> str | None:
    """A shipped set's instruction for a task its table does not list, where the paper gives the tasks of that
    type one instruction (STS: "Retrieve semantically similar text."; BIOSSES and SICK-R have their own rows);
    ``None`` for the other types, whose instructions are task-specific, and for sets that are not shipped."""
    if set_name not in SHIPPED_SETS:
        return None
    return _shipped_set(set_name)["type_defaults"].get(task_type)


def load_instruction_set(spec: str | None) -> tuple[str, dict[str, str]]:
    """Resolve ``released`` | ``paper`` | ``none`` | a YAML/JSON file (task name -> instruction) to (label, mapping).

    ``released`` and ``paper`` are shipped with the package (see the module docstring for how they differ).
    """
    from pathlib import Path

    if spec is None or spec == "none":
        return "none", {}
    if spec in SHIPPED_SETS:
        return spec, dict(_shipped_set(spec)["instructions"])
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"instructions {spec!r}: expected one of {list(INSTRUCTION_SETS)} or a file (task name -> instruction)"
        )
    import yaml

    try:
        mapping = yaml.safe_load(path.read_text(encoding="utf8"))  # YAML is a superset of JSON
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(
            f"instructions file {path} is not valid YAML/JSON text ({e}): fix it, or pass one of "
            f"{list(INSTRUCTION_SETS)}"
        ) from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise ValueError(f"{path} must map task names to instruction strings")
    return str(path), {str(k): v.strip() for k, v in mapping.items()}


def task_prompts(
    task_name: str,
    task_type: str,
    instruction: str | None,
    template: str = DEFAULT_TEMPLATE,
    registered: bool = True,
) -> dict[str, str]:
    """Sentence-transformers prompts under the keys mteb looks up for one task.

    Sided tasks get ``"<Task>-query"`` (the instruction) and ``"<Task>-document"`` (empty); other tasks get
    ``"<Task>"``, applied to every text. No instruction gives empty prompts, so no generic prompt of the
    model leaks into the task. mteb drops keys naming tasks it does not know (local task cards), so for those
    (``registered=False``) the same prompts are keyed by task type instead.
    """
    prefix = instruction_prefix(instruction, template)
    key = task_name if registered else task_type
    if task_type in SIDED_TASK_TYPES:
        return {f"{key}-query": prefix, f"{key}-document": ""}
    return {key: prefix}
