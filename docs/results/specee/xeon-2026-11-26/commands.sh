#!/bin/bash
# SpecEE on the AMX Xeon, bf16 (2026-11-26). Heads: as in docs/results/adadecode/xeon-2026-11-26
# (selfspec heads train --model qwen2.5-coder-1.5b-instruct --dtype bf16 --threads 2 --layers 7,14,21,24
#  --loss-vocab 16384 --draft-vocab 16384 --data stdlib,onpolicy:humaneval,onpolicy:stdlib,onpolicy:sharegpt-chat
#  --tokens 28000 --max-new-tokens 128).
set -ex
H=${SELFSPEC_HOME:-$HOME/.cache/selfspec}/heads/qwen2.5-coder-1.5b-instruct
rm -rf $H/ngram; cp -r $H/default $H/ngram
P="selfspec heads train-predictors --model qwen2.5-coder-1.5b-instruct --dtype bf16 --threads 2 --data onpolicy:humaneval,onpolicy:sharegpt-chat,stdlib --tokens 12000 --max-new-tokens 128"
$P --heads $H/default
$P --heads $H/ngram --candidates head+ngram
S=specee:heads=$H/default
N=specee:heads=$H/ngram
selfspec bench --model qwen2.5-coder-1.5b-instruct --dtype bf16 --threads 2 --bandwidth-mib 512 \
  --dataset humaneval --n 8 --max-new-tokens 96 \
  --methods ar,$S,$N,$N,threshold=0.7,$N,threshold=0.5,$N,kv=deferred,early-exit:epsilon=0.9 \
  --out ${OUT:-docs/results/specee/xeon-2026-11-26}/qwen-humaneval
