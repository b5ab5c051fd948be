"""Task instructions (prompts): one formatting rule shared by training and evaluation.

The paper puts a task instruction before the query and nothing before documents; tasks without
query/document sides (STS, classification, clustering, pair classification, summarisation) put the
task's instruction before every text. Instructions are stored as sentence-transformers prompts, so the
same strings reach ``encode_query`` / ``encode_document`` and mteb's per-task prompt lookup.
"""

from __future__ import annotations

DEFAULT_TEMPLATE = "{instruction} {text}"

__all__ = ["DEFAULT_TEMPLATE", "format_with_instruction", "instruction_prefix"]


def instruction_prefix(instruction: str | None, template: str = DEFAULT_TEMPLATE) -> str:
    """The text placed before every input for ``instruction`` (``""`` for no instruction).

    Sentence-transformers prompts are plain prefixes, so the template must end in ``{text}``.
    """
    if not instruction:
        return ""
    if "{instruction}" not in template or not template.endswith("{text}"):
        raise ValueError(
            f"instruction template {template!r} must contain '{{instruction}}' and end with '{{text}}' "
            "(prompts are prefixes)"
        )
    return template[: -len("{text}")].format(instruction=instruction)


def format_with_instruction(instruction: str | None, text: str, template: str = DEFAULT_TEMPLATE) -> str:
    """``instruction`` + ``text`` following ``template``; the text alone when there is no instruction."""
    return instruction_prefix(instruction, template) + text
