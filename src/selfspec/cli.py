"""Command-line interface: ``selfspec generate | models``.

The CLI is the only place that prints. Errors raised on purpose (:class:`SelfSpecError`)
are shown as one line on stderr with exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from selfspec.bench.cli import add_bench_parser
from selfspec.errors import SelfSpecError
from selfspec.heads.cli import add_heads_parser


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate a continuation of PROMPT, streaming the text, "
                                   "then print one stats line.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None,
                   help="registry name, local directory or Hugging Face hub id "
                        "(default: smollm2-135m-instruct)")
    p.add_argument("--method", default="ar", help="decoding method (default: ar)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k limit")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    spec = p.add_argument_group(
        "method options (layerskip, dv, adaspeed, adaspeed-probe, dssd, early-exit)")
    spec.add_argument("--exit-layer", type=int, default=None,
                      help="layers the draft runs, in [1, L-1] (default: 3/4 of the depth)")
    spec.add_argument("--draft-len", type=int, default=None,
                      help="draft tokens per step for layerskip (default 4)")
    spec.add_argument("--gamma", type=float, default=None,
                      help="stop threshold in (0, 1) for dv/adaspeed (initial value if adaptive)")
    spec.add_argument("--max-draft-len", type=int, default=None, help="longest draft")
    spec.add_argument("--fixed-gamma", dest="adaptive", action="store_const", const=False,
                      default=None, help="turn off the adaptive gamma update of dv/adaspeed")
    spec.add_argument("--heads", default=None,
                      help="exit heads: 'default' (trained with `selfspec heads train`) or a "
                           "head file/directory; drafts use the head at --exit-layer")
    spec.add_argument("--epsilon", type=float, default=None,
                      help="DSSD accuracy level in [0, 1] for dssd / early-exit (default 0.9)")
    spec.add_argument("--metric", default=None, choices=["entropy", "max_prob", "margin"],
                      help="confidence metric of the calibrated heads (default entropy)")
    spec.add_argument("--draft-vocab", type=int, default=None,
                      help="draft heads score only the K most frequent tokens (ranked by the "
                           "heads' token counts; needs --heads), e.g. 8192")
    p.set_defaults(func=_cmd_generate)


def _method_options(args: argparse.Namespace) -> dict:
    """The method options given on the command line (unset ones are left to the method)."""
    names = ("exit_layer", "draft_len", "gamma", "max_draft_len", "adaptive", "heads",
             "epsilon", "metric", "draft_vocab")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer

    import selfspec
    from selfspec.decoding.sampling import SamplingConfig
    from selfspec.decoding.state import DecodeOptions
    from selfspec.methods.registry import get_method

    # Refuse bad options before spending seconds on loading the model.
    get_method(args.method)
    DecodeOptions(max_new_tokens=args.max_new_tokens,
                  sampling=SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed))
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = selfspec.load(args.model, dtype=args.dtype)
    streamer = TextStreamer(engine.tokenizer, skip_special_tokens=True)
    result = engine.generate(args.prompt, method=args.method, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             seed=args.seed, chat=args.chat, stop=args.stop, streamer=streamer,
                             **_method_options(args))
    s = result.stats
    line = (f"[selfspec] {engine.name} · {args.method} · {s.new_tokens} new tokens · "
            f"{s.tokens_per_s:.1f} tok/s · TTFT {s.ttft_ms:.0f} ms · finish: {s.finish_reason}")
    if s.verifications:
        line += (f" · acceptance {s.acceptance_rate:.2f} · mean accepted {s.mean_accepted:.2f}")
    if s.exit_layer_total:
        line += f" · mean exit layer {s.mean_exit_layer:.1f}"
    print(line, file=sys.stderr)
    return 0


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list or fetch registry models")
    msub = p.add_subparsers(dest="models_cmd", required=True)
    ls = msub.add_parser("list", help="list registry models and whether they are cached")
    ls.set_defaults(func=_cmd_models_list)
    fetch = msub.add_parser("fetch", help="download, verify and convert a registry model")
    fetch.add_argument("name")
    fetch.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    fetch.add_argument("--force", action="store_true", help="fetch again even if cached")
    fetch.set_defaults(func=_cmd_models_fetch)


def _cmd_models_list(args: argparse.Namespace) -> int:
    from selfspec.models.common import dtype_name
    from selfspec.models.provision import cached_dtypes
    from selfspec.models.registry import DEFAULT_MODEL, REGISTRY

    for name, spec in REGISTRY.items():
        cached = [dtype_name(d) for d in cached_dtypes(name)]
        mark = " (default)" if name == DEFAULT_MODEL else ""
        state = f"cached: {', '.join(cached)}" if cached else "not fetched"
        print(f"{name}{mark}\t{spec.architecture}, {spec.num_layers} layers\t{state}")
    return 0


def _cmd_models_fetch(args: argparse.Namespace) -> int:
    from selfspec.models.provision import fetch

    path = fetch(args.name, args.dtype, force=args.force)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``selfspec`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="selfspec",
        description="Faster generation from a Hugging Face causal LM using its own layers.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_models(sub)
    add_bench_parser(sub)
    add_heads_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``selfspec`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except SelfSpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
