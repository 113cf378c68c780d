#!/bin/bash
# SpecEE's predictors and drafter candidates as compiled calls (specee:kernel=auto, the default),
# AMX Xeon, bf16, 2026-11-27 (after ../xeon-2026-11-27-lens/; same head files, trained there).
# Each bench has kernel=torch (the torch path, as before) and the kernel in one run.
set -ex
HOME_=${SELFSPEC_HOME:-$HOME/.cache/selfspec}
M=qwen2.5-coder-1.5b-instruct
H=$HOME_/heads/$M
S=specee:heads=$H/lensstate4k,verify=true
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 8 --max-new-tokens 96 \
  --methods ar,adadecode:tuned=true,$S,threshold=0.98,kernel=torch,$S,threshold=0.98,$S,threshold=0.95 \
  --out ${OUT:-.}/qwen-humaneval-c                          # 17 min
M=qwen2.5-coder-0.5b-instruct
H=$HOME_/heads/$M
S=specee:heads=$H/lensstate,verify=true
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 40 --max-new-tokens 96 \
  --methods ar,$S,threshold=0.98,kernel=torch,$S,threshold=0.98 --out ${OUT:-.}/qwen05-humaneval-40k   # 25 min
# where the predictor time goes, kernel against torch (per token, one prompt), from this directory:
python prof3.py $M $H/lensstate 0.98 > prof3-0.5b.txt
python prof3.py qwen2.5-coder-1.5b-instruct $HOME_/heads/qwen2.5-coder-1.5b-instruct/lensstate4k 0.98 > prof3-1.5b.txt
# 8 candidates instead of 4 (0.5B; held-out table only: no gain, not benchmarked)
rm -rf $H/lensstate8; cp -r $H/drafter $H/lensstate8
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lensstate8 --candidates drafter+ngram \
  --k 8 --draft-vocab 4096 --head-lens --state --include-head-train --data "stdlib*4,onpolicy:humaneval,onpolicy:stdlib" \
  --tokens 49000 --max-new-tokens 128 > qwen05-predictors-lensstate8.txt   # 5 min
# thresholds falling with depth (specee:shallow_threshold; ours), 0.5B 12 problems, then 1.5B 8 problems
M=qwen2.5-coder-0.5b-instruct; H=$HOME_/heads/$M; V=specee:heads=$H/lensstate,verify=true
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 12 --max-new-tokens 96 \
  --methods ar,$V,threshold=0.98,$V,threshold=0.98,shallow_threshold=0.9,$V,threshold=0.98,shallow_threshold=0.8,$V,threshold=0.99,shallow_threshold=0.9 \
  --out ${OUT:-.}/qwen05-humaneval-12-depth                 # 14 min
M=qwen2.5-coder-1.5b-instruct; H=$HOME_/heads/$M; V=specee:heads=$H/lensstate4k,verify=true
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 8 --max-new-tokens 96 \
  --methods ar,adadecode:tuned=true,$V,threshold=0.98,$V,threshold=0.98,shallow_threshold=0.9,$V,threshold=0.98,shallow_threshold=0.95 \
  --out ${OUT:-.}/qwen-humaneval-d
# a third 1.5B run, the same 8 problems
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 8 --max-new-tokens 96 \
  --methods ar,adadecode:tuned=true,$V,threshold=0.98 --out ${OUT:-.}/qwen-humaneval-e     # 11 min
