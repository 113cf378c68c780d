"""The user's own prompts from a JSONL file (``selfspec bench --prompts FILE``).

One JSON object per line::

    {"id": "greet", "prompt": "Say hello in French.", "chat": true, "reference": "Bonjour"}
    {"id": "fib", "prompt": "def fibonacci(n):\\n"}

``id`` (a non-empty string, unique in the file) and ``prompt`` (a non-empty string) are
required; ``chat`` (true = apply the model's chat template, default false = continue the raw
text) and ``reference`` (a non-empty string: the expected answer, scored by
:func:`selfspec.bench.accuracy.check_reference`) are optional. No other key is allowed. Blank
lines are skipped; the file is UTF-8.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from selfspec.data.prompt import Prompt
from selfspec.errors import InvalidArgumentError

FILE_LABEL_PREFIX = "file:"
ALLOWED_KEYS = ("id", "prompt", "chat", "reference")


def file_label(path: str | Path) -> str:
    """The dataset label of a prompt file in reports: ``file:<stem>`` (``file:my-prompts``)."""
    return FILE_LABEL_PREFIX + Path(path).stem


def load_prompt_file(path: str | Path) -> list[Prompt]:
    """Read and validate every prompt of a JSONL prompt file (format: see the module).

    The whole file is checked before anything is returned, so a mistake on the last line
    costs no model load or benchmark time.

    Args:
        path: the JSONL file.

    Returns:
        The prompts in file order (``Prompt(id, text=prompt, chat, reference)``, empty meta).

    Raises:
        InvalidArgumentError: the file is missing or unreadable, or holds no prompt; or a line
            is not valid UTF-8 or JSON, is not an object, lacks ``id`` or ``prompt`` or has
            them empty, has ``chat`` not a boolean or ``reference`` not a non-empty string,
            has a key outside :data:`ALLOWED_KEYS`, or repeats an earlier line's ``id``. The
            message names the file, the 1-based line number and the field.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise InvalidArgumentError(
            f"cannot read prompt file {str(path)!r}: {err.strerror or err}") from err
    prompts: list[Prompt] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        where = f"prompt file {str(path)!r}, line {number}"
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # -sig: drop a BOM
        except UnicodeDecodeError as err:
            raise InvalidArgumentError(f"{where}: not valid UTF-8 ({err.reason})") from err
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise InvalidArgumentError(
                f"{where}: invalid JSON ({err.msg} at column {err.colno})") from err
        prompt = _prompt(entry, where)
        if prompt.id in first_line:
            raise InvalidArgumentError(
                f"{where}: field 'id': duplicate id {prompt.id!r} (first on line "
                f"{first_line[prompt.id]})")
        first_line[prompt.id] = number
        prompts.append(prompt)
    if not prompts:
        raise InvalidArgumentError(
            f"prompt file {str(path)!r} holds no prompts; write one JSON object per line, "
            'e.g. {"id": "q1", "prompt": "Explain KV caches.", "chat": true}')
    return prompts


def _prompt(entry: Any, where: str) -> Prompt:
    """One line's object as a :class:`Prompt` (``where`` prefixes the error messages)."""
    if not isinstance(entry, dict):
        raise InvalidArgumentError(
            f"{where}: expected a JSON object with 'id' and 'prompt', got {_json_type(entry)}")
    unknown = [key for key in entry if key not in ALLOWED_KEYS]
    if unknown:
        raise InvalidArgumentError(
            f"{where}: unknown field {unknown[0]!r}; allowed fields: {', '.join(ALLOWED_KEYS)}")
    for key in ("id", "prompt"):
        if key not in entry:
            raise InvalidArgumentError(f"{where}: field {key!r} is missing (a non-empty string)")
        _check_text(entry[key], key, where)
    chat = entry.get("chat", False)
    if not isinstance(chat, bool):
        raise InvalidArgumentError(
            f"{where}: field 'chat' must be true or false, got {_json_type(chat)}")
    reference = entry.get("reference")
    if "reference" in entry:
        _check_text(reference, "reference", where)
    return Prompt(id=entry["id"], text=entry["prompt"], chat=chat, reference=reference)


def _check_text(value: Any, key: str, where: str) -> None:
    if not isinstance(value, str):
        raise InvalidArgumentError(
            f"{where}: field {key!r} must be a string, got {_json_type(value)}")
    if not value.strip():
        raise InvalidArgumentError(f"{where}: field {key!r} is empty")


def _json_type(value: Any) -> str:
    """The JSON name of ``value``'s type, with the value when short (``number 3``)."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    name = names.get(type(value), type(value).__name__)
    shown = json.dumps(value, ensure_ascii=False)
    return f"{name} ({shown})" if value is not None and len(shown) <= 40 else name
