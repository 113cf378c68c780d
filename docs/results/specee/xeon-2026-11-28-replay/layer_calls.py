"""Time the calls verified SpecEE makes against `ar`'s: python layer_calls.py MODEL CONTEXT.

One token through all layers + lm_head + argmax (ar's fused path); the layers as one-layer
calls of 1-4 positions (LayerExecutor.run_layers_at, as DeferredLayers runs them); the output
layer (final norm + lm_head) on 1 and 3 positions. Medians of interleaved repetitions.
"""
import statistics
import sys
import time

import torch

import selfspec

torch.set_num_threads(2)
name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b-instruct"
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 400
ex = selfspec.load(name, "bf16", show_progress=False).executor
L = ex.num_layers
cache = ex.new_cache(1, ctx + 64)
ids = torch.randint(0, 1000, (1, ctx))
ex.run_layers(ex.embed(ids), torch.arange(ctx).unsqueeze(0), 0, L, cache)
H = ex.embed_token(5).shape[-1]


def layers(rows):
    x = torch.cat([ex.embed_token(5 + i) for i in range(rows)], 1)

    def run():
        cache.truncate(ctx)
        h = x
        for layer in range(L):
            h = ex.run_layers_at(h, ctx, layer, layer + 1, cache)
    return run


def ar_token():
    cache.truncate(ctx)
    h = ex.run_layers(ex.embed_token(5), torch.tensor([[ctx]]), 0, L, cache)
    return ex.logits(h)[0, -1].argmax()


def output(rows):
    h = torch.randn(1, rows, H).to(torch.bfloat16)
    return lambda: ex.logits(h)


fns = {"ar_token": ar_token, **{f"layers_x{r}": layers(r) for r in (1, 2, 3, 4)},
       **{f"lmhead_x{r}": output(r) for r in (1, 3)}}
times = {k: [] for k in fns}
for _ in range(25):
    for k, f in fns.items():
        t = time.perf_counter()
        f()
        times[k].append(time.perf_counter() - t)
for k in fns:
    ms = 1e3 * statistics.median(times[k][3:])
    extra = f"  per layer {ms / L:.3f} ms" if k.startswith("layers") else ""
    print(f"{k:12s} median {ms:7.2f} ms{extra}")
