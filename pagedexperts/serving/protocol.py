"""The OpenAI protocol as served here: the request bodies, and parsing them in OpenAI's error shape.

Owns: the pydantic request models of /v1/completions and /v1/chat/completions (unknown fields
refused; fields not implemented refused by name, ``UNSUPPORTED``; informational ones accepted,
``INFORMATIONAL``; every field's fate in docs/server.md), ``ApiError`` (HTTP status, OpenAI
``code``, ``param``) and ``parse_request`` (raw body -> model, or ApiError naming the field).
Does not: check ranges or tokenize (``validation``) or build responses (``bodies``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

# Fields of the OpenAI API this server does not implement; sent with a non-default value they
# are refused (400 naming the field) instead of being ignored.
UNSUPPORTED = {"tools": "tool calling", "tool_choice": "tool calling", "functions": "function calling",
               "function_call": "function calling", "parallel_tool_calls": "tool calling",
               "response_format": "structured output", "best_of": "best_of", "suffix": "suffix (insertion)",
               "audio": "audio output", "modalities": "non-text output", "prediction": "predicted outputs",
               "web_search_options": "web search"}
# SGLang's extension fields that sglang-router and vllm-router add at their defaults to each request they
# forward (watched on loopback): only the defaults pass. The reasoning flags change nothing without a parser.
# (ignore_eos, skip_special_tokens and continue_final_message, which the routers add too, are served: _Common,
# ChatCompletionRequest.)
SGLANG_DEFAULTS = {"no_stop_trim": (None, False), "return_hidden_states": (None, False)}
# OpenAI's fields that ask for something this server does not do but that change no output (vLLM accepts
# them and logs that it ignores them): accepted; a value other than these defaults is logged
# (``validation.ignored_fields``). service_tier: OpenAI's tiers (vLLM's response field).
INFORMATIONAL = {"store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default")}
SERVICE_TIERS = Literal["auto", "default", "flex", "scale", "priority"]
# reasoning_effort's values as vLLM declares them (OpenAI's, and DeepSeek V4's "max")
REASONING_EFFORTS = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ApiError(Exception):
    """A request the server refuses: HTTP status, message, OpenAI error code, offending param.

    ``code`` is one of a small fixed set (it labels the refusal counter in /metrics);
    ``headers`` are added to the response (``Retry-After``).
    """

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str = "invalid_value",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.headers = message, param, status, code, headers


class StreamOptions(BaseModel):
    """OpenAI's ``include_usage`` (a last chunk with the usage; None: on only with
    ``continuous_usage_stats``, whose vLLM default is on) and vLLM's ``continuous_usage_stats``
    (every chunk carries its choice's usage so far, with include_usage)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None  # vLLM's and SGLang's sampling extensions (engine.sampling)
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None  # vLLM's options, with its meaning (engine.sampling.SamplingParams)
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    user: str | None = None  # an end-user id for abuse monitoring in OpenAI's API; no effect on output
    store: bool | None = None  # INFORMATIONAL
    metadata: dict[str, str] | None = None
    service_tier: SERVICE_TIERS | None = None
    no_stop_trim: bool | None = None  # SGLANG_DEFAULTS
    return_hidden_states: bool | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # other part types are refused by name in chat_messages
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant turn's calls: only none ([] or null) is accepted


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's chat template options (``validation.chat_prompt``): the generation prompt (default true), the
    # final message continued, and the template's own variables (Qwen3's enable_thinking)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: REASONING_EFFORTS | None = None  # passed to the chat template, as vLLM passes it
    separate_reasoning: bool | None = None  # these three: no effect (no reasoning parser)
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None  # vllm-router adds it


def parse_request(raw: bytes, model_cls: type[BaseModel]) -> BaseModel:
    """The request model of a raw JSON body.

    Raises:
        ApiError: the body is not UTF-8 JSON, a field has the wrong type, or a field is
            unknown or unsupported (named in the message).
    """
    try:
        return model_cls.model_validate_json(raw)
    except ValidationError as exc:
        raise type_error(exc.errors()) from None


def _field_path(loc) -> str:
    """A pydantic error location without its union-branch tags ('str', 'list[int]', 'TextPart')."""
    names = [str(x) for x in loc if isinstance(x, int) or not (x in _TYPE_TAGS or "[" in str(x) or str(x)[:1].isupper())]
    return ".".join(names)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "function-before", "body"}


def type_error(errors: list[dict]) -> ApiError:
    """One ApiError for pydantic's errors: bad JSON, an unknown or unsupported field, a bad type."""
    first = errors[0] if errors else {}
    where, kind = _field_path(first.get("loc", ())), first.get("type", "")
    if kind == "json_invalid":
        return ApiError(f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
                        code="invalid_json")
    other = [e for e in errors if e.get("type") != "extra_forbidden"]
    if not other:
        extra = errors[0]
        where = _field_path(extra["loc"])
        what = UNSUPPORTED.get(where.split(".")[-1])
        why = f"{what} is not supported by this server" if what else "this field is not part of the API served here"
        return ApiError(f"unsupported field {where!r}: {why}", param=where, code="unsupported_field")
    first = other[0]
    where = _field_path(first.get("loc", ()))
    forms = sum(1 for e in other if _field_path(e.get("loc", ())) == where)
    alternatives = f" (none of its {forms} accepted forms matched)" if forms > 1 else ""
    return ApiError(f"{where or 'request body'}: {first.get('msg', 'invalid request')}{alternatives}",
                    param=where or None, code="invalid_type")
