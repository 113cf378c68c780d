"""The decoding step with and without its linears, and the linears alone on cold weights:
what one-token decoding costs outside the matrix products, and what the products cost when
nothing else runs. An experiment behind the executor-profile README, not a selfspec code path.

    python docs/results/executor-profile/step_floor.py [MODEL]
"""
from __future__ import annotations

import sys
import time
import warnings

import torch
import torch.nn.functional as F

import selfspec
from selfspec.executor import linear as L

warnings.filterwarnings("ignore")
torch.set_num_threads(2)
engine = selfspec.load(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct",
                       dtype="bf16", show_progress=False)
ex = engine.executor
original = L.Linear.__call__


def no_product(self: L.Linear, x: torch.Tensor, bulk: bool = False) -> torch.Tensor:
    if bulk:
        return original(self, x, bulk)
    return torch.zeros(*x.shape[:-1], self.weight.shape[0], dtype=x.dtype)


def step_ms(n: int = 32) -> float:
    cache = ex.new_cache(capacity=1024)
    ex.forward(torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None], cache)
    token = torch.tensor([[5]])
    start = time.perf_counter()
    for i in range(n):
        ex.forward(token, torch.tensor([[4 + i]]), cache)
    return (time.perf_counter() - start) / n * 1e3


def timed(fn, repeats: int = 10) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


for _ in range(2):
    L.Linear.__call__ = original
    step_ms(4)
    full = step_ms()
    L.Linear.__call__ = no_product
    step_ms(4)
    print(f"step {full:.2f} ms, without its linears {step_ms():.2f} ms")
L.Linear.__call__ = original
linears = [lin for w in ex._weights for lin in (w.qkv, w.o, w.gate_up, w.down)]
xs = [torch.randn(1, lin.weight.shape[1], dtype=torch.bfloat16) for lin in linears]
print(f"the {len(linears)} layer linears back to back (cold): "
      f"{timed(lambda: [lin(x) for lin, x in zip(linears, xs)]):.2f} ms")
print(f"F.linear on the unpacked weights: "
      f"{timed(lambda: [F.linear(x, lin.weight) for lin, x in zip(linears, xs)]):.2f} ms")
print(f"sum() of the same weights (read only): "
      f"{timed(lambda: [lin.weight.sum() for lin in linears]):.2f} ms")
