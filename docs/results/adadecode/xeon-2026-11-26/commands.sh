#!/bin/bash
# Issue 13 on the AMX Xeon (2026-11-26): heads, then the three bench runs of docs/results/adadecode/README.md.
set -ex
selfspec heads train --model qwen2.5-coder-1.5b-instruct --dtype bf16 --threads 2 --layers 7,14,21,24 --loss-vocab 16384 --draft-vocab 16384 --data stdlib,onpolicy:humaneval,onpolicy:stdlib,onpolicy:sharegpt-chat --tokens 28000 --max-new-tokens 128
B="selfspec bench --model qwen2.5-coder-1.5b-instruct --dtype bf16 --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots"
O=${OUT:-docs/results/adadecode/xeon-2026-11-26}
A=adadecode:draft_vocab=16384
$B --dataset humaneval --n 4 --max-new-tokens 64 \
  --methods ar,$A,layers=7,14,21,$A,layers=7,14,21,gamma=0.9,$A,gamma=0.9,$A,layers=21,24,gamma=0.9,$A,layers=7,14,21,verify=false,dssd:draft_vocab=16384 \
  --out $O/qwen-humaneval
$B --dataset mtbench --n 3 --max-new-tokens 64 \
  --methods ar,$A,layers=7,14,21,$A,gamma=0.9,$A,layers=21,24,gamma=0.9,dssd:draft_vocab=16384 \
  --out $O/qwen-mtbench
B="selfspec bench --model qwen2.5-coder-1.5b-instruct --dtype bf16 --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots"
O=${OUT:-docs/results/adadecode/xeon-2026-11-26}
A=adadecode:draft_vocab=16384
$B --dataset humaneval --n 4 --max-new-tokens 64 \
  --methods ar,$A,layers=7,14,21,gamma=0.9,$A,layers=7,14,21,gamma=0.95,$A,layers=7,14,21,gamma=0.97,$A,layers=14,21,gamma=0.9,$A,layers=14,21,24,gamma=0.9,$A,layers=7,14,21,gamma=0.9,max_early=2,dssd:draft_vocab=16384,epsilon=0.95 \
  --out $O/qwen-humaneval-b
B="selfspec bench --model qwen2.5-coder-1.5b-instruct --dtype bf16 --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots"
O=${OUT:-docs/results/adadecode/xeon-2026-11-26}
A=adadecode:draft_vocab=16384
$B --dataset humaneval --n 4 --max-new-tokens 64 \
  --methods ar,$A,layers=7,14,21,gamma=0.9,$A,layers=7,14,21,gamma=0.97,$A,gamma=0.97,$A,layers=7,14,21,gamma=0.99 \
  --out $O/qwen-humaneval-c
# alternating A/B on 5 held-out problems: python docs/results/adadecode/xeon-2026-11-26/ab_ada.py 5 2 "ar;adadecode:draft_vocab=16384|gamma=0.97;adadecode:draft_vocab=16384|layers=7,14,21|gamma=0.9"
