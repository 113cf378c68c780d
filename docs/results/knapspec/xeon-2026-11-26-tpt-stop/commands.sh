#!/bin/bash
set -ex
O=${OUT:-docs/results/knapspec/xeon-2026-11-26-tpt-stop}
selfspec bench --model qwen2.5-coder-1.5b-instruct --dtype bf16 --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots \
  --dataset humaneval --n 3 --max-new-tokens 64 \
  --methods ar,knapspec,knapspec:draft_weights=w4a8,knapspec:draft_weights=w4a8,tpt_stop=true,qspec:draft_weights=w4a8 \
  --out $O/qwen-humaneval
