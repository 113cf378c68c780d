"""Greedy tokens of a registry model decoded on its GGUF blocks (``dtype="gguf"``) against the
de-quantised fp32 model and the dense bf16 model (default ``gemma3-270m``, issue 75 item 5).

The GGUF kernels round activations to Q8 blocks between the products, so a token may differ
where the fp32 model's top two logits nearly tie; the fp32 margin at the first new token is
printed to tell such a tie from a mapping error (which changes every prompt at once).

    PYTHONPATH=src python scripts/gguf_block_parity.py --model gemma3-270m --tokens 32

Prints one block per prompt (equal prefix and positions against fp32, the three texts).
"""

from __future__ import annotations

import argparse
import gc

import torch

import selfspec

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time, there was a"]


def greedy(model: str, dtype: str, tokens: int) -> tuple[list[list[int]], list[str], list]:
    """Each prompt's greedy token ids and text under ``dtype``, and (fp32 only) the top-2
    logits of the first new token."""
    engine = selfspec.load(model, dtype=dtype, show_progress=False)
    ids, texts, tops = [], [], []
    for prompt in PROMPTS:
        out = engine.generate(prompt, method="ar", max_new_tokens=tokens)
        ids.append(list(out.token_ids))
        texts.append(out.text)
        if dtype == "fp32":
            prompt_ids = engine.tokenizer(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                top = engine.model(prompt_ids).logits[0, -1].float().topk(2)
            tops.append([(engine.tokenizer.decode([i]), round(v, 3))
                         for i, v in zip(top.indices.tolist(), top.values.tolist())])
    del engine
    gc.collect()
    return ids, texts, tops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    runs = {dtype: greedy(args.model, dtype, args.tokens) for dtype in ("gguf", "fp32", "bf16")}
    for n, prompt in enumerate(PROMPTS):
        g, f = runs["gguf"][0][n], runs["fp32"][0][n]
        prefix = next((i for i, (a, b) in enumerate(zip(g, f)) if a != b), min(len(g), len(f)))
        same = sum(a == b for a, b in zip(g, f))
        print(f"{prompt!r}: gguf vs fp32 equal prefix {prefix}/{args.tokens}, equal positions "
              f"{same}/{args.tokens}; fp32 top-2 of the first token {runs['fp32'][2][n]}")
        for dtype in runs:
            print(f"  {dtype}: {runs[dtype][1][n][:100]!r}")


if __name__ == "__main__":
    main()
