#!/bin/bash
# SpecEE with head-lens predictors, AMX Xeon, bf16, 2026-11-27 (after ../xeon-2026-11-27-verify/).
# The predictors read the candidates through the exit head at layers 7/14/21/24 (1.5B) and
# 6/12/18 (0.5B): `train-predictors --head-lens`.
set -ex
HOME_=${SELFSPEC_HOME:-$HOME/.cache/selfspec}
M=qwen2.5-coder-1.5b-instruct
H=$HOME_/heads/$M
D="--data stdlib,onpolicy:humaneval,onpolicy:stdlib*4,onpolicy:sharegpt-chat --tokens 49000 --max-new-tokens 128"
# drafter49k: the 49k-token heads + drafter (../xeon-2026-11-27-drafter/commands.sh)
rm -rf $H/lens49k; cp -r $H/drafter49k $H/lens49k          # 12 features, 16,384-token candidates
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lens49k --candidates drafter+ngram \
  --head-lens --include-head-train $D                       # 2 min 49 s; predictors-lens49k.txt
rm -rf $H/lensstate49k; cp -r $H/drafter49k $H/lensstate49k  # state-reading, 16,384-token candidates
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lensstate49k --candidates drafter+ngram \
  --head-lens --state --include-head-train $D               # 4 min; predictors-lensstate49k.txt
rm -rf $H/lensstate4k; cp -r $H/drafter49k $H/lensstate4k    # state-reading, 4,096-token candidates
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lensstate4k --candidates drafter+ngram \
  --draft-vocab 4096 --head-lens --state --include-head-train $D   # 4.8 min; predictors-lensstate4k.txt
L=specee:heads=$H/lens49k,verify=true; S=specee:heads=$H/lensstate49k,verify=true
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 8 --max-new-tokens 96 \
  --methods ar,adadecode:tuned=true,$L,threshold=0.8,$L,threshold=0.9,$S,threshold=0.95,$S,threshold=0.98 \
  --out ${OUT:-.}/qwen-humaneval-a                          # 15 min
S=specee:heads=$H/lensstate4k
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 8 --max-new-tokens 96 \
  --methods ar,adadecode:tuned=true,$S,verify=true,threshold=0.98,$S,verify=true,threshold=0.99,$S,threshold=0.998,specee:heads=$H/state49k,threshold=0.995 \
  --out ${OUT:-.}/qwen-humaneval-b                          # 17 min
M=qwen2.5-coder-0.5b-instruct
H=$HOME_/heads/$M
rm -rf $H/lensstate; cp -r $H/drafter $H/lensstate          # heads 6/12/18 + drafter
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lensstate --candidates drafter+ngram \
  --draft-vocab 4096 --head-lens --state --include-head-train --data "stdlib*4,onpolicy:humaneval,onpolicy:stdlib" \
  --tokens 49000 --max-new-tokens 128                       # 4.7 min; qwen05-predictors-lensstate.txt
S=specee:heads=$H/lensstate
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 40 --max-new-tokens 96 \
  --methods ar,adadecode,$S,verify=true,threshold=0.98,$S,threshold=0.993,$S,threshold=0.98 --out ${OUT:-.}/qwen05-humaneval-40
V=specee:heads=$H/lensstate,verify=true                     # settings, 12 problems each (~6 min per run)
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 12 --max-new-tokens 96 \
  --methods ar,$V,threshold=0.98,$V,threshold=0.98,offline_layers=3,$V,threshold=0.98,offline_layers=2,$V,threshold=0.98,offline_layers=4 \
  --out ${OUT:-.}/qwen05-humaneval-12-offline
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 12 --max-new-tokens 96 \
  --methods ar,$V,threshold=0.98,$V,threshold=0.95,$V,threshold=0.9,$V,threshold=0.98,max_early=8 \
  --out ${OUT:-.}/qwen05-humaneval-12-threshold
# where the predictor time goes (verified, per token), from this directory:
python prof.py $M $H/lensstate 0.98 > prof-0.5b.txt
python prof.py qwen2.5-coder-1.5b-instruct $HOME_/heads/qwen2.5-coder-1.5b-instruct/lensstate4k 0.98 > prof-1.5b.txt
