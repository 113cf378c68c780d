"""Per-matrix cost of a call of M activation rows on Qwen2.5-Coder-1.5B's GGUF blocks (layer 0
and lm_head), the AVX-512 VNNI build against the AMX build, on the same bytes; and each AMX
row of a 16-row call equal to the row alone. One process, 2 threads, medians of 7 calls.

    python docs/results/gguf/amx-2026-11-29/verify_blocks.py
"""
import statistics
import time

import torch

from selfspec.api import load
from selfspec.executor.gguf_rows import GgufMatrix

torch.set_num_threads(2)
eng = load("qwen2.5-coder-1.5b-instruct", dtype="gguf", show_progress=False)
ex = eng.executor
w = ex.layer_weights[0]
mats = {"qkv": w.qkv, "o": w.o, "gate_up": w.gate_up, "down": w.down, "lm_head": ex.output_weights}
ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
print("# ms per call (x: against M = 1 of the same build); prefill: ms per row of a 256-row call")
for name, lin in mats.items():
    src = lin.rows_weight
    K = src.in_features
    for isa in ("avx512", "amx"):
        mat = GgufMatrix(src.segments, K, src.bias, isa)
        row = []
        for M in ROWS + (256,):
            x = torch.randn(M, K, dtype=torch.bfloat16)
            for _ in range(2):
                mat(x)
            ts = []
            for _ in range(7 if M <= 16 else 3):
                t = time.perf_counter()
                mat(x)
                ts.append(time.perf_counter() - t)
            row.append(statistics.median(ts) * 1e3)
        types = ",".join(t.name for t in src.types)
        cells = "  ".join(f"M={M}: {t:.2f} ({t / row[0]:.2f}x)" for M, t in zip(ROWS, row))
        print(f"{name:8s} {isa:6s} [{types}] {cells}  prefill {row[-1] / 256:.3f} ms/row")
        if isa == "amx":
            x = torch.randn(16, K, dtype=torch.bfloat16)
            together = mat(x)
            assert all(torch.equal(together[i:i + 1], mat(x[i:i + 1])) for i in range(16)), name
