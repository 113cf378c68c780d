"""Method options: one dataclass per method, the single source of CLI flags, API keywords,
benchmark ``NAME:key=value`` specs, validation messages and ``selfspec methods``.

Each field of a method's ``Options`` dataclass is declared with :func:`option`, which records
its help text, valid range or choices, and how to show a default that depends on the model::

    @dataclass(frozen=True)
    class Options:
        exit_layer: int | None = option(None, "layers the draft runs", low=1, high="L-1",
                                        default_text="3/4 of the depth")

Bounds are numbers or one of the model-dependent symbols of :data:`MODEL_BOUNDS`
(``"L"``: layers, ``"L-1"``: layers − 1, ``"R-1"``: the longest bit-exact draft, ``"V"``: vocabulary
size),
checked once the model is known (:func:`check_model_bounds`).

An option whose value names a file the method reads (trained heads, a skip set) declares it
with ``asset=`` (:data:`HEAD_FILE`, :data:`SKIP_SET_FILE`): the server refuses such paths from
clients and resolves their bare names in its own assets directory
(:mod:`selfspec.serving.assets`), so every such option must say so.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.heads.files import DEFAULT, DEFAULT_PROBES

# Model-dependent bounds: symbol -> (value for an executor, meaning).
MODEL_BOUNDS: Mapping[str, tuple[Callable[[LayerExecutor], int], str]] = {
    "L": (lambda ex: ex.num_layers, "the model's layers"),
    "L-1": (lambda ex: ex.num_layers - 1, "the model's layers - 1"),
    "R-1": (lambda ex: max(1, ex.row_attention_max - 1),
            "the longest draft verified bit-exactly, 63 by default"),
    "V": (lambda ex: ex.vocab_size, "the vocabulary size"),
}

Bound = float | int | str | None


@dataclass(frozen=True)
class Asset:
    """What an option naming a file reads: a trained asset on the machine that decodes.

    Attributes:
        kind: ``"heads"`` (a head file, or a folder holding ``heads.safetensors``) or
            ``"skip_set"`` (a skip-set file, or a folder holding ``swift-skip.json``).
        keywords: values that name no path: the model's own assets in ``$SELFSPEC_HOME``
            (``default``), or none at all (AdaDecode's ``none``).
    """

    kind: str
    keywords: tuple[str, ...] = ()


#: A head file option: ``default`` / ``default-probes`` or a path.
HEAD_FILE = Asset("heads", (DEFAULT, DEFAULT_PROBES))
#: A skip-set file option: ``default`` or a path.
SKIP_SET_FILE = Asset("skip_set", (DEFAULT,))


@dataclass(frozen=True)
class OptionInfo:
    """What :func:`option` records about one field.

    Attributes:
        help: one line for ``--help``, ``selfspec methods`` and error messages.
        low / high: inclusive bounds (numbers or :data:`MODEL_BOUNDS` symbols), or ``None``.
        low_open / high_open: the bound itself is excluded.
        choices: the allowed values of a string option, or ``()``.
        default_text: how to show a default the method works out (e.g. from the model).
        asset: the file a string option names (:class:`Asset`), or ``None`` for a value
            that opens nothing.
    """

    help: str
    low: Bound = None
    high: Bound = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()
    default_text: str | None = None
    asset: Asset | None = None


def option(default: Any, help: str, *, low: Bound = None, high: Bound = None,
           low_open: bool = False, high_open: bool = False, choices: tuple[str, ...] = (),
           default_text: str | None = None, asset: Asset | None = None) -> Any:
    """A dataclass field that is a method option (see the module docstring)."""
    info = OptionInfo(help, low, high, low_open, high_open, tuple(choices), default_text,
                      asset)
    return dataclasses.field(default=default, metadata={"option": info})


@dataclass(frozen=True)
class OptionField:
    """One option of one method, as read from its ``Options`` dataclass.

    Attributes:
        name: the keyword (``exit_layer``); the CLI flag is ``--exit-layer``.
        type: ``int``, ``float``, ``bool`` or ``str``.
        default: the dataclass default (``None`` = the method decides, see ``info.default_text``).
        info: help, range and choices.
    """

    name: str
    type: type
    default: Any
    info: OptionInfo

    @property
    def flag(self) -> str:
        """The CLI flag, e.g. ``--exit-layer``."""
        return "--" + self.name.replace("_", "-")

    @property
    def default_label(self) -> str:
        """The default as shown to users."""
        if self.info.default_text is not None:
            return self.info.default_text
        if self.default is None:
            return "none"
        return str(self.default).lower() if isinstance(self.default, bool) else str(self.default)

    @property
    def range_label(self) -> str:
        """``[1, L-1]``, ``(0, 1)``, ``entropy|max_prob|margin``, ``true|false`` or ``any``."""
        return self.range_for({})

    def range_for(self, symbols: Mapping[str, int]) -> str:
        """:attr:`range_label` with the model-dependent bounds in ``symbols`` resolved."""
        if self.info.choices:
            return "|".join(self.info.choices)
        if self.type is bool:
            return "true|false"
        low, high = (symbols.get(b, b) if isinstance(b, str) else b
                     for b in (self.info.low, self.info.high))
        if low is None and high is None:
            return "any"
        left = "(" if self.info.low_open or low is None else "["
        right = ")" if self.info.high_open or high is None else "]"
        return f"{left}{'-inf' if low is None else low}, {'inf' if high is None else high}{right}"

    def coerce(self, value: Any, method: str, symbols: Mapping[str, int] | None = None) -> Any:
        """``value`` as this option's type (strings from a command line or a bench spec are
        parsed), then checked against its range: the numeric bounds, and the model-dependent
        ones resolved in ``symbols`` when given.

        Raises:
            InvalidArgumentError: wrong type or out of range; the message names the method,
                the option, its range and what was given.
        """
        if value is None:
            return None
        kind = self.type
        try:
            if isinstance(value, str) and kind is not str:
                value = _parse(value, kind)
            elif kind is bool and not isinstance(value, bool):
                raise ValueError
            elif kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                else:
                    raise ValueError
            elif kind is float:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError
                value = float(value)
            elif kind is str and not isinstance(value, str):
                raise ValueError
        except ValueError:
            raise self._error(method, value, symbols) from None
        if self.info.choices and value not in self.info.choices:
            raise self._error(method, value)
        if kind in (int, float):
            if isinstance(value, float) and not math.isfinite(value):
                raise self._error(method, value, symbols)
            self.check_bounds(value, method, symbols or {})
        return value

    def check_bounds(self, value: Any, method: str, symbols: Mapping[str, int]) -> None:
        """Check the bounds that are numbers or symbols resolved in ``symbols``.

        Raises:
            InvalidArgumentError: ``value`` outside them.
        """
        if value is None or self.type not in (int, float):
            return
        low, high = (symbols.get(b, b) if isinstance(b, str) else b
                     for b in (self.info.low, self.info.high))
        if isinstance(low, (int, float)) and (value < low or (self.info.low_open and value == low)):
            raise self._error(method, value, symbols)
        if isinstance(high, (int, float)) and (
                value > high or (self.info.high_open and value == high)):
            raise self._error(method, value, symbols)

    def _error(self, method: str, value: Any, symbols: Mapping[str, int] | None = None
               ) -> InvalidArgumentError:
        what = {int: "an integer", float: "a number", bool: "true or false",
                str: "a string"}[self.type]
        if self.info.choices:
            where = f"one of {', '.join(self.info.choices)}"
        elif self.type in (int, float) and self.range_label != "any":
            where = f"{what} in {self.range_for(symbols or {})}"
        else:
            where = what
        return InvalidArgumentError(
            f"method {method!r}: {self.name} must be {where} ({self.info.help}); got {value!r}")


def _parse(text: str, kind: type) -> Any:
    text = text.strip()
    if kind is bool:
        lowered = text.lower()
        if lowered in ("true", "yes", "1", "on"):
            return True
        if lowered in ("false", "no", "0", "off"):
            return False
        raise ValueError(text)
    return kind(text)


def _base_type(annotation: Any) -> type:
    """``int | None`` → ``int``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    kind = args[0] if args else annotation
    if kind not in (int, float, bool, str):
        raise TypeError(f"option type {annotation!r} is not int, float, bool or str")
    return kind


@functools.cache
def option_fields(options_cls: type) -> tuple[OptionField, ...]:
    """The :class:`OptionField` of every field of an ``Options`` dataclass: the method's own
    in declaration order, then those of shared option groups (a base class with
    ``__option_group__ = True``, e.g. ``draft_weights``), which a dataclass would put first.
    Kept per class (a class's fields never change): resolving the type hints took ~0.6 ms a
    call, and every step built parses its options twice.

    Raises:
        TypeError: a field not declared with :func:`option` or of an unsupported type.
    """
    hints = typing.get_type_hints(options_cls)
    fields = []
    for f in dataclasses.fields(options_cls):
        info = f.metadata.get("option")
        if info is None:
            raise TypeError(f"{options_cls.__name__}.{f.name} is not declared with option()")
        fields.append(OptionField(f.name, _base_type(hints[f.name]), f.default, info))
    return tuple(sorted(fields, key=lambda field: _in_option_group(options_cls, field.name)))


def _in_option_group(options_cls: type, name: str) -> bool:
    return any(c.__dict__.get("__option_group__", False)
               and name in c.__dict__.get("__annotations__", {}) for c in options_cls.__mro__)


def changed_options(options: Any, names: Sequence[str]) -> list[str]:
    """The fields among ``names`` whose value in ``options`` (a method's ``Options``) differs
    from the class default: what the user gave, e.g. options a ``tuned=true`` replaces."""
    defaults = type(options)()
    return [name for name in names if getattr(options, name) != getattr(defaults, name)]


def model_symbols(executor: LayerExecutor) -> dict[str, int]:
    """The values of :data:`MODEL_BOUNDS` for ``executor``'s model."""
    return {name: get(executor) for name, (get, _) in MODEL_BOUNDS.items()}


def parse_options(options_cls: type, values: Mapping[str, Any], method: str,
                  symbols: Mapping[str, int] | None = None) -> Any:
    """Build an ``Options`` instance from keyword values (typed, or strings to parse),
    checking model-dependent bounds too when their ``symbols`` are given.

    Raises:
        InvalidArgumentError: an option the method does not take (the message lists the ones
            it takes), a wrong type or a value out of its static range.
    """
    fields = {f.name: f for f in option_fields(options_cls)}
    unknown = [k for k in values if k not in fields]
    if unknown:
        accepted = ", ".join(fields) or "none"
        raise InvalidArgumentError(
            f"method {method!r} does not take option(s) {', '.join(unknown)}; it accepts: "
            f"{accepted} (see `selfspec methods`)")
    typed = {k: fields[k].coerce(v, method, symbols) for k, v in values.items() if v is not None}
    return options_cls(**typed)


def check_model_bounds(options: Any, executor: LayerExecutor, method: str) -> None:
    """Check the model-dependent bounds (:data:`MODEL_BOUNDS`) of ``options``.

    Raises:
        InvalidArgumentError: a value outside its range for this model.
    """
    symbols = model_symbols(executor)
    for f in option_fields(type(options)):
        f.check_bounds(getattr(options, f.name), method, symbols)

