"""Where verified SpecEE's predictor time goes, per token."""
import sys, time, torch, selfspec
import selfspec.decoding.specee.step as sp
import selfspec.decoding.specee.kernel as spk  # the torch path of the per-layer decision
torch.set_num_threads(2)
model, heads, thr = sys.argv[1], sys.argv[2], float(sys.argv[3])
eng = selfspec.load(model, dtype="bf16", show_progress=False)
acc = {}
calls = {}
def timed(name, fn):
    acc[name] = 0.0; calls[name] = 0
    def w(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); acc[name] += time.perf_counter() - t; calls[name] += 1; return r
    return w
spk.candidate_features = timed("features", spk.candidate_features)
sp.DrafterCandidates.__call__ = timed("candidates", sp.DrafterCandidates.__call__)
sp.HeadCandidates.__call__ = timed("candidates", sp.HeadCandidates.__call__)
from selfspec.heads.predictor import ExitPredictors
from selfspec.heads.modules import LightweightHead
ExitPredictors.prob = timed("mlp", ExitPredictors.prob)
LightweightHead.transform_normed = timed("lens (head T)", LightweightHead.transform_normed)
from selfspec.executor import LayerExecutor
LayerExecutor.final_norm = timed("final_norm", LayerExecutor.final_norm)
scan = sp.PredictorScan.scan
sp.PredictorScan.scan = timed("scan total (incl layers)", scan)
prompt = "def sort_by_length(words: list[str]) -> list[str]:\n    \"\"\"Sort words by length, then alphabetically.\"\"\"\n"
for rep in range(2):
    for k in acc: acc[k] = 0.0; calls[k] = 0
    t = time.perf_counter()
    r = eng.generate(prompt, method="specee", heads=heads, verify=True, threshold=thr, max_new_tokens=96)
    wall = time.perf_counter() - t
    n = r.stats.new_tokens
    print(f"rep {rep}: {n} tokens, {wall/n*1e3:.1f} ms/token, predictor_ms/token {r.stats.predictor_ms/n:.2f}")
    for k in acc: print(f"   {k}: {acc[k]/n*1e3:.2f} ms/token ({calls[k]/n:.1f} calls/token)")
