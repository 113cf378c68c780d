#!/bin/bash
# Verified SpecEE (specee:verify=true) and 40 held-out HumanEval problems on the 0.5B model,
# AMX Xeon, bf16, 2026-11-27. Head files from ../xeon-2026-11-27-state/commands.sh and
# ../xeon-2026-11-27-drafter/commands.sh (state49k, drafter49k, 0.5B default and state).
set -ex
HOME_=${SELFSPEC_HOME:-$HOME/.cache/selfspec}
M=qwen2.5-coder-1.5b-instruct
H=$HOME_/heads/$M
S=specee:heads=$H/state49k,verify=true; D=specee:heads=$H/drafter49k,verify=true
# exploration: 4 problems, 64 tokens (qwen-humaneval-explore.md)
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 4 --max-new-tokens 64 \
  --methods ar,$S,$S,threshold=0.95,$S,threshold=0.8,$S,threshold=0.5,$D,$D,threshold=0.5 --out ${OUT:-.}/explore
# 8 problems, 96 tokens, against AdaDecode's tuned heads (qwen-humaneval.md)
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 8 --max-new-tokens 96 \
  --methods ar,adadecode:tuned=true,$S,threshold=0.95,$S,threshold=0.98,$S,threshold=0.95,schedule=all,$D,threshold=0.95 \
  --out ${OUT:-.}/qwen-humaneval-verify
M=qwen2.5-coder-0.5b-instruct
H=$HOME_/heads/$M
S=specee:heads=$H/state
# 40 problems (qwen05-humaneval-40.md), 25 min
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 40 --max-new-tokens 96 \
  --methods ar,specee,specee:threshold=0.95,$S,$S,threshold=0.99,specee:verify=true --out ${OUT:-.}/qwen05-humaneval-40
# GPU check (device tool, H200): gpu_check_verify.py from the repository root (gpu_check.txt).
# 1.5B, 32 problems (qwen-humaneval-32.md), 35 min
M=qwen2.5-coder-1.5b-instruct
H=$HOME_/heads/$M
S=specee:heads=$H/state49k; D=specee:heads=$H/drafter49k
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 32 --max-new-tokens 96 \
  --methods ar,$D,$D,threshold=0.95,$S,threshold=0.995 --out ${OUT:-.}/qwen-humaneval-32
