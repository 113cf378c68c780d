"""Row-consistent products directly on a GGUF file's quantized blocks (``kernels/gguf_rows.cpp``),
as llama.cpp multiplies them: :class:`GgufMatrix`.

Scheme: each weight type is multiplied with the activation format llama.cpp pairs with it,
quantized once per call and per format, with llama.cpp's reference rounding: Q8_0 (blocks of
32) for Q4_0/Q5_0/Q8_0, Q8_1 (Q8_0 plus ``s = d * sum``) for Q4_1/Q5_1, Q8_K (blocks of 256
with per-16 sums) for Q2_K/Q3_K/Q4_K/Q5_K/Q6_K; F32/F16/BF16 rows multiply fp32 activations.
Block dot products are exact integer ones, scaled per block in fp32. ``GGUF_ROW_TYPES`` lists
the types.

Why: a GGUF model then decodes on the bytes of its file, no re-quantization into selfspec's
own w4a8 blocks (:mod:`selfspec.executor.w4a8`), no bf16 copy; a token costs reading them.

Row consistency: a row's result is bit-identical whatever the number of rows in the call and
whatever the others are (and whatever the thread count), so a verification block equals
one-token decoding bit for bit; yet each decoded weight block serves every row of the call,
so a block of 8-16 rows costs far less than as many one-row calls.

Three builds of the same source, chosen at run time: AMX (the AVX-512 build plus AMX int8
tiles, ``kernels/gguf_amx.h``) where the CPU lists amx_tile and amx_int8 and Linux grants the
tile state, else AVX-512 (F/BW/VL + VNNI: ``vpdpbusd``, ``vpdpwssd``, 64 inputs a zmm) where
the CPU has it, else AVX2 + FMA + F16C (``vpmaddubsw``/``vpmaddwd``). ``isa=`` forces one
(tests check each available). On the AVX-512 builds, Q4_0, Q4_1 and Q8_0 rows run in groups
of 16 weight rows, one per vector lane (``kernels/gguf_group32.h``): each block's codes are
transposed once and multiplied with every token of the call (``vpdpbusd`` with the token's
inputs broadcast), each block summed exactly in int32 and scaled in fp32 lane by lane. The
AMX build multiplies Q4_K rows of calls of 4 activation rows and more (Q6_K: 5) in tiles —
16 weight rows against up to 16 activation rows a tile multiply, the weights decoded once per
group into AMX's layout — and smaller calls row by row; both paths sum each 256-input block
exactly in int32 and apply the same fp32 steps, so a row is the same bits in either. Other
types (and every type on AVX2) run row by row, a tile of up to 8 tokens per decoded block.
The builds may differ in the last bits; each is row-consistent.

``scripts/gguf_rows_bench.py`` measures the products (one-token bandwidth per block type,
multi-row calls against one-row ones): a call of 8 or 16 rows costs a fraction of that many
one-row calls, a smaller fraction than on the w4a8 kernel.

Layout: a :class:`GgufMatrix` is segments of rows (``[rows, row_bytes]`` uint8, each row
``K / block_size`` blocks, as stored in the GGUF) stacked along the outputs, each segment its
own type (a fused q/k/v matrix may hold Q4_K q, k and Q6_K v); each segment's product goes into
its column slice of one ``[M, N]`` output. The same library holds the fused sub-layers
(``kernels/fused_layers.h`` with its ``GgufProduct``), which take a matrix as
:attr:`GgufMatrix.fused`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, partial

import gguf
import numpy as np
import torch

from selfspec.errors import InvalidArgumentError, UnsupportedGgufTypeError
from selfspec.executor import native
from selfspec.executor.gguf_quantize import quantize_blocks  # noqa: F401  (re-exported)
from selfspec.executor.isa import isa_allowed

SOURCE = "gguf_rows.cpp"
_T = gguf.GGMLQuantizationType

# Weight type -> the activation format its products take (F32: the fp32 input itself).
_ACTIVATION = {
    _T.Q4_0: _T.Q8_0, _T.Q5_0: _T.Q8_0, _T.Q8_0: _T.Q8_0,
    _T.Q4_1: _T.Q8_1, _T.Q5_1: _T.Q8_1,
    _T.Q2_K: _T.Q8_K, _T.Q3_K: _T.Q8_K, _T.Q4_K: _T.Q8_K, _T.Q5_K: _T.Q8_K, _T.Q6_K: _T.Q8_K,
    _T.F32: _T.F32, _T.F16: _T.F32, _T.BF16: _T.F32,
}
GGUF_ROW_TYPES: tuple[gguf.GGMLQuantizationType, ...] = tuple(_ACTIVATION)
ISAS = ("avx2", "avx512", "amx")

_FLAGS = {
    # -ffp-contract=off: no compiler-fused multiply-adds, whose choice could differ between
    # differently unrolled tiles (row consistency).
    "avx2": ("-mf16c", "-ffp-contract=off"),
    "avx512": ("-mf16c", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512vnni"),
    # the AVX-512 build plus AMX int8 tiles for Q4_K / Q6_K rows (kernels/gguf_amx.h)
    "amx": ("-mf16c", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl",
            "-mavx512vnni", "-mamx-tile", "-mamx-int8", "-DSELFSPEC_GGUF_AMX"),
}
_CPU_FLAGS = {
    "avx2": ("f16c",),
    "avx512": ("f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    "amx": ("f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"),
}


class _Segment(ctypes.Structure):
    """``SelfspecGgufSegment`` (``kernels/gguf_rows.cpp``)."""

    _fields_ = [("type", ctypes.c_int64), ("w", ctypes.c_void_p), ("rows", ctypes.c_int64),
                ("bias", ctypes.c_void_p), ("col", ctypes.c_int64)]


class FusedMatrix(ctypes.Structure):
    """``SelfspecGgufMatrix`` (``kernels/gguf_rows.cpp``): a whole :class:`GgufMatrix` as the
    fused sub-layers (``selfspec_gguf_attention`` / ``_mlp``) take it."""

    _fields_ = [("segments", ctypes.POINTER(_Segment)), ("num_segments", ctypes.c_int64),
                ("k", ctypes.c_int64)]


@dataclass(frozen=True)
class _Lib:
    """One build's functions (``gguf_rows.cpp``'s ``extern "C"``), or why there is none."""

    isa: str
    reason: str
    rows: object | None = None
    quantize: object | None = None
    act_row_bytes: object | None = None
    segments: object | None = None
    library: ctypes.CDLL | None = None


def _functions(library: ctypes.CDLL):
    rows = library.selfspec_gguf_rows
    rows.restype = ctypes.c_int64
    rows.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_int64, ctypes.c_int64]
    segments = library.selfspec_gguf_rows_segments
    segments.restype = ctypes.c_int64
    segments.argtypes = [ctypes.POINTER(_Segment), ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                         ctypes.c_int64]
    quantize = library.selfspec_gguf_quantize
    quantize.restype = ctypes.c_int64
    quantize.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_int64, ctypes.c_void_p]
    act_row_bytes = library.selfspec_gguf_act_row_bytes
    act_row_bytes.restype = ctypes.c_int64
    act_row_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    return rows, quantize, act_row_bytes, segments


def _resolve(isa: str) -> str:
    if isa == "auto":
        return chosen_isa()
    if isa not in ISAS:
        raise InvalidArgumentError(
            f"isa must be 'auto', 'avx2', 'avx512' or 'amx', not {isa!r}")
    return isa


def _avx512_unavailable_reason() -> str:
    """Why the AVX-512 build cannot run here (``""`` when it can). Besides ``/proc/cpuinfo``
    (native.load's check) ATen's own CPU detection decides, so that a machine whose cpuinfo
    cannot be read never runs AVX-512 code it lacks (the probe would die of SIGILL)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return "needs a CPU with AVX-512 (ATen's AVX512 level)"
    vnni = getattr(torch.cpu, "_is_vnni_supported", None)  # private, so only where it exists
    if vnni is not None and not vnni():
        return "needs a CPU with AVX-512 VNNI"
    return ""


@cache
def _library(isa: str) -> _Lib:
    """The ``isa`` build, loaded and probed (never raises: a failure is the reason)."""
    if isa in ("avx512", "amx") and (reason := _avx512_unavailable_reason()):
        return _Lib(isa, reason)
    kernel = native.load(SOURCE, "selfspec_gguf_rows_version", [], partial(_probe, isa),
                         extra_flags=_FLAGS[isa], cpu_flags=_CPU_FLAGS[isa])
    if kernel.library is None:
        return _Lib(isa, kernel.reason)
    return _Lib(isa, "", *_functions(kernel.library), kernel.library)


def chosen_isa() -> str:
    """The build ``isa="auto"`` uses here: ``"amx"`` where the CPU also lists amx_tile and
    amx_int8 and Linux grants the tile state, else ``"avx512"`` where the CPU lists avx512f,
    avx512bw, avx512vl and avx512_vnni and that build loads, else ``"avx2"``; never a build
    above ``SELFSPEC_MAX_ISA`` (:func:`selfspec.executor.isa.isa_allowed`)."""
    for isa in ("amx", "avx512"):
        if isa_allowed(isa) and _library(isa).rows is not None:
            return isa
    return "avx2"


def gguf_library(isa: str = "auto") -> ctypes.CDLL | None:
    """The loaded ``isa`` build (its fused sub-layers: ``selfspec_gguf_attention``,
    ``selfspec_gguf_mlp``), or ``None`` where it cannot run here."""
    return _library(_resolve(isa)).library


def gguf_rows_available(isa: str = "auto") -> bool:
    """Whether the ``isa`` build (``"auto"``, ``"avx2"``, ``"avx512"``, ``"amx"``) is built (or
    can be) and passed its probe on this machine."""
    return _library(_resolve(isa)).rows is not None


def gguf_rows_unavailable_reason(isa: str = "auto") -> str:
    """Why the ``isa`` build cannot run here (``""`` when it can)."""
    return _library(_resolve(isa)).reason


@dataclass(frozen=True, eq=False)
class GgufSegment:
    """Rows of one GGUF block type (compared by identity: tensors have no truth value).

    Attributes:
        type: the rows' :class:`gguf.GGMLQuantizationType`.
        data: ``[rows, row_bytes]`` uint8, contiguous: each row ``K / block_size`` blocks as
            stored in the GGUF file.
    """

    type: gguf.GGMLQuantizationType
    data: torch.Tensor

    @property
    def rows(self) -> int:
        return self.data.shape[0]


def _check_type(qtype) -> gguf.GGMLQuantizationType:
    try:
        qtype = _T(qtype)
    except ValueError:
        qtype = None
    if qtype not in _ACTIVATION:
        name = getattr(qtype, "name", str(qtype))
        raise UnsupportedGgufTypeError(
            f"GGUF block type {name} is not supported by the GGUF rows kernel (supported: "
            f"{', '.join(t.name for t in GGUF_ROW_TYPES)})")
    return qtype


class GgufMatrix:
    """``y = x Wᵀ + b`` on GGUF blocks, each row of ``x`` computed as if alone (module
    docstring).

    Args:
        segments: the weight's rows, stacked in order along the outputs.
        in_features: ``K``; a multiple of every segment's block size.
        bias: ``[N]`` or ``None`` (kept in fp32).
        isa: ``"auto"``, ``"avx2"``, ``"avx512"`` or ``"amx"``: the kernel build.

    Calls take ``[..., K]`` (bf16 or fp32; other dtypes go through fp32) and return
    ``[..., N]`` in ``x``'s dtype.

    Attributes:
        fused: the matrix as the fused sub-layers take it (:class:`FusedMatrix`, pointing into
            this matrix's segments, which it keeps alive).

    Raises:
        UnsupportedGgufTypeError: a segment's type is not in :data:`GGUF_ROW_TYPES` (the
            message names it and the supported ones; the caller adds the tensor's name).
        InvalidArgumentError: ``K`` is not a multiple of a segment's block size, a segment's
            data is not uint8 ``[rows, K / block_size * type_size]``, the bias is not ``[N]``,
            no segments, or an unknown ``isa``.
        RuntimeError: the kernel is not available here (the reason in the message).
    """

    def __init__(self, segments: Sequence[GgufSegment], in_features: int,
                 bias: torch.Tensor | None = None, isa: str = "auto") -> None:
        if not segments:
            raise InvalidArgumentError("a GGUF matrix needs at least one segment")
        k = int(in_features)
        checked = []
        for seg in segments:
            qtype = _check_type(seg.type)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            if k <= 0 or k % block:
                raise InvalidArgumentError(
                    f"{qtype.name} rows need the input size ({k}) to be a positive multiple "
                    f"of {block}")
            want = k // block * size
            data = seg.data
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != want:
                raise InvalidArgumentError(
                    f"{qtype.name} rows of {k} inputs need uint8 data [rows, {want}], not "
                    f"{data.dtype} {list(data.shape)}")
            checked.append(GgufSegment(qtype, data.contiguous()))
        self.segments = tuple(checked)
        self.in_features = k
        self.out_features = sum(s.rows for s in self.segments)
        if bias is not None:
            if bias.shape != (self.out_features,):
                raise InvalidArgumentError(
                    f"the bias must be [{self.out_features}], not {list(bias.shape)}")
            bias = bias.detach().float().contiguous()
        self.bias = bias
        self.isa = _resolve(isa)
        lib = _library(self.isa)
        if lib.rows is None:
            raise RuntimeError(f"the GGUF rows kernel ({self.isa}) is not available: {lib.reason}")
        self._lib = lib
        # Activation formats in first-use order with their bytes a row (None: the fp32 input),
        # and per segment the kernel's arguments that do not change between calls.
        formats = list(dict.fromkeys(_ACTIVATION[s.type] for s in self.segments))
        self._formats = tuple((int(f), None if f == _T.F32 else lib.act_row_bytes(int(f), k))
                              for f in formats)
        # All segments run in one kernel call (one parallel region: one wake-up of the threads).
        self._args = (_Segment * len(self.segments))()
        col = 0
        for arg, seg in zip(self._args, self.segments):
            arg.type, arg.w, arg.rows, arg.col = int(seg.type), seg.data.data_ptr(), seg.rows, col
            arg.bias = None if bias is None else bias.data_ptr() + 4 * col
            col += seg.rows
        self._which = tuple(formats.index(_ACTIVATION[s.type]) for s in self.segments)
        self._acts_type = ctypes.c_void_p * len(self.segments)
        self.fused = FusedMatrix(ctypes.cast(self._args, ctypes.POINTER(_Segment)),
                                 len(self._args), k)

    @property
    def types(self) -> tuple[gguf.GGMLQuantizationType, ...]:
        """Each segment's type, in order."""
        return tuple(s.type for s in self.segments)

    @property
    def nbytes(self) -> int:
        """Bytes one call reads: every segment's blocks and the bias."""
        return sum(s.data.numel() for s in self.segments) + (
            0 if self.bias is None else self.bias.numel() * 4)

    def dequantize(self) -> torch.Tensor:
        """The weight ``[N, K]`` in fp32 (:func:`gguf.quants.dequantize`, for checks)."""
        parts = [np.asarray(gguf.quants.dequantize(s.data.numpy(), s.type), dtype=np.float32)
                 .reshape(s.rows, self.in_features) for s in self.segments]
        return torch.from_numpy(np.concatenate(parts, axis=0))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., K]`` → ``[..., N]`` in ``x``'s dtype.

        Raises:
            InvalidArgumentError: ``x``'s last dimension is not ``K``.
        """
        k, n = self.in_features, self.out_features
        if x.dim() == 0 or x.shape[-1] != k:
            raise InvalidArgumentError(f"expected inputs [..., {k}], not {list(x.shape)}")
        dtype = x.dtype
        if dtype is not torch.bfloat16 and dtype is not torch.float32:
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        m = x.numel() // k
        is_bf16 = int(x.dtype is torch.bfloat16)
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
        if m:
            lib, xp = self._lib, x.data_ptr()
            acts = []  # per activation format, in self._formats' order (kept alive to the end)
            for fmt, row_bytes in self._formats:
                if row_bytes is None:
                    acts.append(x.float())
                else:
                    acts.append(torch.empty((m, row_bytes), dtype=torch.uint8))
                    lib.quantize(fmt, xp, is_bf16, m, k, acts[-1].data_ptr())
            ptrs = self._acts_type(*(acts[i].data_ptr() for i in self._which))
            lib.segments(self._args, len(self._args), k, ptrs, m, out.data_ptr(), n, is_bf16)
        return out if out.dtype == dtype else out.to(dtype)



class GgufDraftLinear(GgufMatrix):
    """A :class:`GgufMatrix` as a draft view's matrix (``qspec``'s ``q3_k``/``q2_k`` copies,
    :func:`selfspec.executor.quant.gguf_draft_linear`): called ``m(x, bulk=False)`` (every
    call on the blocks) with :attr:`decode_bytes`; a ``GgufMatrix`` still, so a draft view of
    them runs on the fused GGUF sub-layers."""

    @property
    def decode_bytes(self) -> int:
        """Bytes of weight one call reads (:attr:`nbytes`)."""
        return self.nbytes

    def __call__(self, x: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        return super().__call__(x)


ACTIVATION_FORMATS = (_T.Q8_0, _T.Q8_1, _T.Q8_K)


def activation_format(qtype: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """The activation format ``qtype``'s products take (Q8_0, Q8_1 or Q8_K; F32 for the float
    types).

    Raises:
        UnsupportedGgufTypeError: ``qtype`` is not in :data:`GGUF_ROW_TYPES`.
    """
    return _ACTIVATION[_check_type(qtype)]


def _quantize(lib: _Lib, x: torch.Tensor, fmt: gguf.GGMLQuantizationType) -> torch.Tensor:
    """``x`` ``[..., K]`` contiguous fp32/bf16 → ``[M, row_bytes]`` blocks of ``fmt``."""
    k = x.shape[-1]
    m = x.numel() // k
    buf = torch.empty((m, lib.act_row_bytes(int(fmt), k)), dtype=torch.uint8)
    if m:
        lib.quantize(int(fmt), x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, buf.data_ptr())
    return buf


def quantize_activations(x: torch.Tensor, fmt: gguf.GGMLQuantizationType,
                         isa: str = "auto") -> torch.Tensor:
    """The kernel's quantization of ``x`` ``[M, K]`` (fp32 or bf16; others via fp32) to
    ``fmt`` (Q8_0, Q8_1 or Q8_K, ggml's block structs), rounded as llama.cpp's
    ``quantize_row_q8_0_ref`` / ``q8_1_ref`` / ``q8_K_ref``: ``[M, row_bytes]`` uint8.

    Raises:
        InvalidArgumentError: another format, ``x`` not 2-D, or ``K`` not a multiple of the
            format's block.
        RuntimeError: the kernel is not available here.
    """
    fmt = _T(fmt)
    if fmt not in ACTIVATION_FORMATS:
        raise InvalidArgumentError(
            f"activation format must be Q8_0, Q8_1 or Q8_K, not {fmt.name}")
    block = gguf.GGML_QUANT_SIZES[fmt][0]
    if x.dim() != 2 or x.shape[1] % block:
        raise InvalidArgumentError(
            f"{fmt.name} needs inputs [M, K] with K a multiple of {block}, not {list(x.shape)}")
    lib = _library(_resolve(isa))
    if lib.rows is None:
        raise RuntimeError(f"the GGUF rows kernel ({lib.isa}) is not available: {lib.reason}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    return _quantize(lib, x.contiguous(), fmt)


def _probe(isa: str, version) -> str:
    """Check the ``isa`` build's Q4_K and Q8_0 products against gguf-py's dequantized blocks
    on random data (``""`` when close). ``version`` is the loaded version function."""
    library = ctypes.CDLL(str(native.build(SOURCE, _FLAGS[isa])))
    if isa == "amx":
        library.selfspec_gguf_rows_amx.restype = ctypes.c_int64
        if library.selfspec_gguf_rows_amx() != 1:
            return "Linux did not grant this process the AMX tile state (arch_prctl)"
    rows, quantize, act_row_bytes, _ = _functions(library)
    gen = torch.Generator().manual_seed(7)
    k = 512
    x = torch.randn(5, k, generator=gen)
    for qtype, fmt in ((_T.Q4_K, _T.Q8_K), (_T.Q8_0, _T.Q8_0)):
        weight = torch.randn(9, k, generator=gen)          # odd N
        blocks = quantize_blocks(weight, qtype)
        want = x @ torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype)).T
        act = torch.empty((5, act_row_bytes(int(fmt), k)), dtype=torch.uint8)
        got = torch.full((5, 9), float("nan"))
        if quantize(int(fmt), x.data_ptr(), 0, 5, k, act.data_ptr()) != 0 or rows(
                int(qtype), blocks.data_ptr(), 9, k, act.data_ptr(), 5, None, got.data_ptr(),
                9, 0) != 0:
            return f"refused {qtype.name}"
        err = (got - want).abs().max().item()
        # int8 activations: about 1/254 of a block's largest input per product
        if not err < 0.03 * want.abs().max().item():
            return f"{qtype.name} differs from the dequantized product by {err:.3g}"
    return ""
