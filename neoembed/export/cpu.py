"""What this CPU does with int8: its instruction set's file suffix, and whether its int8 products saturate.

Read by the ONNX export (which weights to write) and by torch's dynamic int8 (:mod:`neoembed.export.torch_int8`).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["int8_saturates", "isa_suffix"]


def isa_suffix() -> str:
    """sentence-transformers' int8 file suffix for this CPU (``avx512_vnni``, ``avx512``, ``avx2``, ``arm64``)."""
    import platform

    flags = _cpu_flags()
    if platform.machine().lower() in ("arm64", "aarch64"):
        return "arm64"
    for isa in ("avx512_vnni", "avx512f", "avx2"):
        if isa in flags:
            return isa.removesuffix("f")
    return "avx2"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {
        flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":")[1].split()
    }


def int8_saturates() -> bool:
    """Whether this CPU's uint8 x int8 products can overflow: x86 without VNNI (AVX2, AVX-512F) multiplies with
    ``vpmaddubsw``, whose pairwise int16 sums saturate for weights outside [-64, 63] (ONNX Runtime's
    ``session.x64quantprecision`` note; oneDNN's "Nuances of int8 computations"). On such a CPU int8 weights keep 7 bits
    (``reduce_range``): with full 8-bit weights the tiny NeoBERT's int8 graph fails
    ``tests/test_export.py::test_neobert_int8_close_to_fp32`` (cosine to fp32 ≥ 0.99) on an AVX2-only CPU."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return False
    return not ({"avx512_vnni", "avx_vnni"} & _cpu_flags())
