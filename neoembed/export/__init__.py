"""ONNX export and ONNX Runtime serving (``neoembed export``, ``neoembed.load(path, backend="onnx")``).

Kept free of imports: :mod:`neoembed.export.runtime` sits on a lower floor than :mod:`neoembed.export.onnx`
(docs/architecture.md), and importing one must not pull in the other.
"""
