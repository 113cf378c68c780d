"""What the processor can do, and which number format each kind of work runs in.

On x86 CPUs without native bf16 instructions (``avx512_bf16`` or AMX), PyTorch emulates bf16
matrix-matrix products: there a bf16 ``F.linear`` of a few hundred rows costs several times
the fp32 one even with the cast of the bf16 weight to fp32 included, and bf16 cost grows
linearly with the rows (about one matrix-vector product per row). One-token decoding is
memory-bound, so bf16 weights, half the bytes, still decode faster there. Hence two formats
per run
(:class:`ComputeFormats`): the weights' own format for decoding and for everything that
must be bit-consistent with it (verification), and the fast format for bulk matrix-matrix
work (prefill, long blocks, training, feature extraction).

Detection runs once per process (:func:`detect_cpu`): the CPU flags decide on x86; where they
cannot (no ``/proc/cpuinfo``, other architectures) a short micro-benchmark does. The oneDNN
and ATen switches that restrict the kernels to a lower instruction set
(``ONEDNN_MAX_CPU_ISA=AVX2``, ``ATEN_CPU_CAPABILITY=avx2``) are honoured, so the AVX2-only
behaviour can be approximated on a machine with AVX-512 (``selfspec bench-cpu --isa
native,avx2``): bf16 products then cost less against fp32 there than on an AVX2-only CPU, and
FBGEMM keeps its AVX-512 kernels.

``SELFSPEC_MAX_ISA`` (``avx2``, ``avx512`` or ``amx``) caps the builds selfspec's own kernels
choose (:func:`selfspec.executor.isa.isa_allowed`): ``avx512`` on an AMX Xeon runs the AVX-512
VNNI / BF16 builds, as on a CPU without AMX, to measure that path or to compare; ``avx2`` the
AVX2 builds (add ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` for torch's own kernels).
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from selfspec.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# Flags worth recording (x86 /proc/cpuinfo names; ARM's "bf16" feature as well).
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "bf16")
# oneDNN ISA names (ONEDNN_MAX_CPU_ISA) from which bf16 matrix products are native.
_ONEDNN_BF16_ISAS = frozenset({
    "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
    "AVX10_2_512_AMX_2", "ALL", "DEFAULT"})
# ATen capability levels that lack native bf16 dot products.
_ATEN_NO_BF16 = frozenset({"default", "avx2", "zvector", "sve256", "vsx"})
# A bf16 matrix product counts as native when it is at most this much slower than fp32 (the
# micro-benchmark's verdict; emulation measures several times slower).
_BENCH_SLOWDOWN_LIMIT = 1.5


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class CpuInfo:
    """The processor as far as number formats are concerned.

    Attributes:
        arch: ``platform.machine()`` (``x86_64``, ``aarch64``, ...).
        model: CPU model name (``/proc/cpuinfo``), or ``""``.
        flags: the :data:`REPORTED_FLAGS` present, in that order.
        aten_capability: ATen's kernel level (``torch.backends.cpu.get_cpu_capability()``:
            ``AVX2``, ``AVX512``, ...), after any ``ATEN_CPU_CAPABILITY`` restriction.
        onednn_max_isa: ``ONEDNN_MAX_CPU_ISA`` when set, else ``""``.
        native_bf16: bf16 matrix-matrix products run natively (not emulated).
        decided_by: ``"flags"`` or ``"micro-benchmark"`` (no x86 flags, or flags that say
            native under an ISA restriction).
    """

    arch: str
    model: str
    flags: tuple[str, ...]
    aten_capability: str
    onednn_max_isa: str
    native_bf16: bool
    decided_by: str

    def summary(self) -> str:
        """One line, e.g. ``x86_64 AMD EPYC 7B13, AVX2 kernels, flags avx2 fma: bf16 emulated
        (flags)``."""
        isa = f", ONEDNN_MAX_CPU_ISA={self.onednn_max_isa}" if self.onednn_max_isa else ""
        flags = " ".join(self.flags) or "none"
        native = "native" if self.native_bf16 else "emulated"
        return (f"{self.arch} {self.model or 'unknown CPU'}, {self.aten_capability} kernels"
                f"{isa}, flags {flags}: bf16 matrix products {native} ({self.decided_by})")

    def to_dict(self) -> dict[str, object]:
        """JSON-ready fields."""
        return asdict(self)


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """CPU model name and feature flags from ``/proc/cpuinfo`` (``("", {})`` if unreadable)."""
    model, flags = "", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":", 1)[0].strip().lower()
            if key in ("model name", "cpu model") and not model:
                model = line.split(":", 1)[1].strip()
            elif key in ("flags", "features") and not flags:  # x86 / ARM spelling
                flags = frozenset(line.split(":", 1)[1].split())
    except (OSError, IndexError):
        pass
    return model, flags


def _bench_native_bf16(threads: int) -> bool:
    """Time a [128×512]·[512×512] product in bf16 and fp32 (best of 3, ~20 ms in all)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(128, 512, generator=gen)
    w = torch.randn(512, 512, generator=gen)
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        xs, ws = x.to(dtype), w.to(dtype)
        F.linear(xs, ws)  # warm-up (kernel selection, packing)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            F.linear(xs, ws)
            times.append(time.perf_counter() - start)
        best[dtype] = min(times)
    ratio = best[torch.bfloat16] / max(best[torch.float32], 1e-9)
    logger.info("bf16/fp32 matrix-product time ratio %.2f on %d threads", ratio, threads)
    return ratio <= _BENCH_SLOWDOWN_LIMIT


def classify(arch: str, flags: frozenset[str], onednn_max_isa: str, aten_capability: str,
             bench: Callable[[], bool]) -> tuple[bool, str]:
    """``(native_bf16, decided_by)`` for a processor described by its flags and the kernel
    restrictions in force; ``bench()`` is called only where those cannot decide.

    x86 with flags: native iff ``avx512_bf16`` or ``amx_bf16`` is present. Where the flags
    say native but ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` restrict the kernels (which
    library's bf16 path the restriction binds depends on the build), and anywhere without x86
    flags (ARM, macOS), the micro-benchmark decides.
    """
    onednn = onednn_max_isa.strip().upper()
    restricted = ((bool(onednn) and onednn not in _ONEDNN_BF16_ISAS)
                  or aten_capability.lower() in _ATEN_NO_BF16)
    if arch in ("x86_64", "AMD64", "i686") and flags:
        native = bool(flags & NATIVE_BF16_FLAGS)
        if not (native and restricted):
            return native, "flags"
    return bench(), "micro-benchmark"


@lru_cache(maxsize=1)
def detect_cpu() -> CpuInfo:
    """Detect, once per process, whether this CPU multiplies bf16 matrices natively
    (:func:`classify` on ``/proc/cpuinfo``, the environment and torch's kernel level)."""
    arch = platform.machine()
    model, flags = _cpuinfo()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    aten = torch.backends.cpu.get_cpu_capability()
    native, decided = classify(arch, flags, onednn, aten,
                               lambda: _bench_native_bf16(torch.get_num_threads()))
    info = CpuInfo(arch=arch, model=model, flags=tuple(f for f in REPORTED_FLAGS if f in flags),
                   aten_capability=aten, onednn_max_isa=onednn, native_bf16=native,
                   decided_by=decided)
    logger.info("CPU: %s", info.summary())
    return info


def native_bf16() -> bool:
    """True when the CPU multiplies bf16 matrices natively (``avx512_bf16`` or AMX)."""
    return detect_cpu().native_bf16


def fast_matmul_dtype() -> str:
    """``"bf16"`` on a CPU with native bf16, else ``"fp32"`` (emulated bf16 is slower)."""
    return "bf16" if native_bf16() else "fp32"


@dataclass(frozen=True)
class ComputeFormats:
    """The number formats of one run.

    Attributes:
        weights: the weights' (and KV cache's) format; one-token decoding and every block
            that must be bit-consistent with it (verification, deferred KV fills) compute in
            it, or on fp16 copies of the weights when ``rows`` says so.
        bulk: the format of bulk matrix-matrix work (prefill, blocks longer than the
            verification limit, feature extraction): the weights are cast to it per call and
            the outputs cast back, so storage and memory traffic stay in ``weights``.
        reason: why, in words (for logs and reports).
        rows: ``"weights"``; ``"fp16"``: decoding and verification multiply by an fp16
            copy of each weight of at least ``rows_min_bytes`` with FBGEMM's row-consistent
            kernel (:mod:`selfspec.executor.fp16_rows`), where the weights' own kernel is
            emulated; ``"bf16"``: selfspec's row-consistent AVX2 kernel on the bf16 weights
            themselves (:mod:`selfspec.executor.bf16_rows`); ``"bf16+fp16"``: FBGEMM for the
            weights of at least ``rows_min_bytes``, the bf16 kernel for the others; ``"int4"``
            (int4 weights, bf16 activations); ``"w4a8"`` (int4 weights, int8 activations).
        rows_min_bytes: smaller weights keep their own kernel, or take the bf16 kernel under
            ``"bf16+fp16"`` (FBGEMM's per-call overhead outweighs its faster reads below a
            few MiB); under ``"bf16"``, weights of at least this size keep an FBGEMM
            fp16 copy for bulk work (prefill) only.
    """

    weights: torch.dtype
    bulk: torch.dtype
    reason: str
    rows: str = "weights"
    rows_min_bytes: int = 0

    @property
    def upcast(self) -> bool:
        """Bulk work runs in another format than the weights."""
        return self.bulk != self.weights

    def describe(self) -> str:
        """E.g. ``weights bf16, bulk matrix products fp32 (bf16 emulated on this CPU)``."""
        size = (f" of matrices >= {self.rows_min_bytes / 2**20:g} MiB"
                if self.rows_min_bytes else "")
        rows = {"fp16": f", decoding and verification on fp16 copies{size} (FBGEMM)",
                "bf16": ", decoding and verification on selfspec's bf16 kernel"
                        + (f" (prefill on fp16 copies{size}, FBGEMM)" if size else ""),
                "bf16+fp16": f", decoding and verification on fp16 copies{size} (FBGEMM), "
                             "smaller matrices on selfspec's bf16 kernel",
                "int4": ", decoding and verification on int4 copies (group 32, lossy vs the "
                        "weights; prefill keeps the weights)",
                "w4a8": ", every product on selfspec's w4a8 kernel (4-bit weights per block "
                        "of 32, 8-bit activations; lossy vs the weights)",
                "gguf": ", every product on the GGUF file's own blocks (activations quantized "
                        "per block as llama.cpp does; the weights as published)",
                "gguf+dense": ", decoding and verification on the GGUF file's own blocks, "
                              "prefill on the dense weights (the blocks de-quantized)"
                }.get(self.rows, "")
        return (f"weights {DTYPE_NAMES.get(self.weights, self.weights)}, bulk matrix products "
                f"{DTYPE_NAMES.get(self.bulk, self.bulk)} ({self.reason}){rows}")


ROWS_FORMATS = ("auto", "weights", "bf16", "bf16+fp16", "fp16", "int4", "w4a8", "gguf",
                "gguf+dense")
# The kernels on a GGUF file's own blocks: "gguf" runs prefill on them too (as llama.cpp
# does); "gguf+dense" runs prefill (and other blocks that need not match one-token decoding)
# on the dense weights, the blocks as transformers de-quantized them, in the bulk format:
# with AMX that is much faster on long prompts, but the prompt's KV no longer comes from the
# blocks (selfspec.executor.gguf_backend).
GGUF_ROWS = ("gguf", "gguf+dense")
# The kernels that make the model itself quantized: --dtype takes them. int4 and w4a8
# re-quantize the dense weights (lossy against them); gguf multiplies the GGUF's own blocks.
QUANTIZED_ROWS = ("int4", "w4a8", "gguf")
# FBGEMM's fp16 kernel takes matrices from this size: under "bf16" (what "auto" picks where
# bf16 is emulated) for bulk work (prefill) only, under "bf16+fp16" and auto's "fp16" for
# decoding and verification too. Below it FBGEMM's per-call overhead outweighs its faster
# reads. "auto" left Qwen2.5-1.5B's matrices (4.5-52 MiB) on FBGEMM until selfspec's bf16
# kernel streamed its weights well (prefetching): since then `ar` decodes faster on the bf16
# kernel and its fused sub-layers, while verification blocks cost the same on both.
AUTO_ROWS_MIN_BYTES = 4 << 20

#: On CPUs with native bf16, ``auto`` decodes a bf16 model on selfspec's bf16 kernel (with its
#: fused sub-layers: two calls a layer instead of ~55 torch operators) when every
#: decoder-layer matrix is smaller than this. With the kernel's AVX512-BF16 build, small
#: matrices (SmolLM2-135M's, 3.4 MiB at most) decode and verify faster than on oneDNN; large
#: ones (Qwen2.5-1.5B's, up to 52 MiB) decode faster but make verification blocks
#: compute-bound on the kernel, where oneDNN's AMX keeps them near one token's cost, so
#: `auto` loses. The kernel's AMX build (AMX bf16
#: tiles for every call) has no such limit: ``auto`` takes it for models of any size where it
#: runs (:func:`selfspec.executor.bf16_rows.chosen_isa` ``== "amx"``).
NATIVE_BF16_ROWS_MAX_BYTES = 4 << 20


def choose_rows(weights: torch.dtype, device: torch.device | str = "cpu",
                rows: str = "auto", largest_matrix_bytes: int | None = None) -> str:
    """The kernel of decoding and verification products for weights stored as ``weights``.

    Args:
        rows: ``"auto"``: on a CPU that emulates bf16, for bf16 weights ``"bf16"``
            (selfspec's AVX2 bf16 kernel for every matrix; prefill on FBGEMM fp16 copies of
            the matrices of at least :data:`AUTO_ROWS_MIN_BYTES` where FBGEMM is available)
            where that kernel builds, else (and for fp16 weights) ``"fp16"`` for matrices of
            at least :data:`AUTO_ROWS_MIN_BYTES` where FBGEMM is available; on a CPU with
            native bf16, for bf16 weights whose largest decoder-layer matrix is under
            :data:`NATIVE_BF16_ROWS_MAX_BYTES`, ``"bf16"`` too (prefill stays on oneDNN's
            native bf16), and for bf16 weights of any size where the kernel's AMX build
            runs; elsewhere ``"weights"``. ``"weights"``, ``"bf16"``, ``"bf16+fp16"`` (FBGEMM for
            the matrices
            of at least :data:`AUTO_ROWS_MIN_BYTES`, the bf16 kernel for the rest) or
            ``"fp16"`` (every matrix on FBGEMM) to force, or ``"int4"``: int4 copies of every matrix
            whose input size is a multiple of 32 (:mod:`selfspec.executor.int4_rows`; lossy;
            16-bit weights), or ``"w4a8"``: selfspec's 4-bit-weight, 8-bit-activation kernel
            on copies of those matrices (:class:`selfspec.executor.w4a8.W4A8Rows`; lossy), or
            ``"gguf"``: every matrix on the blocks of the GGUF file the model came from
            (:mod:`selfspec.executor.gguf_backend`; the executor attaches the file), or
            ``"gguf+dense"``: the same for decoding and verification, prefill on the dense
            weights.

    Raises:
        InvalidArgumentError: ``rows`` is none of :data:`ROWS_FORMATS`, or a forced kernel
            where it is missing (the bf16 kernel: with the reason it did not build) or the
            weights do not fit it (fp32, fp16 for the bf16 kernel, not on the CPU).
    """
    from selfspec.executor.bf16_rows import (
        bf16_rows_available,
        bf16_rows_unavailable_reason,
    )
    from selfspec.executor.bf16_rows import chosen_isa as bf16_isa
    from selfspec.executor.fp16_rows import fbgemm_fp16_available
    from selfspec.executor.gguf_rows import gguf_rows_available, gguf_rows_unavailable_reason
    from selfspec.executor.int4_rows import int4_available
    from selfspec.executor.w4a8 import w4a8_available, w4a8_unavailable_reason

    if rows not in ROWS_FORMATS:
        raise InvalidArgumentError(
            f"the decoding kernel must be one of {', '.join(ROWS_FORMATS)}, got {rows!r}")
    sixteen = weights in (torch.bfloat16, torch.float16) and torch.device(device).type == "cpu"
    # A forced kernel: (is its kernel here, what it needs).
    ours = "selfspec's AVX2 kernel (x86 with AVX2/FMA and a C++ compiler)"
    forced = {"bf16": (bf16_rows_available, ours),
              "bf16+fp16": (lambda: bf16_rows_available() and fbgemm_fp16_available(),
                            f"{ours} and FBGEMM"),
              "fp16": (fbgemm_fp16_available, "FBGEMM (x86 torch builds)"),
              "int4": (int4_available, "torch's CPU int4 kernel"),
              "w4a8": (w4a8_available,
                       "selfspec's w4a8 kernel (x86 with AVX2/FMA/F16C and a C++ compiler)"),
              "gguf": (gguf_rows_available,
                       "selfspec's GGUF block kernels (x86 with AVX2/FMA/F16C and a C++ "
                       "compiler)")}
    forced["gguf+dense"] = forced["gguf"]
    if rows in forced:
        available, kernel = forced[rows]
        on_cpu = torch.device(device).type == "cpu"
        fits = (on_cpu if rows in GGUF_ROWS
                else sixteen and (not rows.startswith("bf16") or weights == torch.bfloat16))
        if not (fits and available()):
            why = ""
            if fits and rows.startswith("bf16") and not bf16_rows_available():
                why = f" ({bf16_rows_unavailable_reason()})"
            elif fits and rows == "w4a8":
                why = f" ({w4a8_unavailable_reason()})"
            elif fits and rows in GGUF_ROWS:
                why = f" ({gguf_rows_unavailable_reason()})"
            need = ("bf16" if rows.startswith("bf16") else "float" if rows in GGUF_ROWS
                    else "bf16/fp16")
            raise InvalidArgumentError(
                f"{rows} decoding products need {need} weights on a CPU and {kernel}{why}; "
                "load the model with --dtype bf16, or use 'auto' or 'weights'")
        return rows
    if rows == "auto" and sixteen and not native_bf16():
        if weights == torch.bfloat16 and bf16_rows_available():
            return "bf16"
        if fbgemm_fp16_available():
            return "fp16"
    if (rows == "auto" and sixteen and weights == torch.bfloat16 and bf16_rows_available()
            and ((largest_matrix_bytes is not None
                  and largest_matrix_bytes < NATIVE_BF16_ROWS_MAX_BYTES)
                 or bf16_isa() == "amx")):
        return "bf16"
    return "weights"


def choose_formats(weights: torch.dtype, device: torch.device | str = "cpu",
                   bulk: str = "auto", rows: str = "auto",
                   largest_matrix_bytes: int | None = None) -> ComputeFormats:
    """Pick the bulk format, and the decoding kernel (:func:`choose_rows`), for weights
    stored as ``weights`` on ``device``.

    Args:
        weights: the model's parameter dtype.
        device: where it runs; only CPUs get a different bulk format.
        bulk: ``"auto"`` (fp32 for bf16/fp16 weights on a CPU without native bf16, else the
            weights' format), or ``"bf16"`` / ``"fp16"`` / ``"fp32"`` / ``"weights"`` to force.
        rows, largest_matrix_bytes: see :func:`choose_rows`.

    Raises:
        InvalidArgumentError: ``bulk`` or ``rows`` is none of those.
    """
    from selfspec.executor.fp16_rows import fbgemm_fp16_available

    kernel = choose_rows(weights, device, rows, largest_matrix_bytes)
    # FBGEMM takes the matrices of at least AUTO_ROWS_MIN_BYTES in the chain and under auto's
    # "fp16"; under "bf16" (with FBGEMM) they keep fp16 copies for bulk work (prefill) only,
    # except where bf16 is native and auto chose it (oneDNN's bf16 prefill is faster).
    native_auto = rows == "auto" and kernel == "bf16" and native_bf16()
    row_args = (kernel, AUTO_ROWS_MIN_BYTES
                if kernel == "bf16+fp16" or (rows == "auto" and kernel == "fp16")
                or (kernel == "bf16" and fbgemm_fp16_available() and not native_auto) else 0)
    if bulk == "weights":
        return ComputeFormats(weights, weights, "as requested", *row_args)
    if bulk != "auto":
        if bulk not in DTYPES:
            raise InvalidArgumentError(
                f"bulk compute format must be 'auto', 'weights' or one of {sorted(DTYPES)}, "
                f"got {bulk!r}")
        return ComputeFormats(weights, DTYPES[bulk], "as requested", *row_args)
    if torch.device(device).type != "cpu" or weights == torch.float32:
        return ComputeFormats(weights, weights, "the weights' format", *row_args)
    if weights == torch.bfloat16 and native_bf16():
        return ComputeFormats(weights, weights, "native bf16 on this CPU", *row_args)
    name = DTYPE_NAMES.get(weights, str(weights))
    return ComputeFormats(weights, torch.float32, f"{name} matrix products emulated on this CPU",
                          *row_args)


def available_memory_bytes() -> int | None:
    """Memory the OS can give without swapping (``MemAvailable``), or ``None`` if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
