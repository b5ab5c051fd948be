"""Stand-in for transformers' ``tests/exporters/test_export.py`` (not in the sdist).

The real module holds ``ExportTesterMixin``, the base of ``ModelTesterMixin``: export tests for torch.export,
AOTInductor, ONNX, ExecuTorch, OpenVINO and TensorRT, driven by skip lists for hundreds of models and helpers
from newer transformers (``transformers.exporters.components``) than the installed release has. Its torch.export
tier is what an encoder needs: ``test_torch_export`` exports every model class with transformers' own
``DynamoExporter`` (static and dynamic shapes) and compares the exported program's outputs with eager ones
(atol = rtol = 1e-4), as the real test does. The other backends need packages (onnxruntime, executorch, a C++
toolchain for AOTInductor) that neoembed does not install, so they are left out rather than skipped.
"""

from __future__ import annotations

import copy
import unittest

import torch
from transformers import set_seed
from transformers.exporters.exporter_dynamo import DynamoConfig, DynamoExporter
from transformers.exporters.utils import get_leaf_tensors


class ExportTesterMixin:
    """``test_torch_export_static`` / ``test_torch_export_dynamic`` as in transformers' ``ExportTesterMixin``."""

    test_torch_exportable = True

    def _export_and_compare(self, dynamic: bool, atol: float = 1e-4, rtol: float = 1e-4) -> None:
        if not self.test_torch_exportable:
            raise unittest.SkipTest("model declares itself not exportable (test_torch_exportable = False)")
        for model_class in self.all_model_classes:
            config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
            inputs = {k: v for k, v in self._prepare_for_class(inputs, model_class).items() if v is not None}
            inputs.pop("labels", None)
            model = model_class(config).eval()
            with torch.no_grad():
                set_seed(1234)
                eager = get_leaf_tensors(model(**copy.deepcopy(inputs)))
            with self.subTest(model_class.__name__):
                exported = DynamoExporter().export(model, inputs, config=DynamoConfig(dynamic=dynamic))
                with torch.no_grad():
                    set_seed(1234)
                    got = get_leaf_tensors(exported(**copy.deepcopy(inputs)))
                self.assertTrue(got, f"the exported {model_class.__name__} returned nothing")
                shared = {name: got[name] for name in eager if name in got}
                self.assertEqual(set(shared), set(eager), "the exported program lost outputs")
                torch.testing.assert_close(shared, eager, atol=atol, rtol=rtol)

    def test_torch_export_static(self):
        self._export_and_compare(dynamic=False)

    def test_torch_export_dynamic(self):
        self._export_and_compare(dynamic=True)
