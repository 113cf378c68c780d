"""Argparse helpers shared by every command (generate, bench, serve, heads, models): argument
types that check values at parse time with :mod:`selfspec.validation`'s checks, so a bad value
is a usage error (exit status 2) before anything loads, the arguments every command that
loads a model takes, and the output-processing flags of ``selfspec generate`` (read and
checked before a model loads)."""

from __future__ import annotations

import argparse

from selfspec.errors import InvalidArgumentError
from selfspec.validation import MAX_THREADS, check_device, check_float, check_int


def threads_arg():
    """The argparse ``type=`` of ``--threads``: an integer in ``[1, MAX_THREADS]``."""
    return int_arg(1, MAX_THREADS)


DENSE_DTYPES = ("bf16", "fp32", "fp16")
"""``--dtype`` choices of dense weights (a registry model's cached formats, ``bench-cpu``)."""

TRAINING_DTYPES = ("bf16", "fp32")
"""``--dtype`` choices of the frozen backbone that heads, probes and predictors train on."""


def add_threads_argument(parser, help: str = "torch intra-op threads (default: torch's default)",
                         default: int | None = None) -> None:
    """``--threads``, as every command that runs a model takes it: an integer in
    ``[1, MAX_THREADS]`` checked at parse time, default ``None`` (torch's own choice; the load
    tests give the server's count instead)."""
    parser.add_argument("--threads", type=threads_arg(), default=default, help=help)


def add_dtype_argument(parser, choices=DENSE_DTYPES, default: str | None = "bf16",
                       help: str | None = None) -> None:
    """``--dtype`` over one of this module's sets of choices (:data:`DENSE_DTYPES`,
    :data:`TRAINING_DTYPES`), so a meaning has one set of choices everywhere."""
    parser.add_argument("--dtype", default=default, choices=list(choices),
                        help=help or f"weights' dtype (default {default})")


def int_arg(low: int | None = None, high: int | None = None):
    """An argparse ``type=`` that parses an integer in ``[low, high]``, so a bad value is a
    usage error at parse time (exit status 2) before anything is loaded."""
    return _arg_type(int, "an integer", lambda v: check_int("", v, low=low, high=high))


def float_arg(low: float | None = None, high: float | None = None, *, low_open: bool = False,
              high_open: bool = False):
    """An argparse ``type=`` for a finite number in the range given (see :func:`check_float`)."""
    return _arg_type(float, "a number", lambda v: check_float(
        "", v, low=low, high=high, low_open=low_open, high_open=high_open))


def _arg_type(kind: type, what: str, check):
    def parse(text: str):
        try:
            return check(kind(text))
        except ValueError as err:  # InvalidArgumentError is a ValueError too
            message = str(err) if isinstance(err, InvalidArgumentError) else (
                f"expected {what}, got {text!r}")
            raise argparse.ArgumentTypeError(message) from None

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


MODEL_HELP = ("registry name, local directory or Hugging Face hub id "
              "(default: smollm2-135m-instruct)")
"""``--model``'s help where the command falls back to the registry default."""


def add_model_argument(parser, help: str = MODEL_HELP, required: bool = False) -> None:
    """``--model``, as every command that loads one model takes it: default ``None`` (the
    registry default, or required with ``required``); ``help`` says what a command does
    without one."""
    parser.add_argument("--model", required=required, default=None, help=help)


def device_arg(text: str) -> str:
    """The argparse ``type=`` of ``--device``: checked at parse time
    (:func:`selfspec.validation.check_device`: malformed, ``cuda`` without a GPU, a GPU index
    that does not exist are usage errors before anything loads); the text is kept."""
    try:
        check_device(text)
    except InvalidArgumentError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text.strip().lower()


device_arg.__name__ = "device"


DEVICE_HELP = ("auto (CUDA when available, else the CPU), cpu, cuda or cuda:N: where the "
               "weights, KV cache, heads and every method's tensors live (default %(default)s)")
"""``--device``'s help in the commands that load a model."""


def add_device_argument(parser, help: str = DEVICE_HELP, cuda_graphs: bool = True) -> None:
    """``--device`` (checked at parse time, default ``auto``) and, with ``cuda_graphs``,
    ``--cuda-graphs``, as every command that loads a model takes them (``selfspec info``
    takes ``--device`` alone, with its own ``help``)."""
    parser.add_argument("--device", type=device_arg, default="auto", help=help)
    if not cuda_graphs:
        return
    parser.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                        help="replay one-token and verification forwards as captured CUDA "
                             "graphs: auto = on for CUDA (default auto; ignored on the CPU)")


def weight_dtypes() -> list[str]:
    """``--dtype`` choices of a model loaded for decoding: the dense dtypes and the formats
    decoding runs on copies or blocks of (``int4``, ``w4a8``, ``gguf``)."""
    from selfspec.executor.cpu import QUANTIZED_ROWS

    return [*DENSE_DTYPES, *QUANTIZED_ROWS]


def add_weight_format_arguments(parser) -> None:
    """``--dtype`` and ``--decode-kernel`` (and ``--device``, ``--cuda-graphs``: see
    :func:`add_device_argument`), as every command that loads a model for decoding
    (generate, bench, serve, models latency) takes them."""
    add_device_argument(parser)
    from selfspec.executor.cpu import ROWS_FORMATS

    add_dtype_argument(parser, choices=weight_dtypes(),
                       help="weights' format (int4: bf16 weights, decoding on int4 copies; "
                             "w4a8: on 4-bit copies with 8-bit activations, as llama.cpp's "
                             "Q4_1; gguf: on the GGUF file's own blocks, the weights as "
                             "published: a registry model's GGUF or --model FILE.gguf)")
    parser.add_argument(
        "--decode-kernel", default="auto", choices=list(ROWS_FORMATS),
        help="kernel of decoding and verification products: auto (on CPUs that emulate "
             "bf16: bf16, i.e. selfspec's bf16 kernel for every matrix, prefill on "
             "FBGEMM fp16 copies of matrices >= 4 MiB; where bf16 is native: bf16 for "
             "models whose layer matrices are all < 4 MiB or on its AMX build, else weights), "
             "bf16+fp16 (FBGEMM's fp16-weight "
             "kernel for matrices >= 4 MiB, selfspec's for the rest), fp16 "
             "(FBGEMM for every matrix), weights (the weights' own format), int4 (4-bit "
             "copies: lossy), w4a8 (4-bit copies, 8-bit activations: lossy), gguf (the "
             "GGUF file's own blocks)")


def add_prefill_chunk_argument(parser) -> None:
    """``--prefill-chunk N`` (an integer >= 1, checked at parse time; default
    :data:`~selfspec.executor.plan.PREFILL_CHUNK`): positions per prefill call and so the
    prefix cache's block size (:func:`selfspec.load`'s ``prefill_chunk``), as ``serve``,
    ``generate`` and ``batch`` take it."""
    from selfspec.executor.plan import PREFILL_CHUNK

    parser.add_argument(
        "--prefill-chunk", type=int_arg(1), default=PREFILL_CHUNK, metavar="N",
        help="prompts are prefilled in calls of N positions, and the prefix cache keeps and "
             "reuses whole N-token blocks: smaller N = faster warm turns (a warm prompt "
             "reruns up to N-1 kept tokens), slower cold prefill (default %(default)s)")


def add_generation_arguments(parser) -> None:
    """How a generation samples and stops (``--max-new-tokens``, ``--temperature``,
    ``--top-k``, ``--top-p``, ``--seed``, ``--stop``) and
    :func:`add_output_processing_arguments`: ``selfspec generate`` and ``selfspec batch`` take
    them, with these defaults."""
    from selfspec.validation import SEED_MAX, SEED_MIN

    parser.add_argument("--max-new-tokens", type=int_arg(1), default=128)
    parser.add_argument("--temperature", type=float_arg(0.0), default=0.0,
                        help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int_arg(0), default=0, help="0 = no top-k limit")
    parser.add_argument("--top-p", type=float_arg(0.0, 1.0, low_open=True), default=1.0,
                        help="nucleus mass in (0, 1]")
    parser.add_argument("--seed", type=int_arg(SEED_MIN, SEED_MAX), default=None,
                        help="seed for reproducible sampling")
    parser.add_argument("--stop", action="append", default=[],
                        help="stop string (repeatable)")
    add_output_processing_arguments(parser)


def add_output_processing_arguments(parser) -> None:
    """Structured output (``--json-schema FILE | --json-object | --regex PATTERN | --grammar
    FILE``, one at most), ``--presence-penalty``, ``--frequency-penalty`` and ``--logprobs``
    (:mod:`selfspec.decoding.core.processors`): ``selfspec generate`` takes them."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE", default=None,
                       help="constrain the output to JSON valid against the JSON schema in "
                            "FILE (every token, draft tokens included, is checked, so "
                            "lossless methods give constrained ar's output)")
    group.add_argument("--json-object", action="store_true",
                       help="constrain the output to one JSON object")
    group.add_argument("--regex", metavar="PATTERN", default=None,
                       help="constrain the whole output to match PATTERN (no look-around)")
    group.add_argument("--grammar", metavar="FILE", default=None,
                       help="constrain the output to the Lark grammar in FILE "
                            "(llguidance's dialect)")
    parser.add_argument("--presence-penalty", type=float_arg(-2.0, 2.0), default=0.0,
                        help="subtracted once from the logit of every token generated so far, "
                             "in [-2, 2] (OpenAI's; default 0)")
    parser.add_argument("--frequency-penalty", type=float_arg(-2.0, 2.0), default=0.0,
                        help="subtracted per occurrence of a token generated so far, in "
                             "[-2, 2] (OpenAI's; default 0)")
    parser.add_argument("--logprobs", type=int_arg(0, 20), default=None, metavar="K",
                        help="after the stats line, print each generated token's log "
                             "probability and its K most likely alternatives (0-20)")


def response_format_of(args: argparse.Namespace) -> dict | None:
    """The ``response_format`` of :func:`add_output_processing_arguments`' flags, read and
    validated without a model (files readable, the schema JSON, the schema, regex or
    grammar accepted by llguidance), so a mistake is one error line before anything loads.

    Returns:
        OpenAI's ``{"type": "json_schema", ...}`` / ``{"type": "json_object"}`` or selfspec's
        ``{"type": "regex" | "lark", ...}``; ``None`` without a constraint.

    Raises:
        InvalidArgumentError: an unreadable file, a schema file that is not UTF-8 JSON or not
            a JSON object, an invalid or unsupported schema, regex or grammar (the message
            names the flag).
        MissingDependencyError: a constraint is given and llguidance is not installed.
    """
    import json

    from selfspec.decoding.core.grammar import check_response_format

    if args.json_schema is not None:
        text = _read_text("--json-schema", args.json_schema)
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as err:
            raise InvalidArgumentError(
                f"--json-schema {args.json_schema}: not JSON ({err.msg} at line {err.lineno}, "
                f"column {err.colno}); give a file holding one JSON schema object") from None
        if not isinstance(schema, dict):
            kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number",
                    float: "a number", type(None): "null"}[type(schema)]
            raise InvalidArgumentError(
                f"--json-schema {args.json_schema}: a JSON schema is a JSON object, got "
                f"{kind}; e.g. {{\"type\": \"object\", \"properties\": ...}}")
        response_format = {"type": "json_schema",
                           "json_schema": {"name": "output", "schema": schema}}
        flag = f"--json-schema {args.json_schema}"
    elif args.json_object:
        response_format, flag = {"type": "json_object"}, "--json-object"
    elif args.regex is not None:
        response_format, flag = {"type": "regex", "regex": args.regex}, "--regex"
    elif args.grammar is not None:
        response_format = {"type": "lark", "lark": _read_text("--grammar", args.grammar)}
        flag = f"--grammar {args.grammar}"
    else:
        return None
    try:
        check_response_format(response_format)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"{flag}: {err}") from None
    return response_format


def _read_text(flag: str, path: str) -> str:
    """The UTF-8 text of ``path``.

    Raises:
        InvalidArgumentError: the file cannot be read or is not UTF-8 (names ``flag``).
    """
    from pathlib import Path

    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except OSError as err:
        raise InvalidArgumentError(
            f"{flag} {path}: cannot read the file ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise InvalidArgumentError(f"{flag} {path}: not UTF-8 text ({err.reason})") from None
