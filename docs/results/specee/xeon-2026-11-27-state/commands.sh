#!/bin/bash
# SpecEE with state-reading predictors, AMX Xeon, bf16, 2026-11-27 (after ../xeon-2026-11-27-drafter/).
set -ex
HOME_=${SELFSPEC_HOME:-$HOME/.cache/selfspec}
M=qwen2.5-coder-1.5b-instruct
H=$HOME_/heads/$M
# drafter49k: the 49k-token heads + drafter + drafter+ngram predictors (../xeon-2026-11-27-drafter/commands.sh)
rm -rf $H/state49k; cp -r $H/drafter49k $H/state49k
# the heads' own corpus (its features are cached from training the heads): 60,963 training positions
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/state49k --candidates drafter+ngram \
  --state --include-head-train --data stdlib,onpolicy:humaneval,onpolicy:stdlib*4,onpolicy:sharegpt-chat \
  --tokens 49000 --max-new-tokens 128          # 206 s, 20.4 GB peak RSS; predictors-state.txt
D=specee:heads=$H/drafter49k; S=specee:heads=$H/state49k
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 8 --max-new-tokens 96 \
  --methods ar,$D,$S,threshold=0.99,$S,threshold=0.995,$S,threshold=0.98 --out ${OUT:-.}/qwen-humaneval
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset gsm --n 5 --max-new-tokens 320 \
  --methods ar,$D,$S --out ${OUT:-.}/qwen-gsm          # $S: default threshold = the card's for accuracy 0.97 (0.993)
M=qwen2.5-coder-0.5b-instruct
H=$HOME_/heads/$M
rm -rf $H/state; cp -r $H/default $H/state     # heads 6/12/18 + head+ngram predictors
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/state --candidates head+ngram \
  --state --include-head-train --data "stdlib*4,onpolicy:humaneval,onpolicy:stdlib" --tokens 49000 \
  --max-new-tokens 128                         # 328 s (126 s of it on-policy generation), 8.9 GB peak RSS
S=specee:heads=$H/state
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 8 --max-new-tokens 96 \
  --methods ar,specee,$S,$S,threshold=0.98,$S,threshold=0.99 --out ${OUT:-.}/qwen05-humaneval

# predictor time breakdown (results README): python prof.py $M $H/state; python prof.py $M $H/default
# offline analysis (analysis.txt §7-8), from this directory:
#   python state_analysis.py      (reads $SELFSPEC_HOME; ~20 GB RAM)
#   python sweep.py $H/state49k,$H/drafter49k heads,onpolicy:humaneval+onpolicy:sharegpt-chat+stdlib
# GPU check (device tool, H200): gpu_check_state.py from the repository root (gpu_check.txt).
