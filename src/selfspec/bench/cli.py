"""``selfspec bench``: the benchmark command (registered by :mod:`selfspec.cli`)."""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import datetime
from pathlib import Path

from selfspec.data import DATASETS

DEFAULT_BASELINES = ("hf-ar", "hf-early-exit", "hf-prompt-lookup")


def default_methods() -> str:
    """Every registered selfspec method with its default options, then the transformers
    baselines that need no second model."""
    from selfspec.methods.registry import METHODS

    return ",".join([*METHODS, *DEFAULT_BASELINES])


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``subparsers``; returns its parser."""
    p = subparsers.add_parser(
        "bench", help="benchmark methods on real prompts against transformers' decoding",
        description="Run every method on the same prompts, interleaved prompt by prompt after "
                    "a warm-up, and write per-prompt JSONL, summary.json, report.md and PNG "
                    "plots to --out. Prints the markdown table at the end.",
        epilog="Methods: NAME[:key=value,...], e.g. layerskip:exit_layer=24,draft_len=4 or "
               "hf-assistant:model=qwen2.5-coder-0.5b-instruct. "
               "Sweeps: NAME:key=v1,v2:key2=a..b, "
               "e.g. layerskip:exit_layer=18,22,26:draft_len=1..6.")
    p.add_argument("--model", default=None,
                   help="registry name, local directory or hub id (default: smollm2-135m-instruct)")
    p.add_argument("--methods", action="append", default=None,
                   help="comma-separated method specs (repeatable; default: "
                        "all selfspec methods + hf-ar,hf-early-exit,hf-prompt-lookup)")
    p.add_argument("--sweep", action="append", default=[],
                   help="a grid of one method's options, added to --methods (repeatable)")
    p.add_argument("--dataset", default="humaneval", choices=DATASETS,
                   help="prompt set (default: humaneval)")
    p.add_argument("--n", type=int, default=10, help="prompts per method (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed; prompt selection: 0 = the dataset's first n prompts, "
                        "else a seeded sample (default 0)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads, fixed for the run and recorded "
                        "(default: torch's default)")
    p.add_argument("--warmup", type=int, default=1,
                   help="prompts each method generates for before timing (default 1)")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default: out/bench/MODEL-DATASET-TIME)")
    p.add_argument("--no-accuracy", dest="score", action="store_false",
                   help="skip HumanEval / GSM scoring of the outputs")
    p.add_argument("--bandwidth-mib", type=int, default=512,
                   help="buffer for the bandwidth measurement in MiB (0 = skip the roofline)")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    p.set_defaults(func=cmd_bench)
    return p


def _methods(args: argparse.Namespace) -> list:
    from selfspec.bench.spec import combine, parse_methods, parse_sweep
    from selfspec.errors import InvalidArgumentError

    methods = []
    texts = args.methods
    if texts is None:  # no --methods: the defaults, unless only a sweep was asked for
        texts = [] if args.sweep else [default_methods()]
    for text in texts:
        methods += parse_methods(text)
    for sweep in args.sweep:
        methods += parse_sweep(sweep)
    if not methods:
        raise InvalidArgumentError("no methods to run; pass --methods or --sweep")
    return combine(methods)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark; prints the table on stdout and the progress bar on stderr."""
    import torch
    from tqdm import tqdm

    import selfspec
    from selfspec.bench.pipeline import BenchOptions, run_benchmark
    from selfspec.bench.report import ensure_writable
    from selfspec.data import load_prompts
    from selfspec.errors import InvalidArgumentError
    from selfspec.models.registry import DEFAULT_MODEL

    # Everything that can be refused is refused before the model loads (seconds to minutes).
    methods = _methods(args)
    if args.max_new_tokens < 1:
        raise InvalidArgumentError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise InvalidArgumentError(f"--temperature must be >= 0, got {args.temperature}")
    if args.threads is not None and args.threads < 1:
        raise InvalidArgumentError(f"--threads must be >= 1, got {args.threads}")
    prompts = load_prompts(args.dataset, args.n, args.seed)
    model = args.model or DEFAULT_MODEL
    out = args.out or Path("out", "bench", "{}-{}-{}".format(
        Path(model).name, args.dataset, datetime.now().strftime("%Y%m%d-%H%M%S")))
    ensure_writable(out)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = selfspec.load(model, dtype=args.dtype)
    options = BenchOptions(
        dataset=args.dataset, max_new_tokens=args.max_new_tokens, out_dir=out,
        temperature=args.temperature, seed=args.seed, warmup_prompts=args.warmup,
        score=args.score, bandwidth_mib=args.bandwidth_mib, plots=args.plots,
        command="selfspec " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "")
    warm = min(args.warmup, len(prompts)) * len(methods)
    with tqdm(total=warm + len(prompts) * len(methods), desc="bench", unit="gen",
              file=sys.stderr, dynamic_ncols=True) as bar:
        def progress(event) -> None:
            if event.phase == "score":
                return
            bar.set_postfix_str(f"{event.phase} {event.method} {event.prompt_id}", refresh=False)
            bar.update(1)

        report = run_benchmark(engine, methods, prompts, options, progress=progress)
    print(report.table, end="")
    failed = [s.method for s in report.summaries if s.failed]
    print(f"\nreport: {out / 'report.md'}  ({len(report.files)} files in {out})", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)} (see the table)", file=sys.stderr)
    return 1 if len(failed) == len(report.summaries) else 0
