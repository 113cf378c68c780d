import time, torch
from selfspec.api import load
from selfspec.executor.fused_layers import KVSegment
torch.set_num_threads(2)
import sys
ss = load(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b-instruct", dtype=sys.argv[2] if len(sys.argv) > 2 else "w4a8")
ex = ss.executor
ids = torch.arange(100, 400).unsqueeze(0)
cache = ex.new_cache(capacity=1024)
ex.forward(ids, torch.arange(300).unsqueeze(0), cache, last_only=True)
f = ex.fused_layers()
pos = 300
res = {"attn": [], "mlp": [], "head": [], "total": [], "rest": []}
for step in range(30):
    tok = torch.tensor([[7]]); p = torch.tensor([[pos]])
    t0 = time.perf_counter()
    ex.forward(tok, p, cache)
    t1 = time.perf_counter()
    res["total"].append(t1 - t0)
    # now the parts (on crop-and-redo): crop cache back and rerun components
    for i in range(ex.num_layers): cache.crop(i, pos)
    h = ex.embed(tok)[0].contiguous()
    cos, sin = ex._rope_rows(h[None], p)
    ta = tm = 0
    for i in range(ex.num_layers):
        k, v = cache.claim(i, pos, 1)
        s = time.perf_counter(); h = f.attention(i, h, cos, sin, [KVSegment(k, v, pos, 0, 1)]); ta += time.perf_counter() - s
        s = time.perf_counter(); h = f.mlp(i, h); tm += time.perf_counter() - s
    s = time.perf_counter(); ex.logits(h[None]); th = time.perf_counter() - s
    res["attn"].append(ta); res["mlp"].append(tm); res["head"].append(th)
    pos += 1
for k, v in res.items():
    if v: v = sorted(v); print(f"{k:6s} median {v[len(v)//2]*1e3:.1f} ms  min {v[0]*1e3:.1f}")
