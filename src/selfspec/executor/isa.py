"""Which of selfspec's own kernel builds may be chosen: the ``SELFSPEC_MAX_ISA`` cap.

``SELFSPEC_MAX_ISA`` (``avx2``, ``avx512`` or ``amx``; unset: no cap) lets an AMX Xeon run the
AVX-512 builds, or any AVX-512 CPU the AVX2 builds, to measure those paths (docs/cpu.md). Its
own module so that the kernel modules and :mod:`selfspec.executor.cpu` can all read it.
"""

from __future__ import annotations

import os

from selfspec.errors import InvalidArgumentError

# selfspec's kernel builds by level: each build's name -> its rank.
_ISA_RANK = {"avx2": 0, "avx512": 1, "avx512bf16": 1, "amx": 2}
MAX_ISA_VALUES = ("avx2", "avx512", "amx")


def isa_allowed(isa: str) -> bool:
    """Whether a kernel build ``isa`` (``"avx2"``, ``"avx512"``, ``"avx512bf16"``, ``"amx"``)
    may be chosen automatically under ``SELFSPEC_MAX_ISA`` (unset: every build).

    Raises:
        InvalidArgumentError: ``SELFSPEC_MAX_ISA`` is set to another value.
    """
    cap = os.environ.get("SELFSPEC_MAX_ISA", "").strip().lower()
    if not cap:
        return True
    if cap not in MAX_ISA_VALUES:
        raise InvalidArgumentError(
            f"SELFSPEC_MAX_ISA must be one of {', '.join(MAX_ISA_VALUES)} (or unset), "
            f"not {cap!r}")
    return _ISA_RANK[isa] <= _ISA_RANK[cap]
