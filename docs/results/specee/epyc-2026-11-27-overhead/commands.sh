#!/bin/bash
# Verified SpecEE: predictors on twice the text from sources outside HumanEval, and the
# layer-by-layer decoding overhead. AMD EPYC (AVX2 only, 2 cores), bf16, 2026-11-27, after
# ../epyc-2026-11-27-ceiling/commands.sh (heads, drafter, lensstate-r10).
set -ex
HOME_=${SELFSPEC_HOME:-$HOME/.cache/selfspec}
M=qwen2.5-coder-0.5b-instruct
H=$HOME_/heads/$M
# 1. Twice the training text, the extra half from the standard library (teacher-forced and the
#    model's own answers), HumanEval's share unchanged (weight 1 of 12 = the 8,167 tokens of
#    the 49k corpus: the same problems seen, the same 40 held out). 50 min: on-policy
#    generation 20 min, features 24 min, predictors 7 min; predictors-lensstate-98ks.txt
rm -rf $H/lensstate-98ks; cp -r $H/drafter $H/lensstate-98ks
selfspec heads train-predictors --heads $H/lensstate-98ks --model $M --dtype bf16 --threads 2 \
  --candidates drafter+ngram --draft-vocab 4096 --head-lens --state --include-head-train \
  --data 'stdlib*7,onpolicy:humaneval,onpolicy:stdlib*4' --tokens 98000 --max-new-tokens 128
BENCH="selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 40 --max-new-tokens 96 \
  --methods ar,specee:heads=$H/lensstate-r10,verify=true,tuned=true,specee:heads=$H/lensstate-98ks,verify=true,tuned=true"
# 2. before the overhead change (at 4ed85c6): qwen05-humaneval-40-before.md (11 min)
$BENCH --out ${OUT:-.}/qwen05-humaneval-40-before
# 3. where the time goes (cProfile of 6 held-out problems; prof-specee.txt, prof-ar.txt), and
#    the Python side of one layer call (ovh2.py, ovh3.py)
python prof.py specee > prof-specee.txt; python prof.py ar > prof-ar.txt
python ovh2.py; python ovh3.py
python kt.py   # per token: wall time, time in the compiled layer and output kernels, the rest
# 4. the bf16 rows kernel's tiles and prefetch distance (kvar.py, needs the compile-time knobs
#    it names added to kernels/bf16_rows.cpp; kvar.txt): no variant beats the noise, kept as is
# 5. after 233465a (the fused path's RoPE rows sliced from an fp32 table; SpecEE's draft token
#    picked among its k candidates): two runs, qwen05-humaneval-40-after-1.md, -after-2.md
$BENCH --out ${OUT:-.}/qwen05-humaneval-40-after-1
$BENCH --out ${OUT:-.}/qwen05-humaneval-40-after-2
