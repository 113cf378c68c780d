"""Command-line interface: ``selfspec generate | methods | models | bench | heads | serve |
batch``.

The CLI is the only place that prints. Errors raised on purpose (:class:`SelfSpecError`)
are shown as one line on stderr with exit status 2, without a traceback; any other exception
as one line with exit status 1 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing
from collections.abc import Sequence

from selfspec.batch.cli import add_batch_parser
from selfspec.bench.cli import add_bench_cpu_parser, add_bench_parser
from selfspec.cli_args import (
    add_device_argument,
    add_dtype_argument,
    add_generation_arguments,
    add_model_argument,
    add_threads_argument,
    add_weight_format_arguments,
    int_arg,
)
from selfspec.errors import InvalidArgumentError, SelfSpecError
from selfspec.executor.quant import DRAFT_WEIGHT_FORMATS
from selfspec.methods.cli_options import (  # noqa: F401 (re-exported for callers)
    add_method_arguments,
    apply_method_spec,
    method_option_fields,
    method_options,
)
from selfspec.serving.cli import add_serve_parser
from selfspec.training.cli import add_heads_parser
from selfspec.validation import (
    check_device,
    check_stop,
    check_text,
    check_threads,
)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate a continuation of PROMPT, streaming the text, "
                                   "then print one stats line.")
    p.add_argument("prompt", help="the prompt text")
    add_model_argument(p)
    p.add_argument("--method", default="auto",
                   help="decoding method (default: auto, which picks an n-gram draft, a "
                        "4/8-bit self-draft or plain decoding each step by predicted "
                        "tokens/s; lossless); "
                        "`selfspec methods` lists them. A bench row's label works too, "
                        "options included: adadecode:draft_vocab=4096,gamma=0.9")
    add_generation_arguments(p)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_weight_format_arguments(p)
    add_threads_argument(p)
    p.add_argument("--compare-ar", action="store_true",
                   help="also generate with plain autoregressive decoding (ar) on the same "
                        "prompt afterwards (with the same constraint and penalties) and print "
                        "the speedup measured in this run and whether the outputs are "
                        "identical")
    p.add_argument("--explain", action="store_true",
                   help="auto: print what each drafter did (steps, acceptance, predicted vs "
                        "measured tokens/s)")
    add_method_arguments(p)
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer

    import selfspec
    from selfspec.cli_args import response_format_of
    from selfspec.decoding.core.sampling import SamplingConfig
    from selfspec.decoding.core.state import DecodeOptions
    from selfspec.methods.registry import get_method

    # Refuse bad options before spending seconds on loading the model.
    apply_method_spec(args)
    spec = get_method(args.method)
    options = spec.parse(method_options(args))
    DecodeOptions(max_new_tokens=args.max_new_tokens,
                  sampling=SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed))
    check_stop(args.stop)
    check_text("the prompt", args.prompt)
    response_format = response_format_of(args)  # files read, schema / regex / grammar checked
    processed = (response_format is not None or args.presence_penalty or args.frequency_penalty
                 or args.logprobs is not None)
    if processed and not spec.processes_logits_for(options):
        raise InvalidArgumentError(
            f"--method {args.method} picks tokens from early-exit predictions without "
            "verification, so --json-schema/--json-object/--regex/--grammar, penalties and "
            "--logprobs cannot apply to it; use a lossless method (auto, ar, ngram, ...)")
    if check_threads("--threads", args.threads):
        torch.set_num_threads(args.threads)
    engine = selfspec.load(args.model, dtype=args.dtype, decode_kernel=args.decode_kernel,
                           device=args.device, cuda_graphs=args.cuda_graphs)
    # Compiled against the tokenizer before any token (and before --compare-ar's warm-up).
    processing = {"response_format": engine.grammar(response_format),
                  "presence_penalty": args.presence_penalty,
                  "frequency_penalty": args.frequency_penalty}
    if args.compare_ar and args.method != "ar":
        _warm_up(engine, args)
    streamer = TextStreamer(engine.tokenizer, skip_special_tokens=True)
    result = engine.generate(args.prompt, method=args.method, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             seed=args.seed, chat=args.chat, stop=args.stop, streamer=streamer,
                             logprobs=args.logprobs, **processing, **method_options(args))
    s = result.stats
    line = (f"[selfspec] {engine.name} · {args.method} · {s.new_tokens} new tokens · "
            f"{s.tokens_per_s:.1f} tok/s · TTFT {s.ttft_ms:.0f} ms · finish: {s.finish_reason}")
    if s.verifications:
        line += (f" · acceptance {s.acceptance_rate:.2f} · mean accepted {s.mean_accepted:.2f}")
    if s.exit_layer_total and not s.drafters:
        line += f" · mean exit layer {s.mean_exit_layer:.1f}"
    if s.drafters:
        line += " · steps: " + ", ".join(f"{name} {u.steps}" for name, u in s.drafters.items())
    if result.logprobs:
        mean = sum(lp.logprob for lp in result.logprobs) / len(result.logprobs)
        line += f" · mean logprob {mean:.3f}"
    print(line, file=sys.stderr)
    if result.logprobs is not None:
        print(format_logprobs(engine.tokenizer, result.logprobs, args.logprobs),
              file=sys.stderr)
    if args.explain and s.drafters:
        print(explain_drafters(s), file=sys.stderr)
    if args.compare_ar and args.method != "ar":
        base = engine.generate(args.prompt, method="ar", max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, top_k=args.top_k,
                               top_p=args.top_p, seed=args.seed, chat=args.chat,
                               stop=args.stop, **processing)
        same = "identical" if base.token_ids == result.token_ids else (
            "differ" + ("" if args.temperature > 0 else " (greedy: a lossy method)"))
        speedup = s.tokens_per_s / base.stats.tokens_per_s if base.stats.tokens_per_s else 0.0
        print(f"[selfspec] ar on the same prompt: {base.stats.tokens_per_s:.1f} tok/s → "
              f"{args.method} is {speedup:.2f}x ar (measured in this run); outputs {same}",
              file=sys.stderr)
    return 0


def format_logprobs(tokenizer, logprobs, k: int) -> str:
    """``--logprobs K``: one line per generated token: its position, text, natural-log
    probability and its ``k`` most likely alternatives (under the processed distribution:
    penalties and constraint applied, temperature not; alternatives the constraint forbids,
    at -inf, are left out)."""
    def text(token: int) -> str:
        return repr(tokenizer.decode([token]))

    lines = ["[selfspec] logprobs (natural log; token, logprob"
             + (f", top {k})" if k else ")")]
    for i, lp in enumerate(logprobs):
        row = f"  {i:>4}  {text(lp.token):<20} {lp.logprob:9.4f}"
        top = [(t, v) for t, v in lp.top if v != float("-inf")]
        if top:
            row += "   " + "  ".join(f"{text(t)} {v:.4f}" for t, v in top)
        lines.append(row)
    return "\n".join(lines)


def _warm_up(engine, args: argparse.Namespace) -> None:
    """A few tokens of ``ar`` and of the method on another prompt, so neither timed run of
    ``--compare-ar`` pays one-time costs (first calls of each shape, quantized copies); the
    engine's memory of earlier generations is left as it was."""
    previous = engine.methods.use_memory(None)
    try:
        for method, options in (("ar", {}), (args.method, method_options(args))):
            engine.generate("Hello", method=method, max_new_tokens=8, **options)
    finally:
        engine.methods.use_memory(previous)


def explain_drafters(stats) -> str:
    """A table of what each drafter of ``auto`` did: steps, acceptance, predicted vs measured
    tokens per second."""
    rows = ["  drafter   steps  drafted  accepted  acceptance  tok/s predicted  tok/s measured"]
    for name, u in stats.drafters.items():
        rows.append(f"  {name:<9} {u.steps:>5}  {u.drafted:>7}  {u.accepted:>8}  "
                    f"{u.acceptance_rate:>10.2f}  {u.predicted_tokens_per_s:>15.1f}  "
                    f"{u.tokens_per_s:>14.1f}")
    return "\n".join(rows)


def _add_methods(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("methods", help="list decoding methods, their options and defaults",
                       description="Every decoding method: whether it is lossless, the paper "
                                   "it implements, and each option with its type, default, "
                                   "range and help. L = the model's layers, R-1 = the longest "
                                   "draft verified bit-exactly (63), V = vocabulary size.")
    p.add_argument("name", nargs="?", default=None, help="one method (default: all)")
    p.set_defaults(func=_cmd_methods)


def _cmd_methods(args: argparse.Namespace) -> int:
    from selfspec.methods.registry import METHODS, get_method

    specs = [get_method(args.name)] if args.name else list(METHODS.values())
    for i, spec in enumerate(specs):
        if i:
            print()
        if spec.lossless_for(spec.options()):
            kind = "lossless"
        else:  # lossy as given; some options may make it lossless
            kind = "lossy by default" if spec.lossless else "lossy"
        kind += "; batches share forwards" if spec.batched else ""
        print(f"{spec.name}  ({kind}; {spec.paper})")
        print(f"  {spec.summary}")
        for f in spec.fields:
            print(f"  {f.flag:<16} {f.type.__name__:<5}  default {f.default_label:<26} "
                  f"range {f.range_label:<24} {f.info.help}")
        if not spec.fields:
            print("  (no options)")
    return 0


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list, fetch or verify registry models")
    msub = p.add_subparsers(dest="models_cmd", required=True)
    ls = msub.add_parser("list", help="list registry models and whether they are cached and intact "
                                      "(checked as a load checks them)")
    ls.set_defaults(func=_cmd_models_list)
    fetch = msub.add_parser("fetch", help="download, verify and convert a registry model")
    fetch.add_argument("name")
    add_dtype_argument(fetch)
    fetch.add_argument("--force", action="store_true", help="fetch again even if cached")
    fetch.add_argument("--gguf", action="store_true",
                       help="instead keep the original GGUF file, verified (for the llama.cpp "
                            "baselines of `selfspec bench`), and print its path")
    fetch.set_defaults(func=_cmd_models_fetch)
    verify = msub.add_parser(
        "verify", help="hash every file of the cached entries against their manifests (exit status "
                       "1 if one is corrupt) and remove what interrupted fetches left behind")
    verify.add_argument("names", nargs="*", metavar="NAME",
                        help="registry models to check (default: all cached)")
    add_dtype_argument(verify, default=None, help="check only this dtype's entries")
    verify.set_defaults(func=_cmd_models_verify)
    pack = msub.add_parser(
        "pack", help="split a registry model's verified GGUF into parts with a sha256 "
                     "manifest (to carry it to a machine without network in pieces)",
        description="Writes OUT/<gguf>.partNN and OUT/manifest.json. On the other machine "
                    "scripts/gpu_check.py --parts OUT joins, verifies and converts them "
                    "(selfspec.models.parts.unpack_model).")
    pack.add_argument("name")
    pack.add_argument("--part-mib", type=int_arg(1, 4096), default=60,
                      help="MiB per part (default 60)")
    pack.add_argument("--out", required=True, help="directory for the parts and manifest")
    pack.set_defaults(func=_cmd_models_pack)
    lat = msub.add_parser(
        "latency", help="show (or measure again) this machine's layer latencies for a model",
        description="The latency model auto and knapspec choose drafts by: measured once per "
                    "model, dtype, decoding kernel, thread count and processor, then kept. "
                    "--remeasure replaces it (e.g. one measured while the machine was busy).")
    add_model_argument(lat)
    add_weight_format_arguments(lat)
    add_threads_argument(lat)
    lat.add_argument("--remeasure", action="store_true", help="measure again and replace the file")
    lat.add_argument("--draft-weights", choices=DRAFT_WEIGHT_FORMATS, default=None,
                     help="the latency model of the quantized draft copies that "
                          "knapspec/qspec:draft_weights=... draft on (default: the model's own)")
    lat.set_defaults(func=_cmd_models_latency)


def _cmd_models_list(args: argparse.Namespace) -> int:
    from selfspec.models.common import dtype_name
    from selfspec.models.integrity import Depth, check_entry
    from selfspec.models.provision import cached_dtypes, entry_dir
    from selfspec.models.registry import DEFAULT_MODEL, REGISTRY

    for name, spec in REGISTRY.items():
        groups: dict[str, list[str]] = {"cached": [], "corrupt": []}
        for dtype in cached_dtypes(name):
            status = check_entry(entry_dir(name, dtype), Depth.LOAD).status
            groups["corrupt" if status == "corrupt" else "cached"].append(dtype_name(dtype))
        state = "; ".join(f"{key}: {', '.join(labels)}" for key, labels in groups.items() if labels)
        if groups["corrupt"]:
            state += " (see `selfspec models verify`)"
        mark = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name}{mark}\t{spec.architecture}, {spec.num_layers} layers\t"
              f"{state or 'not fetched'}")
    return 0


def _cmd_models_fetch(args: argparse.Namespace) -> int:
    from selfspec.models.provision import fetch

    if args.gguf:
        from selfspec.models.gguf_cache import fetch_gguf

        print(fetch_gguf(args.name, verify=args.force))
        return 0
    path = fetch(args.name, args.dtype, force=args.force)
    print(path)
    return 0


def _cmd_models_pack(args: argparse.Namespace) -> int:
    from pathlib import Path

    from selfspec.models.parts import pack_model

    manifest = pack_model(args.name, Path(args.out), args.part_mib)
    for part in manifest.parts:
        print(f"{Path(args.out) / part.file}\t{part.bytes}\t{part.sha256}")
    print(f"{manifest.file}: {manifest.bytes} bytes in {len(manifest.parts)} parts, sha256 "
          f"{manifest.sha256}")
    return 0


def _cmd_models_verify(args: argparse.Namespace) -> int:
    from selfspec.models.common import dtype_name, parse_dtype
    from selfspec.models.integrity import Depth, check_entry, fetch_command
    from selfspec.models.provision import cached_dtypes, clean_leftovers, entry_dir
    from selfspec.models.registry import REGISTRY, get_spec

    names = [get_spec(n).name for n in args.names] or list(REGISTRY)
    corrupt = 0
    for name in names:
        for path in clean_leftovers(name):
            print(f"removed {path} (left behind by an interrupted fetch or a replaced entry)")
        dtypes = [d for d in cached_dtypes(name)
                  if args.dtype is None or d is parse_dtype(args.dtype)]
        if not dtypes and args.names:
            print(f"{name}\t{args.dtype or '-'}\tnot fetched")
        for dtype in dtypes:
            check = check_entry(entry_dir(name, dtype), Depth.FULL)
            if check.status == "corrupt":
                corrupt += 1
                problems = "; ".join(p.describe() for p in check.problems)
                line = f"corrupt: {problems}; run `{fetch_command(name, dtype)}`"
            else:
                line = (f"ok ({len(check.records)} files, "
                        f"{sum(r.size for r in check.records) / 1e6:.0f} MB)")
            print(f"{name}\t{dtype_name(dtype)}\t{line}")
    return 1 if corrupt else 0


def _cmd_models_latency(args: argparse.Namespace) -> int:
    import datetime

    import torch

    import selfspec
    from selfspec.executor.cost_model import cached_latency, latency_path
    from selfspec.models.provision import selfspec_home

    if check_threads("--threads", args.threads):
        torch.set_num_threads(args.threads)
    engine = selfspec.load(args.model, dtype=args.dtype, decode_kernel=args.decode_kernel,
                           device=args.device, cuda_graphs=args.cuda_graphs)
    executor = engine.executor
    if args.draft_weights is not None:
        executor = executor.draft_view(args.draft_weights)
    path = latency_path(executor, selfspec_home())
    before = path.stat().st_mtime if path.exists() else None
    model = cached_latency(executor, selfspec_home(), remeasure=args.remeasure)
    mtime = path.stat().st_mtime
    when = datetime.datetime.fromtimestamp(mtime).isoformat(timespec="seconds")
    print(f"{path}\t{'measured now' if mtime != before else 'read (measured ' + when + ')'}")
    n = 256
    print(f"per token at {n} cached positions: attention {model.t_attn(n):.3f} ms, MLP "
          f"{model.mlp_ms:.3f} ms ({model.num_layers} layers), output head {model.head_ms:.2f} ms "
          f"= {model.target_ms(n):.1f} ms ({1e3 / model.target_ms(n):.1f} tok/s)")
    print(f"each extra token of a verification: +{model.verify_token_ms:.2f} ms "
          f"({model.verify_token_ms / model.target_ms(n):.0%} of a token); one batched "
          f"sub-layer call on r rows: {model.batched_call_ms:.2f} + r x "
          f"{model.batched_row_ms:.3f} ms")
    if model.verify_points:
        print("a forward of T tokens over one token: " + ", ".join(
            f"T={t} +{ms:.1f} ms" for t, ms in model.verify_points))
    return 0


def _version_line() -> str:
    from selfspec.version import __version__

    return f"selfspec {__version__}"


def _cmd_info(args: argparse.Namespace) -> int:
    import platform

    import torch
    import transformers

    from selfspec.executor.cpu import DTYPES, choose_formats, detect_cpu

    print(f"{_version_line()} · python {platform.python_version()} · torch {torch.__version__} "
          f"· transformers {transformers.__version__} · torch threads {torch.get_num_threads()}")
    print(f"cpu: {detect_cpu().summary()}")
    device = check_device(args.device)
    for line in device_kernels(device):
        print(line)
    for name in ("bf16", "fp32"):
        print(f"--dtype {name}: {choose_formats(DTYPES[name], device).describe()}")
    from selfspec.models.architecture import family_paths

    print(f"model families: {family_paths()}")
    return 0


def device_kernels(device) -> list[str]:
    """What runs where for ``device``: the device, its decoding kernels, the quantized
    draft formats (``qspec``, ``auto``'s qspec candidate) and CUDA graphs."""
    import torch

    from selfspec.executor.argmax import argmax_available
    from selfspec.executor.backends import BACKEND_DEVICES, runs_on
    from selfspec.executor.cost_model import device_name
    from selfspec.executor.quant import DRAFT_WEIGHT_FORMATS, draft_formats_on

    lines = []
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        lines.append(f"device: {device} ({torch.cuda.get_device_name(device)}, "
                     f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free)")
    else:
        lines.append(f"device: {device} ({device_name(device)})")
    families = [f for f in BACKEND_DEVICES if runs_on(f, device)]
    lines.append("decoding kernels: " + (
        ", ".join(families) + " (selfspec's bf16 and w4a8, FBGEMM fp16, torch int4, "
        "selfspec's GGUF blocks)" if families else
        "the weights' own products (F.linear / cuBLAS): the CPU kernels "
        f"({', '.join(BACKEND_DEVICES)}) do not run on {device.type}"))
    if "bf16" in families:
        from selfspec.executor.bf16_rows import (
            bf16_rows_available,
            bf16_rows_unavailable_reason,
        )
        from selfspec.executor.bf16_rows import chosen_isa as bf16_isa

        lines.append("bf16 kernel (--decode-kernel bf16; auto's where bf16 is emulated, and "
                     "where it is native for models whose layer matrices are all < 4 MiB, or "
                     "of any size on the amx build): " + (
                         f"the {bf16_isa()} build" if bf16_rows_available()
                         else f"unavailable ({bf16_rows_unavailable_reason()})"))
    if "gguf" in families:
        from selfspec.executor.gguf_rows import (
            chosen_isa,
            gguf_rows_available,
            gguf_rows_unavailable_reason,
        )

        lines.append("GGUF block kernels (--dtype gguf): " + (
            f"the {chosen_isa()} build" if gguf_rows_available()
            else f"unavailable ({gguf_rows_unavailable_reason()})"))
    drafts = draft_formats_on(device)
    lines.append("quantized draft formats (qspec, auto's qspec candidate): " + (
        ", ".join(drafts) if drafts else
        f"none on {device.type} ({', '.join(DRAFT_WEIGHT_FORMATS)} are CPU kernels): qspec "
        "and draft_weights=... are refused, auto drafts with ngram and its other drafters"))
    argmax = (device.type == "cpu" and argmax_available())
    lines.append("greedy argmax: " + ("selfspec's AVX2 kernel" if argmax else "torch.argmax")
                 + "; SpecEE predictor kernel: " + ("C++ (CPU)" if device.type == "cpu"
                                                     else "torch (the C++ kernel is CPU-only)"))
    lines.append("CUDA graphs (--cuda-graphs auto): " + (
        "on: one-token and verification forwards of up to 16 tokens replayed"
        if device.type == "cuda" else "off (CUDA only)"))
    return lines


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (the full usage of ``generate``
    runs to forty lines, burying the message) with a pointer to ``--help``."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def ray_app(args: dict[str, str]):
    """The Ray Serve application of ``selfspec serve --ray`` for ``serve run`` and KubeRay:
    ``serve run selfspec.cli:ray_app model=NAME replicas=2 method=auto`` takes every
    ``selfspec serve`` option as ``key=value`` (``-`` or ``_`` in keys; ``true`` for a flag)
    and checks it as the command line does.

    Raises:
        InvalidArgumentError: an unknown option or a bad value.
    """
    argv = ["serve", "--ray"]
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        argv += [flag] if str(value).lower() == "true" else [flag, str(value)]
    parser = build_parser()
    parser.exit_on_error = False
    for action in parser._subparsers._group_actions[0].choices.values():
        action.exit_on_error = False
    try:
        namespace, unknown = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as err:
        raise InvalidArgumentError(f"selfspec serve option: {err}") from None
    if unknown:
        raise InvalidArgumentError(f"selfspec serve has no option {' '.join(unknown)} "
                                   "(`selfspec serve --help` lists them)")
    from selfspec.serving.cli import ray_plan

    return ray_plan(namespace)[3]


def build_parser() -> argparse.ArgumentParser:
    """The ``selfspec`` argument parser."""
    parser = _Parser(
        prog="selfspec",
        description="Faster generation from a Hugging Face causal LM using its own layers.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    parser.add_argument("--debug", action="store_true",
                        help="debug logging, and show the traceback of any error")
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_methods(sub)
    _add_models(sub)
    add_bench_parser(sub)
    add_bench_cpu_parser(sub)
    add_heads_parser(sub)
    add_serve_parser(sub)
    add_batch_parser(sub)
    info = sub.add_parser("info", help="versions, the CPU's abilities and the number formats "
                                       "and kernels selfspec will use on a device")
    add_device_argument(info, cuda_graphs=False,
                        help="the device to describe: auto, cpu, cuda or cuda:N "
                             "(default %(default)s)")
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``selfspec`` console script; returns the exit status.

    Exit status: 0 done, 1 an unexpected error (a one-line message; ``--debug`` shows the
    traceback), 2 bad input or a known failure (:class:`SelfSpecError`, argparse usage
    errors), 130 interrupted.
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help, --version, or a usage error already printed
        return done.code if isinstance(done.code, int) else 2
    logging.basicConfig(level=logging.DEBUG if args.debug else
                        logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except SelfSpecError as err:
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (e.g. `| head`): not an error of ours.
        sys.stderr.close()
        return 1
    except Exception as err:  # the last line of defence: one line, not a traceback
        if args.debug:
            raise
        print(f"error: {_unexpected(err)}", file=sys.stderr)
        return 1


def _unexpected(err: BaseException) -> str:
    """One line for an exception selfspec did not raise on purpose, with what to do."""
    text = str(err).strip().splitlines()
    what = f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
    if isinstance(err, MemoryError):
        return (f"out of memory ({what}); try a smaller model, --dtype bf16, a shorter prompt "
                "or fewer --max-new-tokens")
    if isinstance(err, OSError):
        return f"{what}; check the path, its permissions and the free disk space"
    return (f"unexpected {what}. This is a bug in selfspec or an input it should have "
            "refused: rerun with --debug for the traceback and report it")


if __name__ == "__main__":
    sys.exit(main())
