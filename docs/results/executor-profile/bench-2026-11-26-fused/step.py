"""Time a w4a8 decode step and a 5-token verification block on a real model."""
import sys, time, torch
from selfspec.api import load
torch.set_num_threads(2)
name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b-instruct"
dtype = sys.argv[2] if len(sys.argv) > 2 else "w4a8"
ss = load(name, dtype=dtype)
if len(sys.argv) > 3: ss.executor._fused = [None]
print("fused:", ss.executor.fused_layers() and ss.executor.fused_layers().kernel)
ex = ss.executor if hasattr(ss, "executor") else ss._executor
ids = torch.arange(100, 400).unsqueeze(0)
def run(n_steps, verify):
    cache = ex.new_cache(capacity=1024)
    ex.forward(ids, torch.arange(300).unsqueeze(0), cache, last_only=True)
    pos = 300
    ts = []
    for _ in range(n_steps):
        T = 5 if verify else 1
        t0 = time.perf_counter()
        ex.forward(torch.full((1, T), 7), torch.arange(pos, pos + T).unsqueeze(0), cache)
        ts.append(time.perf_counter() - t0)
        pos += T
    return sorted(ts)
for rep in range(2):
    d = run(20, False); v = run(8, True)
    print(f"decode median {d[len(d)//2]*1e3:.1f} ms min {d[0]*1e3:.1f} | verify5 median {v[len(v)//2]*1e3:.1f} min {v[0]*1e3:.1f}", flush=True)
