"""transformers' own common model tests (``ModelTesterMixin``, ``ConfigTester``) run against NeoBERT.

The two test files come from the source distribution of the *installed* transformers release on the package
index, fetched once into a cache (``$NEOEMBED_TEST_CACHE``, default ``~/.cache/neoembed``) and never copied into
this repository; ``$NEOEMBED_TRANSFORMERS_SDIST`` may name an already downloaded ``transformers-X.tar.gz``
instead. The three modules they import that the sdist lacks are replaced by ``tests/transformers_standins``.

Nothing is skipped here; the skips in the report are transformers' own, each for a feature this encoder or this
machine lacks:

* hardware and packages: accelerator, multiple accelerators, deepspeed, flash-attn 2/3/4, kernels;
* not in the architecture: composite models and sub-configs (the "does not support SDPA" message comes from the
  *composite* SDPA test; the non-composite one runs and passes), experts / grouped_mm / router logits, sliding
  windows, decoder or seq2seq heads, a position-embedding table, partial or axial RoPE;
* no weight-name conversion mapping (NeoBERT's names are the official ones), no ``_keep_in_fp32_modules`` (RMSNorm
  computes its statistics in float32 itself; RoPE frequencies stay float32 under casts), no tensor-parallel plan
  (the fused per-head ``qkv`` and ``[gate | value]`` ``w12`` would need packed sharding; a 250M encoder does not
  need TP);
* output capture by hooks (``capture_outputs`` / ``_can_record_outputs``): a hook records what each block returns,
  which in the padding-free layout is the packed ``(T, D)`` sequence, not the ``(B, L, D)`` the caller gets;
  NeoBERT's forward unpacks and collects the hidden states itself.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tarfile
import tempfile
import types
import unittest
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto as _auto

from neoembed.modeling import (
    NeoBERTConfig,
    NeoBERTForMaskedLM,
    NeoBERTForSequenceClassification,
    NeoBERTForTokenClassification,
    NeoBERTModel,
)

_FILES = ("test_modeling_common.py", "test_configuration_common.py")
_PACKAGE = "_transformers_common_tests"
_STANDINS = {  # module the sdist's files import -> our stand-in (tests/transformers_standins/)
    "exporters.test_export": "export",
    "generation.test_utils": "generation",
    "utils.test_configuration_utils": "configuration_utils",
}


def _download_sdist(version: str, into: Path) -> Path:
    """``pip download`` of transformers' sdist; without build isolation first (no setuptools download)."""
    base = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-binary",
        ":all:",
        "--no-deps",
        "-q",
        "-d",
        str(into),
    ]
    errors = []
    for extra in (["--no-build-isolation"], []):
        run = subprocess.run([*base, *extra, f"transformers=={version}"], capture_output=True, text=True)
        found = sorted(into.glob(f"transformers-{version}.tar.gz"))
        if found:
            return found[0]
        errors.append(run.stderr.strip()[-500:])
    raise RuntimeError(
        f"could not download the source distribution of transformers=={version} from the package index "
        f"(these tests need it; or set NEOEMBED_TRANSFORMERS_SDIST to a downloaded transformers-{version}.tar.gz):"
        f"\n" + "\n".join(errors)
    )


def _common_tests_dir() -> Path:
    """Folder holding the sdist's two common test files for the installed transformers version."""
    version = transformers.__version__
    cache = Path(os.environ.get("NEOEMBED_TEST_CACHE", Path.home() / ".cache" / "neoembed"))
    target = cache / f"transformers-{version}-tests"
    if all((target / name).is_file() for name in _FILES):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        given = os.environ.get("NEOEMBED_TRANSFORMERS_SDIST")
        sdist = Path(given) if given else _download_sdist(version, Path(tmp))
        staging = Path(tmp) / "tests"
        staging.mkdir()
        with tarfile.open(sdist) as tar:
            for name in _FILES:
                member = tar.extractfile(f"transformers-{version}/tests/{name}")
                if member is None:
                    raise RuntimeError(f"{sdist} has no tests/{name}: is it transformers {version}'s sdist?")
                (staging / name).write_bytes(member.read())
        # test_configuration_common.py execs the __init__.py beside it (direct_transformers_import)
        (staging / "__init__.py").write_text("")
        try:
            staging.rename(target)
        except OSError:  # another process got there first
            if not (target / _FILES[0]).is_file():
                raise
    return target


def _import_common_tests():
    """Import the two files as a package whose missing submodules are our stand-ins."""
    package = types.ModuleType(_PACKAGE)
    package.__path__ = [str(_common_tests_dir())]
    sys.modules[_PACKAGE] = package
    here = Path(__file__).parent / "transformers_standins"
    for dotted, standin in _STANDINS.items():
        parent = f"{_PACKAGE}.{dotted.split('.')[0]}"
        sys.modules.setdefault(parent, types.ModuleType(parent)).__path__ = []
        spec = importlib.util.spec_from_file_location(f"{_PACKAGE}.{dotted}", here / f"{standin}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[f"{_PACKAGE}.{dotted}"] = module
    modeling = importlib.import_module(f"{_PACKAGE}.test_modeling_common")
    configuration = importlib.import_module(f"{_PACKAGE}.test_configuration_common")
    return modeling, configuration


_modeling_common, _configuration_common = _import_common_tests()
ModelTesterMixin = _modeling_common.ModelTesterMixin
ConfigTester = _configuration_common.ConfigTester
ids_tensor = _modeling_common.ids_tensor
random_attention_mask = _modeling_common.random_attention_mask


class NeoBERTModelTester:
    """Tiny NeoBERT configs and padded batches for the common tests."""

    def __init__(
        self,
        parent,
        batch_size=3,
        seq_length=7,
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        is_training=True,
    ):
        self.parent = parent
        self.batch_size, self.seq_length, self.vocab_size = batch_size, seq_length, vocab_size
        self.hidden_size, self.num_hidden_layers = hidden_size, num_hidden_layers
        self.num_attention_heads, self.intermediate_size = num_attention_heads, intermediate_size
        self.is_training = is_training

    def get_config(self) -> NeoBERTConfig:
        return NeoBERTConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            max_length=64,
        )

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        labels = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        return self.get_config(), input_ids, attention_mask, labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask, _ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}


class NeoBERTModelTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (
        NeoBERTModel,
        NeoBERTForMaskedLM,
        NeoBERTForSequenceClassification,
        NeoBERTForTokenClassification,
    )
    # NeoBERT has no position embedding table to resize (RoPE)
    test_resize_position_embeddings = False

    @classmethod
    def setUpClass(cls):
        # transformers' tests find a model's role (base model, masked LM) by its class name in the tables of
        # built-in models, where a native NeoBERT would be listed; list it there for the duration of the tests.
        super().setUpClass()
        cls._tables = [
            (_auto.MODEL_MAPPING_NAMES, "NeoBERTModel"),
            (_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, "NeoBERTForMaskedLM"),
            (_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, "NeoBERTForSequenceClassification"),
            (_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES, "NeoBERTForTokenClassification"),
        ]
        for table, name in cls._tables:
            table["neobert"] = name

    @classmethod
    def tearDownClass(cls):
        for table, _ in cls._tables:
            table.pop("neobert", None)
        super().tearDownClass()

    def setUp(self):
        self.model_tester = NeoBERTModelTester(self)
        self.config_tester = ConfigTester(self, config_class=NeoBERTConfig, hidden_size=48)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if return_labels and model_class is NeoBERTForMaskedLM:
            inputs_dict["labels"] = torch.zeros_like(inputs_dict["input_ids"])
        return inputs_dict

    def test_config(self):
        self.config_tester.run_common_tests()


def test_config_common_kwargs_are_base_attributes():
    """The stand-in's ``config_common_kwargs`` sets every public attribute of the installed transformers' base
    config that a model config may be given (``is_encoder_decoder`` aside: an encoder-decoder flag)."""
    from transformers import PretrainedConfig

    common = sys.modules[f"{_PACKAGE}.utils.test_configuration_utils"].config_common_kwargs
    base = {k for k in PretrainedConfig().__dict__ if not k.startswith("_")} | {"output_attentions"}
    assert set(common) == base - {"transformers_version", "is_encoder_decoder"}


pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    # the RoPE-scaling tests run a plain-RoPE model at 1.5x its max_position_embeddings on purpose
    pytest.mark.filterwarnings("ignore:a sequence exceeds the .* tokens this model supports"),
]
