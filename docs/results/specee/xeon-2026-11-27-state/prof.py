"""Where SpecEE's predictor time goes: candidates / final norm + features / predictor MLP, per token."""
import sys, time, torch, selfspec
import selfspec.decoding.specee.step as sp
import selfspec.decoding.specee.kernel as spk  # the torch path of the per-layer decision
torch.set_num_threads(2)
model, heads = sys.argv[1], sys.argv[2]
eng = selfspec.load(model, dtype="bf16", show_progress=False)
acc = {"candidates": 0.0, "final_norm+features": 0.0, "mlp": 0.0}
calls = {k: 0 for k in acc}
def timed(name, fn):
    def w(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); acc[name] += time.perf_counter() - t; calls[name] += 1; return r
    return w
spk.candidate_features = timed("final_norm+features", spk.candidate_features)
sp.HeadCandidates.__call__ = timed("candidates", sp.HeadCandidates.__call__)
sp.DrafterCandidates.__call__ = timed("candidates", sp.DrafterCandidates.__call__)
from selfspec.heads.predictor import ExitPredictors
ExitPredictors.prob = timed("mlp", ExitPredictors.prob)
prompt = "def sort_by_length(words: list[str]) -> list[str]:\n    \"\"\"Sort words by length, then alphabetically.\"\"\"\n"
for rep in range(2):
    for k in acc: acc[k] = 0.0; calls[k] = 0
    t = time.perf_counter()
    r = eng.generate(prompt, method="specee", heads=heads, max_new_tokens=96, **({"threshold": float(sys.argv[3])} if len(sys.argv) > 3 else {}))
    wall = time.perf_counter() - t
    n = r.stats.new_tokens
    print(f"rep {rep}: {n} tokens, {wall/n*1e3:.1f} ms/token, layers {getattr(r.stats, 'mean_exit_layer', float('nan'))}")
    for k in acc: print(f"   {k}: {acc[k]/n*1e3:.2f} ms/token ({calls[k]/n:.1f} calls/token)")
