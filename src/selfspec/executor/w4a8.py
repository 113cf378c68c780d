"""Products on 4-bit weights and 8-bit activations: selfspec's AVX2 kernel
(``kernels/w4a8_rows.cpp``) for the quantized self-draft (``--draft-weights w4a8``) and for a
model that decodes on 4-bit weights (``--dtype w4a8`` / ``--decode-kernel w4a8``,
:class:`W4A8Rows`).

Scheme (llama.cpp's Q4_1 weights × Q8_0 activations): weights in blocks of 32 inputs, each
block a scale ``d = (max - min) / 15`` and its minimum, stored in fp16, and codes
``q = round((w - min) / d)`` in [0, 15]; activations quantized per call, per block of 32, to
int8 with scale ``max|x| / 127``. Products are integer dot products per block
(``vpmaddubsw``/``vpmaddwd``), scaled and summed in fp32. One pass reads 0.625 bytes a
weight. Asymmetric blocks (rather than Q4_0's symmetric ones) buy agreement: teacher-forced
top-1 agreement of the draft with Qwen2.5-Coder-1.5B in bf16 0.957 against Q4_0's 0.933–0.938
(``qspec`` acceptance 98% against 81%) and torch int4's 0.950 (the executor-profile
results).

Why: a quantized draft token costs what reading its weights costs. On AVX2 CPUs torch's int4
kernel unpacks nibbles below the memory bandwidth and FBGEMM's W8A8 reads a byte a weight;
this reads 0.625. On CPUs with AMX torch's int4 kernel may still win:
:func:`selfspec.executor.quant.fastest_format` measures all of them.

Lossy against the model (a draft may be): verification with the model's own weights decides
every token. Rows are computed independently (a row's result does not depend on the other
rows of the call), so a model decoding on this kernel verifies drafts bit-consistently with
its own one-token decoding, and every lossless method stays exact relative to it.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from selfspec.errors import InvalidArgumentError
from selfspec.executor import native

SOURCE = "w4a8_rows.cpp"
BLOCK = 32


def w4a8_available() -> bool:
    """Whether the kernel is built (or can be) and passed its probe on this machine."""
    return _library().call is not None


def w4a8_unavailable_reason() -> str:
    """Why the kernel cannot run here (``""`` when it can)."""
    return _library().reason


@cache
def _library() -> native.Kernel:
    return native.load(SOURCE, "selfspec_w4a8_rows", [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4,
                       _probe, extra_flags=("-mf16c",), cpu_flags=("f16c",))


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes per block of :data:`BLOCK` inputs (min/max, llama.cpp's Q4_1),
    in block order.

    Args:
        weight: ``[N, K]`` float, ``K`` a multiple of :data:`BLOCK`.

    Returns:
        ``(codes [N, K/2] uint8, scale [N, K/32] fp16, minimum [N, K/32] fp16)``: byte ``j``
        of block ``b`` holds the code of input ``32b + j`` in its low nibble and of
        ``32b + j + 16`` in its high one; the weight is ``code * scale + minimum``, the codes
        computed from the fp16-rounded scale and minimum (error about ``scale / 2``).
    """
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    low16 = blocks.amin(dim=-1).half()
    scale16 = ((blocks.amax(dim=-1) - low16.float()) / 15).half()
    low, scale = low16.float(), scale16.float()
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = ((blocks - low[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.reshape(n, k // 2).contiguous(), scale16.contiguous(), low16.contiguous()


def dequantize_q4(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The float weight ``[N, K]`` that :func:`quantize_q4`'s output stands for."""
    n = codes.shape[0]
    blocks = codes.reshape(n, -1, 16)
    q = torch.cat([blocks & 0xF, blocks >> 4], dim=-1).float()
    return (q * scale.float()[..., None] + low.float()[..., None]).reshape(n, -1)


def kernel_layout(codes: torch.Tensor) -> torch.Tensor:
    """:func:`quantize_q4`'s codes ``[N, K/2]`` in the kernel's order: each pair of blocks'
    32 bytes interleaved in 4-byte chunks (chunk ``g`` of block ``b + c`` at byte ``8g + 4c``;
    ``kernels/w4a8_rows.cpp``); an odd last block unchanged."""
    n = codes.shape[0]
    blocks = codes.reshape(n, -1, 16)
    pairs = blocks.shape[1] // 2
    head = blocks[:, :2 * pairs].reshape(n, pairs, 2, 4, 4).transpose(2, 3)
    return torch.cat([head.reshape(n, -1), blocks[:, 2 * pairs:].reshape(n, -1)],
                     dim=1).contiguous()


def _call(fn, x: torch.Tensor, lin: W4A8Linear) -> torch.Tensor:
    """``x`` ``[..., K]`` (bf16 or fp32; other dtypes go through fp32) → ``[..., N]``."""
    dtype = x.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    if not x.is_contiguous():
        x = x.contiguous()
    k = x.shape[-1]
    out = torch.empty((*x.shape[:-1], lin.out_features), dtype=x.dtype)
    fn(lin.codes_ptr, lin.scale_ptr, lin.low_ptr, x.data_ptr(), out.data_ptr(), lin.bias_ptr,
       x.numel() // k, k, lin.out_features, int(x.dtype == torch.bfloat16))
    return out if out.dtype == dtype else out.to(dtype)


def _probe(fn) -> str:
    """Check the kernel against the dequantized product on random data (``""`` when close)."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(37, 96, generator=gen)       # odd N, a pair of blocks and a lone one
    bias = torch.randn(37, generator=gen)
    x = torch.randn(7, 96, generator=gen)
    lin = W4A8Linear(weight, bias, _fn=fn)
    want = x @ dequantize_q4(*quantize_q4(weight)).T + bias
    got = _call(fn, x, lin)
    err = (got - want).abs().max().item()
    # int8 activations: ~1/254 of each block's largest entry per product.
    if not err < 0.05 * want.abs().max().item():
        return f"differs from the dequantized product by {err:.3g}"
    return ""


class W4A8Linear:
    """``y ≈ x Wᵀ + b`` with 4-bit weights and per-call 8-bit activations (module docstring).

    Args:
        weight: ``[N, K]`` float weight; ``K`` a multiple of 32.
        bias: ``[N]`` or ``None``.

    Calls take ``[..., K]`` in any float dtype and return ``[..., N]`` in it.

    Raises:
        InvalidArgumentError: ``K`` is not a multiple of 32.
        RuntimeError: the kernel is not available here (check :func:`w4a8_available`).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, _fn=None) -> None:
        n, k = weight.shape
        if k % BLOCK:
            raise InvalidArgumentError(
                f"w4a8 weights need the input size ({k}) to be a multiple of {BLOCK}")
        if _fn is None:
            lib = _library()
            if lib.call is None:
                raise RuntimeError(f"the w4a8 kernel is not available: {lib.reason}")
            _fn = lib.call
        self._fn = _fn
        codes, self.scale, self.low = quantize_q4(weight)
        self.codes = kernel_layout(codes)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.codes_ptr, self.scale_ptr = self.codes.data_ptr(), self.scale.data_ptr()
        self.low_ptr = self.low.data_ptr()
        self.bias_ptr = None if self.bias is None else self.bias.data_ptr()
        self.out_features, self.in_features = n, k

    @property
    def nbytes(self) -> int:
        """Bytes one product reads: codes, scales, minima, bias."""
        parts = [self.codes, self.scale, self.low] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    @property
    def decode_bytes(self) -> int:
        """Bytes of weight one call reads (:attr:`nbytes`)."""
        return self.nbytes

    def __call__(self, x: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        return _call(self._fn, x, self)


class W4A8Rows:
    """Decoding and verification products on w4a8 copies of the weights, for the non-bulk
    calls of :class:`selfspec.executor.linear.Linear` (``--decode-kernel w4a8``, also
    ``--dtype w4a8``): the model itself runs with 4-bit weights and 8-bit activations, as
    llama.cpp's Q4_1 × Q8_0 does. Lossy against the bf16 model (the bench reports greedy
    agreement and pass@1).

    No row limits are needed (unlike :class:`selfspec.executor.int4_rows.Int4Rows`): each
    row's result is independent of the call's other rows, so verification blocks equal
    one-token decoding bit for bit.

    Prefill and other bulk blocks run on it too, as in llama.cpp: its cost per row falls with
    the rows where bf16 is emulated, and a prompt's worth of rows cost less here than on
    FBGEMM's fp16 copy or casting the bf16 weight to fp32 per call (the bulk path of the
    weights' own kernel).

    Attributes:
        serves_bulk: ``True``: bulk calls take this kernel too (the same numbers).
    """

    serves_bulk = True

    def prepack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> W4A8Linear | None:
        """A w4a8 copy of ``weight`` ``[N, K]``, or ``None`` when ``K`` is not a multiple of
        32 (the weight keeps its own kernel)."""
        if weight.shape[1] % BLOCK:
            return None
        return W4A8Linear(weight, bias)

    def __call__(self, x: torch.Tensor, packed: W4A8Linear) -> torch.Tensor:
        """``[..., K]`` → ``[..., N]`` in ``x``'s dtype, each row as computed alone."""
        return packed(x)

    def bulk(self, x: torch.Tensor, packed: W4A8Linear) -> torch.Tensor:
        """The same product: bulk blocks and decoding rows agree bit for bit."""
        return packed(x)

    def decode_bytes(self, packed: W4A8Linear, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> int:
        """Bytes one call reads (:attr:`W4A8Linear.nbytes`)."""
        return packed.nbytes
