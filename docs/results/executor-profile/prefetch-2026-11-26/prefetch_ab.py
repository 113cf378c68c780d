"""A/B of the decoding kernels' software-prefetch distance on Qwen2.5-1.5B's matrix shapes.

Builds ``bf16_rows.cpp`` with its one- and two-row calls prefetching 2 KiB ahead ("old", as
before 2026-11-26) and 8 KiB ahead ("new", the default since), and ``w4a8_rows.cpp`` at 2 KiB
(its default, "old") and 8 KiB (tried, "new"; not kept), through the ``SELFSPEC_*_PREFETCH``
macros; then times one call of each shape at T activation rows,
alternating the builds round by round (7 rounds; medians), on random weights in three copies
(``COPIES``) so that they stream from DRAM as in decoding. Prints old ms and the new build's
speedup per T. Run alone: ``python prefetch_ab.py`` (about 3 minutes on 2 cores).
"""

import ctypes
import os
import statistics
import time

import torch

from selfspec.executor import native
from selfspec.executor.bf16_rows import _weight
from selfspec.executor.w4a8 import W4A8Linear, _call

# qkv, o, gate_up, down, lm_head
SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536)]
ROWS = (1, 2, 4, 8, 13)
COPIES = int(os.environ.get("COPIES", "3"))


def build(source, symbol, argtypes, flags):
    lib = ctypes.CDLL(str(native.build(source, flags)))
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = argtypes, None
    return fn


def timed(calls, rounds=7):
    """Median seconds of each entry of ``calls`` (name -> zero-argument function), interleaved."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in times.items()}


def main():
    torch.set_num_threads(2)
    bf16 = {label: build("bf16_rows.cpp", "selfspec_bf16_rows",
                         [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3,
                         (f"-DSELFSPEC_BF16_PREFETCH={elements}",))
            for label, elements in (("old", 1024), ("new", 4096))}
    w4a8 = {label: build("w4a8_rows.cpp", "selfspec_w4a8_rows",
                         [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4,
                         ("-mf16c", f"-DSELFSPEC_W4A8_PREFETCH={nbytes}"))
            for label, nbytes in (("old", 2048), ("new", 8192))}
    gen = torch.Generator().manual_seed(0)
    weights = {s: [torch.randn(*s, generator=gen) for _ in range(COPIES)] for s in SHAPES}
    packed_bf16 = {s: [_weight(w.bfloat16(), None) for w in ws] for s, ws in weights.items()}
    packed_w4a8 = {s: [W4A8Linear(w, None, _fn=w4a8["old"]) for w in ws]
                   for s, ws in weights.items()}
    del weights

    def bf16_call(fn, rows):
        xs = {s: torch.randn(rows, s[1]).bfloat16() for s in SHAPES}
        outs = {s: torch.empty(rows, s[0], dtype=torch.bfloat16) for s in SHAPES}

        def run():
            for s in SHAPES:
                for w in packed_bf16[s]:
                    fn(w.weight_ptr, xs[s].data_ptr(), outs[s].data_ptr(), None, rows, s[1], s[0])
        return run

    def w4a8_call(fn, rows):
        xs = {s: torch.randn(rows, s[1]).bfloat16() for s in SHAPES}

        def run():
            for s in SHAPES:
                for w in packed_w4a8[s]:
                    _call(fn, xs[s], w)
        return run

    print(f"shapes {SHAPES}, {COPIES} copies each; times per layer-and-lm_head set of calls")
    for kernel, fns, make in (("bf16", bf16, bf16_call), ("w4a8", w4a8, w4a8_call)):
        for rows in ROWS:
            got = timed({label: make(fn, rows) for label, fn in fns.items()})
            old, new = got["old"] / COPIES * 1e3, got["new"] / COPIES * 1e3
            print(f"{kernel} T={rows:2d}: old {old:7.2f} ms  new {new:7.2f} ms  "
                  f"speedup {old / new:.2f}x", flush=True)


if __name__ == "__main__":
    main()
