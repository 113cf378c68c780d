"""Profile verified SpecEE (tuned) against ar on a few held-out HumanEval prompts: wall time per
token and where the Python time goes (cProfile, by tottime)."""
import cProfile, pstats, sys, time, torch
import selfspec
from selfspec.training.corpus import load_dataset_prompts
torch.set_num_threads(2)
H = "/root/.cache/selfspec/heads/qwen2.5-coder-0.5b-instruct/lensstate-r10"
m = selfspec.load("qwen2.5-coder-0.5b-instruct", "bf16", show_progress=False)
ps = {p.id: p for p in load_dataset_prompts("humaneval")}
ids = ["HumanEval/0", "HumanEval/3", "HumanEval/8", "HumanEval/10", "HumanEval/11", "HumanEval/13"]
spec = "specee"
OPTS = dict(heads=H, verify=True, tuned=True)
def run(method, n=None):
    tot_t = tot_n = 0
    for i in ids[:n]:
        p = ps[i]
        t = time.perf_counter()
        r = m.generate(p.text, method, max_new_tokens=96, chat=p.chat, **(OPTS if method == "specee" else {}))
        tot_t += time.perf_counter() - t; tot_n += len(r.token_ids)
    return tot_t, tot_n
run("ar", 1); run(spec, 1)
if len(sys.argv) == 1:
  for meth in ("ar", spec, "ar", spec):
    t, n = run(meth)
    print(meth[:12], f"{t:.2f}s {n} tok {1000*t/n:.1f} ms/tok", flush=True)
else:
    pr = cProfile.Profile(); pr.enable(); run(sys.argv[1]); pr.disable()
    st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumtime").print_stats(60)
