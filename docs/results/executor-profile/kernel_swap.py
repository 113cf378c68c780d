"""Whole-model forward time with each candidate kernel swapped into every linear (decoding,
one token at a time; M>1 for a verification-sized block). An experiment behind
src/selfspec/executor/quant.py's choice of kernels, not a selfspec code path.

    python docs/results/executor-profile/kernel_swap.py MODEL bf16,i8w,i8dyn,i4g32,f16 [M]
"""
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
import selfspec
from selfspec.executor import linear as L

torch.set_num_threads(2)
e = selfspec.load(sys.argv[1], dtype="bf16", show_progress=False)
ex = e.executor
orig = L.Linear.__call__
def prep(self, kind):
    c = self.__dict__.setdefault("_q", {})
    if kind in c: return c[kind]
    W = self.weight.float(); N, K = W.shape
    if kind == "i8w":
        sc = W.abs().amax(1) / 127; q = (W / sc[:, None]).round().clamp(-127, 127).to(torch.int8)
        c[kind] = (q, sc.bfloat16())
    elif kind == "i8dyn":
        sc = (W.abs().amax(1) / 127).clamp(min=1e-8)
        qw = torch.quantize_per_channel(W, sc.double(), torch.zeros(N, dtype=torch.long), 0, torch.qint8)
        c[kind] = torch.ops.quantized.linear_prepack(qw, None if self.bias is None else self.bias.float())
    elif kind == "f16":
        c[kind] = torch.ops.quantized.linear_prepack_fp16(W, None if self.bias is None else self.bias.float())
    elif kind.startswith("i4g"):
        g = int(kind[3:]); wg = W.reshape(N, K // g, g)
        mn, mx = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True); s = (mx - mn).clamp(min=1e-6) / 15
        q = ((wg - mn) / s).round().clamp(0, 15).to(torch.int32).reshape(N, K); z = mn + 8 * s
        sz = torch.cat([s.reshape(N, -1, 1), z.reshape(N, -1, 1)], 2).transpose(0, 1).contiguous().bfloat16()
        c[kind] = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), g, sz)
    return c[kind]
def make(kind):
    def call(self, x, bulk=False):
        if bulk or kind == "bf16": return orig(self, x, bulk)
        K = x.shape[-1]; x2 = x.reshape(-1, K)
        p = prep(self, kind)
        if kind == "i8w": y = torch.ops.aten._weight_int8pack_mm(x2, p[0], p[1])
        elif kind == "f16": y = torch.ops.quantized.linear_dynamic_fp16(x2.float(), p).to(x.dtype)
        elif kind == "i8dyn": y = torch.ops.quantized.linear_dynamic(x2.float(), p, True).to(x.dtype)
        else: y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, p[0], p[1], p[2])
        if self.bias is not None and kind not in ("i8dyn", "f16"): y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return call
M = int(sys.argv[3]) if len(sys.argv) > 3 else 1
def step_loop(n=16):
    cache = ex.new_cache(capacity=1024)
    ex.forward(torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None], cache)
    tok = torch.tensor([[5] * M]); t = time.perf_counter()
    for i in range(n):
        ex.forward(tok, (4 + i * M + torch.arange(M))[None], cache)
    return (time.perf_counter() - t) / n * 1e3
kinds = sys.argv[2].split(",")
for rep in range(2):
    for k in kinds:
        L.Linear.__call__ = make(k); step_loop(4)
        print(f"{sys.argv[1]} M={M} {k}: {step_loop():.2f} ms/token", flush=True)
