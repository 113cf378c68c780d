#!/bin/bash
# Table 3's full-parameter-heads row (AdaDecode), SmolLM2-135M fp32, against the lightweight heads in one run.
set -ex
cd /work/main
B="selfspec -v bench --threads 2 --no-accuracy --bandwidth-mib 0"
S=smollm2-135m-instruct; F=/work/runs/s35/full-heads; O=/work/runs/s35/bench
$B --model $S --dtype fp32 --dataset humaneval --n 5 --max-new-tokens 128 \
  --methods ar,adadecode:draft_vocab=4096,adadecode:heads=$F,draft_vocab=4096,adadecode:draft_vocab=4096,gamma=0.85,adadecode:heads=$F,draft_vocab=4096,gamma=0.85 \
  --out $O/smollm2-humaneval-full
$B --model $S --dtype fp32 --dataset mtbench --n 5 --max-new-tokens 128 \
  --methods ar,adadecode:draft_vocab=4096,adadecode:heads=$F,draft_vocab=4096 \
  --out $O/smollm2-mtbench-full
