# Copyright 2026 the neoembed developers. MIT License.
"""NeoBERT (Le Breton et al., 2025), top to bottom: RMSNorm -> RoPE -> attention -> SwiGLU -> block ->
encoder -> heads (masked LM, sequence and token classification).

Imports only torch and transformers: this file is copied next to every saved model, with the files it imports:
``configuration_neobert.py``, ``attention_neobert.py`` (RoPE and the attention functions) and
``layout_neobert.py`` (the layouts and the input checks).

Shapes: B batch, L padded length, T packed tokens (sum of real lengths), D width, H heads, Dh = D / H.

Attention runs in one of two layouts, chosen once per forward (``layout_neobert.plan_layout``):

* padded: ``(B, L, D)`` with a key-padding mask ``(B, 1, 1, L)`` (none where nothing is padded);
* packed (``config.padding_free``, or ``flash_attention_2``): the real tokens of every sequence in one
  ``(1, T, D)`` sequence for every linear layer, attention confined to each sequence by the standard flash
  keyword arguments (``cu_seq_lens_q``, ``max_length_q``). Outputs are scattered back to ``(B, L, D)``, so
  callers do not care. Input that comes packed (``cu_seq_lens_q``, or ``position_ids`` restarting at 0 in one
  row: transformers' ``DataCollatorWithFlattening``) stays packed.

``NeoBERTAttention`` rotates q and k and calls the function transformers' ``AttentionInterface`` holds under the
forward's name: ``sdpa`` or ``eager`` padded, neoembed's ``neobert_grouped`` / ``neobert_varlen`` packed
(``attention_neobert.py``). A subclass may replace the attention of every block (``neoembed.cde``'s position-less
prefix).

The hot path never asks the host: a padded forward makes no data-dependent sync (value checks of the input
run on host tensors only, outside compilation); dropping padding or reading packed boundaries costs one sync,
made in ``forward`` itself so that ``torch.compile`` breaks the graph there once. Padding positions of the last
hidden state are zeros in every layout.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

try:
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # pragma: no cover - older transformers
    GradientCheckpointingLayer = nn.Module  # type: ignore[misc,assignment]

from .attention_neobert import NeoBERTRotaryEmbedding, apply_rope, eager_attention_forward
from .configuration_neobert import NeoBERTConfig
from .layout_neobert import check_inputs, plan_layout, prepare_layout

__all__ = [
    "NeoBERTForMaskedLM",
    "NeoBERTForSequenceClassification",
    "NeoBERTForTokenClassification",
    "NeoBERTModel",
    "NeoBERTPreTrainedModel",
    "NeoBERTWarning",
]

#: Parameter-name prefixes of the task heads on top of the encoder (``model.``): the official masked-LM
#: ``decoder`` and the official classifier's ``dense`` / ``classifier``. A checkpoint may lack them (they start
#: fresh) or hold another head's (dropped); the encoder's own weights must match exactly.
HEAD_KEY_PREFIXES = ("decoder.", "dense.", "classifier.")


class NeoBERTWarning(UserWarning):
    """A warning about the model's own use (a checkpoint without its decoder, a sequence past the supported
    length). Its own class, so that neoembed tells it from the libraries' warnings whichever code called the model
    (``neoembed.progress.is_own_category``); defined here, as this file also runs as remote code without neoembed."""


# --------------------------------------------------------------------------------------------------- norm
class NeoBERTRMSNorm(nn.Module):
    """RMSNorm with its statistics in float32 (autocast-safe), output in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu":
            # one reduction pass over x (its norm) and no x² temporary: F.rms_norm's CPU composite makes three
            # passes and two full-size temporaries (benchmarks/throughput.py --official)
            inv_rms = (
                torch.linalg.vector_norm(x, dim=-1, keepdim=True).square().div(x.shape[-1]).add(self.eps)
            )
            y = x * inv_rms.rsqrt()
            return y * self.weight if torch.is_grad_enabled() else y.mul_(self.weight)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight.float(), self.eps)
        # one fused kernel (CUDA) that accumulates half-precision input in float32 and rounds once: the float32
        # copy, cast back and separate product of the plain form were 3 of the eager forward's 4 memory passes
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class NeoBERTAttention(nn.Module):
    """Multi-head self-attention over projected q, k, v: RoPE, then the AttentionInterface function the forward
    names. The q/k/v and output projections belong to the block (``qkv``, ``wo``: the official parameter names)."""

    is_causal = False  # read by transformers' attention functions

    def __init__(self, config: NeoBERTConfig):
        super().__init__()
        self.config, self.scaling = config, config.head_dim**-0.5

    def forward(self, q, k, v, position_embeddings, attention_mask, implementation: str, **kwargs):
        # q, k, v: (B, L, H, Dh) padded or (1, T, H, Dh) packed; cos, sin broadcast over the heads
        cos, sin = position_embeddings
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, L, Dh)
        return attention(self, q, k, v, attention_mask, scaling=self.scaling, **kwargs)


# ------------------------------------------------------------------------------------------------ SwiGLU
class NeoBERTSwiGLU(nn.Module):
    """w3(silu(gate) * value) where [gate | value] = w12(x)."""

    def __init__(self, config: NeoBERTConfig):
        super().__init__()
        hidden = config.ffn_hidden_size
        self.w12 = nn.Linear(config.hidden_size, 2 * hidden, bias=False)
        self.w3 = nn.Linear(hidden, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eager_cpu = x.device.type == "cpu" and not torch.compiler.is_exporting()
        if eager_cpu and type(self.w12) is nn.Linear:  # a wrapped w12 (a LoRA adapter) is called
            # Two GEMMs on the two contiguous row blocks of the fused weight: faster than the fused one on
            # CPU (measured, benchmarks/throughput.py), and silu then runs on a contiguous tensor. Not in an
            # exported graph: there the split weight is a runtime op, which int8 quantization leaves in fp32.
            gate_w, value_w = self.w12.weight.chunk(2, dim=0)
            gate, value = F.linear(x, gate_w), F.linear(x, value_w)
            if torch.is_grad_enabled():
                return self.w3(F.silu(gate) * value)
            return self.w3(F.silu(gate, inplace=True).mul_(value))  # inference: no (T, 2,048) temporaries
        gate, value = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(gate) * value)


# ------------------------------------------------------------------------------------------------- block
class NeoBERTBlock(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(norm(x)), then x + swiglu(norm(x)). Parameter names as the official ones."""

    def __init__(self, config: NeoBERTConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.attention = NeoBERTAttention(config)
        self.ffn = NeoBERTSwiGLU(config)
        self.attention_norm = NeoBERTRMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = NeoBERTRMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, x: torch.Tensor, attention: dict):
        # x: (B, L, D) padded or (1, T, D) packed; per head the official layout is [q | k | v]; ``attention``: the
        # attention module's arguments, built once per forward by the model
        qkv = self.qkv(self.attention_norm(x)).unflatten(-1, (self.num_heads, 3 * self.head_dim))
        attn, weights = self.attention(*qkv.chunk(3, dim=-1), **attention)
        # residuals added into the fresh projection outputs (no third tensor; autograd-safe: a linear layer's
        # backward does not read its output)
        x = self.wo(attn.flatten(-2)).add_(x)
        return self.ffn(self.ffn_norm(x)).add_(x), weights


# --------------------------------------------------------------------------------------------- encoder
class NeoBERTPreTrainedModel(PreTrainedModel):
    config_class = NeoBERTConfig
    config: NeoBERTConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["NeoBERTBlock"]
    _supports_sdpa = True
    _supports_flash_attn = True
    # read by sentence-transformers (is_backend_compatible): with flash attention it then packs each batch itself
    # (DataCollatorWithFlattening: position_ids, cu_seq_lens_q/k, max_length_q/k), which forward() accepts
    _supports_attention_backend = True

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """As transformers' ``from_pretrained``, but a checkpoint with missing or unexpected NeoBERT weights is an
        error listing them (never a silently half-random model), unless ``output_loading_info=True`` asks for
        them: then ``(model, info)`` comes back and checking it is the caller's business. Task heads
        (``HEAD_KEY_PREFIXES``: the MLM ``decoder``, the classifiers' ``dense`` / ``classifier``) are the exception:
        a head the checkpoint lacks starts fresh, one it has and the model lacks is dropped, both listed in
        transformers' load report (the masked-LM model also warns that its decoder is random)."""
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        state_dict = kwargs.get("state_dict")
        # no checkpoint at all (no path, an empty state_dict): transformers' way to build and initialise a model
        # through the loading machinery, with nothing that could mismatch
        no_checkpoint = source is None and isinstance(state_dict, dict) and not state_dict
        if kwargs.get("output_loading_info") or no_checkpoint:
            return super().from_pretrained(*args, **kwargs)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        missing = [k for k in info.get("missing_keys", ()) if not k.startswith(HEAD_KEY_PREFIXES)]
        unexpected = [k for k in info.get("unexpected_keys", ()) if not k.startswith(HEAD_KEY_PREFIXES)]
        # ignore_mismatched_sizes=True asks for mismatched weights to start fresh (a new label count)
        mismatched = [] if kwargs.get("ignore_mismatched_sizes") else list(info.get("mismatched_keys", ()))
        if missing or unexpected or mismatched:
            parts = [f"missing keys {sorted(missing)}"] if missing else []
            parts += [f"unexpected keys {sorted(unexpected)}"] if unexpected else []
            parts += [f"keys with mismatched shapes {mismatched}"] if mismatched else []
            raise ValueError(
                f"checkpoint {source!r} does not match "
                f"{cls.__name__}: " + "; ".join(parts) + ". Check that config.json belongs to these weights "
                "(or pass output_loading_info=True to get the model and this information instead)."
            )
        if any(k.startswith("decoder.") for k in info.get("missing_keys", ())):
            warnings.warn(
                "the checkpoint has no masked-LM decoder: it was initialised randomly (fine for pre-training, "
                "not for scoring masked tokens)",
                NeoBERTWarning,
                stacklevel=2,
            )
        return model

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # Official initialisation: uniform in +-range for linear layers and embeddings.
        if isinstance(module, nn.Linear) and getattr(module, "_is_classifier", False):
            # the official classification heads: normal(0, classifier_init_range), zero bias
            nn.init.normal_(module.weight, 0.0, self.config.classifier_init_range)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            r = self.config.decoder_init_range
            nn.init.uniform_(module.weight, -r, r)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            r = self.config.embedding_init_range
            nn.init.uniform_(module.weight, -r, r)
        elif isinstance(module, NeoBERTRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, NeoBERTRotaryEmbedding):
            super()._init_weights(
                module
            )  # transformers recomputes the frequency buffers (not in checkpoints)

    def _output_flags(self, output_attentions, output_hidden_states, return_dict) -> tuple[bool, bool, bool]:
        """Call arguments, else the config's (transformers' convention)."""
        pick = lambda value, default: bool(default if value is None else value)  # noqa: E731
        return (
            pick(output_attentions, self.config.output_attentions),
            pick(output_hidden_states, self.config.output_hidden_states),
            pick(return_dict, self.config.return_dict),
        )


class NeoBERTModel(NeoBERTPreTrainedModel):
    """The NeoBERT encoder: token embedding (no position embedding) -> blocks -> final RMSNorm."""

    # official checkpoints hold the masked-LM decoder too, fine-tuned ones a classifier; the bare encoder drops
    # them without complaint
    _keys_to_ignore_on_load_unexpected = [r"^decoder\.", r"^dense\.", r"^classifier\."]

    def __init__(self, config: NeoBERTConfig):
        super().__init__(config)
        self.encoder = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.transformer_encoder = nn.ModuleList(
            NeoBERTBlock(config) for _ in range(config.num_hidden_layers)
        )
        self.layer_norm = NeoBERTRMSNorm(config.hidden_size, config.norm_eps)
        self.rotary_emb = NeoBERTRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        **kwargs,
    ) -> BaseModelOutput | tuple:
        """Encode a batch.

        Args:
            input_ids: (B, L) token ids, or (1, T) packed ids with ``cu_seq_lens_q`` / ``position_ids``.
            attention_mask: (B, L) with 1 for tokens and 0 for padding, or a bool (B, 1, L or 1, L) mask, True
                where a query attends to a key (a prepared 4-D mask; padded layout, output not zeroed).
            position_ids: RoPE positions (default: 0, 1, … per sequence).
            inputs_embeds: (B, L, D) instead of ``input_ids``.
        """
        for name in ("token_type_ids", "seq_idx"):
            kwargs.pop(name, None)  # tokenizers and flattening collators may send these; NeoBERT has no use
        if kwargs:
            raise TypeError(f"NeoBERTModel.forward got unexpected arguments: {sorted(kwargs)}")
        output_attentions, output_hidden_states, return_dict = self._output_flags(
            output_attentions, output_hidden_states, return_dict
        )
        check_inputs(self.config, input_ids, attention_mask, inputs_embeds)
        x = self.encoder(input_ids) if inputs_embeds is None else inputs_embeds
        plan, to_read = plan_layout(
            self.config, x, attention_mask, position_ids, cu_seq_lens_q, output_attentions
        )
        host = None if to_read is None else to_read.tolist()  # the forward's one host sync (a graph break)
        x, layout, attention = prepare_layout(
            self, plan, host, x, attention_mask, position_ids, cu_seq_lens_k, output_attentions
        )
        hidden_states, attentions = [layout.unpack(x)] if output_hidden_states else None, []
        for block in self.transformer_encoder:
            x, weights = block(x, attention)
            attentions.append(weights)
            if output_hidden_states:
                hidden_states.append(layout.unpack(x))
        out = BaseModelOutput(
            last_hidden_state=layout.output(self.layer_norm(x)),
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )
        return out if return_dict else out.to_tuple()

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's (cos, sin) at ``position_ids``, broadcast over the heads."""
        cos, sin = self.rotary_emb(self.rotary_emb.inv_freq, position_ids)
        return cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads

    def check_length(self, length: int) -> None:
        """RoPE has no hard limit (transformers' models run past their trained length), but quality drops there."""
        limit = self.config.max_sequence_length
        if length > limit:
            hint = (
                "set rope_parameters={'rope_type': 'yarn', 'factor': f} (YaRN) to extend it"
                if self.config.rope_type == "default"
                else "raise rope_parameters['factor'] or truncate the input"
            )
            warnings.warn(
                f"a sequence exceeds the {limit} tokens this model supports; its outputs degrade: {hint}",
                NeoBERTWarning,
                stacklevel=3,
            )


# ----------------------------------------------------------------------------------------------- MLM head
class NeoBERTForMaskedLM(NeoBERTPreTrainedModel):
    """NeoBERT with the untied masked-LM decoder (a linear layer with bias) of the official checkpoint."""

    def __init__(self, config: NeoBERTConfig):
        super().__init__(config)
        self.model = NeoBERTModel(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.decoder = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MaskedLMOutput | tuple:
        """Logits (B, L, vocab), or (1, T, vocab) for packed input; with ``labels`` of the same leading shape (-100
        = not masked), the cross-entropy loss too: the mean over masked tokens, or their sum over
        ``num_items_in_batch`` (the Trainer's count over all accumulated micro-batches)."""
        num_items = kwargs.pop("num_items_in_batch", None)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=True,
            **kwargs,
        )
        logits = self.decoder(out.last_hidden_state)
        loss = None
        if labels is not None:
            if labels.shape != logits.shape[:-1]:
                raise ValueError(
                    f"labels shape {tuple(labels.shape)} does not match logits {tuple(logits.shape[:-1])}"
                )
            flat = logits.flatten(0, -2).float(), labels.flatten()
            if num_items is None:
                loss = F.cross_entropy(*flat, ignore_index=-100)
            else:
                loss = F.cross_entropy(*flat, ignore_index=-100, reduction="sum") / num_items
        result = MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return result if self._output_flags(None, None, return_dict)[2] else result.to_tuple()


# ---------------------------------------------------------------------------------------- classification
def _classifier_linear(in_features: int, out_features: int) -> nn.Linear:
    """A head's linear layer, marked for the official classifier initialisation (``_init_weights``)."""
    layer = nn.Linear(in_features, out_features)
    layer._is_classifier = True
    return layer


def _first_tokens(h: torch.Tensor, attention_mask, position_ids, cu_seq_lens_q) -> torch.Tensor:
    """(B, D): the hidden state of each sequence's first real token (``[CLS]``).

    ``h`` is the encoder output, (B, L, D), or (1, T, D) for packed input, whose sequences start at
    ``cu_seq_lens_q[:-1]`` or where ``position_ids`` restart at 0. The official code takes ``h[:, 0]``
    (right padding); the first position of the attention mask is the same there and also right under left
    padding. No host sync except for packed input given by ``position_ids`` alone."""
    if cu_seq_lens_q is not None:
        return h[0, cu_seq_lens_q[:-1].long()]
    if position_ids is not None and attention_mask is None and h.shape[0] == 1:
        starts = (position_ids[0] == 0).nonzero().flatten()
        if starts.numel():  # the model packed these sequences the same way (NeoBERTModel._plan)
            return h[0, starts]
    if attention_mask is None:
        return h[:, 0]
    first = attention_mask.to(torch.int32).argmax(dim=1)  # the first 1 of each row
    return h[torch.arange(h.shape[0], device=h.device), first]


PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor, config) -> torch.Tensor:
    """transformers' loss for sequence classifiers, chosen by ``config.problem_type`` or, when unset, as
    transformers infers it (without writing it into the config): one label -> regression (MSE), integer labels
    -> single-label (cross-entropy), float labels of shape (B, num_labels) -> multi-label (BCE with logits)."""
    kind = config.problem_type
    if kind is None:
        if config.num_labels == 1:
            kind = "regression"
        elif labels.dtype in (torch.long, torch.int32, torch.int16, torch.uint8):
            kind = "single_label_classification"
        else:
            kind = "multi_label_classification"
    if kind == "regression":
        if config.num_labels == 1:
            return F.mse_loss(logits.view(-1).float(), labels.view(-1).float())
        return F.mse_loss(logits.float(), labels.float())
    if kind == "single_label_classification":
        return F.cross_entropy(logits.view(-1, config.num_labels).float(), labels.view(-1))
    if kind == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
    raise ValueError(f"unknown problem_type {kind!r}; valid: {list(PROBLEM_TYPES)}")


class NeoBERTForSequenceClassification(NeoBERTPreTrainedModel):
    """NeoBERT with the official sequence-classification head: the first token's hidden state (``[CLS]``) ->
    dropout -> ``dense`` -> tanh -> dropout -> ``classifier`` (``num_labels`` logits).

    As the official ``NeoBERTHFForSequenceClassification`` (chandar-lab/NeoBERT, ``src/neobert/model/model.py``),
    parameter names included, so that its fine-tuned checkpoints load; its linear layers start from
    normal(0, ``classifier_init_range``). Regression (``num_labels=1``, STS-B), single- and multi-label
    classification follow ``config.problem_type`` as in every transformers classifier."""

    def __init__(self, config: NeoBERTConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = NeoBERTModel(config)
        self.dense = _classifier_linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = _classifier_linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput | tuple:
        """Logits (B, num_labels); with ``labels`` (B,) or (B, num_labels), the loss too. Packed input (1, T)
        with ``cu_seq_lens_q`` or restarting ``position_ids`` gives one row per packed sequence."""
        kwargs.pop("num_items_in_batch", None)  # the Trainer's; a per-sequence loss is a mean over the batch
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=True,
            **kwargs,
        )
        x = _first_tokens(
            out.last_hidden_state, attention_mask, kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")
        )
        x = self.dropout(torch.tanh(self.dense(self.dropout(x))))
        logits = self.classifier(x)
        loss = None if labels is None else sequence_classification_loss(logits, labels, self.config)
        result = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return result if self._output_flags(None, None, return_dict)[2] else result.to_tuple()


class NeoBERTForTokenClassification(NeoBERTPreTrainedModel):
    """NeoBERT with a token-classification head: every token's hidden state -> dropout -> ``classifier``.

    The official code has no token head; this one is BERT's (``BertForTokenClassification``), with the
    official classifier initialisation and dropout. Padding positions get logits too; label them -100."""

    def __init__(self, config: NeoBERTConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = NeoBERTModel(config)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = _classifier_linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> TokenClassifierOutput | tuple:
        """Logits (B, L, num_labels), or (1, T, num_labels) for packed input; with ``labels`` of the same
        leading shape (-100 = ignored), the cross-entropy loss too: the mean over labelled tokens, or their sum over
        ``num_items_in_batch`` (the Trainer's count over all accumulated micro-batches)."""
        num_items = kwargs.pop("num_items_in_batch", None)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(self.dropout(out.last_hidden_state))
        loss = None
        if labels is not None:
            if labels.shape != logits.shape[:-1]:
                raise ValueError(
                    f"labels shape {tuple(labels.shape)} does not match the tokens {tuple(logits.shape[:-1])}"
                )
            flat = logits.flatten(0, -2).float(), labels.flatten()
            if num_items is None:
                loss = F.cross_entropy(*flat, ignore_index=-100)
            else:
                loss = F.cross_entropy(*flat, ignore_index=-100, reduction="sum") / num_items
        result = TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return result if self._output_flags(None, None, return_dict)[2] else result.to_tuple()


NeoBERTModel.register_for_auto_class("AutoModel")
NeoBERTForMaskedLM.register_for_auto_class("AutoModelForMaskedLM")
NeoBERTForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
NeoBERTForTokenClassification.register_for_auto_class("AutoModelForTokenClassification")
