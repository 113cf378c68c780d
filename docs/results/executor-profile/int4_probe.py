"""How much would int4 (torch's packed CPU kernel) speed up ar decoding end to end?

An experiment, not the int4 path of issue 15: the decoder layers' linears are swapped for
torch's int4 packed kernel (asymmetric min/max, group G), lm_head stays bf16.

    python docs/results/executor-profile/int4_probe.py 32
"""
import sys
import time

import torch

import selfspec

torch.set_num_threads(2)
G = int(sys.argv[1]) if len(sys.argv) > 1 else 64

class Int4:
    def __init__(self, lin, g=G):
        W = lin.weight.float(); N, K = W.shape
        wg = W.reshape(N, K // g, g)
        mn, mx = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
        s = (mx - mn).clamp(min=1e-6) / 15
        q = ((wg - mn) / s).round().clamp(0, 15).to(torch.int32).reshape(N, K)
        z = mn + 8 * s
        self.sz = torch.cat([s.reshape(N, -1, 1), z.reshape(N, -1, 1)], 2).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.g = g; self.bias = lin.bias; self.lin = lin
    def __call__(self, x, bulk=False):
        shp = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shp[-1]), self.packed, self.g, self.sz)
        if self.bias is not None: y = y + self.bias
        return y.reshape(*shp[:-1], y.shape[-1])

e = selfspec.load("smollm2-135m-instruct", dtype="bf16", show_progress=False)
P = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
def speed():
    e.generate(P, max_new_tokens=16)
    best = 0
    for _ in range(3):
        t = time.perf_counter(); r = e.generate(P, max_new_tokens=64); dt = time.perf_counter() - t
        best = max(best, r.stats.new_tokens / dt)
    return best, r.token_ids
bf, ref = speed()
for w in e.executor._weights:
    for name in ("qkv", "o", "gate_up", "down"):
        object.__setattr__(w, name, Int4(getattr(w, name)))
i4, got = speed()
same = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
print(f"group {G}: bf16 ar {bf:.1f} tok/s, int4 layers ar {i4:.1f} tok/s ({i4/bf:.2f}x); greedy agreement prefix {same}/{len(ref)}")
print(repr(e.tokenizer.decode(ref)[:120]))
print(repr(e.tokenizer.decode(got)[:120]))
