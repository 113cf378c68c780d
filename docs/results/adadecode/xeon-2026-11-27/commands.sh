#!/bin/bash
# AdaDecode on the 2-core AMX Xeon, bf16 (2026-11-27): heads on 49k tokens (stdlib on-policy
# weighted 4x), thresholds tuned by replay, an 8-problem held-out bench and an alternating A/B.
set -ex
M=qwen2.5-coder-1.5b-instruct
# 40 min: 60k tokens of on-policy answers (30 min), features, 3 epochs, calibration
selfspec heads train --model $M --dtype bf16 --threads 2 --layers 7,14,21,24 --loss-vocab 16384 \
  --draft-vocab 16384 --max-new-tokens 128 --tokens 49000 \
  --data "stdlib,onpolicy:humaneval,onpolicy:stdlib*4,onpolicy:sharegpt-chat"
# 2.5 min: per-head thresholds, layers and draft vocabulary by replay on held-out code text
selfspec heads tune-adadecode default --model $M --threads 2 --data onpolicy:humaneval,onpolicy:stdlib
selfspec heads show default --model $M > heads.txt
OUT=${OUT:-.}
selfspec bench --model $M --dtype bf16 --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots \
  --dataset humaneval --n 8 --max-new-tokens 64 \
  --methods "ar,adadecode:tuned=true,adadecode:draft_vocab=16384,gamma=0.97,adadecode:draft_vocab=16384,adadecode:tuned=true,verify=false" \
  --out $OUT/qwen-humaneval
selfspec bench --model $M --dtype bf16 --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots \
  --dataset mtbench --n 4 --max-new-tokens 64 \
  --methods "ar,adadecode:tuned=true,adadecode:draft_vocab=16384,gamma=0.97" --out $OUT/qwen-mtbench
# Alternating A/B on the first 8 HumanEval problems that neither head file saw (2 rounds, 64
# tokens), as run: H28 = the 2026-11-26 heads (28k tokens, tuned with the same tune-adadecode
# command), H49 = this run's heads (trained with --out H49, tuned there, then copied to default).
python ab_ada.py 8 2 64 "ar;adadecode:heads=$H28|draft_vocab=16384|gamma=0.97;adadecode:heads=$H28|tuned=true;adadecode:heads=$H49|tuned=true;adadecode:heads=$H49|draft_vocab=16384|gamma=0.97" $H28,$H49
