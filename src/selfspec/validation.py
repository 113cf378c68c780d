"""Checks of user input at the boundary (CLI and Python API share them).

Every public entry point validates its arguments here before any work starts, so a bad value
is an :class:`~selfspec.errors.InvalidArgumentError` (or :class:`~selfspec.errors.PromptError`)
that names the argument, its valid range and what was given — never a traceback from deep
inside torch, and never a silently reinterpreted value (``True`` read as ``1``, a ``[2, T]``
batch flattened into one prompt, bytes read as token ids).

Method options are checked by their ``Options`` dataclasses
(:mod:`selfspec.methods.options`); this module covers what every generation takes: the
prompt, the token budget, sampling settings, stop strings, threads.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from selfspec.errors import InvalidArgumentError, PromptError

# torch.Generator.manual_seed takes any value representable in 64 bits, signed or not.
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 64) - 1


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer that is not a bool (``True`` is not layer 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None,
              hint: str = "") -> int:
    """``value`` as an ``int``, checked to be an integer (not a bool, not a float) in
    ``[low, high]``.

    Raises:
        InvalidArgumentError: wrong type or out of range; the message names ``name``.
    """
    if not is_int(value) or (low is not None and value < low) or (
            high is not None and value > high):
        raise InvalidArgumentError(
            f"{name} must be an integer{_range(low, high)}{_hint(hint)}; got {value!r}".lstrip())
    return int(value)


def check_float(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False, hint: str = "") -> float:
    """``value`` as a finite ``float`` in the range given (bounds inclusive unless ``*_open``).
    ints are accepted; bools, strings, NaN and infinities are not.

    Raises:
        InvalidArgumentError: wrong type, not finite, or out of range.
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = math.isfinite(value)
        if ok and low is not None:
            ok = value > low if low_open else value >= low
        if ok and high is not None:
            ok = value < high if high_open else value <= high
    if not ok:
        left = "(" if low_open or low is None else "["
        right = ")" if high_open or high is None else "]"
        where = "" if low is None and high is None else (
            f" in {left}{'-inf' if low is None else _num(low)}, "
            f"{'inf' if high is None else _num(high)}{right}")
        raise InvalidArgumentError(
            f"{name} must be a finite number{where}{_hint(hint)}; got {value!r}".lstrip())
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool.

    Raises:
        InvalidArgumentError: anything else (``"yes"``, ``1``, ``None``).
    """
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be True or False; got {value!r}")
    return value


def check_seed(seed: Any) -> int | None:
    """A sampling seed: ``None`` or an integer that fits in 64 bits.

    Raises:
        InvalidArgumentError: a float, a string, or an integer beyond 64 bits.
    """
    if seed is None:
        return None
    return check_int("seed", seed, low=SEED_MIN, high=SEED_MAX,
                     hint="it seeds torch.Generator, which takes 64-bit values")


MAX_THREADS = 4096  # torch.set_num_threads takes a C int; no CPU has more cores than this


def check_threads(name: str, threads: Any) -> int | None:
    """A thread count: ``None`` (keep torch's setting) or an integer in ``[1, MAX_THREADS]``.

    Raises:
        InvalidArgumentError: 0, a negative number, more than :data:`MAX_THREADS` or a
            non-integer.
    """
    if threads is None:
        return None
    return check_int(name, threads, low=1, high=MAX_THREADS,
                     hint="omit it to keep torch's default")


def check_stop(stop: Any) -> tuple[str, ...]:
    """Stop strings: one string or a sequence of non-empty strings.

    Raises:
        InvalidArgumentError: an empty string (it would stop before the first token), a
            non-string item, or a value that is not a string or a sequence of strings.
    """
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, Sequence) or isinstance(items, (bytes, bytearray)):
        raise InvalidArgumentError(
            f"stop must be a string or a list of strings; got {type(stop).__name__}")
    for item in items:
        if not isinstance(item, str) or not item:
            raise InvalidArgumentError(
                f"every stop string must be non-empty text; got {item!r}")
        check_text("a stop string", item)
    return tuple(items)


def check_text(what: str, text: str) -> str:
    """``text`` if it can be encoded as UTF-8 (no lone surrogates, which is what invalid
    bytes on a command line become in Python).

    Raises:
        PromptError: ``text`` holds characters no tokenizer can encode.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise PromptError(
            f"{what} is not valid text: the character at position {err.start} "
            f"({text[err.start]!r}) is not Unicode (invalid UTF-8 bytes?); pass UTF-8 text"
        ) from None
    return text


def check_token_ids(ids: Sequence[Any], vocab_size: int) -> list[int]:
    """Token ids as a list of ints, each in ``[0, vocab_size)``.

    Raises:
        PromptError: an item that is not an integer (floats, bools, nested lists) or an id
            outside the vocabulary; the message gives its position.
    """
    out = []
    for i, t in enumerate(ids):
        if not is_int(t):
            raise PromptError(
                f"token ids must be integers; item {i} is {t!r} ({type(t).__name__}). Pass "
                "text as a str, or a list / 1-D integer tensor of token ids")
        if not 0 <= t < vocab_size:
            raise PromptError(
                f"token id {t} at position {i} is outside the vocabulary [0, {vocab_size})")
        out.append(int(t))
    if not out:
        raise PromptError("the prompt is empty; give at least one token")
    return out


def tensor_prompt(prompt: Any) -> list[Any]:
    """The token ids of a ``[T]`` or ``[1, T]`` integer tensor (torch or numpy).

    Raises:
        PromptError: a float or bool tensor, a batch ``[B, T]`` with ``B > 1`` (a batch is a
            list of prompts: a padded tensor would decode its padding), or another shape.
    """
    dtype = str(prompt.dtype)
    if "int" not in dtype or dtype.startswith("torch.bool"):
        raise PromptError(
            f"a tensor prompt must hold integer token ids; got dtype {dtype}")
    shape = tuple(prompt.shape)
    if len(shape) == 2 and shape[0] > 1:
        raise PromptError(
            f"a prompt tensor of shape {list(shape)} is a batch of {shape[0]} prompts; "
            "pass a batch as a list of prompts without padding, e.g. "
            "engine.generate([row.tolist() for row in ids]) (strip any padding first)")
    if len(shape) == 2:
        return prompt.reshape(-1).tolist()
    if len(shape) != 1:
        raise PromptError(
            f"a prompt tensor must have shape [T] or [1, T]; got {list(shape)}")
    return prompt.tolist()


def prompt_kind(prompt: Any) -> str:
    """``"text"`` or ``"ids"`` for a prompt the API takes.

    Raises:
        PromptError: ``bytes`` (decode them first), ``None``, a number or another type.
    """
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise PromptError(
            "a bytes prompt is ambiguous (text or token ids?): decode it to str "
            "(prompt.decode('utf-8')) or pass a list of token ids")
    if hasattr(prompt, "dtype") and hasattr(prompt, "shape"):
        return "ids"
    if isinstance(prompt, Sequence):
        return "ids"
    raise PromptError(
        f"the prompt must be text (str), a list of token ids or a 1-D integer tensor; got "
        f"{type(prompt).__name__}")


def _range(low: int | None, high: int | None) -> str:
    if low is None and high is None:
        return ""
    if high is None:
        return f" >= {low}"
    if low is None:
        return f" <= {high}"
    return f" in [{low}, {high}]"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _hint(hint: str) -> str:
    return f" ({hint})" if hint else ""


DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
# What a model needs on a GPU beyond its parameters: the KV cache, activations, the CUDA
# context's own allocations. A fraction of the parameters' bytes plus a fixed floor.
DEVICE_MEMORY_MARGIN = 0.2
DEVICE_MEMORY_FLOOR = 512 << 20


def check_device(text: Any, *, cuda_available: bool | None = None,
                 device_count: int | None = None) -> Any:
    """The ``torch.device`` that ``--device`` / ``device=`` names: ``"auto"`` (CUDA when
    ``torch.cuda.is_available()``, else the CPU), ``"cpu"``, ``"cuda"`` (GPU 0) or
    ``"cuda:N"``; a ``torch.device`` is checked the same way. Cheap: nothing is allocated on
    the device.

    Args:
        text: the device as given.
        cuda_available / device_count: what torch reports (default: ask torch); tests pass
            them to stand for a machine with or without GPUs.

    Raises:
        InvalidArgumentError: a malformed string, another device type, ``cuda`` where no GPU
            is available, or a GPU index that does not exist.
    """
    import torch

    if isinstance(text, torch.device):
        text = str(text)
    if not isinstance(text, str):
        raise InvalidArgumentError(
            f"device must be one of {DEVICE_CHOICES} (a str or torch.device); got {text!r}")
    name = text.strip().lower()
    if cuda_available is None:
        cuda_available = bool(torch.cuda.is_available())
    if name == "auto":
        return torch.device("cuda", 0) if cuda_available else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    kind, sep, index = name.partition(":")
    if kind != "cuda" or (sep and not index.isdigit()):
        raise InvalidArgumentError(f"device must be one of {DEVICE_CHOICES}; got {text!r}")
    if not cuda_available:
        raise InvalidArgumentError(
            f"device {text!r}: no CUDA device: torch.cuda.is_available() is False; use "
            "--device cpu (or device='cpu')")
    number = int(index) if sep else 0
    if device_count is None:
        device_count = int(torch.cuda.device_count())
    if number >= device_count:
        raise InvalidArgumentError(
            f"device {text!r}: there is no GPU {number}; this machine has {device_count} "
            f"(cuda:0..cuda:{device_count - 1})" if device_count else
            f"device {text!r}: this machine has no GPU")
    return torch.device("cuda", number)


def check_device_memory(device: Any, param_bytes: int, *, free_bytes: int | None = None,
                        margin: float = DEVICE_MEMORY_MARGIN,
                        floor: int = DEVICE_MEMORY_FLOOR) -> None:
    """Refuse a model that would not fit in ``device``'s free memory (checked before any
    weight moves there). CPUs are not checked here (the OS pages; loading checks RAM).

    Args:
        device: the target ``torch.device``.
        param_bytes: bytes of the model's parameters (and buffers) in their dtype.
        free_bytes: free bytes on the device (default: ``torch.cuda.mem_get_info``).
        margin / floor: room kept for the KV cache and activations:
            ``param_bytes * (1 + margin) + floor`` must fit.

    Raises:
        InvalidArgumentError: it does not fit.
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return
    if free_bytes is None:
        free_bytes = int(torch.cuda.mem_get_info(device)[0])
    need = int(param_bytes * (1 + margin)) + floor
    if need > free_bytes:
        raise InvalidArgumentError(
            f"the model does not fit on {device}: its weights take "
            f"{param_bytes / 2**30:.2f} GiB (+{margin:.0%} and {floor >> 20} MiB for the KV "
            f"cache and activations = {need / 2**30:.2f} GiB) but {free_bytes / 2**30:.2f} GiB "
            "are free; use a smaller model or dtype, free the GPU, or use --device cpu")
