"""What the processor can do, as far as dtype choice is concerned.

On x86 CPUs without native bf16 instructions (``avx512_bf16`` or AMX), oneDNN emulates bf16
matrix-matrix products at 5-7× the cost of fp32 ones, so training and verification matmuls
should run in fp32 there; with them, bf16 is about twice as fast as fp32.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where it is not readable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16() -> bool:
    """True when the CPU multiplies bf16 matrices natively (``avx512_bf16`` or AMX)."""
    return bool(cpu_flags() & NATIVE_BF16_FLAGS)


def fast_matmul_dtype() -> str:
    """``"bf16"`` on a CPU with native bf16, else ``"fp32"`` (emulated bf16 is slower)."""
    return "bf16" if native_bf16() else "fp32"
