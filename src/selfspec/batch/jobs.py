"""One line of a ``selfspec batch`` prompt file, and the record written for it.

A request line is a JSON object::

    {"id": "q1", "prompt": "def fib(n):"}                          # a text prompt
    {"id": 7, "messages": [{"role": "user", "content": "Hi"}],     # a chat (template applied)
     "max_new_tokens": 64, "temperature": 0.7, "seed": 1,
     "method": "layerskip", "options": {"exit_layer": 12}}

``id`` (a string or an integer, unique in the file) and exactly one of ``prompt`` /
``messages`` are required; every :class:`GenerationSettings` field may be given to override
the command line's value for that request; ``options`` are the method's options (they
replace the command line's when ``method`` is given, else are added to them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from selfspec.errors import InvalidArgumentError, SelfSpecError

_REQUEST_KEYS = {"id", "prompt", "messages", "options"}


@dataclass(frozen=True)
class GenerationSettings:
    """How one request generates: :meth:`selfspec.SelfSpec.generate`'s arguments (the
    defaults are the command line's, :func:`selfspec.cli_args.add_generation_arguments`).

    Requests with equal settings run together as one ragged batch
    (:meth:`selfspec.SelfSpec.generate_batch`).
    """

    method: str
    options: Mapping[str, Any]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    response_format: Mapping[str, Any] | None
    presence_penalty: float
    frequency_penalty: float
    logprobs: int | None

    def key(self) -> str:
        """A string equal for equal settings (the grouping key)."""
        return json.dumps(asdict(self), sort_keys=True, default=str)

    def generate_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``generate`` / ``generate_batch``."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}
        kwargs["stop"] = list(self.stop)
        return {**kwargs, **dict(self.options)}


SETTINGS_KEYS = {f.name for f in fields(GenerationSettings)} - {"options"}


@dataclass(frozen=True)
class BatchRequest:
    """One request of the prompt file.

    Attributes:
        id: as given (a string or an integer); :attr:`key` is its string form.
        prompt: the text prompt, or ``None`` for a chat.
        messages: the chat's messages (``[{"role", "content"}, ...]``), or ``None``.
        settings: the command line's settings with this line's overrides.
        line: the line number in the file (1-based), for messages.
    """

    id: str | int
    prompt: str | None
    messages: tuple[Mapping[str, Any], ...] | None
    settings: GenerationSettings
    line: int = 0

    @property
    def key(self) -> str:
        return str(self.id)

    def to_json(self) -> str:
        """This request as one JSON text (what a Ray Data row carries)."""
        return json.dumps({"id": self.id, "prompt": self.prompt, "line": self.line,
                           "messages": None if self.messages is None else list(self.messages),
                           "settings": asdict(self.settings)}, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> BatchRequest:
        """The request :meth:`to_json` wrote."""
        obj = json.loads(text)
        settings = dict(obj["settings"])
        settings["stop"] = tuple(settings["stop"])
        messages = obj["messages"]
        return cls(obj["id"], obj["prompt"], None if messages is None else tuple(messages),
                   GenerationSettings(**settings), obj["line"])


def parse_request(obj: Any, defaults: GenerationSettings, where: str) -> BatchRequest:
    """The request of one decoded JSON line (``where``: ``FILE:LINE`` for messages).

    Raises:
        InvalidArgumentError: not an object, no or a bad ``id``, not exactly one of
            ``prompt`` / ``messages``, an unknown key, a setting of the wrong type or out of
            range, or options the method does not take.
    """
    if not isinstance(obj, dict):
        raise InvalidArgumentError(f"{where}: a request must be a JSON object")
    unknown = sorted(set(obj) - _REQUEST_KEYS - SETTINGS_KEYS)
    if unknown:
        raise InvalidArgumentError(
            f"{where}: unknown key(s) {', '.join(unknown)} (a request takes id, prompt or "
            f"messages, options and {', '.join(sorted(SETTINGS_KEYS))})")
    rid = obj.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise InvalidArgumentError(f"{where}: 'id' must be a non-empty string or an integer")
    if ("prompt" in obj) == ("messages" in obj):
        raise InvalidArgumentError(f"{where}: give exactly one of 'prompt' and 'messages'")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidArgumentError(f"{where}: 'prompt' must be a string")
    if messages is not None and not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)):
        raise InvalidArgumentError(
            f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    settings = _settings(obj, defaults, where)
    return BatchRequest(rid, prompt, None if messages is None else tuple(messages), settings)


def _settings(obj: Mapping[str, Any], defaults: GenerationSettings,
              where: str) -> GenerationSettings:
    """``defaults`` with the line's overrides, checked as ``generate`` checks them."""
    from selfspec.decoding.core.grammar import check_response_format
    from selfspec.decoding.core.sampling import SamplingConfig
    from selfspec.decoding.core.state import DecodeOptions
    from selfspec.methods.registry import get_method
    from selfspec.validation import check_stop

    changes = {k: obj[k] for k in SETTINGS_KEYS if k in obj}
    options = obj.get("options", {})
    if not isinstance(options, dict):
        raise InvalidArgumentError(f"{where}: 'options' must be an object")
    if "stop" in changes:
        stop = changes["stop"]
        changes["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
    base = {} if "method" in changes else dict(defaults.options)
    try:
        settings = replace(defaults, **changes, options={**base, **options})
        get_method(settings.method).parse(dict(settings.options))
        DecodeOptions(max_new_tokens=settings.max_new_tokens, sampling=SamplingConfig(
            settings.temperature, settings.top_k, settings.top_p, settings.seed))
        check_stop(list(settings.stop))
        check_response_format(settings.response_format)
    except (SelfSpecError, TypeError, ValueError) as err:
        raise InvalidArgumentError(f"{where}: {err}") from None
    return settings


def read_requests(path: str | Path, defaults: GenerationSettings) -> list[BatchRequest]:
    """Every request of the JSONL file ``path`` (blank lines skipped), checked before any
    model loads.

    Raises:
        InvalidArgumentError: the file cannot be read, a line is not JSON or not a valid
            request (the message names the line), or two requests share an id.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidArgumentError(f"cannot read the prompt file {path}: {err}") from None
    requests, seen = [], {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise InvalidArgumentError(f"{where}: not JSON ({err.msg})") from None
        request = replace(parse_request(obj, defaults, where), line=number)
        if request.key in seen:
            raise InvalidArgumentError(
                f"{where}: id {request.id!r} is already used on line {seen[request.key]}; "
                "ids must be unique (results are matched and resumed by id)")
        seen[request.key] = number
        requests.append(request)
    if not requests:
        raise InvalidArgumentError(f"the prompt file {path} holds no request")
    return requests


def result_record(request: BatchRequest, result: Any, tokenizer: Any) -> dict[str, Any]:
    """The output line of ``request``'s :class:`~selfspec.api.GenerationResult`: ``id``,
    ``text``, ``token_ids``, ``finish_reason``, ``usage`` (OpenAI's token counts), ``stats``
    (tokens/s, TTFT in ms, drafted / accepted tokens, acceptance rate) and, when asked,
    ``logprobs`` (``[{"token", "logprob", "top": [[token, logprob], ...]}]``)."""
    s = result.stats
    record = {
        "id": request.id, "text": result.text, "token_ids": list(result.token_ids),
        "finish_reason": s.finish_reason, "method": request.settings.method,
        "usage": {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.new_tokens,
                  "total_tokens": s.prompt_tokens + s.new_tokens},
        "stats": {"tokens_per_s": round(s.tokens_per_s, 2), "ttft_ms": round(s.ttft_ms, 2),
                  "total_ms": round(s.total_ms, 2), "steps": s.steps, "drafted": s.drafted,
                  "accepted": s.accepted, "acceptance_rate": round(s.acceptance_rate, 4)},
    }
    if result.logprobs is not None:
        record["logprobs"] = [{"token": tokenizer.decode([lp.token]), "id": lp.token,
                               "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                              for lp in result.logprobs]
    return record


def error_record(request: BatchRequest, error: Exception) -> dict[str, Any]:
    """The output line of a request that could not run: its ``id`` and the ``error``."""
    return {"id": request.id, "error": f"{type(error).__name__}: {error}"}
