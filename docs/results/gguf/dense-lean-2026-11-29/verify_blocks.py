# Per-matrix cost of GgufMatrix products at M rows (Qwen2.5-Coder-1.5B layer 0 and lm_head, 2 threads):
# python docs/results/gguf/dense-lean-2026-11-29/verify_blocks.py
# per-matrix cost of GgufMatrix at M rows, Qwen2.5-Coder-1.5B's layer 0 and lm_head
import time, torch, statistics
from selfspec.api import load
torch.set_num_threads(2)
eng = load("qwen2.5-coder-1.5b-instruct", dtype="gguf", show_progress=False)
ex = eng.executor
w = ex.layer_weights[0]
mats = {"qkv": w.qkv, "o": w.o, "gate_up": w.gate_up, "down": w.down, "lm_head": ex.output_weights}
for name, lin in mats.items():
    K = lin.weight.shape[1]
    row = []
    for M in (1, 2, 4, 8, 16):
        x = torch.randn(M, K, dtype=torch.bfloat16)
        for _ in range(3): lin(x)
        ts = []
        for _ in range(7 if name != "lm_head" else 5):
            t = time.perf_counter(); lin(x); ts.append(time.perf_counter() - t)
        row.append(statistics.median(ts) * 1e3)
    types = [s.type for s in lin.rows_weight.segments] if hasattr(lin.rows_weight, 'segments') else '?'
    print(f"{name:8s} {tuple(lin.weight.shape)} {types}: " + "  ".join(f"M={M}: {t:.2f} ms ({t/row[0]:.2f}x)" for M, t in zip((1,2,4,8,16), row)))
