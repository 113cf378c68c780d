#!/bin/bash
# issue 16 after the bf16 kernel's streaming prefetch (abec358): ar, ngram, auto, qspec on w4a8
# drafts and llama.cpp (Q4_K_M) on held-out HumanEval, Qwen then SmolLM2; each run alone.
OUT=${OUT:-runs/auto-he-prefetch}
mkdir -p "$OUT"
for model in qwen2.5-coder-1.5b-instruct smollm2-135m-instruct; do
  n=3; tok=64; [ $model = smollm2-135m-instruct ] && n=6 && tok=96
  selfspec bench --model $model --dtype bf16 \
    --methods ar,ngram,auto,qspec:draft_weights=w4a8,llamacpp-ar \
    --dataset humaneval --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots --n $n \
    --max-new-tokens $tok --out "$OUT/$model" > "$OUT/$model.log" 2>&1
done
# The same HumanEval prompts with `ar` and `auto` on both decoding kernels in one run
# (qwen-humaneval-decode-kernels.md): the default (auto = bf16+fp16: FBGEMM fp16 for Qwen's
# matrices, all >= 4 MiB) and selfspec's bf16 kernel for every matrix.
selfspec bench --model qwen2.5-coder-1.5b-instruct --dtype bf16 \
  --methods ar,ar:decode_kernel=bf16,auto,auto:decode_kernel=bf16 --dataset humaneval \
  --threads 2 --no-accuracy --no-plots --n 3 --max-new-tokens 64 \
  --out "${OUT%/*}/auto-he-decode-kernels" > "${OUT%/*}/auto-he-decode-kernels.log" 2>&1
