"""Method labels: ``name[:key=value,...]``, lists of them, and sweep grids — the one grammar of
``selfspec generate --method``, ``selfspec bench --methods`` / ``--sweep`` and the bench's row
labels.

Grammar (values are parsed by the type of the method's option, see ``selfspec methods``;
for the benchmark's baselines as int, float, bool ``true``/``false``, else string)::

    method  := NAME [":" KEY "=" VALUE (("," | ":") KEY "=" VALUE)*]
    methods := method ("," method)*          # a ","-item with "=" continues the previous method
    sweep   := NAME (":" KEY "=" VALUES)+    # the cartesian product of every key's VALUES
    VALUES  := ITEM ("," ITEM)*,  ITEM := VALUE | INT ".." INT   (inclusive integer range)

``ar,layerskip:exit_layer=12,draft_len=4,dv`` is three methods;
``layerskip:exit_layer=6,12:draft_len=1..3`` is a sweep of six.

Names outside selfspec (the benchmark's ``hf-*`` and ``llamacpp-*`` baselines) are accepted
only where a caller passes them as ``baselines`` (name → the option names it takes).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from selfspec.errors import InvalidArgumentError
from selfspec.executor.cpu import ROWS_FORMATS
from selfspec.methods.registry import METHODS

# An option of every selfspec method in the benchmark (not of the method itself): the row
# runs on this decoding kernel (``--decode-kernel``; ``int4`` = the model on int4 weights), so
# ``ar`` and ``ar:decode_kernel=int4`` are compared in one run.
DECODE_KERNEL = "decode_kernel"

Baselines = Mapping[str, Collection[str]]
"""Names outside selfspec a caller accepts, each with the option names it takes."""

NO_BASELINES: Baselines = {}


@dataclass(frozen=True)
class MethodConfig:
    """One method with its options, as one row of the benchmark.

    Attributes:
        name: a selfspec method (``METHODS``) or a benchmark baseline (``hf-*``,
            ``llamacpp-*``).
        options: option name → value, in the order given.
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``name`` or ``name:key=value,...``: unique per row, parseable by :func:`parse_method`."""
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_format(v)}" for k, v in self.options.items())

    @property
    def method_options(self) -> dict[str, Any]:
        """The options the method itself takes (all but the row's ``decode_kernel``)."""
        return {k: v for k, v in self.options.items() if k != DECODE_KERNEL}

    @property
    def is_baseline(self) -> bool:
        """True for a baseline outside selfspec (``hf-*``, ``llamacpp-*``)."""
        return self.name not in METHODS


def _format(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def parse_value(text: str) -> Any:
    """``"12"`` → 12, ``"0.5"`` → 0.5, ``"true"``/``"false"`` → bool, else the string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def validate(config: MethodConfig, baselines: Baselines = NO_BASELINES) -> MethodConfig:
    """Check the name, the option names and their values (types and ranges that do not
    depend on the model; the rest is checked when the method is built), converting values
    to each option's type.

    Raises:
        InvalidArgumentError: unknown method (the message lists every known one, the
            ``baselines`` included), an option the method does not take, or a bad value.
    """
    if config.name in METHODS:
        kernel = config.options.get(DECODE_KERNEL)
        options = METHODS[config.name].parse(config.method_options)  # raises on any bad option
        if kernel is not None and kernel not in ROWS_FORMATS:
            raise InvalidArgumentError(
                f"{DECODE_KERNEL} must be one of {', '.join(ROWS_FORMATS)}, got {kernel!r}")
        return MethodConfig(config.name, {k: kernel if k == DECODE_KERNEL else getattr(options, k)
                                          for k in config.options})
    if config.name not in baselines:
        raise InvalidArgumentError(
            f"unknown method {config.name!r}; known methods: {', '.join([*METHODS, *baselines])}")
    accepted = tuple(baselines[config.name])
    unknown = [k for k in config.options if k not in accepted]
    if unknown:
        raise InvalidArgumentError(
            f"method {config.name!r} does not take option(s) {', '.join(unknown)}; "
            f"it accepts: {', '.join(accepted) or 'none'}")
    return MethodConfig(config.name, {k: parse_value(v) if isinstance(v, str) else v
                                      for k, v in config.options.items()})


def _split_option(item: str, spec: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise InvalidArgumentError(
            f"bad option {item!r} in {spec!r}; write key=value (e.g. layerskip:exit_layer=12)")
    return key.strip(), value.strip()


def parse_method(spec: str, baselines: Baselines = NO_BASELINES) -> MethodConfig:
    """Parse one ``name[:key=value,...]`` (options separated by ``,`` or ``:``; a bare
    number after ``key=value`` continues that value, so ``layers=14,21`` is one list).

    Raises:
        InvalidArgumentError: empty spec, malformed option, repeated option, unknown method
            or option (see :func:`validate`).
    """
    name, _, rest = spec.strip().partition(":")
    if not name:
        raise InvalidArgumentError(f"empty method name in {spec!r}")
    options: dict[str, Any] = {}
    key = None
    for item in filter(None, (s.strip() for s in rest.replace(":", ",").split(","))):
        if key is not None and "=" not in item and _is_number(item):
            options[key] += "," + item
            continue
        key, value = _split_option(item, spec)
        if key in options:
            raise InvalidArgumentError(f"option {key!r} given twice in {spec!r}")
        options[key] = value  # typed by validate(), per the method's Options
    return validate(MethodConfig(name.strip(), options), baselines)


def parse_methods(text: str, baselines: Baselines = NO_BASELINES) -> list[MethodConfig]:
    """Parse a comma-separated list of method specs; an item containing ``=`` is another
    option of the method before it (``ar,layerskip:exit_layer=12,draft_len=4,dv``), and an
    item that is a number continues the option before it, so numeric list values keep their
    commas (``adadecode:layers=14,21,gamma=0.9``).

    Raises:
        InvalidArgumentError: see :func:`parse_method`; an option with no method before it.
    """
    groups: list[str] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" in item and ":" not in item.split("=", 1)[0]:
            if not groups:
                raise InvalidArgumentError(f"option {item!r} has no method before it in {text!r}")
            groups[-1] += "," + item
        elif groups and "=" in groups[-1] and _is_number(item):  # a list value goes on
            groups[-1] += "," + item
        else:
            groups.append(item)
    if not groups:
        raise InvalidArgumentError("no method given; e.g. --methods ar,layerskip")
    return [parse_method(g, baselines) for g in groups]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _expand_values(text: str, spec: str) -> list[Any]:
    values: list[Any] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        low, sep, high = item.partition("..")
        if sep:
            start, stop = parse_value(low), parse_value(high)
            if not (isinstance(start, int) and isinstance(stop, int)) or isinstance(start, bool) \
                    or stop < start:
                raise InvalidArgumentError(
                    f"bad range {item!r} in {spec!r}; write INT..INT with the smaller first")
            values.extend(range(start, stop + 1))
        else:
            values.append(item)  # typed by validate()
    if not values:
        raise InvalidArgumentError(f"no values in {spec!r}")
    return values


def parse_sweep(spec: str, baselines: Baselines = NO_BASELINES) -> list[MethodConfig]:
    """Expand a sweep ``name:key=v1,v2:key2=a..b`` into one method per grid point (the last
    key varies fastest).

    Raises:
        InvalidArgumentError: malformed spec, a key given twice, unknown method or option.
    """
    name, *parts = [p.strip() for p in spec.strip().split(":")]
    if not name or not parts:
        raise InvalidArgumentError(
            f"bad sweep {spec!r}; write NAME:key=v1,v2:key2=a..b (e.g. layerskip:exit_layer=6,12)")
    grid: dict[str, list[Any]] = {}
    for part in parts:
        key, values = _split_option(part, spec)
        if key in grid:
            raise InvalidArgumentError(f"option {key!r} given twice in sweep {spec!r}")
        grid[key] = _expand_values(values, spec)
    return [validate(MethodConfig(name, dict(zip(grid, point))), baselines)
            for point in itertools.product(*grid.values())]


def combine(methods: Iterable[MethodConfig]) -> list[MethodConfig]:
    """Drop repeated rows (same label), keeping the first occurrence's position."""
    seen: dict[str, MethodConfig] = {}
    for m in methods:
        seen.setdefault(m.label, m)
    return list(seen.values())
