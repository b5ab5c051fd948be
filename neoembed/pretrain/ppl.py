"""Pseudo-perplexity of a masked language model by sequence length (NeoBERT Section 5.3, Figure 2).

For every document at least as long as the largest length, and for every length ``L``: keep the first ``L``
tokens, mask each non-special token in turn, and score the original token; pseudo-perplexity is
``exp(mean negative log-likelihood)`` over all scored tokens of all documents at that length (Salazar et al.,
2020). One forward pass scores ``batch_size`` masked copies of the sequence at once (each copy masks a
different position), and the decoder runs only at the masked position of each copy.
:func:`pseudo_nll_reference` is the slow twin (one copy per forward, the full masked-LM head) that the fast
path is tested against.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["pseudo_nll", "pseudo_nll_reference", "pseudo_perplexity", "plot_ppl"]


def _positions(ids: torch.Tensor, special_ids) -> torch.Tensor:
    return torch.nonzero(~torch.isin(ids, torch.as_tensor(list(special_ids), dtype=ids.dtype))).flatten()


@torch.no_grad()
def pseudo_nll(
    model, ids: torch.Tensor, special_ids, mask_id: int, batch_size: int = 32
) -> tuple[float, int]:
    """Summed negative log-likelihood of every non-special token of ``ids`` (1-D), each masked alone."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    positions = _positions(ids, special_ids)
    total = 0.0
    for start in range(0, len(positions), batch_size):
        pos = positions[start : start + batch_size]
        k = len(pos)
        copies = ids.repeat(k, 1)  # (k, L): copy i masks position pos[i]
        rows = torch.arange(k, device=device)
        copies[rows, pos] = mask_id
        hidden = model.model(input_ids=copies).last_hidden_state[rows, pos]  # (k, D)
        logits = model.decoder(hidden).float()
        total += float(F.cross_entropy(logits, ids[pos], reduction="sum"))
    return total, len(positions)


@torch.no_grad()
def pseudo_nll_reference(model, ids: torch.Tensor, special_ids, mask_id: int) -> tuple[float, int]:
    """The slow twin of :func:`pseudo_nll`: one masked position per forward, through the full head."""
    total, positions = 0.0, _positions(ids, special_ids)
    for p in positions.tolist():
        x = ids.clone()
        x[p] = mask_id
        logits = model(input_ids=x[None]).logits[0, p].float()
        total -= float(torch.log_softmax(logits, -1)[ids[p]])
    return total, len(positions)


def pseudo_perplexity(
    model,
    documents,
    lengths: list[int],
    special_ids,
    mask_id: int,
    max_docs: int = 16,
    batch_size: int = 32,
    progress: bool = True,
) -> dict:
    """Pseudo-perplexity per length over the first ``max_docs`` documents with at least ``max(lengths)`` tokens."""
    from neoembed.progress import bar as progress_bar

    lengths = sorted(set(lengths))
    longest = lengths[-1]
    limit = model.config.max_sequence_length
    if longest > limit:
        raise ValueError(f"length {longest} exceeds the model's maximum {limit}: drop it from --lengths")
    chosen = []
    for doc in documents:
        if len(doc) >= longest:
            chosen.append(torch.as_tensor(np.asarray(doc), dtype=torch.long))
            if len(chosen) >= max_docs:
                break
    if not chosen:
        raise ValueError(
            f"no document has {longest} tokens or more: lower the largest --lengths or use longer documents"
        )
    model.eval()
    results = []
    work = sum(L for L in lengths) * len(chosen)
    with progress_bar(total=work, unit="tok", desc="pseudo-perplexity", disable=not progress) as bar:
        for L in lengths:
            nll, count = 0.0, 0
            for doc in chosen:
                s, n = pseudo_nll(model, doc[:L], special_ids, mask_id, batch_size)
                nll, count = nll + s, count + n
                bar.update(L)
            results.append(
                {
                    "length": L,
                    "pseudo_perplexity": math.exp(nll / count),
                    "mean_nll": nll / count,
                    "documents": len(chosen),
                    "scored_tokens": count,
                }
            )
    return {"lengths": results, "documents": len(chosen)}


def plot_ppl(result: dict, path: str | Path, title: str = "") -> Path:
    """Pseudo-perplexity against sequence length (log-2 x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["length"] for r in result["lengths"]]
    ys = [r["pseudo_perplexity"] for r in result["lengths"]]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(xs, ys, marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("pseudo-perplexity")
    ax.set_title(title or f"{result['documents']} documents")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def write_ppl(result: dict, out_dir: str | Path, title: str = "") -> tuple[Path, Path]:
    from neoembed.record import atomic_write_text

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    j = out / "ppl.json"
    atomic_write_text(j, json.dumps(result, indent=2) + "\n")
    return j, plot_ppl(result, out / "ppl.png", title)
