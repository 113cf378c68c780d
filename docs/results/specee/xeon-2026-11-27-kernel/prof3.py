"""In-situ split of verified SpecEE's predictor time: candidates vs per-layer decisions."""
import sys, time, torch, selfspec, collections
import selfspec.decoding.specee.step as sp
import selfspec.decoding.specee.kernel as sk
torch.set_num_threads(2)
model, heads, thr = sys.argv[1], sys.argv[2], float(sys.argv[3])
eng = selfspec.load(model, dtype="bf16", show_progress=False)
acc = collections.defaultdict(float); calls = collections.defaultdict(int)
def timed(name, fn):
    def w(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); acc[name] += time.perf_counter() - t; calls[name] += 1; return r
    return w
sp.DrafterCandidates.__call__ = timed("candidates", sp.DrafterCandidates.__call__)
sk.KernelLayerDecision.__call__ = timed("decision (kernel)", sk.KernelLayerDecision.__call__)
sk.TorchLayerDecision.__call__ = timed("decision (torch)", sk.TorchLayerDecision.__call__)
drafter_call = None
prompt = "def sort_by_length(words: list[str]) -> list[str]:\n    \"\"\"Sort words by length, then alphabetically.\"\"\"\n"
for kernel in ("kernel", "torch", "kernel", "torch"):
    acc.clear(); calls.clear()
    t = time.perf_counter()
    r = eng.generate(prompt, method="specee", heads=heads, verify=True, threshold=thr, max_new_tokens=96, kernel=kernel)
    n = r.stats.new_tokens
    print(f"{kernel}: {(time.perf_counter()-t)/n*1e3:.1f} ms/token, predictor_ms/token {r.stats.predictor_ms/n:.2f}")
    for k in acc: print(f"   {k}: {acc[k]/n*1e3:.2f} ms/token ({calls[k]/n:.1f} calls/token, {acc[k]/calls[k]*1e6:.0f} us/call)")
