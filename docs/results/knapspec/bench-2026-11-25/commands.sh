#!/usr/bin/env bash
# Issue 12 on a 2-core AVX-512/AMX Xeon (native bf16), 2026-11-25: one run per model and
# dataset; ratios are within a run. HumanEval/0-4 and the sharegpt-summarize prompts the
# bench reports are held out from the SWIFT skip sets (the bench drops the prompts a skip
# set records); KnapSpec, CLaSp and DEL are training-free.
set -euo pipefail
common="--dtype bf16 --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots"
methods="ar,knapspec,knapspec:draft_weights=int4,qspec:draft_weights=int4,clasp:reoptimize_every=4,del,swift,hf-ar,hf-prompt-lookup"

selfspec heads search-skip --model qwen2.5-coder-1.5b-instruct --dtype bf16 --threads 2
selfspec heads search-skip --model smollm2-135m-instruct --dtype bf16 --threads 2

selfspec bench --model qwen2.5-coder-1.5b-instruct --methods "$methods" --dataset humaneval \
  --n 3 --max-new-tokens 64 $common --out qwen-humaneval
selfspec bench --model qwen2.5-coder-1.5b-instruct --methods "$methods" --dataset sharegpt-summarize \
  --n 2 --max-new-tokens 64 $common --out qwen-sharegpt-summarize
selfspec bench --model smollm2-135m-instruct --methods "$methods" --dataset humaneval \
  --n 4 --max-new-tokens 96 $common --out smol-humaneval
selfspec bench --model smollm2-135m-instruct --methods "$methods" --dataset sharegpt-summarize \
  --n 3 --max-new-tokens 96 $common --out smol-sharegpt-summarize

# 128 new tokens on Qwen (qwen-*-128.md)
selfspec bench --model qwen2.5-coder-1.5b-instruct --methods ar,knapspec,knapspec:draft_weights=int4 \
  --dataset sharegpt-summarize --n 3 --max-new-tokens 128 $common --out qwen-sharegpt-summarize-128
selfspec bench --model qwen2.5-coder-1.5b-instruct --methods ar,knapspec,knapspec:draft_weights=int4 \
  --dataset humaneval --n 3 --max-new-tokens 128 $common --out qwen-humaneval-128
