#!/bin/bash
# issue 16: auto (w4a8 drafts) on the four datasets, Qwen then SmolLM2; each run alone.
mkdir -p "${OUT:-runs/auto-four}"
for model in qwen2.5-coder-1.5b-instruct smollm2-135m-instruct; do
  for ds in humaneval mtbench gsm sharegpt-summarize; do
    n=3; tok=64; [ $model = smollm2-135m-instruct ] && n=6 && tok=96
    selfspec bench --model $model --dtype bf16 --methods ar,ngram,auto,qspec:draft_weights=w4a8,hf-prompt-lookup \
      --dataset $ds --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots --n $n --max-new-tokens $tok \
      --out ${OUT:-runs/auto-four}/$model-$ds > ${OUT:-runs/auto-four}/$model-$ds.log 2>&1
  done
done
