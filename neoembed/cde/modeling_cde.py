"""Contextual document embeddings (CDE, Morris & Rush 2024) as one sentence-transformers input module.

This file imports only torch, transformers and sentence-transformers: it is copied into every saved CDE model,
so that ``SentenceTransformer(path, trust_remote_code=True)`` loads it where neoembed is not installed.

Two independent backbones:

* **first stage** (M1): a context document → mean of its token states → MLP (Linear–GELU–Linear): one vector per
  context document. ``encode_context(docs)`` returns the N × d matrix E of a corpus sample;
* **second stage** (M2): its input is [norm(E) | soft prompt | token embeddings of the text] with full
  bidirectional attention; the output is the mean over the text's tokens (optionally without the instruction
  prefix), plus an MLP of it (residual). No normalisation of the output.

E is a *set*: with a RoPE backbone (NeoBERT) the N + S prefix positions get no rotation (``positionless_prefix``);
with an absolute-position backbone (BERT-like) every prefix position gets the same position id, and the text's
positions start at 0 as without context. Permuting E leaves the output unchanged (tested).

The number of context vectors N is fixed per model: fewer is an error, more are truncated with a warning.
``dataset_embeddings="null"`` uses a learned null context (one learned vector in each of the N slots); during
training a fraction ``context_dropout`` of the context vectors is replaced by it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from sentence_transformers.base.modules import InputModule
from torch import nn
from transformers import AutoModel, AutoTokenizer

logger = logging.getLogger(__name__)

HEAD_WEIGHTS = "cde_head.safetensors"
FIRST, SECOND = "first_stage", "second_stage"
# a folder holding LoRA adapters alone: each stage folder is PEFT's layout, and this file names their base encoder
ADAPTER_BASE = "cde_adapter.json"


class ContextMissingError(ValueError):
    """A CDE model was asked to embed texts without a context (or with too few context vectors)."""


def _mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def use_positionless_prefix(backbone: nn.Module, prefix: int) -> bool:
    """Give every block of a NeoBERT backbone an attention whose first ``prefix`` positions have no position:
    a subclass of the backbone's own ``NeoBERTAttention`` (from the modeling file it was loaded from, neoembed's
    or the copy beside a model loaded with ``trust_remote_code``). Returns whether the backbone is one.

    A pair of tokens interacts through rotated q/k only when both are text tokens (relative positions among the
    text); any pair involving one of the first P (prefix) tokens uses the unrotated q/k. So permuting the prefix
    permutes nothing else, and shifting all text positions changes nothing. The backbone's RoPE tables cover every
    position; the prefix's are not read.
    """
    modeling = sys.modules[type(backbone).__module__]
    base, blocks = getattr(modeling, "NeoBERTAttention", None), getattr(backbone, "transformer_encoder", None)
    if base is None or blocks is None:
        return False
    apply_rope = modeling.apply_rope

    class PositionlessPrefixAttention(base):
        def forward(self, q, k, v, position_embeddings, attention_mask, implementation, **kwargs):
            if "cu_seq_lens_q" in kwargs:
                raise ValueError("CDE's position-less prefix needs the padded layout, not packed input")
            P, (cos, sin) = prefix, position_embeddings  # q, k, v: (B, L, H, Dh), not rotated
            q_text, k_text = (apply_rope(t[:, P:], cos[:, P:], sin[:, P:]).transpose(1, 2) for t in (q, k))
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, L, Dh)
            scores = (q @ k.transpose(-1, -2)) * self.scaling
            scores[..., P:, P:] = (q_text @ k_text.transpose(-1, -2)) * self.scaling
            if attention_mask is not None:
                scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
            probs = scores.float().softmax(dim=-1).to(q.dtype)
            return (probs @ v).transpose(1, 2), probs

    for block in blocks:
        block.attention = PositionlessPrefixAttention(block.attention.config)
    return True


class ContextualDocumentEmbedder(InputModule):
    """Tokenizer + two-stage contextual model; outputs ``sentence_embedding`` (see the module docstring)."""

    config_keys = [
        "n_context",
        "n_soft_prompt",
        "max_seq_length",
        "exclude_prompt",
        "context_dropout",
    ]
    forward_kwargs = {"dataset_embeddings"}
    save_in_root = True

    def __init__(
        self,
        first_stage: nn.Module,
        second_stage: nn.Module,
        tokenizer,
        n_context: int = 512,
        n_soft_prompt: int = 4,
        max_seq_length: int = 512,
        exclude_prompt: bool = False,
        context_dropout: float = 0.0,
    ):
        super().__init__()
        if n_context < 1:
            raise ValueError(f"n_context must be >= 1, got {n_context}")
        self.first_stage, self.second_stage, self.tokenizer = first_stage, second_stage, tokenizer
        self.n_context, self.n_soft_prompt = int(n_context), int(n_soft_prompt)
        self.max_seq_length, self.exclude_prompt = int(max_seq_length), bool(exclude_prompt)
        self.context_dropout = float(context_dropout)
        d1, d = first_stage.config.hidden_size, second_stage.config.hidden_size
        self.context_mlp = nn.Sequential(nn.Linear(d1, d), nn.GELU(), nn.Linear(d, d))
        self.context_norm = nn.LayerNorm(d)
        self.soft_prompt = nn.Parameter(torch.randn(self.n_soft_prompt, d) * 0.02)
        self.null_context = nn.Parameter(torch.randn(d) * 0.02)
        self.output_mlp = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        nn.init.zeros_(self.output_mlp[2].weight)  # the output starts as the plain mean of the text tokens
        nn.init.zeros_(self.output_mlp[2].bias)
        # NeoBERT: a position-less prefix of the N context vectors and the soft prompt
        self._rope_prefix = use_positionless_prefix(second_stage, self.n_context + self.n_soft_prompt)
        self._warned_truncation = False
        # set while neoembed.cde.model.save_cde_adapter saves: the stages' adapters alone over this base
        self.adapter_base: str | None = None

    # ------------------------------------------------------------------------------------------- building
    @classmethod
    def from_backbone(cls, name_or_path: str, tokenizer=None, **settings) -> ContextualDocumentEmbedder:
        """Two independent copies of a pre-trained encoder (any AutoModel) as the two stages, in fp32 whatever the
        encoder was saved in (training's precision is autocast's, over fp32 weights)."""
        first = AutoModel.from_pretrained(name_or_path, dtype=torch.float32)
        second = AutoModel.from_pretrained(name_or_path, dtype=torch.float32)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(name_or_path)
        return cls(first, second, tokenizer, **settings)

    @property
    def dim(self) -> int:
        return self.second_stage.config.hidden_size

    def get_embedding_dimension(self) -> int:
        return self.dim

    def get_sentence_embedding_dimension(self) -> int:
        return self.dim

    def get_max_seq_length(self) -> int:
        return self.max_seq_length

    # ------------------------------------------------------------------------------------------ tokenizing
    def preprocess(self, inputs, prompt: str | None = None, **kwargs) -> dict[str, Any]:
        texts = []
        for i, item in enumerate(inputs):
            if isinstance(item, tuple) and len(item) == 1:
                item = item[0]
            if not isinstance(item, str):
                raise TypeError(f"item {i} is {type(item).__name__}, not str")
            texts.append(item)
        if prompt:
            texts = [prompt + t for t in texts]
        features = dict(
            self.tokenizer(
                texts,
                padding=True,
                truncation=True,
                max_length=self.max_seq_length,
                return_tensors="pt",
            )
        )
        features.pop("token_type_ids", None)
        if prompt:
            n = len(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            features["prompt_length"] = torch.tensor(max(n - 1, 0))  # [CLS] + prompt, without the final [SEP]
        return features

    # ------------------------------------------------------------------------------------------ first stage
    def embed_context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """First stage on tokenized context documents: (n, d) context vectors (with gradient if enabled)."""
        hidden = self.first_stage(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.context_mlp(_mean_pool(hidden, attention_mask))

    @torch.no_grad()
    def encode_context(
        self,
        documents: list[str],
        prompt: str | None = None,
        batch_size: int = 32,
        max_batch_tokens: int | None = None,
    ) -> torch.Tensor:
        """Context vectors E (len(documents) × d) of a corpus sample, on CPU in float32. ``prompt`` is the
        document prefix (``ContextualSentenceTransformer.encode_context`` passes the model's "document" prompt).
        Batches of ``batch_size`` documents, or with ``max_batch_tokens`` longest first and filled while rows ×
        longest row stays within it (a corpus sample mixes titles with long documents); rows in input order."""
        if not documents:
            raise ContextMissingError("encode_context needs at least one document")
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        out = []
        try:
            for rows in self._context_batches(documents, prompt, batch_size, max_batch_tokens):
                f = self.preprocess([documents[i] for i in rows], prompt=prompt)
                e = self.embed_context(f["input_ids"].to(device), f["attention_mask"].to(device))
                out.append((rows, e.float().cpu()))
        finally:
            self.train(was_training)
        context = torch.empty(len(documents), out[0][1].shape[-1])
        for rows, e in out:
            context[rows] = e
        return context

    def _context_batches(self, documents, prompt, batch_size: int, max_batch_tokens: int | None) -> list:
        if max_batch_tokens is None:
            return [
                list(range(i, min(i + batch_size, len(documents))))
                for i in range(0, len(documents), batch_size)
            ]
        texts = [(prompt or "") + d for d in documents]
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_seq_length)["input_ids"]
        order = sorted(range(len(texts)), key=lambda i: -len(ids[i]))
        if len(ids[order[0]]) > max_batch_tokens:
            raise ValueError(
                f"max_batch_tokens={max_batch_tokens} is below the longest context document "
                f"({len(ids[order[0]])} tokens): raise it to at least that"
            )
        batches, current = [], []
        for i in order:  # longest first: a batch's padded cost is its row count x its first row's length
            if current and (len(current) + 1) * len(ids[current[0]]) > max_batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        return batches + [current]

    # ----------------------------------------------------------------------------------------- second stage
    def resolve_context(self, dataset_embeddings, device, dtype) -> torch.Tensor:
        """The (N, d) context the second stage reads: E checked and truncated, or the learned null context."""
        if dataset_embeddings is None:
            raise ContextMissingError(
                "a CDE model needs a context: pass dataset_embeddings=model.encode_context(corpus_sample) "
                f"(at least {self.n_context} documents of the target corpus) or dataset_embeddings='null'"
            )
        if isinstance(dataset_embeddings, str):
            if dataset_embeddings != "null":
                raise ContextMissingError(
                    f"dataset_embeddings must be a tensor or 'null', got {dataset_embeddings!r}"
                )
            return self.null_context.expand(self.n_context, -1).to(device=device, dtype=dtype)
        e = torch.as_tensor(dataset_embeddings)
        if e.dim() != 2 or e.shape[1] != self.dim:
            raise ContextMissingError(f"dataset_embeddings must be (N, {self.dim}), got {tuple(e.shape)}")
        if e.shape[0] < self.n_context:
            raise ContextMissingError(
                f"this model reads exactly {self.n_context} context vectors, got {e.shape[0]}: encode at least "
                f"{self.n_context} corpus documents (sample with replacement if the corpus is smaller)"
            )
        if e.shape[0] > self.n_context:
            if not self._warned_truncation:
                logger.warning(
                    "%d context vectors given, the model reads %d: using the first %d",
                    e.shape[0],
                    self.n_context,
                    self.n_context,
                )
                self._warned_truncation = True
            e = e[: self.n_context]
        bad = ~torch.isfinite(e).all(dim=1)
        if bool(bad.any()):  # else the encoder's output is NaN, and its error blames float16
            raise ContextMissingError(
                f"dataset_embeddings holds NaN or inf in {int(bad.sum())} of the {self.n_context} context vectors "
                f"read (first: row {int(bad.nonzero()[0])}): pass the output of model.encode_context(corpus_sample)"
            )
        e = e.to(device=device, dtype=dtype)
        if self.training and self.context_dropout > 0:
            drop = torch.rand(e.shape[0], device=device) < self.context_dropout
            e = torch.where(drop[:, None], self.null_context.to(dtype).expand_as(e), e)
        return e

    def embed_texts(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        context: torch.Tensor,
        prompt_length: int | torch.Tensor | None = None,
        position_offset: int = 0,
    ) -> torch.Tensor:
        """Second stage: (B, d) embeddings of tokenized texts given the (N, d) context (already resolved)."""
        B, L = input_ids.shape
        tokens = self.second_stage.get_input_embeddings()(input_ids)
        prefix = torch.cat([self.context_norm(context).to(tokens.dtype), self.soft_prompt.to(tokens.dtype)])
        P = prefix.shape[0]
        x = torch.cat([prefix.unsqueeze(0).expand(B, -1, -1), tokens], dim=1)
        mask = torch.cat([attention_mask.new_ones(B, P), attention_mask], dim=1)
        text_pos = torch.arange(L, device=input_ids.device) + position_offset
        # every prefix slot at position 0: with absolute positions that keeps E a set; NeoBERT's prefix
        # attention reads no position of the prefix, and needs the padded layout (a 4-D mask keeps it)
        pos = torch.cat([text_pos.new_zeros(P), text_pos])[None].expand(B, -1)
        if self._rope_prefix:
            mask = mask[:, None, None, :].bool()
        out = self.second_stage(inputs_embeds=x, attention_mask=mask, position_ids=pos)
        hidden = out.last_hidden_state[:, P:]
        pool_mask = attention_mask
        if self.exclude_prompt and prompt_length is not None:
            n = int(prompt_length)
            pool_mask = attention_mask.clone()
            pool_mask[:, :n] = 0
            pool_mask = torch.where(pool_mask.sum(1, keepdim=True) > 0, pool_mask, attention_mask)
        pooled = _mean_pool(hidden, pool_mask)
        return pooled + self.output_mlp(pooled)

    def forward(self, features: dict[str, Any], dataset_embeddings=None, **kwargs) -> dict[str, Any]:
        ids, mask = features["input_ids"], features["attention_mask"]
        dtype = self.second_stage.get_input_embeddings().weight.dtype
        context = self.resolve_context(dataset_embeddings, ids.device, dtype)
        features["sentence_embedding"] = self.embed_texts(ids, mask, context, features.get("prompt_length"))
        return features

    # ------------------------------------------------------------------------------------------ save / load
    def head_state_dict(self) -> dict[str, torch.Tensor]:
        skip = (f"{FIRST}.", f"{SECOND}.")
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith(skip)}

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        """The module's folder; with ``self.adapter_base`` set, the stages' LoRA adapters alone (PEFT's layout)
        over that base encoder instead of the stages' full weights."""
        os.makedirs(output_path, exist_ok=True)
        adapter_base = self.adapter_base
        if adapter_base is None:
            self.first_stage.save_pretrained(os.path.join(output_path, FIRST))
            self.second_stage.save_pretrained(os.path.join(output_path, SECOND))
        else:
            for part, stage in ((FIRST, self.first_stage), (SECOND, self.second_stage)):
                _save_stage_adapter(stage, os.path.join(output_path, part))
            with open(os.path.join(output_path, ADAPTER_BASE), "w") as f:
                json.dump({"base_model": adapter_base}, f, indent=2)
        self.save_tokenizer(output_path)
        save_file(self.head_state_dict(), os.path.join(output_path, HEAD_WEIGHTS))
        with open(os.path.join(output_path, "cde_config.json"), "w") as f:
            json.dump(self.get_config_dict(), f, indent=2)
        code = os.path.join(output_path, "modeling_cde.py")
        if os.path.abspath(__file__) != os.path.abspath(code):
            with open(__file__) as src, open(code, "w") as dst:
                dst.write(src.read())

    @classmethod
    def load(
        cls,
        model_name_or_path: str,
        subfolder: str = "",
        token=None,
        cache_folder=None,
        revision=None,
        local_files_only: bool = False,
        trust_remote_code: bool = False,
        model_kwargs: dict | None = None,
        **kwargs,
    ) -> ContextualDocumentEmbedder:
        hub = {
            "token": token,
            "cache_folder": cache_folder,
            "revision": revision,
            "local_files_only": local_files_only,
        }
        root = cls.load_dir_path(model_name_or_path, subfolder=subfolder, **hub)
        with open(os.path.join(root, "cde_config.json")) as f:
            config = json.load(f)
        model_kwargs = dict(model_kwargs or {})
        base, adapters = None, os.path.join(root, ADAPTER_BASE)
        if os.path.isfile(adapters):  # adapters alone: the base encoder, then each stage's adapter
            with open(adapters) as f:
                base = json.load(f)["base_model"]
        stages = [
            AutoModel.from_pretrained(
                base or os.path.join(root, part), trust_remote_code=trust_remote_code, **model_kwargs
            )
            for part in (FIRST, SECOND)
        ]
        if base is not None:
            for part, stage in zip((FIRST, SECOND), stages, strict=True):
                _load_stage_adapter(stage, os.path.join(root, part))
        tokenizer = AutoTokenizer.from_pretrained(root)
        module = cls(*stages, tokenizer, **config)
        head = load_file(os.path.join(root, HEAD_WEIGHTS))
        missing, unexpected = module.load_state_dict(head, strict=False)
        missing = [k for k in missing if not k.startswith((f"{FIRST}.", f"{SECOND}."))]
        if missing or unexpected:
            raise ValueError(f"{HEAD_WEIGHTS}: missing {missing}, unexpected {unexpected}")
        dtype = stages[1].get_input_embeddings().weight.dtype
        module.to(dtype)
        return module


PEFT_PREFIX = "base_model.model."  # before every key PEFT's own save writes (its PeftModel's path to the model)


def _save_stage_adapter(stage: nn.Module, folder: str) -> None:
    """One stage's LoRA adapter in PEFT's layout (``adapter_config.json``, ``adapter_model.safetensors``)."""
    from peft import get_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    configs = getattr(stage, "peft_config", {})
    if "default" not in configs or not any(isinstance(m, LoraLayer) for m in stage.modules()):
        raise ValueError("adapter_base: the stages hold no LoRA adapter to save alone")
    os.makedirs(folder, exist_ok=True)
    state = get_peft_model_state_dict(stage, adapter_name="default")
    save_file(  # PEFT's own prefix, which PeftModel.from_pretrained on the stage's encoder looks for
        {PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in state.items()},
        os.path.join(folder, "adapter_model.safetensors"),
    )
    configs["default"].save_pretrained(folder)


def _load_stage_adapter(stage: nn.Module, folder: str) -> None:
    """Put a stage's saved LoRA adapter into ``stage`` (the base encoder), not merged."""
    try:
        from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    except ImportError as e:
        raise ImportError(f"{folder} holds a LoRA adapter: loading it needs PEFT (pip install peft)") from e
    config = LoraConfig.from_pretrained(folder)
    inject_adapter_in_model(config, stage)
    state = load_file(os.path.join(folder, "adapter_model.safetensors"))  # with PEFT's prefix, or without
    result = set_peft_model_state_dict(stage, {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()})
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if missing:
        raise ValueError(f"{folder}: the adapter lacks {len(missing)} LoRA weights, e.g. {missing[0]}")
