#!/bin/bash
# The SpecEE chain of ../xeon-2026-11-28-1.5b/commands.sh with on-policy GSM-Symbolic text in
# every stage (exit heads, drafter, predictors and their replay tuning), on both models, then
# each model's held-out GSM and HumanEval benches. AMX Xeon (avx512_bf16, amx_bf16, 2 cores),
# bf16, 2026-11-28, at 4cd0dfd.
set -ex
HOME_=${SELFSPEC_HOME:-$HOME/.cache/selfspec}

# chain MODEL HEAD_LAYERS TAG: heads, drafter and predictors, then the two benches
chain() {
  local M=$1 H=$HOME_/heads/$1
  time selfspec heads train --model $M --dtype bf16 --threads 2 --layers $2 --loss-vocab 16384 --draft-vocab 16384 \
    --max-new-tokens 128 --tokens 12000 --data "stdlib,onpolicy:humaneval,onpolicy:stdlib,onpolicy:gsm" --no-plots
  rm -rf $H/drafter; cp -r $H/default $H/drafter
  time selfspec heads train-drafter $H/drafter --model $M --threads 2
  rm -rf $H/lensstate; cp -r $H/drafter $H/lensstate
  time selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lensstate --candidates drafter+ngram \
    --draft-vocab 4096 --head-lens --state --include-head-train \
    --data "stdlib*4,onpolicy:humaneval,onpolicy:stdlib,onpolicy:gsm*2" --tokens 49000 --max-new-tokens 128
  selfspec heads show $H/lensstate/heads.safetensors > ${OUT:-.}/card$3.txt
  # 20 held-out GSM-Symbolic problems, 320 new tokens (the coder models' worked answers need
  # ~200-300 tokens to reach the number), then 40 held-out HumanEval problems, 96 new tokens
  local S=specee:heads=$H/lensstate,verify=true,tuned=true
  selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset gsm --n 20 --max-new-tokens 320 \
    --methods ar,$S --out ${OUT:-.}/qwen$3-gsm-20
  selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 40 --max-new-tokens 96 \
    --methods ar,$S --out ${OUT:-.}/qwen$3-humaneval-40
}

# as run: heads 9.6 min, drafter 27 s, predictors 15.9 min (corpus 336 s, features 370 s,
# predictors and tuning 210 s); train15.log
chain qwen2.5-coder-1.5b-instruct 7,14,21 15
# as run: heads 7.5 min, drafter 22 s, predictors 8.2 min; train05.log
chain qwen2.5-coder-0.5b-instruct 6,12,18 05
# each report's plots were copied beside it with the report's name as a prefix

# Then: the 0.5B predictors on on-policy text of 320 tokens (the GSM bench's length; the heads
# and drafter as above), 15 min (corpus 727 s, features 87 s, predictors 89 s); train05-p320.log
M=qwen2.5-coder-0.5b-instruct; H=$HOME_/heads/$M
rm -rf $H/lensstate320; cp -r $H/drafter $H/lensstate320
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lensstate320 --candidates drafter+ngram \
  --draft-vocab 4096 --head-lens --state --include-head-train \
  --data "stdlib*4,onpolicy:humaneval,onpolicy:stdlib,onpolicy:gsm*2" --tokens 49000 --max-new-tokens 320
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset gsm --n 20 --max-new-tokens 320 \
  --methods ar,specee:heads=$H/lensstate320,verify=true,tuned=true --out ${OUT:-.}/qwen05-gsm-20-p320
