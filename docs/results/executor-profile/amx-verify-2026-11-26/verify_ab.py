"""qspec (w4a8 drafts) on held-out HumanEval prompts with oneDNN's inconsistent row counts split
(before) vs padded (now), alternating in one process; verify ms per step by block size."""
import sys, time, collections, torch
import selfspec
from selfspec.data.prompts import load_prompts
from selfspec.executor.row_consistency import PackedRowLimits, RowSizes
torch.set_num_threads(2)
eng = selfspec.load("qwen2.5-coder-1.5b-instruct", "bf16")
limits = eng.executor.row_limits
probe = PackedRowLimits._probe
def old_probe(self, *a):
    s = probe(self, *a)
    first = next((r for r in range(2, len(s.call_rows)) if s.call_rows[r] != r), len(s.call_rows)) - 1
    return RowSizes(tuple(r if r <= first else 0 for r in range(len(s.call_rows))), first)
prompts = load_prompts("humaneval", n=3)
res = collections.defaultdict(list)
outs = {}
for rnd in range(2):
    for mode in ("split", "padded"):
        PackedRowLimits._probe = old_probe if mode == "split" else probe
        limits._limits.clear()
        eng.generate(prompts[0].text, method="qspec", draft_weights="w4a8", max_new_tokens=8)
        for p in prompts:
            r = eng.generate(p.text, method="qspec", draft_weights="w4a8", max_new_tokens=64)
            s = r.stats
            res[mode].append((s.tokens_per_s, s.verify_ms / max(s.verifications, 1), s.draft_ms / max(s.drafted, 1)))
            outs.setdefault(p.id, r.token_ids)
            assert outs[p.id] == r.token_ids, (mode, p.id)
for mode, v in res.items():
    tps = sorted(x[0] for x in v); vm = sorted(x[1] for x in v)
    print(mode, "tok/s median", round(tps[len(tps)//2], 2), "mean", round(sum(tps)/len(tps), 2), "verify ms/step median", round(vm[len(vm)//2], 1), "draft ms/token", round(sorted(x[2] for x in v)[len(v)//2], 1))
