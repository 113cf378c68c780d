#!/bin/bash
# SpecEE on the AMX Xeon, bf16 (2026-11-27), candidates from the 49k-token heads of
# docs/results/adadecode/xeon-2026-11-27 (layer 14) + prompt lookup.
set -ex
M=qwen2.5-coder-1.5b-instruct
H=${SELFSPEC_HOME:-$HOME/.cache/selfspec}/heads/$M
rm -rf $H/ngram49k; cp -r $H/default $H/ngram49k
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --data onpolicy:humaneval,onpolicy:sharegpt-chat,stdlib \
  --tokens 12000 --max-new-tokens 128 --heads $H/ngram49k --candidates head+ngram
N=specee:heads=$H/ngram49k
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 8 --max-new-tokens 96 \
  --methods ar,$N,$N,threshold=0.7,$N,threshold=0.5 --out ${OUT:-.}/qwen-humaneval
