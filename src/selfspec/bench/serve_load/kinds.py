"""The request kinds of the mixed load test (:mod:`selfspec.bench.serve_load.mix`), their bodies,
how their answers are read, and how each answer is checked against its reference.

A kind is one way of asking: free-text chat (streamed and not), a JSON schema (streamed and
not), completions with ``logprobs`` and chat with ``top_logprobs`` (one entry per
completion token), and ``n = 2`` (both choices, indices 0 and 1). Every kind is greedy, so
each answer must equal the *reference* of its prompt: the same prompt's answer to a lone
request sent before the load. A choice that differs is *mixed up* (a batch row got another
row's tokens, or the output processing of another request); one without a
``finish_reason``, or a stream without ``data: [DONE]``, is *truncated*.

Everything here is pure: bodies are dictionaries, answers are read from parsed JSON bodies
and server-sent-event lines, and :func:`check` returns the problems it found, so the
checks run without a server (and are tested so).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# Problem categories: every check names one. A response can have several.
FAILED = "failed"              # no 200, an error body or event, or no answer at all
TRUNCATED = "truncated"        # no finish_reason, a stream without [DONE], no usage
MISMATCHED = "mismatched"      # text, tokens, finish reason or token count differ from the ref
INVALID_JSON = "invalid_json"  # a json_schema answer that does not parse or validate
BAD_LOGPROBS = "bad_logprobs"  # logprobs missing or not one entry (with its alternatives) per token
BAD_CHOICES = "bad_choices"    # choice indices other than 0 .. n - 1
CATEGORIES = (FAILED, TRUNCATED, MISMATCHED, INVALID_JSON, BAD_LOGPROBS, BAD_CHOICES)

#: Alternatives asked per token by the logprobs kinds (``logprobs=2`` / ``top_logprobs=2``).
TOP_LOGPROBS = 2

CHAT_PROMPTS = (
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give three tips for writing clear code.",
    "What is the difference between a list and a tuple in Python?",
    "Describe a sunrise in one paragraph.",
    "Why is the sky blue? Answer briefly.",
    "Suggest a name for a friendly robot and say why.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
)

COMPLETION_PROMPTS = (
    "def fibonacci(n):\n",
    "The three primary colours are",
    "import json\n\n\ndef load_config(path):\n",
    "Once upon a time, in a small village,",
    "SELECT name, age FROM users WHERE",
    "The speed of light in a vacuum is",
    "class Stack:\n    def __init__(self):\n",
    "A good breakfast includes",
)


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": list(properties),
            "properties": properties}


@dataclass(frozen=True)
class JsonTask:
    """A JSON-schema request: a prompt and the schema its answer must follow.

    Every schema is bounded (strings have ``maxLength``, arrays ``maxItems``, numbers a
    range or an enum), so its compact JSON ends within a fixed number of tokens even on a
    character-level tokenizer whose model writes noise (the tests' tiny model).
    """

    name: str
    prompt: str
    schema: dict[str, Any]


JSON_TASKS = (
    JsonTask("person", "Alice is 31 years old. Give her name and age as JSON.",
             _object({"name": {"type": "string", "maxLength": 16},
                      "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    JsonTask("answer", "Is Python a compiled language? Answer as JSON.",
             _object({"answer": {"enum": ["yes", "no", "maybe"]},
                      "confidence": {"type": "integer", "minimum": 0, "maximum": 100}})),
    JsonTask("weather", "It is sunny and 24 degrees in Lisbon. Describe the weather as JSON.",
             _object({"city": {"type": "string", "maxLength": 16},
                      "temperature_c": {"type": "integer", "minimum": -40, "maximum": 50},
                      "sunny": {"type": "boolean"}})),
    JsonTask("ticket", "Tag this ticket as JSON: the login page crashes on Safari.",
             _object({"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                               "items": {"enum": ["bug", "ui", "browser", "auth", "crash"]}},
                      "urgent": {"type": "boolean"}})),
)


@dataclass(frozen=True)
class RequestKind:
    """One way of asking.

    Attributes:
        name: its name in reports.
        source: ``"chat"``, ``"completion"`` or ``"json"``: its prompts, its endpoint and the
            references it is compared with (a json kind is a chat request with a
            ``json_schema`` response format).
        stream: server-sent events (with ``stream_options.include_usage``).
        n: choices asked.
        logprobs: ask for the tokens' log probabilities with :data:`TOP_LOGPROBS`
            alternatives (completions: ``logprobs``; chat: ``logprobs`` + ``top_logprobs``).
    """

    name: str
    source: str
    stream: bool = False
    n: int = 1
    logprobs: bool = False

    @property
    def chat(self) -> bool:
        """Whether it goes to ``/v1/chat/completions``."""
        return self.source != "completion"

    @property
    def endpoint(self) -> str:
        """The route it is sent to."""
        return "/v1/chat/completions" if self.chat else "/v1/completions"


KINDS = (
    RequestKind("chat", "chat"),
    RequestKind("chat-stream", "chat", stream=True),
    RequestKind("json", "json"),
    RequestKind("json-stream", "json", stream=True),
    RequestKind("completion-logprobs", "completion", logprobs=True),
    RequestKind("chat-logprobs-stream", "chat", stream=True, logprobs=True),
    RequestKind("n2-chat", "chat", n=2),
    RequestKind("n2-completion-stream", "completion", stream=True, n=2),
)


@dataclass(frozen=True)
class Prompts:
    """The prompts the kinds draw from (the first ``count`` of each list).

    Attributes:
        chat / completion: free-text prompts.
        json: JSON tasks.
    """

    chat: tuple[str, ...]
    completion: tuple[str, ...]
    json: tuple[JsonTask, ...]

    @classmethod
    def first(cls, count: int) -> Prompts:
        """The first ``count`` (>= 1) prompts of each built-in list."""
        count = max(1, count)
        return cls(CHAT_PROMPTS[:count], COMPLETION_PROMPTS[:count], JSON_TASKS[:count])

    def count(self, source: str) -> int:
        """How many prompts ``source`` has."""
        return len(getattr(self, source))

    def keys(self) -> list[tuple[str, int]]:
        """Every ``(source, prompt index)``: the references to take."""
        return [(source, i) for source in ("chat", "completion", "json")
                for i in range(self.count(source))]


def rotation(seed: int) -> list[RequestKind]:
    """The fixed order in which clients pick kinds: a permutation of the kinds shuffled by
    ``seed``, then the same permutation reversed (every kind twice). Client ``c`` of ``C``
    walks it from position ``c * len / C`` (:func:`start`), so the clients ask different
    kinds at any moment and every kind early: 16 clients all of them with their first
    requests, 2 clients with their first four each (a prefix of the permutation and the
    same-length prefix of its reverse make it whole); a run sends the same sequence every
    time."""
    order = list(KINDS)
    random.Random(seed).shuffle(order)
    return order + order[::-1]


def start(client: int, clients: int, length: int) -> int:
    """Where client ``client`` of ``clients`` starts in a rotation of ``length``."""
    return client * length // clients


@dataclass(frozen=True)
class Limits:
    """Tokens asked per request.

    Attributes:
        max_tokens: free-text and logprobs kinds.
        json_max_tokens: JSON kinds (above the longest answer a bounded schema allows, so
            a JSON answer ends by itself, never cut by the limit).
    """

    max_tokens: int = 64
    json_max_tokens: int = 160


def request_params(kind: RequestKind, prompts: Prompts, index: int, model: str,
                   limits: Limits, selfspec: dict | None = None,
                   logprobs: bool | None = None) -> dict[str, Any]:
    """The ``create(...)`` keyword arguments of the ``openai`` client for ``kind`` on prompt
    ``index`` of its source.

    Args:
        selfspec: the request's ``selfspec`` field (method and options), sent as extra body.
        logprobs: ask for log probabilities (default: ``kind.logprobs``); the references ask
            for them so that token lists can be compared.
    """
    want_logprobs = kind.logprobs if logprobs is None else logprobs
    params: dict[str, Any] = {"model": model, "temperature": 0, "stream": kind.stream}
    if kind.n != 1:
        params["n"] = kind.n
    if kind.stream:
        params["stream_options"] = {"include_usage": True}
    if kind.source == "completion":
        params["prompt"] = prompts.completion[index]
        params["max_tokens"] = limits.max_tokens
        if want_logprobs:
            params["logprobs"] = TOP_LOGPROBS
    else:
        if kind.source == "json":
            task = prompts.json[index]
            params["messages"] = [{"role": "user", "content": task.prompt}]
            params["response_format"] = {"type": "json_schema", "json_schema": {
                "name": task.name, "schema": task.schema}}
            params["max_tokens"] = limits.json_max_tokens
        else:
            params["messages"] = [{"role": "user", "content": prompts.chat[index]}]
            params["max_tokens"] = limits.max_tokens
        if want_logprobs:
            params["logprobs"] = True
            params["top_logprobs"] = TOP_LOGPROBS
    if selfspec is not None:
        params["extra_body"] = {"selfspec": selfspec}
    return params


# --------------------------------------------------------------------------- answers
@dataclass
class ChoiceAnswer:
    """One choice as the client received it.

    Attributes:
        text: its text (a stream's deltas joined).
        finish_reason: ``None`` when none came.
        tokens / logprobs / alternatives: per token, its text, log probability and the
            number of alternatives given; ``None`` when the answer had no log probabilities.
    """

    text: str = ""
    finish_reason: str | None = None
    tokens: list[str] | None = None
    logprobs: list[float] | None = None
    alternatives: list[int] | None = None

    def add_logprobs(self, body: dict | None, chat: bool) -> None:
        """Append a (chunk's) ``logprobs`` object in either OpenAI shape."""
        if not body:
            return
        if self.tokens is None:
            self.tokens, self.logprobs, self.alternatives = [], [], []
        assert self.logprobs is not None and self.alternatives is not None
        if chat:
            for entry in body.get("content") or ():
                self.tokens.append(entry.get("token"))
                self.logprobs.append(entry.get("logprob"))
                self.alternatives.append(len(entry.get("top_logprobs") or ()))
        else:
            self.tokens.extend(body.get("tokens") or ())
            self.logprobs.extend(body.get("token_logprobs") or ())
            self.alternatives.extend(len(top or {}) for top in body.get("top_logprobs") or ())


@dataclass
class Answer:
    """A response as the client received it.

    Attributes:
        status: the HTTP status; ``None``: no response (refused, or the connection failed
            before one).
        choices: by index.
        completion_tokens: ``usage.completion_tokens`` (``None`` when no usage came).
        done: a non-streamed body was read whole; a stream ended with ``data: [DONE]``.
        error: what went wrong (an error body's or event's message, or an exception).
        error_code: the error body's or event's ``code`` (``shutting_down`` while draining).
        seconds: from sending to the end of the answer.
        first_token_s: a stream's first non-empty text, from sending.
    """

    status: int | None = None
    choices: dict[int, ChoiceAnswer] = field(default_factory=dict)
    completion_tokens: int | None = None
    done: bool = False
    error: str | None = None
    error_code: str | None = None
    seconds: float = 0.0
    first_token_s: float | None = None

    @property
    def finished_normally(self) -> bool:
        """200, no error, complete (``[DONE]`` or whole body), every choice has a
        ``finish_reason``."""
        return (self.status == 200 and self.error is None and self.done and bool(self.choices)
                and all(c.finish_reason is not None for c in self.choices.values()))

    def choice(self, index: int) -> ChoiceAnswer:
        """Choice ``index``, created when first seen."""
        return self.choices.setdefault(index, ChoiceAnswer())

    def set_error(self, body: Any) -> None:
        """Record an OpenAI error body (``{"error": {...}}``) or any other failure text."""
        inner = body.get("error") if isinstance(body, dict) else None
        if isinstance(inner, dict):
            self.error = str(inner.get("message") or inner)[:300]
            self.error_code = inner.get("code")
        else:
            self.error = str(body)[:300]


def read_body(body: dict, chat: bool, status: int = 200) -> Answer:
    """The :class:`Answer` of a non-streamed body (answered with ``status``)."""
    answer = Answer(status=status, done=True)
    if "error" in body:
        answer.set_error(body)
    for raw in body.get("choices") or ():
        choice = answer.choice(raw.get("index", -1))
        message = raw.get("message") or {}
        choice.text = (message.get("content") if chat else raw.get("text")) or ""
        choice.finish_reason = raw.get("finish_reason")
        choice.add_logprobs(raw.get("logprobs"), chat)
    use = body.get("usage") or {}
    answer.completion_tokens = use.get("completion_tokens")
    return answer


class StreamReader:
    """Builds the :class:`Answer` of a stream from its lines, as they come (its ``status``
    is the caller's to set when the response arrives).

    Args:
        chat: chat chunks (``delta.content``) or completions chunks (``text``).
        started: the clock's value when the request was sent (for the first token's time).
        clock: a function returning the current time, seconds.
    """

    def __init__(self, chat: bool, started: float, clock: Any) -> None:
        self.chat = chat
        self.started = started
        self.clock = clock
        self.answer = Answer()
        self._after_done = False

    def feed(self, line: str) -> None:
        """One line of the event stream (blank lines and comments are skipped)."""
        if not line.startswith("data:"):
            return
        data = line[len("data:"):].strip()
        answer = self.answer
        if self._after_done:  # anything after [DONE] is a protocol error
            answer.done = False
            answer.error = answer.error or f"data after [DONE]: {data[:80]}"
            return
        if data == "[DONE]":
            answer.done = self._after_done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            answer.error = answer.error or f"an event that is not JSON: {data[:80]}"
            return
        if "error" in chunk:
            answer.set_error(chunk)
            return
        for raw in chunk.get("choices") or ():
            choice = answer.choice(raw.get("index", -1))
            text = ((raw.get("delta") or {}).get("content") if self.chat
                    else raw.get("text")) or ""
            if text and answer.first_token_s is None:
                answer.first_token_s = self.clock() - self.started
            choice.text += text
            if raw.get("finish_reason") is not None:
                choice.finish_reason = raw["finish_reason"]
            choice.add_logprobs(raw.get("logprobs"), self.chat)
        if chunk.get("usage"):
            answer.completion_tokens = chunk["usage"].get("completion_tokens")


# --------------------------------------------------------------------------- checks
@dataclass(frozen=True)
class Problem:
    """What is wrong with a response: a category (:data:`CATEGORIES`) and a detail."""

    category: str
    detail: str


def check(kind: RequestKind, answer: Answer, reference: Answer,
          schema: dict | None = None) -> list[Problem]:
    """Everything wrong with ``answer`` (a greedy response of ``kind``) given the
    ``reference`` (the lone answer of the same prompt, asked with log probabilities).

    Args:
        schema: the JSON schema a json kind's text must validate against.

    Returns:
        The problems; empty when the answer is complete, equal to the reference choice by
        choice (text, finish reason, token count, and the tokens when it has them), valid
        JSON where asked, and with one log-probability entry (with its alternatives) per
        completion token where asked.
    """
    if answer.status != 200 or (answer.error is not None and not answer.choices):
        return [Problem(FAILED, f"status {answer.status}: {answer.error}")]
    problems = []
    if answer.error is not None:
        problems.append(Problem(FAILED, f"error event: {answer.error}"))
    if not answer.done:
        problems.append(Problem(TRUNCATED, "stream without data: [DONE]" if kind.stream
                                else "incomplete body"))
    if sorted(answer.choices) != list(range(kind.n)):
        problems.append(Problem(BAD_CHOICES, f"choice indices {sorted(answer.choices)}, "
                                             f"expected 0..{kind.n - 1}"))
    ref = reference.choices[0]
    ref_tokens = reference.completion_tokens
    for index, choice in sorted(answer.choices.items()):
        if choice.finish_reason is None:
            problems.append(Problem(TRUNCATED, f"choice {index} without finish_reason"))
        elif choice.finish_reason != ref.finish_reason:
            problems.append(Problem(MISMATCHED, f"choice {index} finished by "
                                                f"{choice.finish_reason}, the reference by "
                                                f"{ref.finish_reason}"))
        if choice.text != ref.text:
            problems.append(Problem(MISMATCHED, f"choice {index}: {_diff(choice.text, ref.text)}"))
        if schema is not None:
            problems.extend(_check_json(index, choice.text, schema))
        if kind.logprobs:
            problems.extend(_check_logprobs(kind, index, choice, ref, answer))
    if answer.completion_tokens is None:
        problems.append(Problem(TRUNCATED, "no usage"))
    elif ref_tokens is not None and answer.completion_tokens != ref_tokens * kind.n:
        problems.append(Problem(MISMATCHED, f"{answer.completion_tokens} completion tokens, "
                                            f"the reference {ref_tokens} per choice"))
    return problems


def _diff(text: str, reference: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(text, reference, strict=False)) if a != b),
              min(len(text), len(reference)))
    return (f"differs from the reference at character {at}: "
            f"{text[at:at + 30]!r} vs {reference[at:at + 30]!r}")


def _check_json(index: int, text: str, schema: dict) -> list[Problem]:
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as error:
        return [Problem(INVALID_JSON, f"choice {index} is not JSON ({error}): {text[:80]!r}")]
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as error:
        return [Problem(INVALID_JSON, f"choice {index} breaks its schema: {error.message}")]
    return []


def _check_logprobs(kind: RequestKind, index: int, choice: ChoiceAnswer, ref: ChoiceAnswer,
                    answer: Answer) -> list[Problem]:
    if choice.tokens is None or choice.logprobs is None or choice.alternatives is None:
        return [Problem(BAD_LOGPROBS, f"choice {index} has no logprobs")]
    problems = []
    count = len(choice.tokens)
    per_choice = None if answer.completion_tokens is None else answer.completion_tokens // kind.n
    # usage counts an answer's end-of-sequence token; its logprobs do not (not in the text)
    counts = () if per_choice is None else (
        (per_choice, per_choice - 1) if choice.finish_reason == "stop" else (per_choice,))
    if len(choice.logprobs) != count or len(choice.alternatives) != count or (
            per_choice is not None and count not in counts):
        problems.append(Problem(BAD_LOGPROBS, f"choice {index}: {count} tokens, "
                                              f"{len(choice.logprobs)} logprobs, "
                                              f"{len(choice.alternatives)} alternative lists for "
                                              f"{per_choice} completion tokens"))
    # chat lists every alternative; completions key them by text, so two alternatives that
    # decode to the same text make one entry
    low = TOP_LOGPROBS if kind.chat else 1
    if any(not low <= a <= TOP_LOGPROBS for a in choice.alternatives):
        problems.append(Problem(BAD_LOGPROBS, f"choice {index}: alternatives per token "
                                              f"{sorted(set(choice.alternatives))}, expected "
                                              f"{TOP_LOGPROBS}"))
    if any(not isinstance(v, (int, float)) or v > 0 for v in choice.logprobs):
        problems.append(Problem(BAD_LOGPROBS, f"choice {index}: a log probability that is "
                                              "no number <= 0"))
    if ref.tokens is not None and choice.tokens != ref.tokens:
        problems.append(Problem(MISMATCHED, f"choice {index}: its tokens differ from the "
                                            "reference's"))
    return problems


def max_logprob_gap(answer: Answer, reference: Answer) -> float:
    """The largest ``|logprob - reference logprob|`` over the tokens both have (how far
    batching moves the values; informational, greedy tokens are what must match)."""
    ref = reference.choices.get(0)
    if ref is None or ref.logprobs is None:
        return 0.0
    gap = 0.0
    for choice in answer.choices.values():
        if choice.logprobs is None:
            continue
        for a, b in zip(choice.logprobs, ref.logprobs, strict=False):
            if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                gap = max(gap, abs(a - b))
    return gap


def count_problems(problems: Sequence[Problem]) -> dict[str, int]:
    """Problems by category (every category present, zeros included)."""
    counts = dict.fromkeys(CATEGORIES, 0)
    for problem in problems:
        counts[problem.category] += 1
    return counts
