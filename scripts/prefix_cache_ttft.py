#!/usr/bin/env python
"""Time to first token of chat turns that share a long system prompt, with and without the
prefix cache (:mod:`selfspec.decoding.core.prefix_cache`), and the outputs' identity.

Usage::

    PYTHONPATH=src python scripts/prefix_cache_ttft.py                       # bf16, 1,024 tokens
    PYTHONPATH=src python scripts/prefix_cache_ttft.py --configs bf16,fp32,bf16:fp32 --turns 3
    PYTHONPATH=src python scripts/prefix_cache_ttft.py --configs fp32 --chunks 64,128,256 \
        --interleave 3 --threads 1                      # warm vs cold by prefix-cache block

Each configuration (``DTYPE`` or ``DTYPE:BULK``, the bulk format forced with
``executor.set_bulk``: ``bf16:fp32`` is what a CPU that emulates bf16 runs) loads
SmolLM2-135M-Instruct and builds one system prompt of ``--prefix-tokens`` tokens of real
text (docs/design.md) followed by MT-Bench questions as user turns. Then:

1. every turn without the cache: its greedy tokens (the reference) and TTFT (a full prefill);
2. the same turns with a fresh cache: the first keeps the system prompt (cold), the later
   ones reuse it; their tokens must equal the references (the script exits 1 otherwise);
3. the prefill logits of one warm turn with and without the cache: the largest absolute
   difference, and whether they are bit-identical (they must be: the executor prefills in
   fixed chunks over absolute positions, see :mod:`selfspec.decoding.core.prefix_cache`);
4. for every other method of ``--methods``, greedy parity with and without the cache.

All of it at each ``--chunks`` size (the executor's prefill chunk, and so the cache's block
size: a warm turn reruns up to ``chunk - 1`` kept tokens), in ``--interleave`` rounds that
each run every size once; the script exits 1 unless the warm logits are bit-identical to the
cold ones at every size.

Timings are wall clock on a shared machine: run it where nothing else runs, and read the
ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import selfspec
from selfspec.data.prompts import load_prompts
from selfspec.decoding.core.state import DecodeOptions, DecodeState
from selfspec.executor.plan import PREFILL_CHUNK

ROOT = Path(__file__).resolve().parent.parent


def system_prompt(engine: selfspec.SelfSpec, tokens: int) -> str:
    """The first ``tokens`` tokens of docs/design.md, as text, behind one instruction line."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    return "Answer questions with this document in mind.\n\n" + engine.tokenizer.decode(ids)


def chat_ids(engine: selfspec.SelfSpec, system: str, question: str) -> list[int]:
    """The chat-templated token ids of ``system`` then ``question``, ready to answer."""
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": question}],
        add_generation_prompt=True, return_dict=False)
    return list(ids)


def prefill_logits(engine: selfspec.SelfSpec, ids: list[int]) -> torch.Tensor:
    """The last position's logits after prefilling ``ids`` (through the engine's prefix
    cache when it has one), fp32."""
    state = DecodeState(engine.executor, ids, DecodeOptions(max_new_tokens=1),
                        prefix_cache=engine.prefix_cache)
    with torch.inference_mode():
        return state.prefill().float()


def one_pass(engine: selfspec.SelfSpec, chunk: int, prompts: list[list[int]],
             args: argparse.Namespace) -> dict:
    """The turns at one prefill chunk: without the cache (references, full-prefill TTFT),
    then with a fresh cache (cold, then warm turns); the warm turn's logits with and without
    the cache; greedy parity of ``--methods`` past the first."""
    engine.use_prefix_cache(0)
    engine.executor.prefill_chunk = chunk
    full = [engine.generate(p, "ar", max_new_tokens=args.new_tokens) for p in prompts]
    engine.use_prefix_cache(args.mib)  # blocks of ``chunk`` tokens
    cached = [engine.generate(p, "ar", max_new_tokens=args.new_tokens) for p in prompts]
    same = [c.token_ids == f.token_ids for c, f in zip(cached, full, strict=False)]
    warm = prompts[1]
    with_cache = prefill_logits(engine, warm)  # the system prompt's blocks are kept
    engine.use_prefix_cache(0)
    without = prefill_logits(engine, warm)
    parity = {}
    for method in args.methods.split(",")[1:]:  # greedy parity only
        ref = [engine.generate(p, method, max_new_tokens=args.new_tokens) for p in prompts]
        engine.use_prefix_cache(args.mib)
        got = [engine.generate(p, method, max_new_tokens=args.new_tokens) for p in prompts]
        engine.use_prefix_cache(0)
        parity[method] = ([g.stats.cached_tokens for g in got],
                          [g.token_ids == f.token_ids for g, f in zip(got, ref, strict=False)])
    return {"full": [r.stats.ttft_ms for r in full], "cached": [r.stats.ttft_ms for r in cached],
            "cached_tokens": [r.stats.cached_tokens for r in cached], "same": same,
            "diff": float((with_cache - without).abs().max()),
            "argmax_equal": int(with_cache.argmax()) == int(without.argmax()),
            "parity": parity}


def run_config(config: str, args: argparse.Namespace, questions: list[str]) -> bool:
    """Time the turns of one ``DTYPE[:BULK]`` config at every ``--chunks`` size, in
    ``--interleave`` rounds that each run every size once (rotated order), and print the
    tables; whether every method's tokens were equal with and without the cache and the
    warm logits bit-identical to the cold ones at every size."""
    dtype, _, bulk = config.partition(":")
    engine = selfspec.load(args.model, dtype=dtype, show_progress=False)
    if bulk:
        engine.executor.set_bulk(bulk)
    formats = engine.executor.formats
    system = system_prompt(engine, args.prefix_tokens)
    prompts = [chat_ids(engine, system, q) for q in questions]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts[:2], strict=False)) if a != b)
    engine.generate("Hello", max_new_tokens=2)  # one-time costs out of the timings
    chunks = [int(c) for c in args.chunks.split(",")]
    runs: dict[int, list[dict]] = {c: [] for c in chunks}
    for r in range(args.interleave):
        for c in chunks[r % len(chunks):] + chunks[:r % len(chunks)]:
            runs[c].append(one_pass(engine, c, prompts, args))
    print(f"\n## {config}: weights {dtype}, bulk {formats.bulk}, rows {formats.rows}, "
          f"{torch.get_num_threads()} threads")
    print(f"prompts {[len(p) for p in prompts]} tokens, shared prefix {shared}, "
          f"{args.new_tokens} new tokens, method ar, {args.interleave} interleaved round(s): "
          "per chunk the fastest round's figures (a full prefill and the cold turn: the "
          "median over turns, resp. the first turn; warm: the median of the later turns)\n")
    print("| chunk | cached tokens (warm turns) | full prefill TTFT ms | cold TTFT ms | "
          "warm TTFT ms | cold / warm | full / warm | tokens equal | warm logits "
          "bit-identical |")
    print("|---:|---|---:|---:|---:|---:|---:|---|---|")
    ok = True
    for c in chunks:
        full = min(statistics.median(x["full"]) for x in runs[c])
        cold = min(x["cached"][0] for x in runs[c])
        warm = min(statistics.median(x["cached"][1:]) for x in runs[c])
        same = all(all(x["same"]) for x in runs[c])
        exact = all(x["diff"] == 0.0 for x in runs[c])
        print(f"| {c} | {runs[c][0]['cached_tokens'][1:]} | {full:.0f} | {cold:.0f} | "
              f"{warm:.0f} | {cold / warm:.1f}x | {full / warm:.1f}x | {same} | {exact} "
              f"(max diff {max(x['diff'] for x in runs[c]):.3g}) |")
        ok &= same and exact
        for method, (kept, equal) in runs[c][0]["parity"].items():
            print(f"chunk {c}, {method}: cached tokens {kept}, tokens equal {equal}")
            ok &= all(equal)
    return ok


def main() -> int:
    """Run every ``--configs`` entry; exit status 0 when all tokens were equal, else 1."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="registry name, directory or .gguf (default smollm2-135m-instruct)")
    parser.add_argument("--configs", default="bf16",
                        help="comma-separated DTYPE or DTYPE:BULK (default bf16)")
    parser.add_argument("--prefix-tokens", type=int, default=1024,
                        help="tokens of document text in the system prompt (default 1024)")
    parser.add_argument("--turns", type=int, default=4, help="user turns (default 4)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--mib", type=int, default=256, help="prefix cache size (default 256)")
    parser.add_argument("--methods", default="ar",
                        help="ar first (timed), then methods whose greedy parity is checked "
                             "(e.g. ar,auto,ngram)")
    parser.add_argument("--chunks", default=str(PREFILL_CHUNK),
                        help="comma-separated prefill chunks, i.e. prefix-cache block sizes "
                             f"(default {PREFILL_CHUNK})")
    parser.add_argument("--interleave", type=int, default=1,
                        help="rounds, each running every chunk size once in a rotated order; "
                             "the fastest round of each is reported (default 1)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    questions = [p.text for p in load_prompts("mtbench", args.turns)]
    ok = True
    for config in args.configs.split(","):
        t0 = time.perf_counter()
        ok &= run_config(config.strip(), args, questions)
        print(f"({time.perf_counter() - t0:.0f} s)")
    print("\nall outputs identical" if ok else "\nOUTPUTS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
