"""Running ``selfspec batch`` requests on one engine: requests with equal settings in ragged
batches (:meth:`selfspec.SelfSpec.generate_batch`), each record written as its batch ends."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from selfspec.batch.jobs import BatchRequest, error_record, result_record
from selfspec.errors import SelfSpecError

logger = logging.getLogger(__name__)


def batches(requests: Iterable[BatchRequest], size: int) -> Iterator[list[BatchRequest]]:
    """``requests`` in groups of at most ``size`` with equal settings, each group in file
    order, the groups in the order of their first request."""
    groups: dict[str, list[BatchRequest]] = {}
    for request in requests:
        groups.setdefault(request.settings.key(), []).append(request)
    for group in groups.values():
        for start in range(0, len(group), size):
            yield group[start:start + size]


def prompt_of(engine: Any, request: BatchRequest) -> str | list[int]:
    """The prompt ``generate`` takes for ``request``: its text, or its messages' chat
    template token ids.

    Raises:
        PromptError: the model has no chat template, or its template refuses the messages.
    """
    from jinja2 import TemplateError

    from selfspec.errors import PromptError

    if request.messages is None:
        return request.prompt
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(f"model {engine.name!r} has no chat template; give 'prompt' instead "
                          "of 'messages'")
    try:
        ids = tokenizer.apply_chat_template([dict(m) for m in request.messages],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    except TemplateError as err:
        raise PromptError(f"the model's chat template refuses these messages: {err}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def run_batch(engine: Any, group: Sequence[BatchRequest]) -> list[dict[str, Any]]:
    """The records of one group of requests with equal settings, in order: one ragged batch;
    if it raises a :class:`SelfSpecError` (a prompt too long for the context, a template that
    refuses its messages), each request alone, so only the bad one records its error."""
    kwargs = group[0].settings.generate_kwargs()
    try:
        prompts = [prompt_of(engine, r) for r in group]
        results = engine.generate_batch(prompts, **kwargs)
        return [result_record(r, out, engine.tokenizer) for r, out in zip(group, results)]
    except SelfSpecError:
        if len(group) == 1:
            return [_alone(engine, group[0], kwargs)]
        return [_alone(engine, r, kwargs) for r in group]


def _alone(engine: Any, request: BatchRequest, kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        out = engine.generate(prompt_of(engine, request), **kwargs)
    except SelfSpecError as err:
        logger.warning("request %r (line %d) failed: %s", request.id, request.line, err)
        return error_record(request, err)
    return result_record(request, out, engine.tokenizer)


def run_local(engine: Any, requests: Sequence[BatchRequest], write: Callable[[dict], Any],
              batch_size: int) -> None:
    """Run every request on ``engine`` in groups of at most ``batch_size``, passing each
    record to ``write`` as its group ends."""
    for group in batches(requests, batch_size):
        for record in run_batch(engine, group):
            write(record)
