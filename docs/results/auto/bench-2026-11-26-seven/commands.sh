#!/bin/bash
# issue 16: ar, ngram, auto, the best single self-speculative method (qspec on w4a8 drafts),
# hf-ar, hf-prompt-lookup and llama.cpp (Q4_K_M) on the four held-out datasets, Qwen then
# SmolLM2; each run alone (nothing else on the machine).
OUT=${OUT:-runs/auto-seven}
mkdir -p "$OUT"
for model in qwen2.5-coder-1.5b-instruct smollm2-135m-instruct; do
  for ds in humaneval mtbench gsm sharegpt-summarize; do
    n=3; tok=64; [ $model = smollm2-135m-instruct ] && n=6 && tok=96
    selfspec bench --model $model --dtype bf16 \
      --methods ar,ngram,auto,qspec:draft_weights=w4a8,hf-ar,hf-prompt-lookup,llamacpp-ar \
      --dataset $ds --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots --n $n \
      --max-new-tokens $tok --out "$OUT/$model-$ds" > "$OUT/$model-$ds.log" 2>&1
  done
done
