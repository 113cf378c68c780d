"""One-token decode time: Qwen 1.5B bf16 (model's kernel) vs its int4 draft view, AVX2."""
import time, torch
import selfspec
from selfspec.executor.executor import SkipPlan
torch.set_num_threads(2)
m = selfspec.load("qwen2.5-coder-1.5b-instruct", "bf16", show_progress=False)
ex = m.executor
view = ex.draft_view("int4")
ids = torch.tensor([m.encode("def fibonacci(n):\n    a, b = 0, 1\n" * 8)])
with torch.inference_mode():
    for name, e in (("bf16", ex), ("int4", view), ("bf16", ex), ("int4", view)):
        cache = ex.new_cache(capacity=512)
        e.forward(ids, torch.arange(ids.shape[1]).unsqueeze(0), cache)
        n = ids.shape[1]
        tok = ids[:, -1:]
        ts = []
        for i in range(12):
            t0 = time.perf_counter()
            e.forward(tok, torch.tensor([[n + i]]), cache)
            ts.append((time.perf_counter() - t0) * 1e3)
        ts = sorted(ts[2:])
        # MLP-only and attention-only per layer
        mlp = SkipPlan(skip_attention=frozenset(range(e.num_layers)))
        att = SkipPlan(skip_mlp=frozenset(range(e.num_layers)))
        def t(plan):
            h = e.embed(tok); out = []
            for _ in range(8):
                t0 = time.perf_counter()
                e.run_layers(h, torch.tensor([[n + 12]]), 0, e.num_layers, cache, plan, write_cache=False)
                out.append((time.perf_counter() - t0) * 1e3)
            return sorted(out)[len(out)//2]
        print(name, "token median %.1f ms" % ts[len(ts)//2], "all-MLP %.1f ms" % t(mlp), "all-attn %.1f ms" % t(att), flush=True)
