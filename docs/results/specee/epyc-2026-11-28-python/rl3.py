import time, torch, selfspec, statistics as S
from selfspec.executor.fused_layers import KVSegment
torch.set_num_threads(2)
m = selfspec.load("qwen2.5-coder-0.5b-instruct", "bf16", show_progress=False)
ex = m.executor
fused = ex.fused_layers()
cache = ex.new_cache(1, 1024)
ids = torch.randint(0, 1000, (1, 150))
ex.run_layers(ex.embed(ids), torch.arange(150).unsqueeze(0), 0, ex.num_layers, cache)
x = ex.embed(torch.tensor([[5]]))
pos = 150
def rl_one_call():
    cache.truncate(pos)
    ex.run_layers(x, torch.tensor([[pos]]), 0, 24, cache)
def rl_per_layer():
    cache.truncate(pos)
    h = x
    p = torch.tensor([[pos]])
    for L in range(24):
        h = ex.run_layers(h, p, L, L + 1, cache)
def kern_per_layer():
    cache.truncate(pos)
    cos, sin = ex._rope_span(x, pos, 1)
    hh = x[0].contiguous()
    for L in range(24):
        k, v = cache._keys[L], cache._values[L]
        hh = fused.attention(L, hh, cos, sin, [KVSegment(k, v, pos, 0, 1)])
        hh = fused.mlp(L, hh)
def kern_per_layer_sleep():
    cache.truncate(pos)
    cos, sin = ex._rope_span(x, pos, 1)
    hh = x[0].contiguous()
    for L in range(24):
        k, v = cache._keys[L], cache._values[L]
        hh = fused.attention(L, hh, cos, sin, [KVSegment(k, v, pos, 0, 1)])
        hh = fused.mlp(L, hh)
        t = time.perf_counter()
        while time.perf_counter() - t < 50e-6: pass
fns = dict(one=rl_one_call, per=rl_per_layer, kern=kern_per_layer, kern_spin50=kern_per_layer_sleep)
res = {k: [] for k in fns}
for it in range(60):
    for k, f in fns.items():
        t = time.perf_counter(); f(); res[k].append(time.perf_counter() - t)
base = res["one"]
for k in fns:
    d = [1e3*(a - b) for a, b in zip(res[k], base)]
    print(f"{k:12s} median {1e3*S.median(res[k]):7.2f} ms   paired diff vs one: median {S.median(d):+6.2f} ms")
def at_per_layer():
    cache.truncate(pos)
    h = x
    for L in range(24):
        h = ex.run_layers_at(h, pos, L, L + 1, cache)
def at_per_layer_py():  # kernels stubbed
    fa, fm = fused._attention_fn, fused._mlp_fn
    fused._attention_fn = lambda a: None; fused._mlp_fn = lambda a: None
    try:
        cache.truncate(pos)
        h = x
        for L in range(24):
            h = ex.run_layers_at(h, pos, L, L + 1, cache)
    finally:
        fused._attention_fn, fused._mlp_fn = fa, fm
fns = dict(one=rl_one_call, per=rl_per_layer, at=at_per_layer, kern=kern_per_layer, at_py=at_per_layer_py)
res = {k: [] for k in fns}
for it in range(60):
    for k, f in fns.items():
        t = time.perf_counter(); f(); res[k].append(time.perf_counter() - t)
base = res["one"]
print("--- with run_layers_at")
for k in fns:
    d = [1e3*(a - b) for a, b in zip(res[k], base)]
    print(f"{k:12s} median {1e3*S.median(res[k]):7.2f} ms   paired diff vs one: median {S.median(d):+6.2f} ms")
