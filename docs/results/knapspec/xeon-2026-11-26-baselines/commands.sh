#!/bin/bash
# issue 12's bench on the 2-core AVX-512/AMX Xeon (native bf16) with the measured verification
# table (T = 1..32): ar, knapspec (own weights and w4a8 drafts), the CLaSp / DEL / SWIFT
# baselines, hf-ar and hf-prompt-lookup; Qwen on HumanEval and sharegpt-summarize, SmolLM2 on
# HumanEval; each run alone. Reports beside this file.
# swift's skip sets, searched first (bf16; SmolLM2 1.5 min with the defaults, Qwen 1.5 min with
# fewer positions and evaluations); their calibration prompts are dropped by the bench:
#   selfspec heads search-skip --model smollm2-135m-instruct --dtype bf16 --threads 2
#   selfspec heads search-skip --model qwen2.5-coder-1.5b-instruct --dtype bf16 --threads 2 \
#     --prompts 4 --max-new-tokens 32 --max-evaluations 30
OUT=${OUT:-runs/knapspec-xeon}
mkdir -p "$OUT"
M=ar,knapspec,knapspec:draft_weights=w4a8,clasp,del,swift,hf-ar,hf-prompt-lookup
for ds in humaneval sharegpt-summarize; do
  selfspec bench --model qwen2.5-coder-1.5b-instruct --dtype bf16 --methods $M --dataset $ds \
    --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots --n 3 --max-new-tokens 64 \
    --out "$OUT/qwen2.5-coder-1.5b-instruct-$ds" > "$OUT/qwen2.5-coder-1.5b-instruct-$ds.log" 2>&1
done
selfspec bench --model smollm2-135m-instruct --dtype bf16 --methods $M --dataset humaneval \
  --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots --n 6 --max-new-tokens 96 \
  --out "$OUT/smollm2-135m-instruct-humaneval" > "$OUT/smollm2-135m-instruct-humaneval.log" 2>&1
