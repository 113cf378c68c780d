import time, torch, selfspec, statistics as S, cProfile, pstats
torch.set_num_threads(2)
m = selfspec.load("qwen2.5-coder-0.5b-instruct", "bf16", show_progress=False)
ex = m.executor; fused = ex.fused_layers()
cache = ex.new_cache(1, 1024)
ids = torch.randint(0, 1000, (1, 150))
ex.run_layers(ex.embed(ids), torch.arange(150).unsqueeze(0), 0, ex.num_layers, cache)
x = ex.embed(torch.tensor([[5]])); pos = 150
fused._attention_fn = lambda a: None; fused._mlp_fn = lambda a: None
def at():
    cache.truncate(pos); h = x
    for L in range(24): h = ex.run_layers_at(h, pos, L, L + 1, cache)
for _ in range(50): at()
ts=[]
for _ in range(200):
    t=time.perf_counter(); at(); ts.append(time.perf_counter()-t)
print("per call us", 1e6*S.median(ts)/24)
def tm(label, f, n=20000):
    t=time.perf_counter()
    for _ in range(n): f()
    print(f"{label:30s} {1e6*(time.perf_counter()-t)/n:6.2f} us")
h0 = x[0].contiguous()
tm("truncate", lambda: cache.truncate(pos))
tm("empty_like", lambda: torch.empty_like(h0))
tm("contiguous", lambda: x[0].contiguous())
tm("x[0]", lambda: x[0])
tm("unsqueeze", lambda: h0.unsqueeze(0))
tm("rope_span", lambda: ex._rope_span(x, pos, 1))
tm("reserve", lambda: cache.reserve(pos+1))
tm("any_masked", lambda: cache.any_masked(3, 4))
tm("is_free_block", lambda: ex.is_free_block(pos, 1))
tm("data_ptr", lambda: h0.data_ptr())
cos, sin = ex._rope_span(x, pos, 1)
k, v = cache._keys[3], cache._values[3]
tm("attention_at", lambda: fused.attention_at(3, h0, cos, sin, k, v, pos))
tm("mlp", lambda: fused.mlp(3, h0))
pr = cProfile.Profile(); pr.enable()
for _ in range(200): at()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(15)
