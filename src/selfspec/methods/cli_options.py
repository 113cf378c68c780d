"""Command-line flags for method options: one flag per option name over every method."""

from __future__ import annotations

import argparse

from selfspec.methods.options import OptionField


def method_option_fields() -> dict[str, list[tuple[str, OptionField]]]:
    """Every method option by name: ``name -> [(method, field), ...]``, in registry order.

    Raises:
        TypeError: two methods declare the same option name with different types or
            choices (one CLI flag could not serve both).
    """
    from selfspec.methods.registry import METHODS

    by_name: dict[str, list[tuple[str, OptionField]]] = {}
    for spec in METHODS.values():
        for f in spec.fields:
            by_name.setdefault(f.name, []).append((spec.name, f))
    for name, uses in by_name.items():
        kinds = {(f.type, f.info.choices) for _, f in uses}
        if len(kinds) > 1:
            raise TypeError(f"option {name!r} has different types in {[m for m, _ in uses]}")
    return by_name


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per method option (from every method's ``Options``); unset flags stay
    ``None`` and leave the value to the method."""
    group = parser.add_argument_group(
        "method options (each method takes some; `selfspec methods` lists which, with "
        "defaults and ranges)")
    for name, uses in method_option_fields().items():
        f = uses[0][1]
        methods = ", ".join(m for m, _ in uses)
        help_text = f"{f.info.help}; range {f.range_label} [{methods}]"
        if f.type is bool:
            group.add_argument(f.flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        else:
            group.add_argument(f.flag, dest=name, type=f.type, default=None,
                               choices=f.info.choices or None,
                               metavar=f.type.__name__.upper() if not f.info.choices else None,
                               help=help_text)


def method_options(args: argparse.Namespace) -> dict:
    """The method options given on the command line (unset ones are left to the method)."""
    return {n: getattr(args, n) for n in method_option_fields()
            if getattr(args, n, None) is not None}


def apply_method_spec(args: argparse.Namespace) -> None:
    """Let ``--method`` take a bench row's label (``name:key=value,...``, what `selfspec
    bench` reports print), so the best row of a report can be run as it is: the options it
    carries become the option flags (and ``decode_kernel`` the ``--decode-kernel`` flag),
    and ``args.method`` becomes the bare name.

    Raises:
        InvalidArgumentError: a malformed label, an unknown method or option, a bad value, a
            benchmark-only baseline (``hf-*``, ``llamacpp-*``), or an option given both in
            the label and as a flag with different values.
    """
    if ":" not in args.method:
        return
    from selfspec.errors import InvalidArgumentError
    from selfspec.methods.labels import DECODE_KERNEL, parse_method

    name = args.method.partition(":")[0].strip()
    if name.startswith(("hf-", "llamacpp-")):
        raise InvalidArgumentError(
            f"{name} is a benchmark baseline; run it with `selfspec bench --methods {name}`")
    config = parse_method(args.method)  # validates names and values
    given = dict(config.method_options)
    if DECODE_KERNEL in config.options:
        given[DECODE_KERNEL] = config.options[DECODE_KERNEL]
    for key, value in given.items():
        flag = getattr(args, key, None)
        default = "auto" if key == DECODE_KERNEL else None
        if flag not in (None, default, value):
            raise InvalidArgumentError(
                f"{key} is {value!r} in --method {args.method!r} but "
                f"--{key.replace('_', '-')} says {flag!r}; give it once")
        setattr(args, key, value)
    args.method = config.name
