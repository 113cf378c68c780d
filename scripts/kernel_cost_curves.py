#!/usr/bin/env python
"""Cost curves of selfspec's multi-token products: per-layer time of a model's matrices for
T = 1..16 activation rows on each available build of the GGUF rows kernel (a Q4_K_M mix:
Q4_K q/k/o/gate_up, Q6_K v/down) and of the bf16 rows kernel, against the machine's limits.

Usage::

    python scripts/kernel_cost_curves.py [--model qwen1.5b|smollm2] [--threads 2]
        [--kernels gguf-avx512,bf16-avx512bf16] [--rows 1,2,4,8,12,16]

Weights are random (random codes with finite scales for the GGUF builds), several layers of
them so that each call reads from DRAM, not from the last-level cache, as decoding does.

The limits printed beside each curve: ``stream`` = the layer's bytes at the read bandwidth
measured here (every thread streaming its share of 1 GiB), ``compute`` = its multiply-adds at
the machine's peak rate of the build's multiply instruction (``vpdpbusd`` for the int8 GGUF
products, ``vdpbf16ps`` for bf16, ``vpmaddubsw`` / fp32 FMA for the AVX2 builds), both
measured by scripts/peak_macs.cpp on every thread. A call cannot cost less than the larger
of the two; "x T=1" is each T's time over the one-token time (a verification's price in
tokens).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from selfspec.executor import bf16_rows, gguf_rows
from selfspec.executor.gguf_rows import GgufMatrix, GgufSegment

T = gguf.GGMLQuantizationType
MODELS = {  # name: (hidden, kv rows, intermediate, layers timed, (main type, v/down type))
    "qwen1.5b": (1536, 256, 8960, 6, (T.Q4_K, T.Q6_K)),   # its registry GGUF: Q4_K_M
    "smollm2": (576, 192, 1536, 60, (T.Q4_1, T.Q4_1)),    # its registry GGUF: Q4_1
}
# Byte offsets of each block's fp16 scales (set to finite values in random blocks).
SCALE_BYTES = {T.Q4_K: (0, 2), T.Q6_K: (208,), T.Q4_1: (0, 2), T.Q4_0: (0,), T.Q8_0: (0,)}
PEAK_SOURCE = Path(__file__).with_name("peak_macs.cpp")


def _matrices(hidden: int, kv: int, inter: int, types) -> list[tuple[int, list[tuple[int, T]]]]:
    """(in_features, [(rows, type)]) of one layer: qkv, o, gate_up, down; ``types`` = (main,
    v / down) as llama.cpp's mixes pick them (Q4_K_M: Q4_K, Q6_K)."""
    main, big = types
    return [(hidden, [(hidden, main), (kv, main), (kv, big)]),
            (hidden, [(hidden, main)]),
            (hidden, [(2 * inter, main)]),
            (inter, [(hidden, big)])]


def _random_blocks(qtype: T, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """``[n, row bytes]`` blocks of random codes with finite fp16 scales (timing does not
    depend on the values; quantizing dozens of layers would take minutes)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in SCALE_BYTES[qtype]:
        d = rng.uniform(0.002, 0.02, (n, k // block)).astype(np.float16)
        blocks[..., at:at + 2] = d[..., None].view(np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


def _layer_products(kind: str, isa: str, matrices, layers: int, gen, rng):
    """Callables ``f(xs)`` running one layer's products, one per layer, and the bytes read."""
    built, nbytes = [], 0
    for _ in range(layers):
        layer = []
        for k, parts in matrices:
            if kind == "gguf":
                segs = [GgufSegment(t, _random_blocks(t, n, k, rng)) for n, t in parts]
                m = GgufMatrix(segs, k, isa=isa)
                layer.append((k, m))
                nbytes += m.nbytes
            else:
                w = (torch.randn(sum(n for n, _ in parts), k, generator=gen) * 0.02).bfloat16()
                packed = bf16_rows._weight(w, None)
                fn = bf16_rows._library(isa).call
                layer.append((k, lambda x, packed=packed, fn=fn: bf16_rows._product(fn, x, packed)))
                nbytes += w.numel() * 2
        built.append(layer)
    return built, nbytes // layers


def _per_layer_ms(built, rows: int, gen, repeat: int) -> float:
    xs = {}
    for layer in built:
        for k, _ in layer:
            xs.setdefault(k, torch.randn(rows, k, generator=gen).bfloat16())

    def once():
        for layer in built:
            for k, fn in layer:
                fn(xs[k])
    once()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        once()
        best = min(best, (time.perf_counter() - start) / len(built) * 1e3)
    return best


def _peaks(threads: int) -> dict[str, float]:
    """GMAC/s of each multiply instruction and ``read_gbs`` on ``threads`` threads
    (scripts/peak_macs.cpp), or an empty dict without a compiler."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "peak"
        flags = ["-O2", "-fopenmp", "-mavx2", "-mfma"]
        if torch.backends.cpu.get_cpu_capability() == "AVX512":
            flags += ["-mavx512f", "-mavx512bw", "-mavx512vnni", "-mavx512bf16",
                      "-DSELFSPEC_PEAK_AVX512"]
        subprocess.run([cxx, *flags, str(PEAK_SOURCE), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout
    return {name: float(value) for name, value in (line.split() for line in out.splitlines())}


def main() -> None:
    """Print a table per kernel: ms per layer and x T=1 for each T, with the limits."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="qwen1.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    parser.add_argument("--kernels", default="",
                        help="comma-separated gguf-<isa> / bf16-<isa> (default: every build)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    hidden, kv, inter, layers, types = MODELS[args.model]
    matrices = _matrices(hidden, kv, inter, types)
    macs = sum(k * sum(n for n, _ in parts) for k, parts in matrices)
    peaks = _peaks(args.threads)
    gbs = peaks.pop("read_gbs", float("nan"))
    print(f"{args.model}: {macs / 1e6:.1f} M multiply-adds a token and layer; threads "
          f"{args.threads}; read bandwidth {gbs:.1f} GB/s; peak GMAC/s "
          + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()))
    wanted = [k for k in args.kernels.split(",") if k]
    candidates = [("gguf", isa) for isa in gguf_rows.ISAS if gguf_rows.gguf_rows_available(isa)]
    candidates += [("bf16", isa) for isa in bf16_rows.ISAS if bf16_rows._library(isa).call]
    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    for kind, isa in candidates:
        if wanted and f"{kind}-{isa}" not in wanted:
            continue
        built, nbytes = _layer_products(kind, isa, matrices, layers, gen, rng)
        instr = ("fma" if isa == "avx2" else "vdpbf16ps") if kind == "bf16" else (
            "vpmaddubsw" if isa == "avx2" else "vpdpbusd")
        peak = peaks.get(instr)
        ms = {r: _per_layer_ms(built, r, gen, args.repeat) for r in rows}
        print(f"\n{kind}-{isa}: {nbytes / 1e6:.1f} MB a layer; stream limit "
              f"{nbytes / gbs / 1e6:.2f} ms")
        print("| T | ms | x T=1 | compute limit ms | GMAC/s |")
        print("|---:|---:|---:|---:|---:|")
        for r in rows:
            limit = f"{macs * r / peak / 1e6:.2f}" if peak else "-"
            print(f"| {r} | {ms[r]:.2f} | {ms[r] / ms[rows[0]]:.2f} | {limit} | "
                  f"{macs * r / ms[r] / 1e6:.0f} |")


if __name__ == "__main__":
    main()
