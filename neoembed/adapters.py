"""LoRA adapters (PEFT) on the backbone of a sentence-transformers model: add, merge, save alone.

PEFT's layers are injected into the model's Hugging Face backbone (``model[0].auto_model``) with
:func:`peft.inject_adapter_in_model`, which works on NeoBERT and on any encoder; only the adapter's parameters train.
:func:`merge_lora` folds them into the weights and puts the plain layers back, so a merged model is an ordinary
checkpoint (it loads with ``neoembed.load`` and with plain sentence-transformers, no PEFT needed).
:func:`save_adapter` writes the adapter alone in PEFT's layout (``adapter_config.json``,
``adapter_model.safetensors``). PEFT is an optional extra: ``pip install -e '.[peft]'`` in the checkout.
"""

from __future__ import annotations

import logging
from pathlib import Path

from neoembed.hub import hub_reference, pinned_snapshot, resolve_packaged

__all__ = [
    "NEOBERT_LORA_TARGETS",
    "add_lora",
    "count_parameters",
    "load_training_checkpoint",
    "merge_lora",
    "require_peft",
    "save_adapter",
]

logger = logging.getLogger(__name__)

# NeoBERT's linear layers (attention qkv / output, SwiGLU w12 / w3); other encoders: PEFT's defaults for the type
NEOBERT_LORA_TARGETS = ["qkv", "wo", "w12", "w3"]


def require_peft() -> None:
    """An ImportError that names the extra when PEFT is missing (checked before the model loads)."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ImportError(
            "adapter: {type: lora} needs PEFT, which is not installed: pip install -e '.[peft]'"
        )


def _backbone(model):
    return model[0].auto_model


def _backbones(model) -> list:
    """The pre-trained encoders of ``model``: a bi-encoder's one, or a CDE model's two stages."""
    first = model[0]
    if hasattr(first, "auto_model"):
        return [first.auto_model]
    return [first.first_stage, first.second_stage]


def add_lora(
    model,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: list[str] | None = None,
    train_heads: bool = False,
):
    """Inject LoRA layers (rank ``r``, scale ``alpha / r``) into ``model``'s backbone (a CDE model: both stages)
    and freeze the rest of it; returns the PEFT config. ``target_modules`` None: NeoBERT's four linear layers, or
    PEFT's defaults for the backbone's model type. ``train_heads``: modules outside the backbones keep training
    (CDE's head, new and randomly initialised); otherwise only the adapter trains."""
    configs = [_inject(backbone, r, alpha, dropout, target_modules) for backbone in _backbones(model)]
    adapted = {id(p) for backbone in _backbones(model) for p in backbone.parameters()}
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name or (train_heads and id(param) not in adapted)
    model.neoembed_lora_config = configs[0]
    return configs[0]


def _inject(backbone, r: int, alpha: float, dropout: float, target_modules: list[str] | None):
    from peft import LoraConfig, inject_adapter_in_model

    if target_modules is None and backbone.config.model_type == "neobert":
        target_modules = NEOBERT_LORA_TARGETS
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules)
    if target_modules is None:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

        if backbone.config.model_type not in defaults:
            raise ValueError(
                f"adapter: no default LoRA target_modules for model type {backbone.config.model_type!r}: name them "
                "(the backbone's linear layers, e.g. target_modules: [query, key, value, dense])"
            )
        config.target_modules = set(defaults[backbone.config.model_type])
    # the hub id (and commit) of a model the hub's cache holds: PEFT loads the base by this name on any machine
    config.base_model_name_or_path, config.revision = hub_reference(getattr(backbone, "name_or_path", None))
    linear = _linear_widths(backbone)
    try:
        inject_adapter_in_model(config, backbone)
    except ValueError as e:
        if "Target modules" not in str(e):
            raise
        targets = config.target_modules
        targets = targets if isinstance(targets, str) else sorted(targets)
        raise ValueError(
            f"adapter.target_modules: {targets} names no layer of this model; its linear "
            f"layers are {sorted(linear)}"
        ) from None
    widths = [w for name, w in linear.items() if name in config.target_modules]
    if widths and r >= min(widths):
        logger.warning(
            "adapter.r=%d is at least the width of the layers it adapts (the narrowest: %d): a LoRA that wide "
            "trains as many parameters as those layers or more; lower adapter.r",
            r,
            min(widths),
        )
    return config


def _linear_widths(backbone) -> dict[str, int]:
    """The last name of each linear layer of ``backbone`` (what ``target_modules`` matches) and its narrowest
    side."""
    import torch

    widths: dict[str, int] = {}
    for name, module in backbone.named_modules():
        if isinstance(module, torch.nn.Linear):
            key = name.rsplit(".", 1)[-1]
            widths[key] = min(widths.get(key, module.in_features), module.in_features, module.out_features)
    return widths


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameters of ``model``."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def merge_lora(model) -> None:
    """Fold every LoRA layer into its base weight and put the plain layer back (all parameters trainable again, as
    in a loaded model): ``model`` becomes an ordinary checkpoint with the adapted weights."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for backbone in _backbones(model):
        for name, module in list(backbone.named_modules()):
            if isinstance(module, BaseTunerLayer):
                module.merge()
                parent, _, child = name.rpartition(".")
                setattr(backbone.get_submodule(parent) if parent else backbone, child, module.get_base_layer())
    for param in model.parameters():
        param.requires_grad = True
    model.__dict__.pop("neoembed_lora_config", None)


def load_training_checkpoint(model, folder: str | Path) -> None:
    """Put the weights of a checkpoint written while ``model``'s adapter trained back into ``model`` itself (the
    resume of a LoRA run, and keep_best's load of its best step). They carry PEFT's layer names
    (``qkv.base_layer.weight``, ``qkv.lora_A.default.weight``), which the plain model that sentence-transformers
    loads from a checkpoint folder does not have; so each module with weights loads its own files strictly, in
    the layout of ``modules.json`` (a backbone: the safetensors files of its folder). A missing or extra key is
    an error, never a layer left as it was."""
    import json

    from safetensors.torch import load_file

    folder = Path(folder)
    entries = json.loads((folder / "modules.json").read_text())
    for entry, module in zip(entries, model, strict=True):
        target = getattr(module, "auto_model", module)
        if not target.state_dict():
            continue  # pooling, normalisation: nothing saved
        files = sorted((folder / entry["path"]).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder / entry['path']}: no weights for module {entry['name']}")
        state = {}
        for file in files:
            state.update(load_file(str(file)))
        target.load_state_dict(state, strict=True)


#: what PEFT's own save puts before every key (its PeftModel wraps the backbone as ``base_model.model``): without
#: it, ``PeftModel.from_pretrained`` found none of the adapter's weights and warned, leaving the base model as it was
PEFT_PREFIX = "base_model.model."


def save_adapter(model, folder: str | Path) -> Path:
    """Write the adapter alone (before :func:`merge_lora`) in PEFT's layout: ``PeftModel.from_pretrained`` on the
    base backbone, transformers' ``load_adapter`` and sentence-transformers put it back, as :func:`load_adapter`
    does."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.neoembed_lora_config
    state = get_peft_model_state_dict(_backbone(model), adapter_name="default")
    save_file(
        {PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in state.items()},
        str(folder / "adapter_model.safetensors"),
    )
    config.save_pretrained(str(folder))
    _write_pipeline(model, folder)
    return folder


def _write_pipeline(model, folder: Path) -> None:
    """sentence-transformers' files around the encoder (``modules.json``, the later modules, the tokenizer, the
    settings and prompts), without the encoder's weights or config: plain ``SentenceTransformer(folder)`` then loads
    the base model named in ``adapter_config.json`` and applies the adapter (its PEFT integration), as
    ``neoembed.load`` does."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model.save(tmp, create_model_card=False)
        for path in Path(tmp).iterdir():
            weights = path.suffix in (".safetensors", ".bin") or path.name.endswith(".index.json")
            if weights or path.name == "config.json":
                continue
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, folder / path.name)


def is_adapter_folder(path: str | Path) -> bool:
    """A folder holding an adapter alone (PEFT's ``adapter_config.json``, no sentence-transformers model)."""
    path = Path(path)
    return (path / "adapter_config.json").is_file() and not (path / "modules.json").is_file()


def check_adapter_base(folder: str | Path) -> None:
    """An adapter folder whose base model is a local folder that is gone (moved since training) is named with
    the fixes, before the hub client takes the path for a malformed repository id."""
    import json

    config = Path(folder) / "adapter_config.json"
    if not config.is_file():
        return
    base = json.loads(config.read_text()).get("base_model_name_or_path") or ""
    if Path(base).is_absolute() and not Path(base).exists():
        raise FileNotFoundError(
            f"{folder}'s base model {base} (base_model_name_or_path in its adapter_config.json) does not exist: "
            "put the base model back there, edit that path, or load the run's merged model (the adapter "
            "folder's parent)"
        )


def load_adapter(folder: str | Path, load_base, base: str | None = None):
    """The base model named in the adapter's config (or ``base``), loaded by ``load_base(name)`` (a hub id at the
    config's commit: :func:`~neoembed.hub.pinned_snapshot`), with the adapter of ``folder`` applied (not merged:
    :func:`merge_lora` folds it in)."""
    require_peft()
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    folder = Path(folder)
    config = LoraConfig.from_pretrained(str(folder))
    base = base or config.base_model_name_or_path
    if not base:
        raise ValueError(
            f"{folder}/adapter_config.json names no base_model_name_or_path: pass the base model"
        )
    # the packaged all-MiniLM-L6-v2 loads offline under its hub id (the name its adapters record)
    model = load_base(pinned_snapshot(resolve_packaged(base), config.revision))
    inject_adapter_in_model(config, _backbone(model))
    state = load_file(str(folder / "adapter_model.safetensors"))  # keys with PEFT's prefix, or without (before it)
    result = set_peft_model_state_dict(_backbone(model), {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()})
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if missing:  # set_peft_model_state_dict loads leniently: an adapter of other keys would change nothing
        raise ValueError(f"{folder}: the adapter lacks {len(missing)} LoRA weights, e.g. {missing[0]}")
    model.neoembed_lora_config = config
    return model
