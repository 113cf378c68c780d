"""Cost of one DP sub-layer call (read-only, free) vs rows, SmolLM2/Qwen bf16 AVX2."""
import sys, time, torch, statistics
import selfspec
from selfspec.executor.executor import SkipPlan
from selfspec.executor.cost_model import _filled_cache
torch.set_num_threads(2)
m = selfspec.load(sys.argv[1], "bf16", show_progress=False)
ex = m.executor
layer = ex.num_layers // 2
n = 256
cache = _filled_cache(ex, n, range(ex.num_layers))
with torch.inference_mode():
    for batch, rows in ((1, 4), (1, 16), (3, 16), (8, 16), (16, 16), (32, 16)):
        h = torch.randn(batch, rows, ex.config.hidden_size, dtype=ex.dtype) * 0.1
        pos = torch.arange(n - rows, n).unsqueeze(0).expand(batch, rows)
        out = []
        for plan in (SkipPlan(skip_mlp=frozenset({layer})), SkipPlan(skip_attention=frozenset({layer}))):
            ts = []
            for i in range(8):
                # rotate layers so weights are not cache-hot, as in the DP
                l = (layer + i) % ex.num_layers
                p = SkipPlan(skip_mlp=frozenset({l})) if plan.skip_mlp else SkipPlan(skip_attention=frozenset({l}))
                t0 = time.perf_counter()
                ex.run_layers(h, pos, l, l + 1, cache, p, write_cache=False, free=True)
                ts.append((time.perf_counter() - t0) * 1e3)
            out.append(statistics.median(ts[1:]))
        print(f"rows {batch*rows:4d}: attention {out[0]:.2f} ms, MLP {out[1]:.2f} ms, per row {sum(out)/2/(batch*rows):.4f}", flush=True)
