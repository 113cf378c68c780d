"""fp32 greedy parity of selfspec's ``ar`` with transformers' ``generate`` on a registry
model (default ``gemma3-270m``, issue 75): the same converted directory loaded by both, each
prompt's new tokens compared token for token (both stop at the model's EOS). Some prompts are
longer than 512 tokens, so Gemma 3 270M's 512-token sliding window binds on its local layers.

    PYTHONPATH=src python scripts/gemma3_parity.py \
        --out docs/results/gemma3-270m-2026-12-04/parity.json

Writes a JSON report (per prompt: its length, whether the tokens are equal, the first
differing index) and prints one line per prompt; exits 1 when a prompt differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import selfspec
from selfspec.models.provision import fetch

SHORT = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n\ndef softmax(x):",
    "Once upon a time, in a small village by the sea,",
    "Q: What is 17 times 23?\nA:",
    "class Stack:\n    def __init__(self):",
    "The three laws of thermodynamics are",
]


def long_prompts() -> list[str]:
    """Three prompts of more than 512 tokens (the window binds on the sliding layers)."""
    code = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(60))
    story = " ".join(f"On day {i} the traveller walked {i % 7 + 2} miles north and rested."
                     for i in range(80))
    table = "\n".join(f"| {i} | {i * i} | {i ** 3} |" for i in range(120))
    return [code + "def f60(x):", story + " On day 80 the traveller",
            "| n | n^2 | n^3 |\n" + table + "\n| 120 |"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = fetch(args.model, "fp32", show_progress=False)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = selfspec.load(args.model, dtype="fp32", show_progress=False)
    rows, started = [], time.time()
    for prompt in SHORT + long_prompts():
        ids = torch.tensor([engine.encode(prompt)])
        with torch.no_grad():
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=args.max_new_tokens)
        want = out[0, ids.shape[1]:].tolist()
        got = engine.generate(prompt, method="ar", max_new_tokens=args.max_new_tokens).token_ids
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                     None if len(got) == len(want) else min(len(got), len(want)))
        rows.append({"prompt_tokens": ids.shape[1], "new_tokens": len(want),
                     "equal": got == want, "first_difference": first,
                     "prompt_head": prompt[:40]})
        print(f"{ids.shape[1]:5d} prompt tokens: {'equal' if got == want else 'DIFFER'} "
              f"({len(got)} vs {len(want)} tokens, first difference {first})", flush=True)
    report = {"model": args.model, "dtype": "fp32", "max_new_tokens": args.max_new_tokens,
              "window": engine.executor.architecture.sliding_window,
              "equal": sum(r["equal"] for r in rows), "prompts": len(rows),
              "seconds": round(time.time() - started, 1),
              "versions": {"torch": torch.__version__,
                           "transformers": __import__("transformers").__version__},
              "rows": rows}
    print(f"{report['equal']}/{report['prompts']} prompts equal")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["equal"] == report["prompts"] else 1


if __name__ == "__main__":
    sys.exit(main())
