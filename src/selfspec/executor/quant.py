"""Quantized copies of the model's own linear layers, for drafting (QSpec-style
self-speculation: the draft runs the same layers on low-precision weights and the full-
precision model verifies, so the output stays exactly the full model's).

Five formats:

- ``int8``: int8 weights (symmetric, one scale per output channel) with activations
  quantized per call (one scale per block, 7-bit as FBGEMM requires without VNNI): FBGEMM's
  ``quantized::linear_dynamic``. W8A8 is lossy, which a draft may be.
- ``int4``: int4 weights (asymmetric, one scale and offset per group of 32 inputs), bf16
  activations: ``aten::_weight_int4pack_mm_for_cpu`` (torchao's int4 CPU layout calls the
  same kernel, so torchao would add nothing here).
- ``w4a8``: 4-bit weights (asymmetric: a scale and a minimum per block of 32) and 8-bit
  activations per block of 32 (llama.cpp's Q4_1 × Q8_0): selfspec's AVX2 kernel
  (:mod:`selfspec.executor.w4a8`), compiled at first use; 0.625 bytes a weight (fp16 scales and
  minima).
- ``q3_k`` and ``q2_k``: GGUF's 3- and 2-bit K-quant blocks (Q3_K: 3.4375 bits a weight,
  Q2_K: 2.625), quantized by :func:`selfspec.executor.gguf_quantize.quantize_blocks` and
  multiplied by the GGUF rows kernel (:class:`~selfspec.executor.gguf_rows.GgufMatrix`, 8-bit
  activations per block of 256), so a model that itself decodes on 4-bit GGUF blocks
  (``--dtype gguf``, Q4_K ~4.5 bits) has a draft that reads fewer bytes than itself. Input
  sizes must be multiples of 256 (the K-quant super-block). Not among ``auto``'s candidates
  (:data:`AUTO_DRAFT_FORMATS`): their acceptance is lower, which one-row timing does not see.

Which is faster depends on the CPU, so the default (``auto``) measures it
(:func:`fastest_format`). On AVX2 without native bf16, FBGEMM's W8A8 was the fastest of
bf16, int8 weight-only (``_weight_int8pack_mm``), int4 (group 32 or 128) and W8A8: torch's
int4 kernel unpacks nibbles at a rate well below the memory bandwidth on AVX2, while FBGEMM's
int8 dot products (``vpmaddubsw``) keep up with it; w4a8 reads 0.625 of int8's bytes with the
same instructions, and its draft tokens are cheaper than int8's. On an AVX-512/AMX CPU the
int4 kernel beats W8A8 instead.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from selfspec.errors import InvalidArgumentError

if TYPE_CHECKING:
    from selfspec.executor.w4a8 import W4A8Linear

DRAFT_WEIGHT_FORMATS = ("int8", "int4", "w4a8", "q3_k", "q2_k")
#: The formats ``draft_weights=auto`` times (:func:`fastest_format`): the 8- and 4-bit ones. The
#: GGUF 3- and 2-bit blocks would often win on time alone while accepting fewer drafts, so they
#: are chosen by name only.
AUTO_DRAFT_FORMATS = ("int8", "int4", "w4a8")
#: The GGUF block type of each low-bit draft format.
GGUF_DRAFT_TYPES = {"q3_k": "Q3_K", "q2_k": "Q2_K"}
GGUF_DRAFT_BLOCK = 256  # inputs per K-quant super-block
# What a --draft-weights option accepts: a format, or "auto" = the one whose one-row products
# are fastest on this machine (:func:`fastest_format`).
DRAFT_WEIGHT_CHOICES = ("auto", *DRAFT_WEIGHT_FORMATS)
INT4_GROUP = 32  # group 64 already changed SmolLM2's first greedy token (int4_probe.py)
#: The device types each draft format's kernel runs on: all CPU kernels (FBGEMM, torch's CPU
#: int4 kernel, selfspec's AVX2 w4a8). On CUDA no quantized drafter is built (``auto`` drops
#: its qspec candidate, ``draft_weights=auto`` is refused with the reason): on CUDA
#: ``quantize_per_channel`` failed with ``RuntimeError: Unsupported qscheme:
#: per_channel_affine``.
DRAFT_FORMAT_DEVICES: dict[str, tuple[str, ...]] = {"int8": ("cpu",), "int4": ("cpu",),
                                                    "w4a8": ("cpu",), "q3_k": ("cpu",),
                                                    "q2_k": ("cpu",)}


def draft_formats_on(device: torch.device | str,
                     formats: Sequence[str] = DRAFT_WEIGHT_FORMATS) -> list[str]:
    """The draft formats (of ``formats``) whose kernel runs on ``device`` in this build."""
    kind = torch.device(device).type
    return [f for f in formats
            if kind in DRAFT_FORMAT_DEVICES.get(f, ()) and quantized_kernels_available(f)]


def quantized_kernels_available(fmt: str, device: torch.device | str = "cpu") -> bool:
    """Whether this torch build has the kernel of ``fmt`` (``int8`` needs FBGEMM) and it
    runs on ``device`` (:data:`DRAFT_FORMAT_DEVICES`)."""
    if torch.device(device).type not in DRAFT_FORMAT_DEVICES.get(fmt, ()):
        return False
    if fmt == "int8":
        return ("fbgemm" in torch.backends.quantized.supported_engines
                and hasattr(torch.ops.quantized, "linear_dynamic"))
    if fmt == "int4":
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    if fmt == "w4a8":
        from selfspec.executor.w4a8 import w4a8_available

        return w4a8_available()
    if fmt in GGUF_DRAFT_TYPES:
        from selfspec.executor.gguf_rows import gguf_rows_available

        return gguf_rows_available()
    return False


@dataclass(frozen=True)
class FormatTiming:
    """The outcome of :func:`fastest_format`.

    Attributes:
        fastest: the chosen format.
        ms: format → milliseconds of one pass of one-row products over the sampled weights
            (best of the passes); empty when only one format had a kernel (nothing timed).
    """

    fastest: str
    ms: dict[str, float] = field(default_factory=dict)


def fastest_format(weights: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
                   dtype: torch.dtype, passes: int = 5,
                   device: torch.device | str = "cpu") -> FormatTiming:
    """The draft weight format whose one-row products over ``weights`` run fastest here.

    Which kernel wins depends on the CPU: on AVX2 without native bf16, FBGEMM's W8A8 int8
    beats torch's int4 kernel; on an AVX-512/AMX CPU int4 wins (``qspec`` speedups in the
    executor-profile results). So it is measured: each available format quantizes
    ``weights`` (a sample of the model's layers) and times one-row products over all of
    them.

    Args:
        weights: ``(weight [N, K], bias [N] or None)`` pairs of the linears to time.
        dtype: the activations' dtype (the model's).
        passes: timed passes per format (the best counts), after one warm-up pass.
        device: where the model runs: only formats whose kernel runs there compete.

    Raises:
        InvalidArgumentError: no format has a kernel in this torch build or on ``device``.
    """
    formats = draft_formats_on(device, AUTO_DRAFT_FORMATS)
    if not formats and torch.device(device).type != "cpu":
        raise InvalidArgumentError(
            f"no quantized draft format runs on {torch.device(device).type} (int8, int4 and "
            "w4a8 are CPU kernels); draft on the model's own weights (drop draft_weights, or "
            "use ngram / layerskip / auto)")
    if not formats:
        raise InvalidArgumentError(
            "this torch build has neither an int8 (FBGEMM) nor an int4 CPU kernel for "
            "quantized draft weights; draft on the model's own weights")
    if len(formats) == 1:
        return FormatTiming(formats[0])
    inputs = [torch.randn(1, w.shape[1]).to(dtype) for w, _ in weights]
    ms: dict[str, float] = {}
    for fmt in formats:
        copies = [quantize_linear(w, b, fmt) for w, b in weights]
        best = float("inf")
        for index in range(passes + 1):
            start = time.perf_counter()
            for copy, x in zip(copies, inputs):
                copy(x)
            if index:  # the first pass warms up
                best = min(best, time.perf_counter() - start)
        ms[fmt] = best * 1e3
    return FormatTiming(min(ms, key=ms.__getitem__), ms)


def check_draft_weights(fmt: object, device: torch.device | str = "cpu") -> str:
    """Validate a draft weight format for a model on ``device``.

    Raises:
        InvalidArgumentError: not one of :data:`DRAFT_WEIGHT_FORMATS`, its kernel is not in
            this torch build, or it does not run on ``device`` (every format is CPU-only).
    """
    if fmt not in DRAFT_WEIGHT_FORMATS:
        raise InvalidArgumentError(
            f"draft weights must be one of {', '.join(DRAFT_WEIGHT_FORMATS)}, got {fmt!r}")
    if torch.device(device).type not in DRAFT_FORMAT_DEVICES.get(str(fmt), ()):
        raise InvalidArgumentError(
            f"{fmt} draft weights run on the CPU only; the model is on {torch.device(device)}: "
            "draft on the model's own weights (drop draft_weights)")
    if not quantized_kernels_available(str(fmt)):
        raise InvalidArgumentError(
            f"this torch build has no {fmt} kernel (int8 needs FBGEMM, in x86 CPU wheels; "
            "q3_k/q2_k the GGUF rows kernel: x86 with AVX2/FMA/F16C and a C++ compiler); "
            "choose another --draft-weights format")
    return str(fmt)


class Int8DynamicLinear:
    """``y ≈ x Wᵀ + b`` with int8 weights and per-call int8 activations (FBGEMM).

    Args:
        weight: ``[N, K]`` float weight (any float dtype).
        bias: ``[N]`` or ``None``.

    Calls take ``[..., K]`` in any float dtype and return ``[..., N]`` in it.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
        with warnings.catch_warnings():
            # Quantized tensors are deprecated as a user API, not FBGEMM's packed linear,
            # which takes one to build its packed weight.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w, scale,
                                                 torch.zeros_like(scale, dtype=torch.long),
                                                 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(
            qweight, None if bias is None else bias.detach().float())
        self.out_features = w.shape[0]
        # One byte a weight and an fp32 scale a row (FBGEMM's packed weight is opaque).
        self._decode_bytes = w.numel() + 4 * w.shape[0] + (0 if bias is None
                                                            else 4 * bias.numel())

    @property
    def decode_bytes(self) -> int:
        """Bytes of weight one call reads."""
        return self._decode_bytes

    def __call__(self, x: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        out = torch.ops.quantized.linear_dynamic(flat, self.packed, True)
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


class Int4Linear:
    """``y ≈ x Wᵀ + b`` with group-wise asymmetric int4 weights (torch's CPU int4 kernel).

    Args:
        weight: ``[N, K]`` float weight; ``K`` must be a multiple of ``group``.
        bias: ``[N]`` or ``None``.
        group: inputs per scale/offset pair.

    Raises:
        InvalidArgumentError: ``K`` is not a multiple of ``group``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 group: int = INT4_GROUP) -> None:
        w = weight.detach().float()
        n, k = w.shape
        if k % group:
            raise InvalidArgumentError(
                f"int4 weights need the input size ({k}) to be a multiple of the group ({group})")
        codes, scale, zero = quantize_int4(w, group)
        # The kernel computes (q - 8) * scale + zero_point with zero_point = min + 8 * scale.
        self.scales_zeros = torch.stack([scale, zero + 8 * scale], dim=-1).transpose(0, 1) \
            .contiguous().to(torch.bfloat16)                                    # [K/g, N, 2]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self.group = group
        self.bias = None if bias is None else bias.detach()
        self.out_features = n
        self.in_features = k

    @property
    def nbytes(self) -> int:
        """Bytes one product reads: packed codes, scales and offsets, bias."""
        parts = [self.packed, self.scales_zeros] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    @property
    def decode_bytes(self) -> int:
        """Bytes of weight one call reads (:attr:`nbytes`)."""
        return self.nbytes

    def __call__(self, x: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group,
                                                        self.scales_zeros)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor]:
    """Asymmetric min/max int4 quantization per group of ``group`` inputs.

    Args:
        weight: ``[N, K]`` float.

    Returns:
        ``(codes [N, K] int32 in [0, 15], scale [N, K/group], minimum [N, K/group])``, with
        ``weight ≈ codes * scale + minimum`` (error at most ``scale / 2`` per entry).
    """
    n, k = weight.shape
    grouped = weight.reshape(n, k // group, group)
    low = grouped.amin(dim=-1)
    scale = ((grouped.amax(dim=-1) - low) / 15).clamp(min=1e-8)
    codes = ((grouped - low[..., None]) / scale[..., None]).round().clamp(0, 15)
    return codes.reshape(n, k).to(torch.int32), scale, low


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The float weight ``[N, K]`` that :func:`quantize_int4`'s output stands for."""
    n, k = codes.shape
    groups = scale.shape[1]
    return (codes.reshape(n, groups, -1).float() * scale[..., None] + low[..., None]).reshape(n, k)


def gguf_draft_linear(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str):
    """``weight`` (``[N, K]``) as a GGUF matrix of ``fmt``'s block type (``q3_k``: Q3_K,
    ``q2_k``: Q2_K), callable as the draft views call their matrices.

    Raises:
        InvalidArgumentError: ``K`` is not a multiple of 256.
        RuntimeError: the GGUF rows kernel is not available here.
    """
    import gguf

    from selfspec.executor.gguf_quantize import quantize_blocks
    from selfspec.executor.gguf_rows import GgufDraftLinear, GgufSegment

    k = weight.shape[-1]
    if weight.dim() != 2 or k % GGUF_DRAFT_BLOCK:
        raise InvalidArgumentError(
            f"{fmt} draft weights need every input size to be a multiple of "
            f"{GGUF_DRAFT_BLOCK} (GGUF K-quant blocks); this model has a linear of input size "
            f"{k}: choose int8, int4 or w4a8")
    qtype = gguf.GGMLQuantizationType[GGUF_DRAFT_TYPES[fmt]]
    return GgufDraftLinear([GgufSegment(qtype, quantize_blocks(weight, qtype))], k, bias)


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None,
                    fmt: str) -> Int8DynamicLinear | Int4Linear | W4A8Linear:
    """A quantized copy of one linear layer in ``fmt`` (:data:`DRAFT_WEIGHT_FORMATS`).

    Raises:
        InvalidArgumentError: an unknown format, int4 on an input size not a multiple of
            the group, or q3_k/q2_k on one not a multiple of 256.
    """
    if fmt in GGUF_DRAFT_TYPES:
        return gguf_draft_linear(weight, bias, fmt)
    if fmt == "int8":
        return Int8DynamicLinear(weight, bias)
    if fmt == "int4":
        return Int4Linear(weight, bias)
    if fmt == "w4a8":
        from selfspec.executor.w4a8 import W4A8Linear

        return W4A8Linear(weight, bias)
    raise InvalidArgumentError(f"unknown weight format {fmt!r}")
