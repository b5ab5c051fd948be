"""Training sequences from documents: packed (padding-free, attention confined to each document) or padded.

**Packed** (the paper's scheme, and the fix of its M6 ablation): documents, in a shuffled order, are
concatenated into sequences of exactly ``L`` tokens. A document that does not fit is split: its first part
ends the sequence and the rest starts the next one. A micro-batch of ``b`` sequences is given to the model
as one row of ``b * L`` tokens with

* ``position_ids`` restarting at 0 at every document (or document fragment), so RoPE sees each document
  from its own start, and
* ``cu_seq_lens_q``, the cumulative fragment lengths, so attention never crosses a document boundary.

``cross_document=True`` reproduces the flawed variant (positions 0..L-1 per sequence, attention over the
whole sequence) for ablations.

**Padded**: one document (fragment of at most ``L`` tokens) per row, padded to the longest row of the
micro-batch, with an attention mask.

:class:`DocumentStream` walks a corpus in a seeded order per epoch; its state (epoch, cursor, offset in the
current document) is three integers, saved in every checkpoint so that a resumed run reads exactly the
tokens the uninterrupted one would have read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["DocumentStream", "PackedBatch", "PaddedBatch", "collate_packed", "collate_padded"]


class DocumentStream:
    """Token fragments of a corpus in a seeded, per-epoch shuffled order, resumable at any token."""

    def __init__(self, corpus, seed: int, shuffle: bool = True):
        if len(corpus) == 0:
            raise ValueError(f"corpus {getattr(corpus, 'path', '')} holds no documents")
        self.corpus, self.seed, self.shuffle = corpus, seed, shuffle
        self.epoch, self.cursor, self.offset = 0, 0, 0
        self._order = self._make_order()

    def _make_order(self) -> np.ndarray:
        n = len(self.corpus)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, self.epoch]).permutation(n)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor, self.offset = int(state["epoch"]), int(state["cursor"]), int(state["offset"])
        self._order = self._make_order()

    def take(self, n: int) -> np.ndarray:
        """The next (up to) ``n`` tokens of the current document; moves to the next document at its end."""
        doc = self.corpus[int(self._order[self.cursor])]
        piece = doc[self.offset : self.offset + n]
        self.offset += len(piece)
        if self.offset >= len(doc):
            self.cursor, self.offset = self.cursor + 1, 0
            if self.cursor >= len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._make_order()
        return piece

    def packed_sequence(self, length: int) -> list[np.ndarray]:
        """Fragments filling exactly ``length`` tokens."""
        pieces, room = [], length
        while room > 0:
            piece = self.take(room)
            if len(piece):
                pieces.append(piece)
                room -= len(piece)
        return pieces

    def single_document(self, length: int) -> np.ndarray:
        """The next document (fragment) of at most ``length`` tokens, for padded batches."""
        piece = self.take(length)
        while len(piece) == 0:
            piece = self.take(length)
        return piece


@dataclass
class PackedBatch:
    """Model input for a packed micro-batch: one row of T tokens."""

    input_ids: torch.Tensor  # (1, T)
    position_ids: torch.Tensor  # (1, T), restarting at 0 per fragment
    cu_seq_lens_q: torch.Tensor  # (n_fragments + 1,) int32
    max_length_q: int

    def model_inputs(self) -> dict:
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seq_lens_q,
            "max_length_q": self.max_length_q,
        }

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class PaddedBatch:
    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)

    def model_inputs(self) -> dict:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def collate_packed(sequences: list[list[np.ndarray]], cross_document: bool = False) -> PackedBatch:
    """Flatten packed sequences (lists of fragments) into one row with per-fragment positions and bounds."""
    if cross_document:
        fragments = [np.concatenate(seq) for seq in sequences]
    else:
        fragments = [frag for seq in sequences for frag in seq]
    lengths = np.array([len(f) for f in fragments], dtype=np.int64)
    ids = torch.from_numpy(np.concatenate(fragments))[None]
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = torch.from_numpy(np.arange(int(lengths.sum())) - starts)[None]
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return PackedBatch(ids, positions, cu, int(lengths.max()))


def collate_padded(documents: list[np.ndarray], pad_token_id: int) -> PaddedBatch:
    """Right-pad documents to the longest one."""
    width = max(len(d) for d in documents)
    ids = torch.full((len(documents), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(documents), width), dtype=torch.long)
    for i, d in enumerate(documents):
        ids[i, : len(d)] = torch.from_numpy(d)
        mask[i, : len(d)] = 1
    return PaddedBatch(ids, mask)
