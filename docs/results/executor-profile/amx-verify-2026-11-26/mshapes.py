"""Packed bf16 products of 28 distinct copies of Qwen2.5-1.5B's gate_up and down (more than the L3 holds) at M rows: GB/s by row count."""
import time, torch
from selfspec.executor.linear import _packed, _reorder
import torch.nn.functional as F
torch.set_num_threads(2)
H, I = 1536, 8960
for name, (n, k) in {"gate_up": (2 * I, H), "down": (H, I)}.items():
    ws = [torch.randn(n, k).bfloat16() for _ in range(28)]
    ps = [_reorder(w) for w in ws]
    for M in (1, 2, 4, 8, 13, 16, 24):
        x = torch.randn(M, k).bfloat16()
        for label, f in (("packed", lambda p, w: _packed(x, p, None)), ("F.linear", lambda p, w: F.linear(x, w))):
            if label == "F.linear" and M not in (1, 2, 13): continue
            ts = []
            for rep in range(5):
                t0 = time.perf_counter()
                for p, w in zip(ps, ws): f(p, w)
                ts.append(time.perf_counter() - t0)
            t = sorted(ts)[2] * 1e3
            print(f"{name} M={M:2d} {label:8s} {t:6.1f} ms / 28 = {t/28:.2f} ms, {28*n*k*2/t/1e6:.1f} GB/s")
