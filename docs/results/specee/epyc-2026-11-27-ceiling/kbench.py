"""bf16 rows kernel: one product over T rows, on matrices shaped as the 0.5B model's, cycling
through enough copies that the weights come from memory (as in decoding)."""
import time, torch, statistics, sys
from selfspec.executor import bf16_rows as br
torch.set_num_threads(2)
fn = br._library().call
shapes = {"gate_up [9728, 896]": (9728, 896), "down [896, 4864]": (896, 4864), "lm_head [151936, 896]": (151936, 896)}
for name, (n, k) in shapes.items():
    copies = max(2, int(600e6 // (n * k * 2)))
    ws = [br._weight(torch.randn(n, k).bfloat16(), None) for _ in range(copies)]
    base = None
    for T in (1, 2, 3, 4, 5, 6, 8):
        x = torch.randn(1, T, k).bfloat16()
        ts = []
        for rep in range(3):
            t = time.perf_counter()
            for w in ws: br._product(fn, x, w)
            ts.append((time.perf_counter() - t) / len(ws))
        ms = min(ts) * 1e3
        base = base or ms
        print(f"{name} T={T}: {ms:.3f} ms ({ms/base:.2f}x of T=1; GB/s {n*k*2/ms/1e6:.1f})", flush=True)
