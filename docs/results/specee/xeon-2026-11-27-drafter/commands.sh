#!/bin/bash
# SpecEE with drafter candidates (EAGLE-style next-token drafter), AMX Xeon, bf16, 2026-11-27.
set -ex
HOME_=${SELFSPEC_HOME:-$HOME/.cache/selfspec}
M=qwen2.5-coder-1.5b-instruct
H=$HOME_/heads/$M
rm -rf $H/drafter49k; cp -r $H/default $H/drafter49k      # the 49k-token heads of issue 13
selfspec heads train-drafter $H/drafter49k --model $M --threads 2              # 79 s
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --data onpolicy:humaneval,onpolicy:sharegpt-chat,stdlib \
  --tokens 12000 --max-new-tokens 128 --heads $H/drafter49k --candidates drafter+ngram     # 147 s
N=specee:heads=$H/ngram49k; D=specee:heads=$H/drafter49k
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 8 --max-new-tokens 96 \
  --methods ar,$N,$N,threshold=0.7,$D,$D,threshold=0.8,$D,threshold=0.7 --out ${OUT:-.}/qwen-humaneval
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset gsm --n 5 --max-new-tokens 320 \
  --methods ar,$N,$D,early-exit:epsilon=0.9 --out ${OUT:-.}/qwen-gsm

M=qwen2.5-coder-0.5b-instruct
H=$HOME_/heads/$M
rm -rf $H/drafter; cp -r $H/default $H/drafter
selfspec heads train-drafter $H/drafter --model $M --threads 2                  # 26 s
selfspec heads train-predictors --model $M --dtype bf16 --threads 2 --data onpolicy:humaneval,onpolicy:stdlib,stdlib \
  --tokens 12000 --max-new-tokens 128 --heads $H/drafter --candidates drafter+ngram         # 69 s
D=specee:heads=$H/drafter
selfspec bench --model $M --dtype bf16 --threads 2 --bandwidth-mib 512 --dataset humaneval --n 8 --max-new-tokens 96 \
  --methods ar,specee,$D,$D,threshold=0.8 --out ${OUT:-.}/qwen05-humaneval

# offline analysis (analysis.txt), run from this directory with the heads above:
#   python prototype_drafter.py $M_15 $H_15/default 0 4; python oracle.py $M_15 $H_15/default 0
#   python ana.py $M_15 $H_15/ngram49k onpolicy:humaneval,onpolicy:sharegpt-chat,stdlib 4096,16384; python conf2.py ana-$M_15.safetensors 28 0.137
#   python curve2.py $M_15 $H_15/drafter49k onpolicy:humaneval,onpolicy:sharegpt-chat,stdlib
#   python feat.py $M_15 $H_15/drafter49k onpolicy:humaneval,onpolicy:sharegpt-chat,stdlib
#   python hid.py $M_15 $H_15/drafter49k onpolicy:humaneval,onpolicy:sharegpt-chat,stdlib 1e-3
#   python mix.py $M_15 $H_15/drafter49k onpolicy:humaneval,onpolicy:sharegpt-chat,stdlib
# GPU check (device tool, H200): gpu_check_specee.py from the repository root.
