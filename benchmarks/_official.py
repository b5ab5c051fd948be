"""The official NeoBERT implementation (github.com/chandar-lab/NeoBERT, ``src/neobert/model/``) for side-by-side
CPU timings, loaded from a checkout given on the command line (never copied into this repository).

Two patches, applied to the source text in memory, make it run on CPU without its GPU-only dependency:

* ``xformers.ops.SwiGLU`` is replaced by its pure-torch equivalent, the computation of xformers' own CPU fallback:
  two GEMMs on the two row blocks of the fused ``w12`` weight, silu, product, ``w3`` (same parameter names);
  ``memory_efficient_attention`` is a stub that refuses (the model runs with ``flash_attention=False``: SDPA);
* ``@torch.compile`` on ``RMSNorm.forward`` is dropped (eager against eager; neoembed's compiled path is timed
  on its own).
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class _SwiGLU(nn.Module):
    """xformers.ops.SwiGLU(in, hidden, out, bias=False) as its CPU fallback computes it."""

    def __init__(self, in_features, hidden_features, out_features=None, bias=True):
        super().__init__()
        self.w12 = nn.Linear(in_features, 2 * hidden_features, bias=bias)
        self.w3 = nn.Linear(hidden_features, out_features or in_features, bias=bias)

    def forward(self, x):
        w1, w2 = self.w12.weight.chunk(2, dim=0)
        return self.w3(F.silu(F.linear(x, w1)) * F.linear(x, w2))


def _refuse(*args, **kwargs):
    raise RuntimeError(
        "xformers' memory_efficient_attention is not available here: use flash_attention=False"
    )


def official_commit(checkout: Path) -> str:
    """A COMMIT file beside the sources (an exported copy), else the commit of the checkout when it is the top of
    its own git repository (not a folder inside another one), else 'unknown'."""
    marker = Path(checkout) / "COMMIT"
    if marker.is_file():
        return marker.read_text().strip()
    top = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--show-toplevel"], capture_output=True, text=True
    )
    if top.returncode == 0 and Path(top.stdout.strip()).resolve() == Path(checkout).resolve():
        run = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        return run.stdout.strip()
    return "unknown"


def load_official(checkout: Path) -> types.ModuleType:
    """Import ``src/neobert/model/model.py`` of the checkout (patched as described above) as a module."""
    src = Path(checkout) / "src" / "neobert" / "model"
    if not (src / "model.py").is_file():
        raise SystemExit(
            f"--official {checkout}: no src/neobert/model/model.py there; pass a NeoBERT checkout"
        )
    xformers, ops = types.ModuleType("xformers"), types.ModuleType("xformers.ops")
    ops.SwiGLU, ops.memory_efficient_attention = _SwiGLU, _refuse
    xformers.ops = ops
    sys.modules.setdefault("xformers", xformers)
    sys.modules.setdefault("xformers.ops", ops)
    package = types.ModuleType("official_neobert")
    package.__path__ = [str(src)]
    sys.modules["official_neobert"] = package
    for name in ("rotary", "rmsnorm", "model"):
        code = (src / f"{name}.py").read_text().replace("    @torch.compile\n", "")
        module = types.ModuleType(f"official_neobert.{name}")
        module.__package__ = "official_neobert"
        module.__file__ = str(src / f"{name}.py")
        sys.modules[module.__name__] = module
        exec(compile(code, module.__file__, "exec"), module.__dict__)
    return sys.modules["official_neobert.model"]


def official_twin(ours, checkout: Path):
    """The official ``NeoBERT`` encoder with the same configuration and the same weights as ``ours``."""
    official = load_official(checkout)
    c = ours.config
    config = official.NeoBERTConfig(
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        intermediate_size=c.intermediate_size,
        vocab_size=c.vocab_size,
        norm_eps=c.norm_eps,
        max_length=c.max_length,
        pad_token_id=c.pad_token_id,
        flash_attention=False,
    )
    model = official.NeoBERT(config)
    model.load_state_dict(ours.state_dict(), strict=True)
    return model.eval()


def official_forward(model, ids, mask):
    """The official call: an additive mask (0 / -inf), or none for a batch without padding."""
    pad_mask = None if mask is None else torch.zeros(mask.shape).masked_fill(mask == 0, float("-inf"))
    return model(ids, pad_mask)
