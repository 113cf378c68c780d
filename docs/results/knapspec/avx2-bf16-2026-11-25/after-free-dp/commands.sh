#!/bin/bash
# KnapSpec's "never slower than ar by more than 5%" on the AVX2 EPYC (bf16), SmolLM2.
set -ex
cd /work/main
B="selfspec -v bench --threads 2 --no-accuracy --bandwidth-mib 0 --no-plots"
S=smollm2-135m-instruct; O=/work/runs/s35/bench
$B --model $S --dtype bf16 --dataset humaneval --n 5 --max-new-tokens 96 --methods ar,knapspec --out $O/knap2-smollm2-humaneval
$B --model $S --dtype bf16 --dataset sharegpt-summarize --n 3 --max-new-tokens 96 --methods ar,knapspec --out $O/knap2-smollm2-sharegpt
