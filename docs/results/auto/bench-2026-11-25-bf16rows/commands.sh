#!/bin/bash
# issue 16 / 15: SmolLM2 on the new default decode kernel (auto = bf16+fp16), AVX2 EPYC, one run per dataset
set -e
cd /work/main
O=${1:-runs/auto-bf16rows}
selfspec bench --model smollm2-135m-instruct --dtype bf16 --methods "ar,ar:decode_kernel=weights,ngram,auto,qspec,knapspec,dssd,hf-ar,hf-prompt-lookup" --dataset humaneval --n 10 --max-new-tokens 128 --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots --out $O/smol-humaneval
for ds in mtbench gsm sharegpt-summarize; do
selfspec bench --model smollm2-135m-instruct --dtype bf16 --methods "ar,ngram,auto,qspec,hf-prompt-lookup" --dataset $ds --n 8 --max-new-tokens 128 --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots --out $O/smol-$ds
done
