#!/bin/bash
# SpecEE per-layer thresholds tuned by replay, AMD EPYC (AVX2 only, 2 cores), bf16, 2026-11-27.
# The 0.5B chain of docs/results/specee/xeon-2026-11-27-lens/commands.sh on this machine (heads 33 min,
# drafter 89 s (50 s of training, fp32 products: emulated bf16 took > 13 min), predictors 24 min
# (corpus 7 min, features 13 min, predictors + tuning 3 min; the first two are cached afterwards).
set -ex
HOME_=${SELFSPEC_HOME:-$HOME/.cache/selfspec}
M=qwen2.5-coder-0.5b-instruct
H=$HOME_/heads/$M
time selfspec heads train --model $M --dtype bf16 --threads 2 --layers 6,12,18 --loss-vocab 16384 --draft-vocab 16384 \
  --max-new-tokens 128 --tokens 12000 --data "stdlib,onpolicy:humaneval,onpolicy:stdlib" --no-plots
rm -rf $H/drafter; cp -r $H/default $H/drafter
time selfspec heads train-drafter $H/drafter --model $M --threads 2
rm -rf $H/lensstate; cp -r $H/drafter $H/lensstate
time selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lensstate --candidates drafter+ngram \
  --draft-vocab 4096 --head-lens --state --include-head-train --data "stdlib*4,onpolicy:humaneval,onpolicy:stdlib" \
  --tokens 49000 --max-new-tokens 128

# the same predictors tuned with a replay row cost of 0.1 (this machine: a forward of 3-4 tokens
# costs ~0.1 of a token per extra token; `selfspec models latency`), 5 min from the cached features
rm -rf $H/lensstate-r10; cp -r $H/drafter $H/lensstate-r10
time selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lensstate-r10 --candidates drafter+ngram \
  --draft-vocab 4096 --head-lens --state --include-head-train --data "stdlib*4,onpolicy:humaneval,onpolicy:stdlib" \
  --tokens 49000 --max-new-tokens 128 --row-cost 0.1

# 20 problems, then 40
V=specee:heads=$H/lensstate,verify=true
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 20 --max-new-tokens 96 \
  --methods ar,$V,threshold=0.98,$V,tuned=true,$V,threshold=0.93 --out ${OUT:-.}/qwen05-humaneval-tuned
R=specee:heads=$H/lensstate-r10,verify=true
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 40 --max-new-tokens 96 \
  --methods ar,$V,threshold=0.98,$V,threshold=0.93,$V,tuned=true,$R,tuned=true --out ${OUT:-.}/qwen05-humaneval-40-tuned
selfspec models latency --model $M --dtype bf16 --threads 2   # latency.txt
