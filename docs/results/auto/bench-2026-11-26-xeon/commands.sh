#!/bin/bash
# issue 16 on a 2-core AVX-512/AMX Xeon (native bf16), after the w4a8 draft kernel: ar, ngram,
# auto, qspec on w4a8 drafts, hf-ar and hf-prompt-lookup on the four held-out datasets, each
# model, each run alone (llama.cpp not installed on this machine this time). Run at ab369f3 (runs/auto-xeon) and again at the next commit (after the n-gram and carried-estimate change; the reports beside this file).
OUT=${OUT:-runs/auto-xeon}
mkdir -p "$OUT"
for model in qwen2.5-coder-1.5b-instruct smollm2-135m-instruct; do
  n=3; tok=64; [ $model = smollm2-135m-instruct ] && n=6 && tok=96
  for ds in humaneval mtbench gsm sharegpt-summarize; do
    selfspec bench --model $model --dtype bf16 \
      --methods ar,ngram,auto,qspec:draft_weights=w4a8,hf-ar,hf-prompt-lookup \
      --dataset $ds --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots --n $n \
      --max-new-tokens $tok --out "$OUT/$model-$ds" > "$OUT/$model-$ds.log" 2>&1
  done
done
