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

# qwen2.5-coder-0.5b-instruct (fetched with `selfspec models fetch qwen2.5-coder-0.5b-instruct`):
# heads (4.7 min), predictors off the heads' training prompts, bench on 8 held-out problems.
M=qwen2.5-coder-0.5b-instruct
selfspec heads train --model $M --dtype bf16 --threads 2 --layers 6,12,18 --loss-vocab 16384 --draft-vocab 16384 \
  --max-new-tokens 128 --tokens 12000 --data "stdlib,onpolicy:humaneval,onpolicy:stdlib" --no-plots
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --data onpolicy:humaneval,onpolicy:stdlib,stdlib \
  --tokens 12000 --max-new-tokens 128 --candidates head+ngram
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 8 --max-new-tokens 96 \
  --methods ar,specee,specee:threshold=0.7,specee:threshold=0.5,early-exit:epsilon=0.9 --out ${OUT:-.}/qwen05-humaneval
