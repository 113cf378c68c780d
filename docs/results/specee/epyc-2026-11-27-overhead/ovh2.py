"""Python overhead of one run_layers call on the fused path: run_layers(i, i+1) minus the two
fused kernels alone, interleaved, medians over many calls."""
import time, statistics, torch, selfspec
from selfspec.executor.fused_layers import KVSegment
torch.set_num_threads(2)
m = selfspec.load("qwen2.5-coder-0.5b-instruct", "bf16", show_progress=False)
ex = m.executor; fused = ex.fused_layers()
for T in (1, 2):
    cache = ex.new_cache(capacity=4096)
    h = ex.embed(torch.tensor([[1] * T]))
    a, b = [], []
    pos0 = 0
    cos, sin = ex._rope_span(h, 0, T)
    for it in range(600):
        pos = torch.arange(pos0, pos0 + T).unsqueeze(0)
        t = time.perf_counter(); ex.run_layers(h, pos, 0, 1, cache); a.append(time.perf_counter() - t)
        # same kernels directly (layer 1, its own cache layer)
        x = h[0].contiguous()
        t = time.perf_counter()
        k, v = cache.claim(1, pos0, T)
        y = fused.attention(1, x, cos, sin, [KVSegment(k, v, pos0, 0, T)]); fused.mlp(1, y)
        b.append(time.perf_counter() - t)
        # keep layers 2.. in step: nothing reads them
        for i in range(2, ex.num_layers): cache.claim(i, pos0, T)
        pos0 += T
    d = [x - y for x, y in zip(a, b)]
    print(f"T={T}: run_layers {statistics.median(a)*1e6:.0f} us, kernels {statistics.median(b)*1e6:.0f} us, overhead median {statistics.median(d)*1e6:.0f} us")
