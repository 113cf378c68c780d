#!/usr/bin/env bash
# KnapSpec on Qwen2.5-Coder-1.5B with quantized draft copies, 2-core AVX2 EPYC, bf16, greedy.
# The w4a8 latency model is re-measured first (a cached one predates the kernel's last change).
set -euo pipefail
out=${1:-docs/results/knapspec/avx2-w4a8-2026-11-26/qwen-humaneval}  # report.md kept as qwen-humaneval.md
selfspec models latency --model qwen2.5-coder-1.5b-instruct --dtype bf16 --draft-weights w4a8 --threads 2 --remeasure
selfspec bench --model qwen2.5-coder-1.5b-instruct --dtype bf16 \
  --methods "ar,knapspec,knapspec:draft_weights=int8,knapspec:draft_weights=w4a8" \
  --dataset humaneval --n 3 --max-new-tokens 96 --threads 2 --no-accuracy --no-plots --out "$out"
