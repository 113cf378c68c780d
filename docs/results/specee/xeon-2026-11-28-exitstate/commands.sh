#!/bin/bash
# The exit-state drafter experiments (0.5B model), AMX Xeon (avx512_bf16, amx_bf16, 2 cores),
# bf16, 2026-11-28. The machine ran at about half its earlier speed throughout.
set -ex
M=qwen2.5-coder-0.5b-instruct; H=${SELFSPEC_HOME:-$HOME/.cache/selfspec}/heads/$M
D="stdlib*4,onpolicy:humaneval,onpolicy:stdlib,onpolicy:gsm*2"   # the predictors' corpus

# 1. Candidate recall by the previous state's layer, and drafter variants, on the held-out
#    split of lensstate320's corpus (../xeon-2026-11-28-gsm/commands.sh); at 5e66e71
python prev_recall.py $M lensstate320 320 3,6,9,12,18                     # prev_recall.txt
python drafter_mix.py $M lensstate320 320 3,6,9,12,18 "0.25@12,18;0.5@3,6,9,12,18;0.99@3;0.99@6"
python drafter_mix.py $M lensstate320 320 3,6,9,12,18 "0.99@3,6,9,12,18"  # drafter_mix.txt

# 2. lensx: main + exit-state drafters retrained on the predictors' corpus, then predictors
#    (at 4a56a35, where --exit-state-layers defaulted to auto): 2 min + 2.8 min; chain05x.log
rm -rf $H/drafterx; cp -r $H/default $H/drafterx
selfspec heads train-drafter $H/drafterx --model $M --dtype bf16 --threads 2 --exit-state-layers auto \
  --data "$D" --tokens 49000 --max-new-tokens 320
rm -rf $H/lensx; cp -r $H/drafterx $H/lensx
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lensx --candidates drafter+ngram \
  --draft-vocab 4096 --head-lens --state --include-head-train --data "$D" --tokens 49000 --max-new-tokens 320
selfspec heads show $H/lensx/heads.safetensors --model $M > card05x.txt
S=specee:heads=$H/lensx,verify=true,tuned=true
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset gsm --n 20 --max-new-tokens 320 \
  --methods ar,$S,$S,exit_drafter=false --out qwen05-gsm-20-x
# stopped by hand after 12 of 30 problems: qwen05-humaneval-30-x-partial.txt
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 30 --max-new-tokens 96 \
  --methods ar,specee:heads=$H/lensstate320,verify=true,tuned=true,$S --out qwen05-humaneval-30-x

# 3. lensstate320x: lensstate320 plus an exit-state drafter only (main drafter and predictors
#    unchanged), 2 min; exitonly05.log
rm -rf $H/lensstate320x; cp -r $H/lensstate320 $H/lensstate320x
selfspec heads train-drafter $H/lensstate320x --model $M --dtype bf16 --threads 2 --exit-state-only \
  --exit-state-layers auto --data "$D" --tokens 49000 --max-new-tokens 320
S=specee:heads=$H/lensstate320x,verify=true,tuned=true
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset gsm --n 20 --max-new-tokens 320 \
  --methods ar,$S,$S,exit_drafter=false --out qwen05-gsm-20-exitstate
# each report's plots were copied beside it with the report's name as a prefix
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 20 --max-new-tokens 96 \
  --methods ar,$S,$S,exit_drafter=false --out qwen05-humaneval-20-exitstate
