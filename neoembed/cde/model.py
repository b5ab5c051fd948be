"""The CDE model as a SentenceTransformer: build from a backbone, encode a context, save, load.

    model = neoembed.load("runs/cde-tiny")                    # a saved CDE model
    E = model.encode_context(corpus_sample)                     # first stage, N x d
    q = model.encode(queries, prompt_name="query", dataset_embeddings=E)
    d = model.encode(documents, prompt_name="document", dataset_embeddings=E)
    q0 = model.encode(queries, prompt_name="query", dataset_embeddings="null")   # no corpus at hand

The saved folder holds ``modules.json`` naming ``modeling_cde.ContextualDocumentEmbedder``, the file
``modeling_cde.py`` itself, ``first_stage/`` and ``second_stage/`` (Hugging Face checkpoints; NeoBERT ones carry
their own modeling code), ``cde_head.safetensors`` and the tokenizer. Where neoembed is not installed it loads with
``SentenceTransformer(path, trust_remote_code=True)`` (then ``model[0].encode_context(docs, prompt=...)``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import neoembed.modeling  # noqa: F401  (NeoBERT registered with the Auto classes)
from neoembed.cde.modeling_cde import ContextMissingError, ContextualDocumentEmbedder
from neoembed.sentence import EmbeddingModel

__all__ = [
    "CLASS_REF",
    "ContextMissingError",
    "ContextualSentenceTransformer",
    "is_cde_folder",
    "load_cde",
    "save_cde_adapter",
]

CLASS_REF = "modeling_cde.ContextualDocumentEmbedder"


def is_cde_folder(path: str | Path) -> bool:
    modules = Path(path) / "modules.json"
    if not modules.is_file():
        return False
    try:
        return any(str(m.get("type", "")).endswith(CLASS_REF) for m in json.loads(modules.read_text()))
    except (ValueError, AttributeError, TypeError):  # a damaged modules.json: the bi-encoder's load names it
        return False


class ContextualSentenceTransformer(EmbeddingModel):
    """A SentenceTransformer whose single module is the two-stage contextual model."""

    @classmethod
    def from_backbone(
        cls,
        name_or_path: str,
        *,
        n_context: int,
        n_soft_prompt: int = 4,
        max_seq_length: int = 512,
        exclude_prompt: bool = False,
        context_dropout: float = 0.0,
        prompts: dict[str, str] | None = None,
        device: str | None = None,
    ) -> ContextualSentenceTransformer:
        """A fresh CDE model: both stages start as copies of ``name_or_path`` (any Hugging Face encoder, or a
        sentence-transformers folder, whose Transformer module is used)."""
        source = Path(name_or_path)
        if (source / "modules.json").is_file():  # a sentence-transformers folder: its transformer weights
            modules = json.loads((source / "modules.json").read_text())
            sub = next(m["path"] for m in modules if m["type"].endswith("Transformer"))
            name_or_path = str(source / sub) if sub else str(source)
        module = ContextualDocumentEmbedder.from_backbone(
            name_or_path,
            n_context=n_context,
            n_soft_prompt=n_soft_prompt,
            max_seq_length=max_seq_length,
            exclude_prompt=exclude_prompt,
            context_dropout=context_dropout,
        )
        model = cls(modules=[module], device=device, prompts=prompts or {}, similarity_fn_name="cosine")
        model.model_card_data.base_model = str(name_or_path)
        return model

    @property
    def cde(self) -> ContextualDocumentEmbedder:
        return self[0]

    @property
    def n_context(self) -> int:
        return self.cde.n_context

    def encode_context(
        self, documents: list[str], batch_size: int = 32, max_batch_tokens: int | None = None
    ) -> torch.Tensor:
        """First stage on a corpus sample, with the model's "document" prompt: the N x d context E (batches of
        ``batch_size`` documents, or filled to ``max_batch_tokens`` padded tokens)."""
        return self.cde.encode_context(
            list(documents),
            prompt=self.prompts.get("document"),
            batch_size=batch_size,
            max_batch_tokens=max_batch_tokens,
        )

    def encode(self, inputs, *args, dataset_embeddings=None, **kwargs):  # type: ignore[override]
        # the context travels with each call and is never kept on the model: a model used after one task
        # must not silently encode with that task's corpus (``neoembed mteb`` passes each task's context)
        if dataset_embeddings is None:
            raise ContextMissingError(
                "a CDE model needs a context: pass dataset_embeddings=model.encode_context(corpus_sample) "
                f"(at least {self.n_context} documents) or dataset_embeddings='null'"
            )
        return super().encode(inputs, *args, dataset_embeddings=dataset_embeddings, **kwargs)

    def _create_model_card(self, path, model_name=None, train_datasets="deprecated") -> None:
        # sentence-transformers' generated card runs encode() without a context: keep the card the model was
        # loaded with (the trainer's, naming the data and their licences), else write a short one
        readme = Path(path) / "README.md"
        if readme.is_file():
            return
        card = self._model_card_text or (
            "---\nlibrary_name: sentence-transformers\ntags: [contextual-document-embeddings, neoembed]\n---\n\n"
            "# CDE model (neoembed)\n\nLoad with `neoembed.load(PATH)` (then `model.encode_context(docs)` and "
            "`model.encode(texts, prompt_name=..., dataset_embeddings=E)`), or without neoembed with "
            "`SentenceTransformer(PATH, trust_remote_code=True)`.\n"
        )
        model_id = self.model_card_data.model_id or model_name or str(path)
        card = card.replace("load(PATH)", f'load("{model_id}")').replace("(PATH,", f'("{model_id}",')
        readme.write_text(card, encoding="utf8")

    def save(self, path, *args, **kwargs):  # type: ignore[override]
        super().save(path, *args, **kwargs)
        modules_file = Path(path) / "modules.json"
        modules = json.loads(modules_file.read_text())
        for m in modules:  # the repository-local class, so that trust_remote_code loads it without neoembed
            if m["type"].endswith(".ContextualDocumentEmbedder"):
                m["type"] = CLASS_REF
        modules_file.write_text(json.dumps(modules, indent=2))


def save_cde_adapter(model: ContextualSentenceTransformer, path: str | Path) -> Path:
    """The model's LoRA adapters alone (both stages, PEFT's layout) with the head, which trains in full
    (``cde_head.safetensors``), the tokenizer, the prompts and the construction settings; ``cde_adapter.json`` names
    the base encoder the stages started from. It loads like a CDE folder — ``neoembed.load(path)`` or
    ``SentenceTransformer(path, trust_remote_code=True)`` — which loads the base encoder and applies the adapters."""
    cde = model.cde
    cde.adapter_base = cde.first_stage.name_or_path  # the encoder both stages were built from
    try:
        model.save(str(path), create_model_card=False)
    finally:
        cde.adapter_base = None
    return Path(path)


def load_cde(path: str | Path, device: str | None = None, **kwargs) -> ContextualSentenceTransformer:
    """Load a saved CDE model with neoembed's own module class (no trust_remote_code needed). A folder that lost
    a file is refused naming it: without its tokenizer files transformers builds a tokenizer of the special
    tokens alone, and every word encodes as ``[UNK]``."""
    from neoembed.hub import TOKENIZER_FILES

    root = Path(path)
    if not (root / "cde_config.json").is_file():
        raise FileNotFoundError(f"{root} is a CDE model without its cde_config.json: copy or save the model again")
    if not any((root / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{root} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}): copy or save the model again"
        )
    modules = json.loads((Path(path) / "modules.json").read_text())
    # the repository-local reference, and neoembed's own module path that an earlier version may have written:
    # both are this installed class, so neither needs trust_remote_code
    classes = {m["type"]: ContextualDocumentEmbedder for m in modules if m["type"].endswith(CLASS_REF)}
    return ContextualSentenceTransformer._load_with_module_classes(
        str(path), {CLASS_REF: ContextualDocumentEmbedder, **classes}, device=device, **kwargs
    )
