import time, statistics, torch, selfspec, cProfile, pstats
torch.set_num_threads(2)
m = selfspec.load("qwen2.5-coder-0.5b-instruct", "bf16", show_progress=False)
ex = m.executor; fused = ex.fused_layers()
cache = ex.new_cache(capacity=4096)
h = ex.embed(torch.tensor([[1]]))
# replace kernels by no-ops to see the Python side alone
fa, fm = fused._attention_fn, fused._mlp_fn
fused._attention_fn = lambda a: None; fused._mlp_fn = lambda a: None
ts = []
for pos0 in range(2000):
    pos = torch.arange(pos0, pos0 + 1).unsqueeze(0)
    t = time.perf_counter(); ex.run_layers(h, pos, 0, 1, cache); ts.append(time.perf_counter() - t)
    for i in range(1, ex.num_layers): cache.claim(i, pos0, 1)
print("python side of run_layers(0,1), kernels stubbed: median %.1f us" % (statistics.median(ts) * 1e6))
pr = cProfile.Profile(); pr.enable()
for pos0 in range(2000, 3000):
    pos = torch.arange(pos0, pos0 + 1).unsqueeze(0)
    ex.run_layers(h, pos, 0, 1, cache)
    for i in range(1, ex.num_layers): cache.claim(i, pos0, 1)
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(20)
