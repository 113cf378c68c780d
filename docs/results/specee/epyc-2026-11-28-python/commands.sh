#!/bin/bash
# Verified SpecEE: the Python between layer calls, and greedy argmax. AMD EPYC (AVX2 only, 2
# cores), bf16, 2026-11-28, the files of ../epyc-2026-11-27-overhead/commands.sh (lensstate-r10,
# lensstate-98ks). Every timing ran alone.
set -ex
HOME_=${SELFSPEC_HOME:-$HOME/.cache/selfspec}
M=qwen2.5-coder-0.5b-instruct
H=$HOME_/heads/$M
# 1. Where a token's time goes, inclusive timers (no cProfile): before (44094a6) and after
#    (278095f): breakdown-before.txt, breakdown-after.txt (3 min each)
python brk.py > breakdown.txt
# 2. One token's 24 layers as 24 calls against one call, paired per iteration (rl3.py); the
#    Python side alone, kernels stubbed, and single operations (py.py); kernel time against
#    the rest per layer call (cold.py)
python rl3.py; python py.py; python cold.py
# 3. Three bench runs after 278095f (11 min each): qwen05-humaneval-40-after-3.md, -4.md, -5.md (40f463a)
for r in 3 4 5; do
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 40 --max-new-tokens 96 \
  --methods ar,specee:heads=$H/lensstate-r10,verify=true,tuned=true,specee:heads=$H/lensstate-98ks,verify=true,tuned=true \
  --out ${OUT:-.}/qwen05-humaneval-40-after-$r
done
# 4. Out of the predictors' domain: 20 held-out GSM-Symbolic problems (6 min): qwen05-gsm-20.md
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset gsm --n 20 --max-new-tokens 128 \
  --methods ar,specee:heads=$H/lensstate-98ks,verify=true,tuned=true --out ${OUT:-.}/qwen05-gsm-20
