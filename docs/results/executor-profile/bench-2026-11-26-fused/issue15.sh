#!/bin/bash
# issue 15: one bench run per model: bf16 ar, 4-bit ar (w4a8, torch int4), the best lossless method on 4-bit drafts, hf-ar, llama.cpp
OUT=${OUT:-runs/issue15}
mkdir -p $OUT
selfspec bench --model smollm2-135m-instruct --dtype bf16 --methods ar,ar:decode_kernel=w4a8,ar:decode_kernel=int4,qspec:draft_weights=w4a8,auto,hf-ar,llamacpp-ar \
  --dataset humaneval --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots --n 6 --max-new-tokens 96 --out $OUT/smol > $OUT/smol.log 2>&1
selfspec bench --model qwen2.5-coder-1.5b-instruct --dtype bf16 --methods ar,ar:decode_kernel=w4a8,ar:decode_kernel=int4,qspec:draft_weights=w4a8,auto,hf-ar,llamacpp-ar \
  --dataset humaneval --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots --n 3 --max-new-tokens 64 --out $OUT/qwen > $OUT/qwen.log 2>&1
