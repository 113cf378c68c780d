#!/bin/bash
# The SpecEE chain of ../epyc-2026-11-27-tuned/commands.sh on the 1.5B model (28 layers; exit
# heads at 7/14/21), AMX Xeon (avx512_bf16, amx_bf16, 2 cores), bf16, 2026-11-28, at 3a37110.
set -ex
HOME_=${SELFSPEC_HOME:-$HOME/.cache/selfspec}
M=qwen2.5-coder-1.5b-instruct
H=$HOME_/heads/$M
time selfspec heads train --model $M --dtype bf16 --threads 2 --layers 7,14,21 --loss-vocab 16384 --draft-vocab 16384 \
  --max-new-tokens 128 --tokens 12000 --data "stdlib,onpolicy:humaneval,onpolicy:stdlib" --no-plots
rm -rf $H/drafter; cp -r $H/default $H/drafter
time selfspec heads train-drafter $H/drafter --model $M --threads 2
rm -rf $H/lensstate; cp -r $H/drafter $H/lensstate
time selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lensstate --candidates drafter+ngram \
  --draft-vocab 4096 --head-lens --state --include-head-train --data "stdlib*4,onpolicy:humaneval,onpolicy:stdlib" \
  --tokens 49000 --max-new-tokens 128
selfspec heads show $H/lensstate > card.txt
# as run: heads 16.8 min (corpus 710 s, features 121 s), drafter 40 s, predictors 18.8 min
# (corpus 333 s, features 441 s, predictors and tuning 299 s; 22 GB peak memory); train.log

# 40 held-out HumanEval problems, 96 new tokens, two runs
S=specee:heads=$H/lensstate,verify=true,tuned=true
for r in 1 2; do
  selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 40 --max-new-tokens 96 \
    --methods ar,$S --out ${OUT:-.}/qwen15-humaneval-40-run$r
done
# 20 held-out GSM-Symbolic problems, 128 new tokens (the predictors saw no GSM text: code only)
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset gsm --n 20 --max-new-tokens 128 \
  --methods ar,$S --out ${OUT:-.}/qwen15-gsm-20
# the reports' plots redrawn with the short labels of 69cde68 (the runs drew them before it)
for r in qwen15-humaneval-40-run1 qwen15-humaneval-40-run2 qwen15-gsm-20; do python replot.py ${OUT:-.}/$r $r; done
# GPU check (device tool, H200; gpu_check.txt), from the repository root with copies of the
# pure-Python gguf and platformdirs packages in gpudeps/:
#   PYTHONPATH=gpudeps python docs/results/specee/xeon-2026-11-28-1.5b/gpu_check_layers_at.py
#   PYTHONPATH=gpudeps python docs/results/specee/xeon-2026-11-27-verify/gpu_check_verify.py
