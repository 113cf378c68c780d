"""Qwen2.5-1.5B full forwards of T tokens (after a HumanEval prompt) with inconsistent row counts split (before ab369f3) vs padded, 3 alternating rounds."""
import time, torch, selfspec
from selfspec.data.prompts import load_prompts
from selfspec.executor.row_consistency import PackedRowLimits, RowSizes
torch.set_num_threads(2)
eng = selfspec.load("qwen2.5-coder-1.5b-instruct", "bf16")
ex = eng.executor
ids = torch.tensor([eng.encode(load_prompts("humaneval", n=1)[0].text)])
n0 = ids.shape[1]
cache = ex.new_cache(1, 512)
ex.forward(ids, torch.arange(n0)[None], cache)
probe = PackedRowLimits._probe
def old_probe(self, *a):
    s = probe(self, *a)
    first = next((r for r in range(2, len(s.call_rows)) if s.call_rows[r] != r), len(s.call_rows)) - 1
    return RowSizes(tuple(r if r <= first else 0 for r in range(len(s.call_rows))), first)
def run(T, reps=5):
    ts = []
    for _ in range(reps):
        x = torch.randint(100, 1000, (1, T))
        t0 = time.perf_counter()
        ex.forward(x, torch.arange(n0, n0 + T)[None], cache)
        ts.append(time.perf_counter() - t0)
        cache.truncate(n0)
    return sorted(ts)[reps // 2] * 1e3
res = {}
for rnd in range(3):
    for mode in ("split", "padded"):
        PackedRowLimits._probe = old_probe if mode == "split" else probe
        ex.row_limits._limits.clear(); run(2, 1)
        for T in (1, 8, 11, 12, 13, 16, 17, 20, 24):
            res.setdefault((mode, T), []).append(run(T))
for T in (1, 8, 11, 12, 13, 16, 17, 20, 24):
    print(T, " ".join(f"{m} {sorted(res[(m, T)])[1]:.1f}" for m in ("split", "padded")))
