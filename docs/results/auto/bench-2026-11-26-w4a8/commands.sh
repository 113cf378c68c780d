#!/usr/bin/env bash
# Qwen2.5-Coder-1.5B on held-out HumanEval: auto with the int8 (FBGEMM W8A8) self-draft against
# auto with draft weights measured fastest (w4a8: selfspec's AVX2 kernel), and qspec on each.
# 2-core AVX2 EPYC, bf16, 2 threads, greedy; one run, ratios within it.
set -euo pipefail
out=${1:-docs/results/auto/bench-2026-11-26-w4a8/qwen-humaneval}  # report.md kept as qwen-humaneval.md
selfspec bench --model qwen2.5-coder-1.5b-instruct --dtype bf16 \
  --methods "ar,ngram,auto:draft_weights=int8,auto,qspec:draft_weights=int8,qspec:draft_weights=w4a8" \
  --dataset humaneval --n 4 --max-new-tokens 96 --threads 2 --no-accuracy --no-plots --out "$out"
# SmolLM2-135M (its qspec drafts do not pay on this CPU: does auto stay where it was?)
selfspec bench --model smollm2-135m-instruct --dtype bf16 \
  --methods "ar,ngram,auto:draft_weights=int8,auto" \
  --dataset humaneval --n 10 --max-new-tokens 128 --threads 2 --no-accuracy --no-plots --out "${2:-docs/results/auto/bench-2026-11-26-w4a8/smol-humaneval}"
