"""ar vs qspec on GGUF 3-/2-bit draft copies (draft_weights=q3_k / q2_k), Qwen2.5-Coder-1.5B
decoding on its GGUF file's blocks (--dtype gguf), two HumanEval prompts, 64 tokens, greedy."""
import json
import sys
import time

import torch

import selfspec
from selfspec.data.prompts import load_prompts

t0 = time.time()
engine = selfspec.load("qwen2.5-coder-1.5b-instruct", dtype="gguf", show_progress=False)
ex = engine.executor
print(f"loaded in {time.time() - t0:.0f}s, threads {torch.get_num_threads()}, "
      f"model types {ex.gguf_weights.types()}", flush=True)
own = sum(m.decode_bytes for w in ex.layer_weights for m in w.matrices) + ex.output_weights.decode_bytes
for fmt in ("q3_k", "q2_k", "w4a8"):  # built here to time it
    t = time.time()
    v = ex.draft_view(fmt)
    b = sum(m.decode_bytes for w in v.layer_weights for m in w.matrices) + v.output_weights.decode_bytes
    print(f"{fmt} view built in {time.time() - t:.0f}s: {b / 2**20:.0f} MiB vs own {own / 2**20:.0f} MiB",
          flush=True)
prompts = load_prompts("humaneval", 2)
runs = [("ar", {}), ("qspec", {"draft_weights": "q3_k"}), ("qspec", {"draft_weights": "q2_k"}),
        ("qspec", {"draft_weights": "w4a8"})]
if len(sys.argv) > 2 and sys.argv[2] == "short":  # shorter drafts too
    runs += [("qspec", {"draft_weights": f, "max_draft_len": 4}) for f in ("q3_k", "q2_k")]
engine.generate(prompts[0].text, method="ar", max_new_tokens=8)  # warm-up
rows = []
for p in prompts:
    ref = None
    for method, opts in runs:
        engine.generate(p.text, method=method, max_new_tokens=8, **opts)  # warm the drafter
        r = engine.generate(p.text, method=method, max_new_tokens=64, **opts)
        s = r.stats
        ref = ref or r.token_ids
        row = dict(prompt=p.id, method=method + "".join(f":{k}={v}" for k, v in opts.items()),
                   tok_s=round(s.tokens_per_s, 2), new=s.new_tokens, drafted=s.drafted,
                   accepted=s.accepted,
                   acceptance=round(s.accepted / s.drafted, 3) if s.drafted else None,
                   steps=s.steps, draft_ms=round(s.draft_ms), verify_ms=round(s.verify_ms),
                   same_as_ar=r.token_ids == ref)
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "results.json", "w"), indent=1)
