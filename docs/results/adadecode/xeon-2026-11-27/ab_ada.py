"""Alternating A/B on held-out HumanEval prompts (unseen by every head file given)."""
import statistics, sys, torch
import selfspec
from selfspec.data.prompts import load_prompts
from selfspec.heads import load_heads
torch.set_num_threads(2)
n, rounds, ntok = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
methods = sys.argv[4].split(";")
heads_files = sys.argv[5].split(",")
eng = selfspec.load("qwen2.5-coder-1.5b-instruct", "bf16")
seen = set()
for h in heads_files:
    seen |= load_heads(h, eng).card.seen_prompts().get("humaneval", set())
ps = [p for p in load_prompts("humaneval", n=164) if p.id not in seen][:n]
print("held-out prompts:", [p.id for p in ps], flush=True)
def run(spec, p):
    name, _, opts = spec.partition(":")
    kw = {}
    for kv in opts.split("|"):
        if kv:
            k, v = kv.split("="); kw[k] = v
    return eng.generate(p.text, method=name, max_new_tokens=ntok, chat=getattr(p, "chat", False), **kw)
for m in methods:
    run(m, ps[0])
res = {m: [] for m in methods}; toks = {}; acc = {m: [0, 0] for m in methods}
for r in range(rounds):
    for i, p in enumerate(ps):
        for m in (methods if (r + i) % 2 == 0 else methods[::-1]):
            out = run(m, p)
            res[m].append(out.stats.tokens_per_s)
            acc[m][0] += out.stats.drafted; acc[m][1] += out.stats.accepted
            toks.setdefault(i, set()).add(tuple(out.token_ids))
        print(r, i, {m[-30:]: round(res[m][-1], 2) for m in methods}, flush=True)
base = methods[0]
for m in methods:
    ratios = [a / b for a, b in zip(res[m], res[base])]
    a = acc[m][1] / acc[m][0] if acc[m][0] else float("nan")
    print(f"{m:70s} mean tok/s {statistics.mean(res[m]):.2f} mean ratio {statistics.mean(ratios):.3f} median {statistics.median(ratios):.3f} total-time ratio {sum(1/x for x in res[base])/sum(1/x for x in res[m]):.3f} acceptance {a:.3f}")
print("all identical outputs per prompt:", all(len(v) == 1 for v in toks.values()))
