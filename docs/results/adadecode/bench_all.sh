#!/bin/bash
# AdaDecode benchmarks (issue 13): Table 3 rows + gamma sweep, fp32, held-out prompts; then bf16 parity.
set -x
cd /work/main
B="python -m selfspec.cli -v bench --threads 2 --no-accuracy --bandwidth-mib 0"
S=smollm2-135m-instruct; Q=qwen2.5-coder-1.5b-instruct; O=/work/runs/s13/bench
$B --model $S --dtype fp32 --dataset humaneval --n 5 --max-new-tokens 128 \
  --methods ar,adadecode,adadecode:draft_vocab=4096,adadecode:draft_vocab=4096,verify=false,adadecode:draft_vocab=4096,layers=18,adadecode:heads=none \
  --sweep adadecode:draft_vocab=4096:gamma=0.5,0.85,0.95 --out $O/smollm2-humaneval
$B --model $Q --dtype fp32 --dataset humaneval --n 3 --max-new-tokens 96 \
  --methods ar,adadecode:draft_vocab=16384,adadecode:draft_vocab=16384,verify=false,adadecode:heads=none --out $O/qwen-humaneval
$B --model $S --dtype fp32 --dataset mtbench --n 5 --max-new-tokens 128 \
  --methods ar,adadecode,adadecode:draft_vocab=4096,adadecode:heads=none --out $O/smollm2-mtbench
$B --model $Q --dtype fp32 --dataset mtbench --n 2 --max-new-tokens 96 \
  --methods ar,adadecode:draft_vocab=16384 --out $O/qwen-mtbench
$B --model $S --dtype bf16 --dataset humaneval --n 3 --max-new-tokens 64 \
  --methods ar,adadecode,adadecode:draft_vocab=4096,adadecode:heads=none,gamma=0.3 --out $O/smollm2-bf16-parity
