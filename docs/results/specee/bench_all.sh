#!/bin/bash
# SpecEE benchmarks (issue 14), as run for docs/results/specee: fp32, greedy, held-out prompts
# (the bench drops every prompt the heads or predictors saw). Threshold 0.5 was the default
# when the first two runs were made; it is spelled out here.
# Prerequisites:
#   selfspec models fetch qwen2.5-coder-0.5b-instruct --dtype fp32
#   selfspec heads train --model qwen2.5-coder-0.5b-instruct --dtype fp32 --threads 2 --layers 6,12,18 \
#     --loss-vocab 16384 --compute-dtype fp32 --data stdlib,gsm,humaneval --tokens 8000 --draft-vocab 16384
#   selfspec heads train-predictors --model qwen2.5-coder-0.5b-instruct --dtype fp32 --threads 2 \
#     --data stdlib,gsm --tokens 6000 --seed 1          # candidate layer 12 (the default)
#   selfspec heads train-predictors --model qwen2.5-coder-1.5b-instruct --dtype fp32 --threads 2 \
#     --data stdlib,gsm --tokens 3000 --seed 1          # candidate layer 14 (the default)
set -ex
B="python -m selfspec.cli -v bench --threads 2 --bandwidth-mib 0 --dtype fp32"
O=${OUT:-docs/results/specee}
M=qwen2.5-coder-0.5b-instruct
S=specee:threshold=0.5
$B --model $M --dataset humaneval --n 8 --max-new-tokens 128 \
  --methods ar,$S,$S,kv=deferred,$S,kv=skip,$S,schedule=all,early-exit:epsilon=0.8,early-exit:epsilon=0.9 \
  --sweep specee:threshold=0.7,0.9 --out $O/$M-humaneval
$B --model $M --dataset gsm --n 6 --max-new-tokens 160 \
  --methods ar,$S,specee:threshold=0.9,$S,kv=deferred,$S,kv=skip,early-exit:epsilon=0.9 --out $O/$M-gsm
$B --model $M --dataset humaneval --n 8 --max-new-tokens 128 \
  --methods ar,specee,specee:kv=deferred,specee:kv=skip --out $O/$M-humaneval-kv
Q=qwen2.5-coder-1.5b-instruct
$B --model $Q --dataset humaneval --n 4 --max-new-tokens 64 \
  --methods ar,specee,specee:threshold=0.5,specee:kv=deferred,specee:kv=skip --out $O/$Q-humaneval
