#!/bin/bash
# issue 16 after the bf16 kernel's streaming prefetch (abec358): ar, ngram, auto, qspec on w4a8
# drafts and llama.cpp (Q4_K_M) on held-out HumanEval, Qwen then SmolLM2; each run alone. Run
# at abec358, when --decode-kernel auto meant bf16+fp16 (pass that flag to repeat it later).
OUT=${OUT:-runs/auto-he-prefetch}
mkdir -p "$OUT"
for model in qwen2.5-coder-1.5b-instruct smollm2-135m-instruct; do
  n=3; tok=64; [ $model = smollm2-135m-instruct ] && n=6 && tok=96
  selfspec bench --model $model --dtype bf16 \
    --methods ar,ngram,auto,qspec:draft_weights=w4a8,llamacpp-ar \
    --dataset humaneval --threads 2 --no-accuracy --bandwidth-mib 512 --no-plots --n $n \
    --max-new-tokens $tok --out "$OUT/$model" > "$OUT/$model.log" 2>&1
done
# The same HumanEval prompts with `ar` and `auto` on both decoding kernels in one run:
# `decode_kernel=bf16` (selfspec's kernel for every matrix, prefill on FBGEMM fp16 copies;
# the default since 465a087) against the rows without it, which ran on bf16+fp16 (FBGEMM
# fp16 for Qwen's matrices, all >= 4 MiB; the default before). Run at 3a658ae (-fp32-prefill) and 3db119a:
# qwen-humaneval-decode-kernels.md (-fp32-prefill.md: before forced bf16 kept fp16 copies
# for prefill), smol-humaneval-decode-kernels.md. At 465a087 and later pass
# --decode-kernel bf16+fp16 to get the old default in the rows without decode_kernel=.
for model in qwen2.5-coder-1.5b-instruct smollm2-135m-instruct; do
  n=3; tok=64; [ $model = smollm2-135m-instruct ] && n=6 && tok=96
  selfspec bench --model $model --dtype bf16 --decode-kernel bf16+fp16 \
    --methods ar,ar:decode_kernel=bf16,auto,auto:decode_kernel=bf16 --dataset humaneval \
    --threads 2 --no-accuracy --no-plots --bandwidth-mib 512 --n $n --max-new-tokens $tok \
    --out "$OUT/$model-decode-kernels" > "$OUT/$model-decode-kernels.log" 2>&1
done
# On the new default kernel (3b80d92): qwen-humaneval-new-default.md, qwen-mtbench-new-default.md.
for ds in humaneval mtbench; do
  selfspec bench --model qwen2.5-coder-1.5b-instruct --dtype bf16 \
    --methods ar,ngram,auto,qspec:draft_weights=w4a8 --dataset $ds --threads 2 --no-accuracy \
    --no-plots --bandwidth-mib 512 --n 3 --max-new-tokens 64 \
    --out "${OUT%/*}/auto-new-default/$ds" > "${OUT%/*}/auto-new-default-$ds.log" 2>&1
done
