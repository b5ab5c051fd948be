"""Convert NeoBERT checkpoints between the official layout and the neoembed layout.

Both layouts store the same parameter names (``model.encoder.weight``, ``model.transformer_encoder.{i}.qkv.weight``,
…, ``decoder.weight``/``decoder.bias``); they differ in ``config.json``:

* official: ``max_length``, ``dim_head``, init ranges, ``auto_map`` to the official remote code (``model.py``);
* neoembed: our declared fields, ``neoembed_format``, and an ``auto_map`` to ``configuration_neobert.py`` /
  ``modeling_neobert.py``, which are copied beside the weights so the folder loads anywhere.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from neoembed.modeling.configuration_neobert import NeoBERTConfig
from neoembed.modeling.modeling_neobert import NeoBERTForMaskedLM, NeoBERTModel

__all__ = ["OFFICIAL_AUTO_MAP", "convert_checkpoint", "load_state_dict", "require_config", "resolve_checkpoint"]

OFFICIAL_AUTO_MAP = {
    "AutoConfig": "model.NeoBERTConfig",
    "AutoModel": "model.NeoBERT",
    "AutoModelForMaskedLM": "model.NeoBERTLMHead",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def resolve_checkpoint(src: str | Path) -> Path:
    """A local folder as is; otherwise a hub id, downloaded (config, weights, tokenizer files)."""
    path = Path(src)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{src} is a file; a checkpoint is a folder (config.json + model.safetensors)")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                str(src), allow_patterns=["*.json", "*.safetensors", "*.bin", "*.txt", "*.py", "*.model"]
            )
        )
    except Exception as e:  # network, auth, missing repo: say what was tried
        raise OSError(
            f"{src!r} is not a local folder and could not be fetched from the Hugging Face hub ({e}). "
            "Pass a folder holding config.json and model.safetensors, or check the hub id and your network."
        ) from e


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        f = folder / name
        if f.is_file():
            if name.endswith(".safetensors"):
                return load_file(str(f))
            return torch.load(f, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no weights in {folder}: expected one of {', '.join(WEIGHT_FILES)}")


def _expected_keys(config: NeoBERTConfig, with_decoder: bool) -> list[str]:
    with torch.device("meta"):
        model = NeoBERTForMaskedLM(config) if with_decoder else NeoBERTModel(config)
    keys = list(model.state_dict())
    return keys if with_decoder else [f"model.{k}" for k in keys]


def _normalise_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept names with or without the ``model.`` prefix; return them with it (the official form)."""
    out = {}
    for k, v in state.items():
        out[k if k.startswith(("model.", "decoder.")) else f"model.{k}"] = v
    return out


def _check(state: dict[str, torch.Tensor], config: NeoBERTConfig) -> bool:
    with_decoder = any(k.startswith("decoder.") for k in state)
    expected = _expected_keys(config, with_decoder)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            "checkpoint does not match its config: "
            + (f"missing keys {missing}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected keys {unexpected}" if unexpected else "")
        )
    with torch.device("meta"):
        ref = (NeoBERTForMaskedLM(config) if with_decoder else NeoBERTForMaskedLM(config).model).state_dict()
    prefix = "" if with_decoder else "model."
    for k, t in ref.items():
        if tuple(state[prefix + k].shape) != tuple(t.shape):
            raise ValueError(
                f"shape of {prefix + k} is {tuple(state[prefix + k].shape)} but the config implies {tuple(t.shape)}"
            )
    return with_decoder


def official_config_dict(config: NeoBERTConfig) -> dict:
    if config.rope_type != "default" or config.rope_parameters["rope_theta"] != 10000.0:
        raise ValueError(
            "the official NeoBERT layout has plain RoPE with base 10,000 only; set rope_parameters to "
            f"{{'rope_type': 'default', 'rope_theta': 10000.0}} before exporting (got {config.rope_parameters})"
        )
    return {
        "architectures": ["NeoBERTLMHead"],
        "auto_map": dict(OFFICIAL_AUTO_MAP),
        "model_type": "neobert",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "dim_head": config.head_dim,
        "norm_eps": config.norm_eps,
        "vocab_size": config.vocab_size,
        "pad_token_id": config.pad_token_id,
        "max_length": config.max_length,
        "embedding_init_range": config.embedding_init_range,
        "decoder_init_range": config.decoder_init_range,
        "classifier_init_range": config.classifier_init_range,
        "torch_dtype": "float32",
    }


def require_config(folder: Path) -> Path:
    """``folder/config.json``, or a ``FileNotFoundError`` saying what the folder is instead."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json{_modules_hint(folder)}")
    return config_file


def _modules_hint(folder: Path) -> str:
    """For a sentence-transformers folder whose encoders live in subfolders (a CDE model's two stages): what it
    is and which of its subfolders are checkpoints that convert takes."""
    modules = folder / "modules.json"
    if not modules.is_file():
        return ""
    types = [str(m.get("type", "?")).rsplit(".", 1)[-1] for m in json.loads(modules.read_text())]
    inner = sorted(p.parent.name for p in folder.glob("*/config.json"))
    where = f"; its checkpoints are in {', '.join(s + '/' for s in inner)}" if inner else ""
    return (
        f": it is a sentence-transformers model of modules {types}, not a checkpoint. convert takes a NeoBERT "
        f"checkpoint{where}"
    )


def convert_checkpoint(src: str | Path, dst: str | Path, to: str = "neoembed") -> str:
    """Convert ``src`` (folder or hub id, either layout) into ``dst`` in layout ``to``; returns a report."""
    if to not in ("neoembed", "official"):
        raise ValueError(f"unknown target layout {to!r}; valid: 'neoembed', 'official'")
    folder = resolve_checkpoint(src)
    config_file = require_config(folder)
    raw = json.loads(config_file.read_text())
    if raw.get("model_type") != "neobert":
        raise ValueError(f"{src} is not a NeoBERT checkpoint (model_type={raw.get('model_type')!r})")
    config = NeoBERTConfig.from_dict(raw)
    state = _normalise_keys(load_state_dict(folder))
    with_decoder = _check(state, config)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    lines = [f"converted {src} -> {dst} ({to} layout)"]
    if to == "neoembed":
        model_cls = NeoBERTForMaskedLM if with_decoder else NeoBERTModel
        model = model_cls(config)
        missing, unexpected = model.load_state_dict(
            state if with_decoder else {k[len("model.") :]: v for k, v in state.items()}, strict=True
        )
        model.save_pretrained(dst)
        lines.append(
            f"  class: {model_cls.__name__}; config: neoembed_format={config.neoembed_format}, "
            "auto_map -> configuration_neobert.py / modeling_neobert.py (written beside the weights)"
        )
    else:
        out_state = {k: v.contiguous() for k, v in state.items()}
        save_file(out_state, str(dst / "model.safetensors"), metadata={"format": "pt"})
        (dst / "config.json").write_text(json.dumps(official_config_dict(config), indent=2) + "\n")
        lines.append(
            "  config: official keys (max_length, dim_head, auto_map -> model.py of the official release)"
        )
    for k in sorted(state):
        lines.append(f"  {k} {tuple(state[k].shape)} -> {k}")
    copied = []
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copy2(folder / name, dst / name)
            copied.append(name)
    lines.append(
        f"  tokenizer files: {', '.join(copied) if copied else 'none found (pass a tokenizer when loading)'}"
    )
    return "\n".join(lines)
