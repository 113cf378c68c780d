"""Streaming bench: Qwen2.5-1.5B's 28 layers + lm_head as distinct w4a8 copies (965 MB, far
beyond the 32 MB L3), one decode row through all of them, as decoding reads them."""
import copy, ctypes, sys, time, torch
from selfspec.executor import native, w4a8
torch.set_num_threads(2)
shapes = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]
g = torch.Generator().manual_seed(0)
base = [w4a8.W4A8Linear(torch.randn(*s, generator=g) * 0.02, None) for s in shapes]
head = w4a8.W4A8Linear(torch.randn(151936, 1536, generator=g) * 0.02, None)
def clone(lin):
    c = copy.copy(lin)
    c.codes, c.scale, c.low = lin.codes.clone(), lin.scale.clone(), lin.low.clone()
    c.codes_ptr, c.scale_ptr, c.low_ptr = c.codes.data_ptr(), c.scale.data_ptr(), c.low.data_ptr()
    return c
lins = [clone(b) for _ in range(28) for b in base] + [head]
nbytes = sum(l.nbytes for l in lins)
xs = {k: torch.randn(1, k).bfloat16() for k in (1536, 8960)}
def variant(flags):
    path = native.build(w4a8.SOURCE, ("-mf16c", *flags))
    lib = ctypes.CDLL(str(path))
    fn = lib.selfspec_w4a8_rows
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4
    return fn
variants = {name: variant(flags) for name, flags in
            [(a, a.split()) if a else ("default", []) for a in (sys.argv[1:] or [""])]}
res = {k: [] for k in variants}
for rnd in range(5):
    for name, fn in variants.items():
        t0 = time.perf_counter()
        for l in lins:
            w4a8._call(fn, xs[l.in_features], l)
        res[name].append(time.perf_counter() - t0)
for name, v in res.items():
    best = min(v)
    print(f"{name:40s} token {best*1e3:.1f} ms  (median {sorted(v)[2]*1e3:.1f})  {nbytes/best/1e9:.1f} GB/s")
