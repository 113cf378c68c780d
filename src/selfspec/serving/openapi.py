"""The OpenAPI 3.1 document of ``selfspec serve`` (``GET /openapi.json``).

The handlers read raw JSON and validate it themselves (:mod:`selfspec.serving.protocol`,
:mod:`selfspec.serving.tools`, :mod:`selfspec.serving.body`): their checks give the
OpenAI-style error bodies clients expect, which FastAPI's generated validation would not.
So the document is written here, as JSON Schema, and built per server: the limits
(``max_tokens``, ``n``), the served model's name, its vocabulary (token ids), the methods
a request may pick with their options and model-dependent ranges (from each method's
``Options``, the single source of options), and whether an API key is needed all come from
the running server. ``tests/serving/test_fuzz.py`` keeps it true: the request fields equal the ones
protocol.py accepts, and a schemathesis fuzzer checks that no request gets a 5xx or a
response outside this document, and that every request outside it is refused.

The request schemas describe what the server accepts; a request inside them may still be
refused with a documented 4xx for what a schema cannot say (a prompt longer than the
context, a JSON schema llguidance cannot compile, a method whose trained assets this
server lacks, ``top_logprobs`` without ``logprobs``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from selfspec.methods.base import MethodSpec
from selfspec.methods.options import OptionField
from selfspec.serving.protocol import Limits

#: OpenAPI version of the document.
OPENAPI_VERSION = "3.1.0"

_REF = "#/components/schemas/"
_INT64 = (-(2 ** 63), 2 ** 63 - 1)
_NULL = {"type": "null"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def _nullable(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` or ``null`` (the server takes ``null`` as "not given" for every optional
    field of a request)."""
    return {"anyOf": [dict(schema), _NULL]}


def _integer(low: int | None = None, high: int | None = None, **extra: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", **extra}
    if low is not None:
        schema["minimum"] = low
    if high is not None:
        schema["maximum"] = high
    return schema


def _number(low: float, high: float, low_open: bool = False, **extra: Any) -> dict[str, Any]:
    bound = "exclusiveMinimum" if low_open else "minimum"
    return {"type": "number", bound: low, "maximum": high, **extra}


def _text_content() -> dict[str, Any]:
    """A message's content: a string, or text parts joined."""
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    return {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}


# --- requests ---------------------------------------------------------------------------


def _common_fields(model_name: str, limits: Limits) -> dict[str, Any]:
    """Fields of both request bodies (protocol.py's ``_COMMON``)."""
    return {
        "model": {"type": "string", "enum": [model_name],
                  "description": "the served model (GET /v1/models); another name is a 404"},
        "max_tokens": _nullable(_integer(1, limits.max_tokens, description="most tokens to "
                                         "generate (completions default 16, chat "
                                         f"{limits.default_max_tokens})")),
        "temperature": _nullable(_number(0.0, 2.0, description="0: greedy; default 1")),
        "top_p": _nullable(_number(0.0, 1.0, low_open=True, description="nucleus mass")),
        "top_k": _nullable(_integer(0, description="keep the k most likely tokens (0: all)")),
        "n": _nullable(_integer(1, limits.max_n, description="choices, each a row of the "
                                "batch")),
        "stream": _nullable({"type": "boolean", "description": "server-sent events"}),
        "stream_options": _nullable({
            "type": "object", "properties": {"include_usage": {"type": "boolean"}},
            "description": "include_usage: a last chunk with the usage"}),
        "stop": _nullable({"anyOf": [{"type": "string"}, {
            "type": "array", "items": {"type": "string"}, "maxItems": 4}]}),
        "seed": _nullable(_integer(*_INT64, description="choice i samples with seed + i")),
        "user": _nullable({"type": "string", "description": "accepted and not used"}),
        "presence_penalty": _nullable(_number(-2.0, 2.0)),
        "frequency_penalty": _nullable(_number(-2.0, 2.0)),
        "logit_bias": _nullable({"type": "object", "maxProperties": 0,
                                 "description": "not supported: empty or null only"}),
    }


def _response_format() -> dict[str, Any]:
    def kind(name: str, **fields: Any) -> dict[str, Any]:
        return {"type": "object", "required": ["type", *fields],
                "properties": {"type": {"const": name}, **fields}}

    wrapper = {"type": "object", "required": ["schema"], "properties": {
        "name": _nullable({"type": "string"}), "description": _nullable({"type": "string"}),
        "schema": {"anyOf": [{"type": "object"}, {"type": "string"}],
                   "description": "a JSON schema, or its JSON text"},
        "strict": _nullable({"type": "boolean"})}}
    return _nullable({"anyOf": [
        kind("text"), kind("json_object"), kind("json_schema", json_schema=wrapper),
        kind("regex", regex={"type": "string", "minLength": 1}),
        kind("lark", lark={"type": "string", "minLength": 1})],
        "description": "structured output; regex and lark are selfspec's"})


def _option_schema(field: OptionField, symbols: Mapping[str, int],
                   asset_names: bool) -> dict[str, Any]:
    """One method option as JSON Schema, its model-dependent bounds resolved."""
    info = field.info
    if info.asset is not None:
        # Over HTTP an asset option takes its keywords, or a bare name in --assets-dir.
        schema: dict[str, Any] = ({"type": "string"} if asset_names
                                  else {"enum": list(info.asset.keywords)})
    elif info.choices:
        schema = {"enum": list(info.choices)}
    elif field.type is bool:
        schema = {"type": "boolean"}
    elif field.type is str:
        schema = {"type": "string"}
    else:
        schema = {"type": "integer" if field.type is int else "number"}
        # A model-dependent bound missing from ``symbols`` is left out (checked on use).
        low, high = (symbols.get(b) if isinstance(b, str) else b
                     for b in (info.low, info.high))
        if low is not None:
            schema["exclusiveMinimum" if info.low_open else "minimum"] = low
        if high is not None:
            schema["exclusiveMaximum" if info.high_open else "maximum"] = high
    schema["description"] = info.help
    return _nullable(schema)


def _selfspec_field(methods: Mapping[str, MethodSpec], symbols: Mapping[str, int],
                    asset_names: bool) -> dict[str, Any]:
    """``selfspec``: a method and its options (each method's own), or nothing."""
    variants: list[dict[str, Any]] = [{
        "type": "object", "additionalProperties": False,
        "properties": {"method": _NULL, "options": _nullable({"type": "object",
                                                              "maxProperties": 0})},
        "description": "the server's method"}]
    for name, spec in sorted(methods.items()):
        options = {"type": "object", "additionalProperties": False, "properties": {
            f.name: _option_schema(f, symbols, asset_names) for f in spec.fields}}
        variants.append({"type": "object", "additionalProperties": False,
                         "required": ["method"], "description": spec.summary,
                         "properties": {"method": {"const": name},
                                        "options": _nullable(options)}})
    return _nullable({"anyOf": variants, "description": "selfspec's method for this request"})


def _tools_fields() -> dict[str, Any]:
    name = {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}
    tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": name, "description": _nullable({"type": "string"}),
            "parameters": {"type": "object", "description": "a JSON schema"},
            "strict": _nullable({"type": "boolean"})}}}}
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": name}}}}
    return {
        "tools": _nullable({"type": "array", "items": tool, "minItems": 1,
                            "description": "functions the model may call (names unique)"}),
        "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, named],
                                  "description": "a named function must be among tools"}),
        "parallel_tool_calls": _nullable({"type": "boolean"}),
    }


def _message() -> dict[str, Any]:
    call = {"type": "object", "required": ["function"], "properties": {
        "id": _nullable({"type": "string"}), "type": {"enum": ["function", None]},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"},
            "arguments": _nullable({"anyOf": [{"type": "string"}, {"type": "object"}],
                                    "description": "JSON text or an object"})}}}}
    text = _text_content()
    return {"anyOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"enum": ["system", "developer", "user"]}, "content": text,
            "name": _nullable({"type": "string"}), "tool_calls": _NULL}},
        {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"const": "assistant"}, "content": text,
            "tool_calls": _nullable({"type": "array", "items": call}),
            "name": _nullable({"type": "string"})}},
        {"type": "object", "required": ["role", "tool_calls"], "properties": {
            "role": {"const": "assistant"}, "content": _nullable(text),
            "tool_calls": {"type": "array", "items": call},
            "name": _nullable({"type": "string"})},
         "description": "an assistant's calls; its content may be null"},
        {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"const": "tool"}, "content": text, "tool_calls": _NULL,
            "name": _nullable({"type": "string"}),
            "tool_call_id": _nullable({"type": "string"})}}]}


def completion_request(model_name: str, limits: Limits, vocab_size: int) -> dict[str, Any]:
    """The body of ``POST /v1/completions``."""
    ids = {"type": "array", "minItems": 1, "maxItems": limits.max_prompt_tokens,
           "items": _integer(0, vocab_size - 1)}
    one = {"anyOf": [{"type": "string", "minLength": 1}, ids]}
    return {"type": "object", "required": ["model", "prompt"], "additionalProperties": False,
            "properties": {
                **_common_fields(model_name, limits),
                "prompt": {"anyOf": [*one["anyOf"], {
                    "type": "array", "items": one, "minItems": 1, "maxItems": 1}],
                    "description": "text or token ids; one prompt per request"},
                "logprobs": _nullable(_integer(0, 20, description="alternatives per token")),
                "response_format": _response_format(),
                "echo": {"enum": [False, None], "description": "not supported"},
                "best_of": _nullable(_integer(1, limits.max_n,
                                              description="must equal n")),
                "suffix": {"type": "null", "description": "not supported"},
                "selfspec": _ref("Selfspec")}}


def chat_request(model_name: str, limits: Limits) -> dict[str, Any]:
    """The body of ``POST /v1/chat/completions``."""
    return {"type": "object", "required": ["model", "messages"], "additionalProperties": False,
            "properties": {
                **_common_fields(model_name, limits),
                "messages": {"type": "array", "minItems": 1, "items": _ref("Message")},
                "max_completion_tokens": _nullable(_integer(
                    1, limits.max_tokens, description="max_tokens' newer name; wins over it")),
                "logprobs": _nullable({"type": "boolean"}),
                "top_logprobs": _nullable(_integer(0, 20, description="needs logprobs: true")),
                "response_format": _response_format(),
                **_tools_fields(),
                "selfspec": _ref("Selfspec")},
            # top_logprobs needs logprobs: true; tool_choice (other than none) needs tools.
            "dependentSchemas": {
                "top_logprobs": {"anyOf": [
                    {"properties": {"top_logprobs": _NULL}},
                    {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}]},
                "tool_choice": {"anyOf": [
                    {"properties": {"tool_choice": {"enum": ["none", None]}}},
                    {"required": ["tools"], "properties": {"tools": {"type": "array"}}}]}}}


# --- responses --------------------------------------------------------------------------


def _object(properties: Mapping[str, Any], required: Sequence[str] | None = None,
            **extra: Any) -> dict[str, Any]:
    return {"type": "object", "required": list(properties if required is None else required),
            "properties": dict(properties), **extra}


def _response_schemas() -> dict[str, Any]:
    """The response bodies' JSON schemas by name. Over ~80 lines: one declarative table,
    each schema beside the ones it refers to, read as data rather than steps."""
    string, integer, number = {"type": "string"}, {"type": "integer"}, {"type": "number"}
    count = {"type": "integer", "minimum": 0}
    byte_list = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}
    alternative = _object({"token": string, "logprob": number, "bytes": byte_list})
    call = _object({"id": string, "type": {"const": "function"},
                    "function": _object({"name": string, "arguments": string})})
    head = {"id": string, "created": integer, "model": string}
    finish = {"enum": ["stop", "length"]}
    chat_finish = {"enum": ["stop", "length", "tool_calls"]}
    return {
        "Error": _object({"error": _object({
            "message": string, "type": string, "param": _nullable(string),
            "code": _nullable(string)})}),
        "SelfspecUsage": _object({
            "method": string, "steps": count, "draft_tokens": count, "accepted_tokens": count,
            "verifications": count, "acceptance_rate": {"type": "number", "minimum": 0},
            "mean_accepted_tokens": {"type": "number", "minimum": 0},
            "drafters": {"type": "object", "additionalProperties": count}},
            required=["method", "steps", "draft_tokens", "accepted_tokens", "verifications",
                      "acceptance_rate", "mean_accepted_tokens"]),
        "Usage": _object({"prompt_tokens": count, "completion_tokens": count,
                          "total_tokens": count, "selfspec": _ref("SelfspecUsage"),
                          # prompt tokens whose KV came from the prefix cache (OpenAI's name)
                          "prompt_tokens_details": _object({"cached_tokens": count})},
                         required=["prompt_tokens", "completion_tokens", "total_tokens",
                                   "selfspec"]),
        "CompletionLogprobs": _object({
            "tokens": {"type": "array", "items": string},
            "token_logprobs": {"type": "array", "items": number},
            "top_logprobs": {"type": "array",
                             "items": {"type": "object", "additionalProperties": number}},
            "text_offset": {"type": "array", "items": count}}),
        "ChatLogprobs": _object({"content": {"type": "array", "items": _object({
            **alternative["properties"],
            "top_logprobs": {"type": "array", "items": alternative}})}}),
        "ToolCall": call,
        "Completion": _object({
            **head, "object": {"const": "text_completion"},
            "choices": {"type": "array", "minItems": 1, "items": _object({
                "index": count, "text": string,
                "logprobs": _nullable(_ref("CompletionLogprobs")), "finish_reason": finish})},
            "usage": _ref("Usage")}),
        "ChatCompletion": _object({
            **head, "object": {"const": "chat.completion"},
            "choices": {"type": "array", "minItems": 1, "items": _object({
                "index": count,
                "message": _object({"role": {"const": "assistant"},
                                    "content": _nullable(string),
                                    "tool_calls": {"type": "array", "items": _ref("ToolCall")}},
                                   required=["role", "content"]),
                "logprobs": _nullable(_ref("ChatLogprobs")), "finish_reason": chat_finish})},
            "usage": _ref("Usage")}),
        "CompletionChunk": _object({
            **head, "object": {"const": "text_completion"},
            "choices": {"type": "array", "items": _object({
                "index": count, "text": string,
                "logprobs": _nullable(_ref("CompletionLogprobs")),
                "finish_reason": _nullable(finish)})},
            "usage": _ref("Usage")}, required=[*head, "object", "choices"]),
        "ChatCompletionChunk": _object({
            **head, "object": {"const": "chat.completion.chunk"},
            "choices": {"type": "array", "items": _object({
                "index": count,
                "delta": _object({
                    "role": {"const": "assistant"}, "content": _nullable(string),
                    "tool_calls": {"type": "array", "items": _object({
                        "index": count, **call["properties"]})}}, required=[]),
                "logprobs": _nullable(_ref("ChatLogprobs")),
                "finish_reason": _nullable(chat_finish)})},
            "usage": _ref("Usage")}, required=[*head, "object", "choices"]),
        "Model": _object({"id": string, "object": {"const": "model"}, "created": integer,
                          "owned_by": string, "selfspec": _object({
                              "default_method": string,
                              "methods": {"type": "array", "items": string},
                              "batched_methods": {"type": "array", "items": string}})}),
        "ModelList": _object({"object": {"const": "list"},
                              "data": {"type": "array", "items": _ref("Model")}}),
        "Health": _object({"status": {"enum": ["ok", "draining"]}, "model": string,
                           "running": count, "waiting": count}),
    }


def _event_stream(chunk: str) -> dict[str, Any]:
    """``text/event-stream``: each event's ``data`` is a chunk, an error body (a request
    that fails or is cut by shutdown mid-stream) or the final ``[DONE]``."""
    payload = {"contentMediaType": "application/json",
               "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]}}
    return {"schema": {"type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", "if": {"const": "[DONE]"}, "then": True, "else": payload}}},
        "description": f"server-sent events: data: {chunk} JSON ... then data: [DONE]"}


_ERRORS = {
    400: "malformed JSON or a parameter the server refuses (the error names it)",
    401: "missing or wrong API key",
    404: "the model is not served here",
    408: "the body did not arrive within the server's body timeout (the connection closes)",
    413: "the body is over the server's limit",
    429: "the queue is full; retry later",
    500: "decoding failed (the traceback is in the server's log)",
    503: "the server is draining for shutdown; retry (Retry-After)",
}


def _error(status: int) -> dict[str, Any]:
    return {"description": _ERRORS[status],
            "content": {"application/json": {"schema": _ref("Error")}}}


def _generation(summary: str, operation: str, request: str, body: str, chunk: str,
                security: list[dict[str, list[str]]]) -> dict[str, Any]:
    return {"post": {
        "summary": summary, "operationId": operation,
        "security": security,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": f"{body}, or a stream of {chunk} with stream: true",
                    "content": {"application/json": {"schema": _ref(body)},
                                "text/event-stream": _event_stream(chunk)}},
            **{str(s): _error(s) for s in _ERRORS}}}}


def _get(summary: str, operation: str, content: Mapping[str, Any],
         security: list[dict[str, list[str]]], statuses: Sequence[int] = ()
         ) -> dict[str, Any]:
    responses = {"200": {"description": summary, "content": dict(content)}}
    responses.update({str(s): _error(s) for s in statuses})
    return {"get": {"summary": summary, "operationId": operation, "security": security,
                    "responses": responses}}


def openapi_document(model_name: str, limits: Limits, vocab_size: int,
                     methods: Mapping[str, MethodSpec], symbols: Mapping[str, int],
                     api_key: bool, health_auth: bool = False, asset_names: bool = False,
                     version: str = "") -> dict[str, Any]:
    """The OpenAPI 3.1 document of a server.

    Args:
        model_name: the model's name clients send as ``model``.
        limits: the server's limits (``max_tokens``, ``n``, prompt tokens).
        vocab_size: the model's vocabulary (token ids in ``[0, vocab_size)``).
        methods: the methods a request may pick (the registry).
        symbols: the model-dependent option bounds
            (:func:`selfspec.methods.options.model_symbols`).
        api_key: the server needs ``Authorization: Bearer KEY``.
        health_auth: ``/health`` needs it too.
        asset_names: the server has an assets directory (asset options take bare names).
        version: selfspec's version, for ``info.version``.
    """
    secured = [{"bearerAuth": []}] if api_key else []
    schemas = {
        "CompletionRequest": completion_request(model_name, limits, vocab_size),
        "ChatCompletionRequest": chat_request(model_name, limits),
        "Message": _message(),
        "Selfspec": _selfspec_field(methods, symbols, asset_names),
        **_response_schemas()}
    json_of = {"application/json": {"schema": {"type": "object"}}}
    paths = {
        "/v1/completions": _generation(
            "Complete a prompt", "createCompletion", "CompletionRequest", "Completion",
            "CompletionChunk", secured),
        "/v1/chat/completions": _generation(
            "Answer a chat", "createChatCompletion", "ChatCompletionRequest", "ChatCompletion",
            "ChatCompletionChunk", secured),
        "/v1/models": _get("The served model and the methods requests may pick", "listModels",
                           {"application/json": {"schema": _ref("ModelList")}}, secured,
                           [401] if api_key else []),
        "/health": _get("Liveness, the model and the queue", "health",
                        {"application/json": {"schema": _ref("Health")}},
                        secured if health_auth else [],
                        [401, 503] if health_auth and api_key else [503]),
        "/metrics": _get("Prometheus metrics (text format)", "metrics",
                         {"text/plain": {"schema": {"type": "string"}}}, secured,
                         [401] if api_key else []),
        "/openapi.json": _get("This document", "openapi", json_of, secured,
                              [401] if api_key else []),
    }
    # /health's 503 is a Health body ({"status": "draining"}), not an error body.
    paths["/health"]["get"]["responses"]["503"] = {
        "description": "draining for shutdown",
        "content": {"application/json": {"schema": _ref("Health")}}}
    components: dict[str, Any] = {"schemas": schemas}
    if api_key:
        components["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    return {"openapi": OPENAPI_VERSION,
            "info": {"title": "selfspec serve", "version": version or "0",
                     "description": "OpenAI-compatible completions with self-speculative "
                                    "decoding (docs/serving.md)"},
            "paths": paths, "components": components}
