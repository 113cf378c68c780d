"""Alternating A/B on held-out HumanEval prompts (those the default heads' card never saw)."""
import statistics, sys, torch
import selfspec
from selfspec.data.prompts import load_prompts
from selfspec.heads import load_heads
torch.set_num_threads(2)
n, rounds = int(sys.argv[1]), int(sys.argv[2])
methods = sys.argv[3].split(";")
eng = selfspec.load("qwen2.5-coder-1.5b-instruct", "bf16")
seen = load_heads("default", eng).card.seen_prompts().get("humaneval", set())
ps = [p for p in load_prompts("humaneval", n=164) if p.id not in seen][:n]
print("held-out prompts:", [p.id for p in ps], flush=True)
def run(spec, p):
    name, _, opts = spec.partition(":")
    kw = {}
    for kv in opts.split("|"):
        if kv:
            k, v = kv.split("="); kw[k] = v
    return eng.generate(p.text, method=name, max_new_tokens=64, chat=getattr(p, "chat", False), **kw)
for m in methods:
    run(m, ps[0])
res = {m: [] for m in methods}; toks = {}
for r in range(rounds):
    for i, p in enumerate(ps):
        for m in (methods if (r + i) % 2 == 0 else methods[::-1]):
            out = run(m, p)
            res[m].append(out.stats.tokens_per_s)
            toks.setdefault(i, set()).add(tuple(out.token_ids))
        print(r, i, {m: round(res[m][-1], 2) for m in methods}, flush=True)
base = methods[0]
for m in methods:
    ratios = [a / b for a, b in zip(res[m], res[base])]
    print(f"{m:60s} mean tok/s {statistics.mean(res[m]):.2f} mean ratio to {base} {statistics.mean(ratios):.3f} median {statistics.median(ratios):.3f} total-time ratio {sum(1/x for x in res[base])/sum(1/x for x in res[m]):.3f}")
print("all identical outputs per prompt:", all(len(v) == 1 for v in toks.values()))
