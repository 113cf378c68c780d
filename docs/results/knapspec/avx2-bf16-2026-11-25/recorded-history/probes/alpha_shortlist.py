"""Where one KnapSpec re-optimisation's time goes (SmolLM2 bf16, recorded history)."""
import time, torch
import selfspec
from selfspec.decoding.knapspec import step as K
from selfspec.decoding.planning import knapsack as KS
from selfspec.decoding.knapspec.step import KnapSpecConfig, KnapSpecStep
from selfspec.decoding.core.state import DecodeOptions, DecodeState
from selfspec.decoding.core import loop
from selfspec.executor.cost_model import cached_latency

torch.set_num_threads(2)
m = selfspec.load("smollm2-135m-instruct", "bf16", show_progress=False)
ex = m.executor
from pathlib import Path; lat = cached_latency(ex, Path.home() / ".cache/selfspec")
T = {}
def timed(name, fn):
    def w(*a, **k):
        t0 = time.perf_counter(); r = fn(*a, **k); T.setdefault(name, []).append((time.perf_counter() - t0) * 1e3); return r
    return w
K.knapsack_candidates = timed("dp", K.knapsack_candidates)
KnapSpecStep._alphas = timed("alphas", KnapSpecStep._alphas)
K.ResidualRecorder.history = timed("history", K.ResidualRecorder.history)
K.choose_plan = timed("choose", K.choose_plan)
KnapSpecStep._reoptimize = timed("reopt", KnapSpecStep._reoptimize)
prompt = m.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n" * 3)
for rep in range(2):
    step = KnapSpecStep(ex, lat, KnapSpecConfig(plan_budget=1e9, reoptimize_every=16, max_backoff=1))
    st = DecodeState(ex, prompt, DecodeOptions(max_new_tokens=80))
    with torch.inference_mode():
        loop.run(st, step)
    for r in step.history:
        print(r.step, r.history_tokens, r.bin_width, r.recorded, f"{r.ms:.0f} ms predicted {r.predicted_ms:.0f}", r.candidates)
print({k: [round(x) for x in v] for k, v in T.items()})
# exact vs shortlist alpha on the same candidates
import dataclasses
for k in (0, 8, 16, 32, 64):
    step = KnapSpecStep(ex, lat, KnapSpecConfig(plan_budget=1e9, reoptimize_every=16, max_backoff=1, alpha_vocab=k))
    st = DecodeState(ex, prompt, DecodeOptions(max_new_tokens=40))
    T.clear()
    with torch.inference_mode():
        loop.run(st, step)
    print(k, [round(a, 2) for a in step.last_alphas], [round(x) for x in T["alphas"]])
