#!/bin/bash
# issue 16 on the 2-core AVX-512/AMX Xeon (native bf16) after auto's token-by-token draft stop
# (draft_stop=tpt), the measured verification table (T = 1..32) and the qspec prior 0.95:
# ar, ngram, auto, qspec on w4a8 drafts, hf-ar, hf-prompt-lookup and llamacpp-ar (llama.cpp
# built without AMX: its native AMX build dies with SIGSEGV on this VM) on the four held-out
# datasets, each model, each run alone. Reports beside this file.
OUT=${OUT:-runs/auto-xeon-tpt}
mkdir -p "$OUT"
for model in qwen2.5-coder-1.5b-instruct smollm2-135m-instruct; do
  n=4; tok=64; [ $model = smollm2-135m-instruct ] && n=6 && tok=96
  for ds in humaneval mtbench gsm sharegpt-summarize; do
    selfspec bench --model $model --dtype bf16 \
      --methods ar,ngram,auto,qspec:draft_weights=w4a8,hf-ar,hf-prompt-lookup,llamacpp-ar \
      --dataset $ds --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots --n $n \
      --max-new-tokens $tok --out "$OUT/$model-$ds" > "$OUT/$model-$ds.log" 2>&1
  done
done
