"""A simple reference quantizer into GGUF's block formats, for tests, benchmarks and tiny test
models (:func:`quantize_blocks`).

gguf-py's :func:`gguf.quants.quantize` covers the 32-input formats (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0) and the float ones, and raises ``NotImplementedError`` for the K-quants; those are
written here in numpy. They are not llama.cpp's quantizers (no search for the best scales, no
importance weights): plain min/max (Q4_K, Q5_K) or signed absmax (Q6_K: the
largest magnitude at the most negative code, so scales of both signs) scales per sub-block;
for the 2- and 3-bit formats (Q2_K, Q3_K: ``qspec``'s low-bit drafts) those ranges are then
refined by a few rounds of least squares (:func:`_fit_affine`, :func:`_fit_signed`); the
sub-block scales quantized to 4, 6 or 8 bits against the block's fp16
super-scales, then the codes
rounded against those stored scales. The blocks are valid, and
:func:`gguf.quants.dequantize` gives back the input to about half a code step, which is all
that checks of :mod:`selfspec.executor.gguf_rows` need.

Layouts (ggml-common.h), per 256 inputs:

* Q4_K (144 bytes): fp16 ``d``, fp16 ``dmin``, 12 bytes of 6-bit scales and minima of the 8
  sub-blocks of 32, 128 bytes of codes (per 64 inputs: 32 bytes, low nibbles the first 32
  inputs, high nibbles the next 32); ``w = d * sc * q - dmin * m``.
* Q5_K (176 bytes): as Q4_K, with ``qh[32]`` before the codes: bit ``2c`` (``2c + 1``) of
  ``qh[l]`` is the fifth bit of input ``64c + l`` (``64c + 32 + l``).
* Q6_K (210 bytes): ``ql[128]``, ``qh[64]``, int8 ``scales[16]`` (per 16 inputs), fp16 ``d``;
  ``w = d * sc * (u - 32)`` with 6-bit ``u``.
* Q2_K (84 bytes): ``scales[16]`` (per 16 inputs: scale in the low nibble, minimum in the high
  one), 64 bytes of 2-bit codes (input ``128h + 32j + l`` in bits ``2j, 2j + 1`` of byte
  ``32h + l``), fp16 ``d``, ``dmin``; ``w = d * sc * q - dmin * m``.
* Q3_K (110 bytes): ``hmask[32]`` (bit ``4h + j`` of byte ``l``: input ``128h + 32j + l``'s
  third bit), 64 bytes of 2-bit codes as Q2_K's, 12 bytes of 6-bit scales stored ``+ 32``,
  fp16 ``d``; ``w = d * (sc - 32) * (u - 4)``.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from selfspec.errors import UnsupportedGgufTypeError

_T = gguf.GGMLQuantizationType
QK_K = 256
_CHUNK = 512  # super-blocks quantized at a time


def quantize_blocks(weight: torch.Tensor | np.ndarray, qtype: gguf.GGMLQuantizationType
                    ) -> torch.Tensor:
    """``weight`` ``[N, K]`` as rows of ``qtype``'s blocks.

    Args:
        weight: ``[N, K]`` float; ``K`` a multiple of ``qtype``'s block size.
        qtype: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (gguf-py's quantizer), Q2_K, Q3_K,
            Q4_K, Q5_K or Q6_K (this module's).

    Returns:
        ``[N, K / block_size * type_size]`` uint8: each row the blocks of one weight row.

    Raises:
        UnsupportedGgufTypeError: another type.
        InvalidArgumentError: ``weight`` is not 2-D or ``K`` is not a multiple of the block.
    """
    from selfspec.errors import InvalidArgumentError

    w = weight.detach().float().numpy() if isinstance(weight, torch.Tensor) else np.asarray(
        weight, dtype=np.float32)
    if w.ndim != 2:
        raise InvalidArgumentError(f"quantize_blocks needs a 2-D weight, not shape {w.shape}")
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n, k = w.shape
    if k % block:
        raise InvalidArgumentError(
            f"{qtype.name} needs the input size ({k}) to be a multiple of {block}")
    if qtype in _OWN:
        # In chunks of _CHUNK blocks: temporaries that stay in cache (a 1.5B model's lm_head
        # at once would hold several GB of them; chunks are faster too).
        flat = w.reshape(-1, QK_K)
        blocks = np.concatenate([_OWN[qtype](flat[i:i + _CHUNK])
                                 for i in range(0, len(flat), _CHUNK)] or
                                [np.zeros((0, size), dtype=np.uint8)])
    elif qtype in _GGUF_PY:
        blocks = np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8)
    else:
        supported = ", ".join(t.name for t in (*_GGUF_PY, *_OWN))
        raise UnsupportedGgufTypeError(
            f"no reference quantizer for {qtype.name} (there are: {supported})")
    return torch.from_numpy(np.ascontiguousarray(blocks).reshape(n, k // block * size))


def _fp16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16)


def _round(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(a), lo, hi).astype(np.int32)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a / b`` with 0 where ``b`` is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit scales and minima ``[B, 8]`` → ggml's 12 bytes ``[B, 12]`` (get_scale_min_k4's
    inverse)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _k_scales(x: np.ndarray, levels: int):
    """Min/max sub-block scales for Q4_K/Q5_K: ``(d16, dmin16, sc, m, q)`` for ``x`` ``[B, 256]``;
    ``q`` in ``[0, levels]``, rounded against the stored (fp16, 6-bit) scales."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)            # minima stored as -dmin * m, m >= 0
    scale = (sub.max(axis=-1) - low) / levels
    d16 = _fp16(scale.max(axis=-1) / 63)
    dmin16 = _fp16(-low.min(axis=-1) / 63)
    d, dmin = d16.astype(np.float32), dmin16.astype(np.float32)
    sc = _round(_div(scale, d[:, None]), 0, 63)
    m = _round(_div(-low, dmin[:, None]), 0, 63)
    step = d[:, None] * sc
    q = _round(_div(sub + (dmin[:, None] * m)[..., None], step[..., None]), 0, levels)
    return d16, dmin16, sc, m, q.reshape(-1, QK_K)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Codes ``[B, 256]`` (low 4 bits) → 128 bytes: per 64 inputs, input ``l`` low, ``32 + l``
    high."""
    c = (q & 0xF).reshape(-1, 4, 2, 32)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).astype(np.uint8).reshape(-1, 128)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _k_scales(x, 15)
    return np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8),
                           _pack_scales(sc, m), _nibbles(q)], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _k_scales(x, 31)
    high = (q >> 4).reshape(-1, 4, 2, 32)              # [B, chunk c, half, l]
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :])[None, :, :, None]
    qh = (high << shifts).sum(axis=(1, 2)).astype(np.uint8)
    return np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8),
                           _pack_scales(sc, m), qh, _nibbles(q)], axis=1)


def _signed_max(sub: np.ndarray) -> np.ndarray:
    """Per sub-block ``[..., n]``: the entry of largest magnitude, with its sign."""
    return np.take_along_axis(sub, np.abs(sub).argmax(axis=-1)[..., None], -1)[..., 0]


def _q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    # As llama.cpp: the largest magnitude maps to code -32 (its one extra level), so a scale
    # is negative where that entry is positive.
    scale = -_signed_max(sub) / 32
    d16 = _fp16(np.abs(scale).max(axis=-1) / 127)
    d = d16.astype(np.float32)
    sc = _round(_div(scale, d[:, None]), -128, 127)
    step = d[:, None] * sc
    u = (_round(_div(sub, step[..., None]), -32, 31) + 32).reshape(-1, 2, 4, 32)  # [B, h, k, l]
    ql = np.concatenate([(u[:, :, 0] & 0xF) | ((u[:, :, 2] & 0xF) << 4),
                         (u[:, :, 1] & 0xF) | ((u[:, :, 3] & 0xF) << 4)], axis=2)
    hi = u >> 4
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return np.concatenate([ql.astype(np.uint8).reshape(-1, 128),
                           qh.astype(np.uint8).reshape(-1, 64),
                           sc.astype(np.int8).view(np.uint8), d16[:, None].view(np.uint8)], axis=1)


def _two_bits(q: np.ndarray) -> np.ndarray:
    """Codes ``[B, 256]`` (low 2 bits) → 64 bytes: per 128 inputs ``h``, input
    ``128h + 32j + l`` in bits ``2j, 2j + 1`` of byte ``32h + l``."""
    c = (q & 3).reshape(-1, 2, 4, 32)
    shifts = (2 * np.arange(4))[None, None, :, None]
    return (c << shifts).sum(axis=2).astype(np.uint8).reshape(-1, 64)


def _fit_affine(sub: np.ndarray, levels: int, iters: int = 2,
                shrinks: tuple[float, ...] = (1.0, 0.8)):
    """Per sub-block ``(scale >= 0, low <= 0)`` with ``sub ≈ scale * q + low``, ``q`` in
    ``[0, levels]``: from the min/max range shrunk by each of ``shrinks``, alternately rounding
    the codes and refitting scale and low by least squares, the pair of least squared error
    kept (a coarse form of llama.cpp's ``make_qkx`` search; at 2 bits the min/max grid wastes
    its outer levels on rare extremes: 20% less RMSE on Gaussian weights; more shrinks and
    rounds gain 1% more at 3x the time)."""
    lo0, hi0 = np.minimum(sub.min(axis=-1), 0), sub.max(axis=-1)
    mid = 0.5 * (hi0 + lo0)
    best_err = np.full(lo0.shape, np.inf, dtype=np.float32)
    best_scale, best_low = (hi0 - lo0) / levels, lo0
    n = sub.shape[-1]
    sx = sub.sum(axis=-1)
    for f in shrinks:
        low = np.minimum(mid - f * (mid - lo0), 0)
        scale = (mid + f * (hi0 - mid) - low) / levels
        for it in range(iters + 1):
            q = np.clip(np.rint(_div(sub - low[..., None], scale[..., None])), 0, levels)
            err = ((scale[..., None] * q + low[..., None] - sub) ** 2).sum(axis=-1)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_scale = np.where(better, scale, best_scale)
            best_low = np.where(better, low, best_low)
            if it == iters:
                break
            sq, sqq, sxq = q.sum(axis=-1), (q * q).sum(axis=-1), (sub * q).sum(axis=-1)
            det = n * sqq - sq * sq
            s2, l2 = _div(n * sxq - sq * sx, det), _div(sqq * sx - sq * sxq, det)
            pos = l2 > 0                       # low must stay <= 0: refit the scale alone
            s2, l2 = np.where(pos, _div(sxq, sqq), s2), np.where(pos, 0, l2)
            ok = (det > 0) & (s2 > 0)
            scale, low = np.where(ok, s2, scale), np.where(ok, l2, low)
    return best_scale, best_low


def _fit_signed(sub: np.ndarray, low_code: int, high_code: int, iters: int = 2,
                divisors: tuple[float, ...] = (1.1, 1.0)):
    """Per sub-block a signed scale with ``sub ≈ scale * q``, ``q`` in ``[low_code,
    high_code]``: the largest magnitude at ``low_code`` times each of ``divisors`` (1.1: the
    extreme clipped a little), codes rounded and the scale refit by least squares alternately,
    the least squared error kept (7% less RMSE than absmax on Gaussian weights)."""
    smax = _signed_max(sub)
    best_err = np.full(smax.shape, np.inf, dtype=np.float32)
    best = smax / low_code
    for f in divisors:
        scale = smax / (low_code * f)
        for it in range(iters + 1):
            q = np.clip(np.rint(_div(sub, scale[..., None])), low_code, high_code)
            err = ((scale[..., None] * q - sub) ** 2).sum(axis=-1)
            better = err < best_err
            best_err, best = np.where(better, err, best_err), np.where(better, scale, best)
            if it == iters:
                break
            refit = _div((sub * q).sum(axis=-1), (q * q).sum(axis=-1))
            scale = np.where(refit != 0, refit, scale)
    return best


def _q2_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale, low = _fit_affine(sub, 3)
    d16 = _fp16(scale.max(axis=-1) / 15)
    dmin16 = _fp16(-low.min(axis=-1) / 15)
    d, dmin = d16.astype(np.float32), dmin16.astype(np.float32)
    sc = _round(_div(scale, d[:, None]), 0, 15)
    m = _round(_div(-low, dmin[:, None]), 0, 15)
    step = d[:, None] * sc
    q = _round(_div(sub + (dmin[:, None] * m)[..., None], step[..., None]), 0, 3).reshape(-1, QK_K)
    return np.concatenate([(sc | (m << 4)).astype(np.uint8), _two_bits(q),
                           d16[:, None].view(np.uint8), dmin16[:, None].view(np.uint8)], axis=1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale = _fit_signed(sub, -4, 3)                # the largest magnitude near code -4
    d16 = _fp16(np.abs(scale).max(axis=-1) / 31)
    d = d16.astype(np.float32)
    sc = _round(_div(scale, d[:, None]), -31, 31)
    step = d[:, None] * sc
    u = (_round(_div(sub, step[..., None]), -4, 3) + 4).reshape(-1, QK_K)   # 0..7
    third = (u >> 2).reshape(-1, 2, 4, 32)                                   # [B, h, j, l]
    shifts = (4 * np.arange(2)[:, None] + np.arange(4)[None, :])[None, :, :, None]
    hmask = (third << shifts).sum(axis=(1, 2)).astype(np.uint8)
    stored = sc + 32                                                         # 6 bits
    lo, hi = stored & 0xF, stored >> 4
    scales = np.concatenate([lo[:, :8] | (lo[:, 8:] << 4),
                             hi[:, 0:4] | (hi[:, 4:8] << 2) | (hi[:, 8:12] << 4)
                             | (hi[:, 12:16] << 6)], axis=1).astype(np.uint8)
    return np.concatenate([hmask, _two_bits(u), scales, d16[:, None].view(np.uint8)], axis=1)


_GGUF_PY = (_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0)
_OWN = {_T.Q2_K: _q2_k, _T.Q3_K: _q3_k, _T.Q4_K: _q4_k, _T.Q5_K: _q5_k, _T.Q6_K: _q6_k}
