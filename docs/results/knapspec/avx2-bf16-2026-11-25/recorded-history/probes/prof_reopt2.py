"""Predicted vs measured cost of KnapSpec's re-optimisation parts (default config)."""
import sys, time, torch
from pathlib import Path
import selfspec
from selfspec.decoding.knapspec import step as K
from selfspec.decoding.knapspec.step import KnapSpecConfig, KnapSpecStep
from selfspec.decoding.core.state import DecodeOptions, DecodeState
from selfspec.decoding.core import loop
from selfspec.executor.cost_model import cached_latency
torch.set_num_threads(2)
name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"
m = selfspec.load(name, "bf16", show_progress=False)
ex = m.executor
lat = cached_latency(ex, Path.home() / ".cache/selfspec")
T = {}
def timed(key, fn):
    def w(*a, **k):
        t0 = time.perf_counter(); r = fn(*a, **k); T.setdefault(key, []).append((time.perf_counter() - t0) * 1e3); return r
    return w
K.knapsack_candidates = timed("dp", K.knapsack_candidates)
KnapSpecStep._alphas = timed("alphas", KnapSpecStep._alphas)
prompt = m.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n" * 3)
for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
    step = KnapSpecStep(ex, lat, KnapSpecConfig())
    st = DecodeState(ex, prompt, DecodeOptions(max_new_tokens=96))
    with torch.inference_mode():
        loop.run(st, step)
    for r in step.history:
        print(r.step, "r", r.history_tokens, "bin", r.bin_width, "rec", r.recorded, f"{r.ms:.0f} ms predicted {r.predicted_ms:.0f}", r.candidates, r.weights)
print({k: [round(x) for x in v] for k, v in T.items()})
