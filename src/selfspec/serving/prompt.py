"""A generation request's prompt as token ids: the chat template applied to ``messages``
(with the request's tools), or a completion's text tokenized, or its token ids taken as
given; checked against the vocabulary and the server's prompt limit."""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from selfspec.errors import PromptError
from selfspec.serving.protocol import ApiError, ApiRequest, Limits, check_prompt_length
from selfspec.serving.tools import hermes_messages, template_messages, template_takes_tools
from selfspec.validation import check_text, check_token_ids


def prompt_ids(api: ApiRequest, tokenizer: Any, model_name: str, vocab_size: int,
               max_positions: int, limits: Limits) -> list[int]:
    """The prompt's token ids of ``api``.

    Args:
        api: the validated request.
        tokenizer: the event loop's own tokenizer (never the worker thread's).
        model_name: the served name (for the message when there is no chat template).
        vocab_size: ids must be below it.
        max_positions: the model's context, positions.
        limits: the server's ``max_prompt_tokens``.

    Raises:
        ApiError: 400 for a model without a chat template (param ``messages``), messages
            its template refuses, text that cannot be tokenized or ids outside the
            vocabulary (param ``prompt``), or a prompt over the limits.
    """
    try:
        if api.chat:
            ids = _chat_ids(api, tokenizer, model_name)
        elif api.prompt is not None:
            check_text("the prompt", api.prompt)
            ids = tokenizer(api.prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = api.prompt_ids
        ids = check_token_ids(list(ids), vocab_size)
    except PromptError as error:
        raise ApiError(400, str(error), param="prompt") from error
    check_prompt_length(len(ids), limits, max_positions)
    return ids


def _chat_ids(api: ApiRequest, tokenizer: Any, model_name: str) -> list[int]:
    """The chat template's ids of ``api.messages``: the tools passed to a template that
    takes them, else described in the messages (Hermes' format)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, f"model {model_name!r} has no chat template; "
                            "use /v1/completions", param="messages")
    tools = api.tools
    if template_takes_tools(tokenizer):
        extra = {"tools": list(tools.tools)} if tools is not None and tools.active else {}
        messages = template_messages(api.messages)
    else:
        extra, messages = {}, hermes_messages(api.messages, tools)
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **extra)
    except TemplateError as error:  # the template refuses these messages
        raise ApiError(400, f"the model's chat template refuses these messages: "
                            f"{error}", param="messages") from error
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
