"""``selfspec batch PROMPTS.jsonl --output RESULTS.jsonl [--ray]``: offline generation.

Every option of ``selfspec generate`` sets the default of each request (a line may override
it: :mod:`selfspec.batch.jobs`); a rerun with the same output file skips the ids already in
it (:mod:`selfspec.batch.results`).
"""

from __future__ import annotations

import argparse
import sys
import time

from selfspec.cli_args import (
    add_generation_arguments,
    add_model_argument,
    add_prefill_chunk_argument,
    add_threads_argument,
    add_weight_format_arguments,
    int_arg,
)


def add_batch_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``selfspec batch`` to the CLI."""
    from selfspec.methods.cli_options import add_method_arguments

    p = sub.add_parser(
        "batch", help="generate for every prompt of a JSONL file into a JSONL of results",
        description="Offline generation: each line of PROMPTS is {\"id\", \"prompt\" | "
                    "\"messages\", settings...}; each result line {\"id\", \"text\", "
                    "\"token_ids\", \"finish_reason\", \"usage\", \"stats\"} is appended to "
                    "--output as it finishes, and a rerun skips the ids already there. "
                    "Requests with equal settings run as ragged batches; --ray runs them on "
                    "Ray Data, one engine per actor.")
    p.add_argument("prompts", help="the JSONL file of requests")
    p.add_argument("--output", required=True, help="the JSONL file of results (appended)")
    add_model_argument(p)
    p.add_argument("--method", default="auto",
                   help="default decoding method of the requests (default: auto)")
    add_generation_arguments(p)
    add_weight_format_arguments(p)
    add_prefill_chunk_argument(p)
    add_threads_argument(p, help="torch intra-op threads (of each actor with --ray; "
                                 "default: torch's own, 1 per actor with --ray)")
    p.add_argument("--batch-size", type=int_arg(1, 256), default=8,
                   help="requests with equal settings decoded together (default 8)")
    p.add_argument("--ray", action="store_true",
                   help="run on Ray Data: --concurrency actors, each loading the model once")
    p.add_argument("--concurrency", type=int_arg(1), default=2,
                   help="Ray actors (default 2)")
    p.add_argument("--ray-address", default=None,
                   help="a running Ray cluster (ray start --head's address; default: "
                        "$RAY_ADDRESS, else a local cluster)")
    add_method_arguments(p)
    p.set_defaults(func=_cmd_batch)


def settings_of(args: argparse.Namespace):
    """The command line's :class:`~selfspec.batch.jobs.GenerationSettings` (checked)."""
    from selfspec.batch.jobs import GenerationSettings
    from selfspec.cli_args import response_format_of
    from selfspec.methods.cli_options import apply_method_spec, method_options
    from selfspec.methods.registry import get_method

    apply_method_spec(args)
    options = method_options(args)
    get_method(args.method).parse(options)
    return GenerationSettings(
        method=args.method, options=options, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        stop=tuple(args.stop), response_format=response_format_of(args),
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        logprobs=args.logprobs)


def _cmd_batch(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from selfspec.batch.jobs import read_requests
    from selfspec.batch.results import ResultsFile

    requests = read_requests(args.prompts, settings_of(args))  # all checked before loading
    with ResultsFile(args.output) as results:
        pending = [r for r in requests if r.key not in results.done]
        print(f"[selfspec] {len(requests)} requests, {len(requests) - len(pending)} already in "
              f"{args.output}, {len(pending)} to run", file=sys.stderr)
        if not pending:
            return 0
        bar = tqdm(total=len(pending), unit="req", file=sys.stderr)
        tokens, errors, start = 0, 0, time.perf_counter()

        def write(record: dict) -> None:
            nonlocal tokens, errors
            if results.write(record):
                tokens += record.get("usage", {}).get("completion_tokens", 0)
                errors += "error" in record
                bar.update(1)
                bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} tok/s")

        _run(args, pending, write)
        bar.close()
        missing = sum(1 for r in pending if r.key not in results.done)
    elapsed = time.perf_counter() - start
    print(f"[selfspec] wrote {len(pending) - missing} results to {args.output} ({errors} "
          f"errors): {tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tok/s)",
          file=sys.stderr)
    if missing:
        print(f"[selfspec] {missing} requests got no result; run the command again to run "
              "them", file=sys.stderr)
    return 1 if missing else 0


def _run(args: argparse.Namespace, pending, write) -> None:
    import torch

    load = {"model": args.model, "dtype": args.dtype, "decode_kernel": args.decode_kernel,
            "device": args.device, "cuda_graphs": args.cuda_graphs,
            "prefill_chunk": args.prefill_chunk}
    if args.ray:
        from selfspec.batch.ray_data import run_ray

        run_ray(pending, write, load=load, batch_size=args.batch_size,
                concurrency=args.concurrency, threads=args.threads or 1,
                address=args.ray_address)
        return
    import selfspec
    from selfspec.batch.local import run_local

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    engine = selfspec.load(**load)
    run_local(engine, pending, write, args.batch_size)
