"""Row-consistent call sizes of oneDNN's packed kernel on Qwen2.5-1.5B's shapes, and the time of
a T-row call: split at the first inconsistent size (before) vs padded to a consistent one (now)."""
import time, torch
from selfspec.executor.linear import Linear, _alone, _packed
from selfspec.executor.row_consistency import PackedRowLimits, RowSizes, in_consistent_chunks
torch.set_num_threads(2)
H, I = 1536, 8960
shapes = {"qkv": (2048, H, True), "o": (H, H, False), "gate_up": (2 * I, H, False), "down": (H, I, False), "lm_head": (151936, H, False)}
limits = PackedRowLimits(64)
lins = {}
for name, (n, k, bias) in shapes.items():
    w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    lin = Linear(w, b, row_limits=limits)
    lin(torch.randn(2, k).bfloat16())
    sizes = limits._limits[("onednn", k, n, bias, 2)]
    bad = [r for r in range(2, 65) if sizes.call_rows[r] != r]
    print(f"{name} [{n},{k}] chunk {sizes.chunk} inconsistent: {bad} -> {[sizes.call_rows[r] for r in bad]}")
    lins[name] = (lin, sizes)
def old_sizes(s):
    first = next((r for r in range(2, 65) if s.call_rows[r] != r), 65) - 1
    return RowSizes(tuple(r if r <= first else 0 for r in range(65)), first)
def t_layer(T, old):
    tot = 0
    for name in ("qkv", "o", "gate_up", "down"):
        lin, s = lins[name]
        x = torch.randn(T, lin.weight.shape[1]).bfloat16()
        sz = old_sizes(s) if old else s
        f = lambda: in_consistent_chunks(x, sz, lambda b: _packed(b, lin.packed, lin.bias), lambda r: _alone(r, lin.packed, lin.bias))
        f(); ts = []
        for _ in range(9):
            t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
        tot += sorted(ts)[4]
    return tot * 1e3 * 28
for T in (1, 2, 4, 8, 9, 11, 12, 13, 17, 20, 24):
    if T == 1:
        print(f"T={T}: 28 layers {t_layer(2, False)/1:.1f} ms (pair call)")
        continue
    print(f"T={T}: 28 layers split {t_layer(T, True):.1f} ms, padded {t_layer(T, False):.1f} ms")
