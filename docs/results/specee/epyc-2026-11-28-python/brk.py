"""Per token breakdown (inclusive timers, no cProfile): verified SpecEE (tuned) vs ar."""
import time, sys, collections, torch, selfspec
from selfspec.training.corpus import load_dataset_prompts
torch.set_num_threads(2)
H = "/root/.cache/selfspec/heads/qwen2.5-coder-0.5b-instruct/lensstate-r10"
m = selfspec.load("qwen2.5-coder-0.5b-instruct", "bf16", show_progress=False)
ps = {p.id: p for p in load_dataset_prompts("humaneval")}
ids = ["HumanEval/0", "HumanEval/3", "HumanEval/8", "HumanEval/10", "HumanEval/11", "HumanEval/13"]
acc = collections.Counter(); cnt = collections.Counter()
def wrap(obj, name, label):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[label] += time.perf_counter() - t; cnt[label] += 1; return r
    setattr(obj, name, g)
fused = m.executor.fused_layers()
wrap(fused, "_attention_fn", "k.attn"); wrap(fused, "_mlp_fn", "k.mlp")
from selfspec.executor import bf16_rows
orig = bf16_rows._product
def prod(*a):
    t = time.perf_counter(); r = orig(*a); acc["k.product"] += time.perf_counter() - t; cnt["k.product"] += 1; return r
bf16_rows._product = prod
from selfspec.decoding.core import state as st_mod, speculative, deferred, autoregressive
from selfspec.decoding.drafting import exit_drafter as drafting
from selfspec.decoding.specee import step as specee, kernel as specee_kernel
from selfspec.decoding.core.state import DecodeState
wrap(DecodeState, "prefill", "prefill"); wrap(DecodeState, "commit", "commit")
wrap(speculative.SpeculativeStep, "__call__", "step")
wrap(specee.SpecEEDrafter, "draft", "step.draft")
wrap(drafting.ExitDrafter, "target_logits", "step.target")
wrap(specee.SpecEEExits, "choose", "draft.choose")
wrap(specee.PredictorScan, "scan", "choose.scan")
wrap(deferred.DeferredLayers, "advance", "deferred.advance")
wrap(deferred.DeferredLayers, "add", "deferred.add")
wrap(type(m.executor), "run_layers", "run_layers")
if hasattr(type(m.executor), "run_layers_at"):
    wrap(type(m.executor), "run_layers_at", "run_layers_at")
wrap(type(m.executor), "logits", "logits")
wrap(drafting, "pick_draft_token", "pick")
for n in dir(specee_kernel):
    c = getattr(specee_kernel, n)
    if isinstance(c, type) and "__call__" in c.__dict__ and c.__module__ == specee_kernel.__name__:
        wrap(c, "__call__", "kern." + n)
for n in ("DrafterCandidates", "HeadCandidates"):
    wrap(getattr(specee, n), "__call__", "cand." + n)
wrap(speculative, "verify", "verify") if hasattr(speculative, "verify") else None
for meth, opts in (("ar", {}), ("specee", dict(heads=H, verify=True, tuned=True))):
    m.generate(ps[ids[0]].text, meth, max_new_tokens=8, **opts)
    for rep in range(2):
        acc.clear(); cnt.clear(); wall = 0.0; ntok = 0
        for i in ids:
            t = time.perf_counter()
            r = m.generate(ps[i].text, meth, max_new_tokens=96, **opts)
            wall += time.perf_counter() - t; ntok += len(r.token_ids)
        print(f"== {meth} rep {rep}: {1e3*wall/ntok:.2f} ms/token over {ntok}")
        for k in sorted(acc):
            print(f"   {k:28s} {1e3*acc[k]/ntok:7.2f} ms/tok  {cnt[k]:6d} calls  {1e6*acc[k]/max(cnt[k],1):8.1f} us/call")
        sys.stdout.flush()
