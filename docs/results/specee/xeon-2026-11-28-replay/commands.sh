#!/bin/bash
# The tuning replay with positions inside a draft drafted as decoding drafts them, and the
# output layer's measured cost (9ad433f and the next commit). AMX Xeon (avx512_bf16, amx_bf16,
# 2 cores), bf16, 2026-11-28. The corpora and features were cached from
# ../xeon-2026-11-28-gsm/commands.sh and ../xeon-2026-11-28-exitstate/commands.sh.
set -ex
H_=${SELFSPEC_HOME:-$HOME/.cache/selfspec}/heads
D="stdlib*4,onpolicy:humaneval,onpolicy:stdlib,onpolicy:gsm*2"   # the predictors' corpus

# 0. What the calls cost on this machine (quiet): layer_calls.txt
python layer_calls.py qwen2.5-coder-0.5b-instruct 400

# 1. 0.5B: the same predictors tuned with the output layer measured (auto: 6.08 layers) and
#    given (4.75): thresholds identical to lensstate320's (bytes: 9.13); 7 min each
M=qwen2.5-coder-0.5b-instruct; H=$H_/$M
for v in auto 4.75; do
  rm -rf $H/lensstate320-o$v; cp -r $H/drafter $H/lensstate320-o$v
  selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lensstate320-o$v --candidates drafter+ngram \
    --draft-vocab 4096 --head-lens --state --include-head-train --output-cost $v --data "$D" --tokens 49000 --max-new-tokens 320
done

# 2. 0.5B: positions inside a draft replayed (default now), with the main drafter (lensstate320i,
#    9 min) and with the exit-state drafter of lensstate320x (lensstate320xi, 4 min)
rm -rf $H/lensstate320i; cp -r $H/drafter $H/lensstate320i
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lensstate320i --candidates drafter+ngram \
  --draft-vocab 4096 --head-lens --state --include-head-train --data "$D" --tokens 49000 --max-new-tokens 320
selfspec heads show $H/lensstate320i/heads.safetensors --model $M > card05i.txt
rm -rf $H/lensstate320xi; cp -r $H/lensstate320x $H/lensstate320xi
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lensstate320xi --candidates drafter+ngram \
  --draft-vocab 4096 --head-lens --state --include-head-train --data "$D" --tokens 49000 --max-new-tokens 320
selfspec heads show $H/lensstate320xi/heads.safetensors --model $M > card05xi.txt
S=verify=true,tuned=true
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset gsm --n 20 --max-new-tokens 320 \
  --methods ar,specee:heads=$H/lensstate320,$S,specee:heads=$H/lensstate320i,$S,specee:heads=$H/lensstate320xi,$S \
  --out qwen05-gsm-20
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 40 --max-new-tokens 96 \
  --methods ar,specee:heads=$H/lensstate320,$S,specee:heads=$H/lensstate320xi,$S --out qwen05-humaneval-40

# 3. 1.5B: lensstate (128-token corpus) plus an exit-state drafter (2.5 min), predictors again
#    with the replay inside a draft (8 min), then GSM (stopped by hand after the prompts in
#    qwen15-gsm-partial.txt: the machine had slowed to ~half speed)
M=qwen2.5-coder-1.5b-instruct; H=$H_/$M
rm -rf $H/lensstatexi; cp -r $H/lensstate $H/lensstatexi
selfspec heads train-drafter $H/lensstatexi --model $M --dtype bf16 --threads 2 --exit-state-only \
  --exit-state-layers auto --data "$D" --tokens 49000 --max-new-tokens 128
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --heads $H/lensstatexi --candidates drafter+ngram \
  --draft-vocab 4096 --head-lens --state --include-head-train --data "$D" --tokens 49000 --max-new-tokens 128
selfspec heads show $H/lensstatexi/heads.safetensors --model $M > card15xi.txt
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset gsm --n 20 --max-new-tokens 320 \
  --methods ar,specee:heads=$H/lensstate,$S,specee:heads=$H/lensstatexi,$S --out qwen15-gsm-20
# each report's plots were copied beside it with the report's name as a prefix
# 4. 1.5B HumanEval, stopped by hand after 15 problems (qwen15-humaneval-partial.txt)
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 40 --max-new-tokens 96 \
  --methods ar,specee:heads=$H/lensstate,$S,specee:heads=$H/lensstatexi,$S --out qwen15-humaneval-40
