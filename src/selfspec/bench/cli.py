"""``selfspec bench``: the benchmark command (registered by :mod:`selfspec.cli`)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import shlex
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.cli_args import (
    add_dtype_argument,
    add_model_argument,
    add_threads_argument,
    add_weight_format_arguments,
    float_arg,
    int_arg,
)
from selfspec.data import DATASETS
from selfspec.validation import SEED_MAX, SEED_MIN

if TYPE_CHECKING:  # the command imports them when it runs (a fast --help)
    from selfspec.api import SelfSpec
    from selfspec.bench.pipeline import BenchOptions, BenchReport
    from selfspec.bench.spec import MethodConfig
    from selfspec.data import Prompt

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
        description="Run every method on the same prompts (a --dataset, or your own "
                    "--prompts file), interleaved prompt by prompt after a warm-up, and write "
                    "per-prompt JSONL, summary.json, report.md and PNG plots to --out. Prints "
                    "the markdown table at the end.",
        epilog="Methods: NAME[:key=value,...], e.g. layerskip:exit_layer=24,draft_len=4 or "
               "hf-assistant:model=qwen2.5-coder-0.5b-instruct. "
               "Sweeps: NAME:key=v1,v2:key2=a..b, "
               "e.g. layerskip:exit_layer=18,22,26:draft_len=1..6. "
               "Other benchmarks: selfspec bench serve-load | serve-mix | skip-analysis "
               "--help.")
    add_model_argument(p)
    p.add_argument("--methods", action="append", default=None,
                   help="comma-separated method specs (repeatable; default: "
                        "all selfspec methods + hf-ar,hf-early-exit,hf-prompt-lookup)")
    p.add_argument("--sweep", action="append", default=[],
                   help="a grid of one method's options, added to --methods (repeatable)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--dataset", default="humaneval", choices=DATASETS,
                        help="prompt set (default: humaneval)")
    source.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                        help='your own prompts, one JSON object per line: {"id": ..., '
                             '"prompt": ..., "chat": true|false (default false), '
                             '"reference": ... (optional, scored for accuracy)}')
    p.add_argument("--n", type=int, default=None,
                   help="prompts per method (default: 10 of a --dataset, the 20 held-out tasks of "
                        "json-extract, all of --prompts); a prompt that trained a method's "
                        "heads (or is in json-extract's calibration split) is replaced by the "
                        "next held-out one")
    p.add_argument("--max-new-tokens", type=int_arg(1), default=128)
    p.add_argument("--batch-size", type=int_arg(1, 256), default=1,
                   help="prompts each method generates together as one ragged batch (ar, ngram "
                        "and auto share forwards across rows; hf-ar batches with left padding; "
                        "the other methods run their rows in turn); tokens/s is then the "
                        "aggregate throughput (default 1)")
    add_weight_format_arguments(p)
    p.add_argument("--temperature", type=float_arg(0.0), default=0.0,
                   help="0 = greedy (default)")
    p.add_argument("--top-p", type=float_arg(0.0, 1.0, low_open=True), default=1.0,
                   help="nucleus mass in (0, 1] when sampling (default 1 = off)")
    p.add_argument("--seed", type=int_arg(SEED_MIN, SEED_MAX), default=0,
                   help="sampling seed; prompt selection: 0 = the dataset's (or file's) "
                        "first n prompts, else a seeded sample (default 0)")
    add_threads_argument(p, help="torch intra-op threads, fixed for the run and recorded "
                                 "(default: torch's default)")
    p.add_argument("--warmup", type=int_arg(0), default=1,
                   help="prompts each method generates for before timing (default 1)")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default: out/bench/MODEL-DATASET-TIME)")
    p.add_argument("--resume", type=Path, default=None, metavar="DIR",
                   help="continue the interrupted run saved in DIR (in place of --out): repeat "
                        "its options; generations it finished are not run again")
    p.add_argument("--overwrite", action="store_true",
                   help="with --out: replace the folder's previous selfspec bench outputs "
                        "(refused if it holds other files); without it a non-empty --out is "
                        "refused")
    p.add_argument("--no-accuracy", dest="score", action="store_false",
                   help="skip HumanEval / GSM / --prompts reference scoring of the outputs")
    p.add_argument("--unsafe-run-code", action="store_true",
                   help="where no sandbox works (bubblewrap or user namespaces), run HumanEval "
                        "completions unsandboxed instead of refusing: only for models you "
                        "trust, on a machine you do not mind")
    p.add_argument("--bandwidth-mib", type=int_arg(0), default=512,
                   help="buffer for the bandwidth measurement in MiB (0 = skip the roofline)")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    p.add_argument("--allow-in-sample", action="store_true",
                   help="keep prompts that a method's exit heads, thresholds or probes saw in "
                        "training or calibration (default: drop them); the run is then "
                        "labelled in-sample in the table, report.md and summary.json")
    p.set_defaults(func=cmd_bench)
    add_bench_tools(p)
    return p


def add_bench_tools(bench: argparse.ArgumentParser) -> None:
    """Add ``selfspec bench serve-load | serve-mix | skip-analysis`` to the ``bench`` parser
    (without one of them, ``selfspec bench`` is the benchmark itself). Each tool's module
    adds its own flags (``add_arguments(parser)``) and runs from their values."""
    from selfspec.bench import skip_analysis
    from selfspec.bench.serve_load import mix, run

    tools = bench.add_subparsers(dest="bench_tool", title="other benchmarks",
                                 metavar="{serve-load,serve-mix,skip-analysis}")
    for name, module, entry, help in (
            ("serve-load", run, run.run_load,
             "load test of `selfspec serve`: streaming clients at several concurrency levels; "
             "throughput, time to first token, memory"),
            ("serve-mix", mix, mix.run_mixed,
             "mixed load test of `selfspec serve`: every kind of request at once, /metrics "
             "against the clients' counts, SIGTERM with requests in flight"),
            ("skip-analysis", skip_analysis, skip_analysis.run_analysis,
             "KnapSpec's analyses: the latency model against measurements, throughput "
             "against predicted tokens per time (Figure 2), skips against context (Figure 3)")):
        parser = tools.add_parser(name, help=help, description=module.__doc__.split("\n\n")[0])
        module.add_arguments(parser)
        # The namespace also holds bench's and the top-level parser's values, which would
        # end up in a tool's JSON: the tool gets its own flags only.
        own = tuple(action.dest for action in parser._actions  # no public list of them
                    if action.dest not in ("help", argparse.SUPPRESS))
        parser.set_defaults(func=functools.partial(_run_tool, entry, own))


def _run_tool(entry: Callable[[argparse.Namespace], int], own: tuple[str, ...],
              args: argparse.Namespace) -> int:
    """Call a bench tool's ``entry`` with the values of its own flags ``own`` only."""
    return entry(argparse.Namespace(**{dest: getattr(args, dest) for dest in own}))


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


def _prompts(args: argparse.Namespace, dataset: str) -> list:
    """The prompts to run: ``--n`` of the ``--dataset`` (default 10) or of the ``--prompts``
    file (default all), chosen by ``--seed``, followed by the rest of the set (replacements
    for prompts the held-out check drops); ``dataset`` is the report's label.

    Raises:
        InvalidArgumentError: a malformed prompt file, a bad ``--n``.
        DatasetUnavailableError: the dataset's package is not installed.
    """
    from selfspec.data import load_prompt_file, load_prompts
    from selfspec.data.prompt import with_reserve

    if args.prompts is None:
        # Every prompt, the chosen n first: the run replaces prompts that trained a
        # method's heads with the next ones (BenchOptions.n), so n prompts still run.
        return with_reserve(load_prompts(args.dataset), _n(args), args.seed, dataset)
    return with_reserve(load_prompt_file(args.prompts), args.n, args.seed, dataset)


def _check_constraints(prompts: list) -> None:
    """Validate the prompts' output constraints (json-extract's schemas) without a model.

    Raises:
        InvalidArgumentError: a schema llguidance refuses (names the prompt).
        MissingDependencyError: llguidance is not installed.
    """
    from selfspec.decoding.core.grammar import check_response_format
    from selfspec.errors import InvalidArgumentError

    for prompt in prompts:
        try:
            check_response_format(prompt.meta.get("response_format"))
        except InvalidArgumentError as err:
            raise InvalidArgumentError(f"prompt {prompt.id}: {err}") from None


def _n(args: argparse.Namespace) -> int:
    """Prompts to run: ``--n``, else :func:`selfspec.data.bench_size` of the dataset (10;
    json-extract: its held-out split)."""
    from selfspec.data import bench_size

    return bench_size(args.dataset) if args.n is None else args.n


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark; prints the table on stdout and the progress bar on stderr.

    On Ctrl-C (or SIGTERM) or a crash, says where the finished generations are and how to
    resume, then lets the exception through.
    """
    import torch

    import selfspec
    from selfspec.models.registry import DEFAULT_MODEL

    # Everything that can be refused is refused before the model loads (seconds to minutes).
    methods, dataset, prompts = _refuse_early(args)
    model = args.model or DEFAULT_MODEL
    if args.threads:
        torch.set_num_threads(args.threads)
    options = _bench_options(args, dataset, args.resume or args.out)
    options = _claim_out_dir(args, options, model, methods, prompts)
    engine = selfspec.load(model, dtype=args.dtype, decode_kernel=args.decode_kernel,
                           device=args.device, cuda_graphs=args.cuda_graphs)
    report = _run_with_bar(engine, methods, prompts, options, args)
    return _print_outcome(report, Path(options.out_dir))


def _refuse_early(args: argparse.Namespace
                  ) -> tuple[list[MethodConfig], str, list[Prompt]]:
    """The flag checks made before the model loads. Returns (methods, dataset label, prompts).
    Raises InvalidArgumentError (flags), MissingDependencyError (plots, scorer)."""
    from selfspec.bench.plots import require_matplotlib
    from selfspec.data.promptfile import file_label
    from selfspec.errors import InvalidArgumentError

    methods = _methods(args)
    if args.resume is not None and args.out is not None:
        raise InvalidArgumentError("--resume DIR names the output folder; drop --out")
    if args.overwrite and args.out is None:
        raise InvalidArgumentError("--overwrite needs --out DIR (the default output folder is "
                                   "always a new one)")
    if args.plots:
        require_matplotlib()
    dataset = args.dataset if args.prompts is None else file_label(args.prompts)
    prompts = _prompts(args, dataset)
    _check_constraints(prompts)
    if args.score:
        from selfspec.bench.accuracy import require_scorer

        require_scorer(dataset)
    return methods, dataset, prompts


def _bench_options(args: argparse.Namespace, dataset: str, out: Path | None) -> BenchOptions:
    """The :class:`~selfspec.bench.pipeline.BenchOptions` the flags ask for (``out``:
    ``--resume`` or ``--out``; ``None``: a new folder is claimed later)."""
    from selfspec.bench.pipeline import BenchOptions

    return BenchOptions(
        dataset=dataset, max_new_tokens=args.max_new_tokens, out_dir=out or Path(),
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, warmup_prompts=args.warmup,
        score=args.score, unsafe_run_code=args.unsafe_run_code,
        bandwidth_mib=args.bandwidth_mib, plots=args.plots,
        command="selfspec " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "",
        allow_in_sample=args.allow_in_sample, resume=args.resume is not None,
        overwrite=args.overwrite, batch_size=args.batch_size,
        n=_n(args) if args.prompts is None else args.n)


def _claim_out_dir(args: argparse.Namespace, options: BenchOptions, model: str,
                   methods: list[MethodConfig], prompts: list[Prompt]) -> BenchOptions:
    """Without ``--out`` / ``--resume``, claim a new folder under out/bench (never one another
    run took); else check the named one now, before the model loads. Returns the options
    with their ``out_dir``. Raises InvalidArgumentError as ``check_out_dir``."""
    from selfspec.bench import outdir
    from selfspec.bench.pipeline import output_mode, run_identity
    from selfspec.bench.report import ensure_writable

    out = args.resume or args.out
    if out is None:  # a new folder, never one another run took
        out = outdir.claim_new_dir(Path("out", "bench", "{}-{}-{}".format(
            Path(model).name, options.dataset.replace(":", "-"),
            datetime.now().strftime("%Y%m%d-%H%M%S"))))
        return replace(options, out_dir=out)
    identity = run_identity(model, args.dtype, methods, prompts, options)
    outdir.check_out_dir(out, output_mode(options), identity)
    ensure_writable(out)
    return options


def _run_with_bar(engine: SelfSpec, methods: list[MethodConfig], prompts: list[Prompt],
                  options: BenchOptions, args: argparse.Namespace) -> BenchReport:
    """:func:`~selfspec.bench.pipeline.run_benchmark` under a progress bar on stderr; on an
    exception after the first generation started, says how to resume and re-raises."""
    from tqdm import tqdm

    from selfspec.bench.pipeline import run_benchmark

    out = Path(options.out_dir)
    started = False
    with tqdm(total=None, desc="bench", unit="gen", file=sys.stderr,
              dynamic_ncols=True) as bar:
        def progress(event) -> None:
            nonlocal started
            if event.phase == "start":
                started = True
                bar.reset(total=event.total)
                return
            if event.phase == "score":
                return
            bar.set_postfix_str(f"{event.phase} {event.method} {event.prompt_id}", refresh=False)
            bar.update(1)

        try:
            with _sigterm_as_interrupt():
                return run_benchmark(engine, methods, prompts, options, progress=progress)
        except BaseException:
            if started:
                bar.close()
                _say_how_to_resume(out, args)
            raise


def _print_outcome(report: BenchReport, out: Path) -> int:
    """Print the table (stdout) and where the report is, resumed sessions and failed rows
    (stderr). Returns the exit status: 1 when every row failed, else 0."""
    print(report.table, end="")
    failed = [s.method for s in report.summaries if s.failed]
    print(f"\nreport: {out / 'report.md'}  ({len(report.files)} files in {out})", file=sys.stderr)
    if len(report.info.sessions) > 1:
        print(f"resumed: {len(report.info.sessions)} processes made this run; their timings "
              "are mixed (see report.md)", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)} (see the table)", file=sys.stderr)
    return 1 if len(failed) == len(report.summaries) else 0


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while benchmarking, so ``kill`` also leaves the
    partial report (main thread only; the previous handler is restored)."""
    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _say_how_to_resume(out: Path, args: argparse.Namespace) -> None:
    from selfspec.bench import outdir

    try:
        saved = outdir.read_saved_run(out)
    except Exception:  # noqa: BLE001 - a hint must not hide the real error
        saved = None
    if saved is None:
        return
    done = f"{len(saved.records)} of {saved.planned} generations"
    print(f"\nstopped: {done} finished; they are saved in {out} ({outdir.JOURNAL_FILE}, and a "
          "partial records.jsonl, summary.json and report.md)", file=sys.stderr)
    if sys.argv[1:2] == ["bench"]:
        argv = _without_out_flags(sys.argv[2:])
        command = "selfspec bench " + shlex.join([*argv, "--resume", str(out)])
    else:
        command = f"selfspec bench <the same options> --resume {shlex.quote(str(out))}"
    print(f"continue with: {command}", file=sys.stderr)


def _without_out_flags(argv: list[str]) -> list[str]:
    """``argv`` without ``--out``/``--resume`` (and their values) and ``--overwrite``."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out", "--resume"):
            skip = True
        elif arg != "--overwrite" and not arg.startswith(("--out=", "--resume=")):
            kept.append(arg)
    return kept


def add_bench_cpu_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``bench-cpu`` subcommand (:mod:`selfspec.bench.formats`); returns its parser."""
    p = subparsers.add_parser(
        "bench-cpu", help="measure prefill, decoding, head training and batched generation "
                          "with and without per-shape number formats on this CPU",
        description="Measures each kind of work twice in one run: every matrix product in the "
                    "weights' format (before) and with the automatic per-shape choice (after). "
                    "--isa native,avx2 repeats it restricted to AVX2 kernels "
                    "(ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2), to see on a machine "
                    "with native bf16 what users of AVX2-only CPUs get. Writes formats-*.json "
                    "and report.md to --out and prints the table.")
    add_model_argument(p)
    add_dtype_argument(p)
    p.add_argument("--lengths", default="256,1024,4096",
                   help="prefill prompt lengths, comma-separated (default 256,1024,4096)")
    p.add_argument("--decode-tokens", type=int_arg(2), default=64,
                   help="ar tokens to time (default 64)")
    p.add_argument("--train-steps", type=int_arg(0), default=2,
                   help="heads-training steps to time per configuration (0 = skip; default 2)")
    p.add_argument("--no-onpolicy", dest="onpolicy", action="store_false",
                   help="skip batched on-policy generation")
    add_threads_argument(p)
    p.add_argument("--isa", default="native",
                   help="comma-separated kernel sets to measure: native, avx2 (default native)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default runs/bench-cpu-<model>-<time>)")
    p.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)  # child runs
    p.add_argument("--label", default="native", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_bench_cpu)
    return p


def cmd_bench_cpu(args: argparse.Namespace) -> int:
    """Run ``selfspec bench-cpu``."""
    import torch

    from selfspec.bench import formats
    from selfspec.errors import InvalidArgumentError

    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgumentError(
            f"--lengths takes integers, e.g. 256,1024; got {args.lengths!r}") from None
    isas = [x.strip() for x in args.isa.split(",") if x.strip()]
    unknown = [x for x in isas if x not in formats.ISA_ENV]
    if unknown or not isas:
        raise InvalidArgumentError(f"--isa takes {', '.join(formats.ISA_ENV)}; got {args.isa!r}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.json is not None:  # a child run: one ISA, this process
        report = formats.measure(args.model, args.dtype, lengths, args.decode_tokens,
                                 args.train_steps, args.onpolicy, isa=args.label)
        formats.save_report(report, args.json)
        return 0
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or Path("runs") / f"bench-cpu-{args.model or 'default'}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    child = ["--dtype", args.dtype, "--lengths", args.lengths, "--decode-tokens",
             str(args.decode_tokens), "--train-steps", str(args.train_steps)]
    if args.model:
        child += ["--model", args.model]
    if not args.onpolicy:
        child.append("--no-onpolicy")
    if args.threads:
        child += ["--threads", str(args.threads)]
    reports = []
    for isa in isas:
        path = out / f"formats-{isa}.json"
        if isa == "native" and len(isas) == 1:
            report = formats.measure(args.model, args.dtype, lengths, args.decode_tokens,
                                     args.train_steps, args.onpolicy, isa="native")
            formats.save_report(report, path)
        else:  # a fresh process: the ISA switches are read when the libraries load
            report = formats.run_isa(isa, child, path)
        reports.append(report)
    table = formats.markdown(reports)
    (out / "report.md").write_text(f"# selfspec bench-cpu\n\n{table}")
    print(table)
    print(f"written to {out}", file=sys.stderr)
    return 0
