"""Per token: wall time, time inside the compiled kernels (layers, lm_head, predictors, drafter), the rest."""
import time, sys, torch, selfspec
from selfspec.training.corpus import load_dataset_prompts
torch.set_num_threads(2)
H = "/root/.cache/selfspec/heads/qwen2.5-coder-0.5b-instruct/lensstate-r10"
m = selfspec.load("qwen2.5-coder-0.5b-instruct", "bf16", show_progress=False)
ps = {p.id: p for p in load_dataset_prompts("humaneval")}
ids = ["HumanEval/0", "HumanEval/3", "HumanEval/8", "HumanEval/10", "HumanEval/11", "HumanEval/13"]
fused = m.executor.fused_layers()
acc = {"k": 0.0}
def wrap(obj, name):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc["k"] += time.perf_counter() - t; return r
    setattr(obj, name, g)
wrap(fused, "_attention_fn"); wrap(fused, "_mlp_fn")
from selfspec.executor import bf16_rows
orig = bf16_rows._product
def prod(*a):
    t = time.perf_counter(); r = orig(*a); acc["k"] += time.perf_counter() - t; return r
bf16_rows._product = prod
for meth, opts in (("ar", {}), ("specee", dict(heads=H, verify=True, tuned=True))):
    m.generate(ps[ids[0]].text, meth, max_new_tokens=8, **opts)
    for rep in range(2):
        acc["k"] = 0.0; wall = 0.0; ntok = 0; pre = 0.0
        for i in ids:
            t = time.perf_counter()
            r = m.generate(ps[i].text, meth, max_new_tokens=96, **opts)
            wall += time.perf_counter() - t; ntok += len(r.token_ids)
            pre += r.stats.ttft_ms / 1e3 if hasattr(r.stats, "ttft_ms") else 0
        print(f"{meth}: {1e3*wall/ntok:.1f} ms/token, kernels {1e3*acc['k']/ntok:.1f}, rest {1e3*(wall-acc['k'])/ntok:.1f} (prefill incl.)", flush=True)
