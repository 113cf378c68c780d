"""bf16-weight matrix products for decoding and verification on x86 CPUs (``--decode-kernel
bf16``; what ``auto`` picks where bf16 is emulated and a C++ compiler is present, and where it
is native for models of small matrices: :func:`selfspec.executor.cpu.choose_rows`).

Why: on x86 CPUs without native bf16 torch's bf16 ``F.linear`` converts as it multiplies and
its cost grows with the rows, so verifying ``D`` draft tokens costs about ``D + 1`` decoding
steps; FBGEMM's fp16 kernel (:mod:`selfspec.executor.fp16_rows`) is flat in the rows but
costs more a call than reading a SmolLM2-sized matrix, and needs an fp16 copy of every
weight. This kernel (``kernels/bf16_rows.cpp``, AVX2 + FMA) reads the model's own bf16
weights in place, converts each weight row once (a 16-bit shift) and multiplies it with up
to six activation rows while it is in registers, so a call of 4 rows costs little more than
one, and either less than bf16 ``F.linear``.

Numbers: products and sums in fp32, the sum rounded to bf16 once (round to nearest even), as
bf16 ``F.linear`` does, so outputs agree with it to fp32 rounding, not bit for bit (the
summation order differs). Row consistency, which lossless verification rests on, holds by
construction: every dot product is accumulated in one fixed order whatever the number of
rows, the row's place in the call and the threads' split of the outputs.

Build: compiled at first use (:mod:`selfspec.executor.native`), loaded with ``ctypes`` and
checked against ``F.linear`` on a probe. Where any of that fails (no compiler,
no AVX2/FMA, not x86) :func:`bf16_rows_available` says why and ``auto`` keeps the other kernels.
Two builds of the source (:data:`ISAS`): ``"avx2"`` as above, and ``"avx512bf16"`` on CPUs
with AVX512-BF16 (``vdpbf16ps``: pairs of bf16 weights times bf16 activations into fp32
lanes, 32 products an instruction against AVX2's 8; the activations are rounded to bf16 once
per call, as bf16 ``F.linear``'s are), which the process takes where it loads
(:func:`chosen_isa`), so that verification rows cost less compute there. A third build,
``"amx"`` (the AVX512-BF16 build plus AMX bf16 tiles, ``tdpbf16ps``), runs every call in
tiles: the weights are the A operand, read in place 16 rows x 32 inputs at a time, and up to
16 tokens' activations the B operand, so a verification block of up to 16 tokens reads each
weight once (on CPUs that list amx_tile and amx_bf16 where Linux grants the tile state). Each
build is row-consistent; they round differently from each other.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from functools import cache

import torch
import torch.nn.functional as F

from selfspec.executor import native
from selfspec.executor.fp16_rows import bulk_copy, bulk_product, fbgemm_fp16_available
from selfspec.executor.isa import isa_allowed

SOURCE = "bf16_rows.cpp"
BULK_MAX_ROWS = 32   # bulk calls of more rows cast the weight to fp32 for a blocked GEMM


@dataclass(frozen=True)
class Bf16Weight:
    """A weight as this kernel reads it: the model's own bf16 tensor (no copy).

    Attributes:
        weight: ``[N, K]`` bf16, contiguous.
        bias: ``[N]`` fp32 or ``None``.
        nbytes: bytes one call reads (weight and bias).
        weight_ptr, bias_ptr: their addresses (``bias_ptr`` ``None`` without bias), taken once:
            a decoding call's Python overhead is part of its cost (~120 calls a token).
        bulk_copy: FBGEMM's fp16 copy for bulk calls (:class:`Bf16Rows` ``bulk_min_bytes``),
            or ``None``.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    nbytes: int
    weight_ptr: int = 0
    bias_ptr: int | None = None
    bulk_copy: torch.Tensor | None = None


def bf16_rows_available() -> bool:
    """Whether the kernel is built (or can be) and passed its probe on this machine."""
    return _library().call is not None


def bf16_rows_unavailable_reason() -> str:
    """Why the kernel cannot run here (``""`` when it can)."""
    return _library().reason


#: The builds: AVX2 + FMA (fp32 FMAs on converted weights), AVX512-BF16 (``vdpbf16ps``), and
#: AMX (AMX bf16 tiles, ``tdpbf16ps``, for calls of every size).
ISAS = ("avx2", "avx512bf16", "amx")
_AVX512BF16 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-DSELFSPEC_BF16_NATIVE")
_FLAGS = {"avx2": (), "avx512bf16": _AVX512BF16,
          "amx": _AVX512BF16 + ("-mamx-tile", "-mamx-bf16", "-DSELFSPEC_BF16_AMX")}
_CPU_FLAGS = {"avx2": (), "avx512bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
              "amx": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16")}


@cache
def _library(isa: str = "auto") -> native.Kernel:
    """The ``isa`` build (``"auto"``: :func:`chosen_isa`), loaded and probed (never raises:
    a failure is the kernel's ``reason``)."""
    if isa == "auto":
        return _library(chosen_isa())
    if isa not in ISAS:
        raise ValueError(f"isa must be 'auto' or one of {', '.join(ISAS)}, not {isa!r}")
    if isa != "avx2" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        # ATen's own detection too: a machine whose cpuinfo cannot be read never runs
        # AVX-512 code it lacks (the probe would die of SIGILL).
        return native.Kernel(None, "needs a CPU with AVX-512 (ATen's AVX512 level)")
    probe = _probe_amx if isa == "amx" else _probe
    return native.load(SOURCE, "selfspec_bf16_rows", [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3,
                       probe, extra_flags=_FLAGS[isa], cpu_flags=_CPU_FLAGS[isa])


@cache
def chosen_isa() -> str:
    """The build the process uses: ``"amx"`` where the CPU also lists amx_tile and amx_bf16
    and Linux grants the tile state, else ``"avx512bf16"`` where the CPU lists avx512f/bw/vl
    and avx512_bf16, else ``"avx2"`` (each where it loads and passes its probe), never a build
    above ``SELFSPEC_MAX_ISA`` (:func:`selfspec.executor.isa.isa_allowed`)."""
    for isa in ("amx", "avx512bf16"):
        if isa_allowed(isa) and _library(isa).call is not None:
            return isa
    return "avx2"


def _weight(weight: torch.Tensor, bias: torch.Tensor | None) -> Bf16Weight:
    """``weight`` ``[N, K]`` bf16 (and ``bias``) as the kernel reads it."""
    w = weight.detach().contiguous()
    b = None if bias is None else bias.detach().float().contiguous()
    nbytes = w.numel() * 2 + (0 if bias is None else bias.numel() * bias.element_size())
    return Bf16Weight(w, b, nbytes, w.data_ptr(), None if b is None else b.data_ptr())


def _product(fn, x: torch.Tensor, packed: Bf16Weight) -> torch.Tensor:
    """``x`` ``[..., K]`` → ``[..., N]`` in bf16 through the compiled kernel ``fn``."""
    # Kept to a few tensor calls: this runs ~120 times a token, and reshapes and casts here
    # would cost more than F.linear's own overhead.
    if x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    if not x.is_contiguous():
        x = x.contiguous()
    k, n = x.shape[-1], packed.weight.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=torch.bfloat16)
    fn(packed.weight_ptr, x.data_ptr(), out.data_ptr(), packed.bias_ptr, x.numel() // k, k, n)
    return out


def _probe(fn) -> str:
    """Check the kernel on random data: close to ``F.linear`` in fp32 and rows of a call equal
    to rows alone (``""`` when both hold)."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 75, generator=gen).bfloat16()   # odd N, K tail past 64
    bias = torch.randn(37, generator=gen)
    x = torch.randn(9, 75, generator=gen).bfloat16()
    packed = _weight(weight, bias)
    got = _product(fn, x, packed)
    want = F.linear(x.float(), weight.float(), bias)
    if not torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2):
        return f"differs from F.linear by {(got.float() - want).abs().max().item():.3g}"
    alone = torch.cat([_product(fn, row, packed) for row in x.split(1)])
    if not torch.equal(got, alone):
        return "rows of one call differ from the rows computed alone"
    return ""


def _probe_amx(fn) -> str:
    """:func:`_probe` for the AMX build, after asking Linux for the tile state (its calls would
    die of SIGILL without it; ``ctypes.CDLL`` of the built path is the loaded library)."""
    library = ctypes.CDLL(str(native.build(SOURCE, _FLAGS["amx"])))
    library.selfspec_bf16_rows_amx.restype = ctypes.c_int64
    if library.selfspec_bf16_rows_amx() != 1:
        return "Linux did not grant this process the AMX tile state (arch_prctl)"
    return _probe(fn)


class Bf16Rows:
    """Row-consistent bf16-weight products for the non-bulk calls of
    :class:`selfspec.executor.linear.Linear` (see the module docstring).

    Args:
        bulk_min_bytes: keep an FBGEMM fp16 copy of every weight of at least this many bytes
            for bulk calls of more than :data:`BULK_MAX_ROWS` rows (prefill at FBGEMM's speed,
            2 more bytes a weight); ``None``: no copies.
        native_bulk: the CPU multiplies bf16 natively
            (:func:`selfspec.executor.cpu.native_bf16`): bulk calls beyond
            :data:`BULK_MAX_ROWS` rows without an fp16 copy take torch's bf16 GEMM on the
            weight as it is, not an fp32 GEMM on a cast of it.

    Raises:
        RuntimeError: the kernel is not available here (check :func:`bf16_rows_available`),
            or ``bulk_min_bytes`` without FBGEMM's fp16 kernel in this torch build.

    Attributes:
        serves_bulk: ``True``: bulk calls of up to :data:`BULK_MAX_ROWS` rows use it too (short
            prompts); longer ones use the weight's fp16 copy, else cast the weight to fp32
            for torch's blocked GEMM.
    """

    serves_bulk = True

    def __init__(self, bulk_min_bytes: int | None = None, native_bulk: bool = False) -> None:
        lib = _library()
        if lib.call is None:
            raise RuntimeError(f"the bf16 rows kernel is not available: {lib.reason}")
        if bulk_min_bytes is not None and not fbgemm_fp16_available():
            raise RuntimeError("fp16 bulk copies need FBGEMM's fp16 linear in this torch build")
        self._fn = lib.call
        self.bulk_min_bytes = bulk_min_bytes
        self.native_bulk = native_bulk

    def prepack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Bf16Weight | None:
        """The weight as the kernel reads it (with its fp16 bulk copy where
        ``bulk_min_bytes`` asks), or ``None`` when it is not bf16 (it keeps its own kernel)."""
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            return None
        packed = _weight(weight, bias)
        if self.bulk_min_bytes is not None:
            packed = replace(packed, bulk_copy=bulk_copy(weight, bias, self.bulk_min_bytes))
        return packed

    def __call__(self, x: torch.Tensor, packed: Bf16Weight) -> torch.Tensor:
        """``[..., K]`` → ``[..., N]`` in bf16, each row bit-identical to the row computed
        alone (any row count, any position in the block)."""
        return _product(self._fn, x, packed)

    def bulk(self, x: torch.Tensor, packed: Bf16Weight) -> torch.Tensor:
        """``[..., K]`` → ``[..., N]`` for prefill and other bulk work (need not match one-token
        decoding bit for bit): this kernel up to :data:`BULK_MAX_ROWS` rows, else FBGEMM on
        the weight's fp16 copy where it has one, else torch's bf16 GEMM where the CPU has
        native bf16 (oneDNN's AMX / AVX512-BF16 kernel), else an fp32 GEMM on a per-call fp32
        cast of the weight (compute-bound there, where blocked kernels beat this one)."""
        if x.numel() <= BULK_MAX_ROWS * x.shape[-1]:
            return self(x, packed)
        if packed.bulk_copy is not None:
            return bulk_product(x, packed.bulk_copy)
        bias = packed.bias
        if x.dtype == torch.bfloat16 and self.native_bulk:
            return F.linear(x, packed.weight, None if bias is None else bias.to(x.dtype))
        return F.linear(x.float(), packed.weight.float(), bias).to(x.dtype)

    def decode_bytes(self, packed: Bf16Weight, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> int:
        """Bytes one call reads (weight and bias, :attr:`Bf16Weight.nbytes`)."""
        return packed.nbytes
