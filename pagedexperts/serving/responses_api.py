"""The OpenAI Responses API (POST /v1/responses): its request, translated to the one chat path, and
its answer (the Response object, its streamed events), as docs/server.md describes.

Owns: ``ResponsesRequest`` (unknown fields refused; fields not implemented accepted only at
their default, else a 400 naming the field), ``to_chat`` (``instructions`` + ``input`` -> a
``ChatCompletionRequest`` that ``OpenAIServing.admit_body`` checks and tokenizes like any chat
request; its errors renamed to this API's fields), and ``ResponsesServing``, which queues,
waits and streams through ``OpenAIServing``'s shared path and shapes openai's
``types.responses`` (``Response``, one assistant ``message`` with one ``output_text`` part,
``usage``; the stream's events in the published order with a ``sequence_number`` from 0, no
``[DONE]``). Nothing is stored. Does not: validate the chat request (``validation``) or
generate (``engine.scheduler``).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from pagedexperts.serving.protocol import SERVICE_TIERS, ApiError, ChatCompletionRequest, ChatMessage, parse_request
from pagedexperts.serving.validation import Prepared, check_metadata

TEXT_PARTS = {"input_text", "output_text"}  # content part types whose text is read
ROLES = ("user", "assistant", "system", "developer")
# field -> (what it is, the values accepted: the API's defaults)
DEFAULTS_ONLY = {
    "tools": ("tool calling", (None, [])), "tool_choice": ("tool calling", (None, "none", "auto")),
    "parallel_tool_calls": ("tool calling", (None, True, False)), "max_tool_calls": ("tool calling", (None,)),
    "previous_response_id": ("stored responses (send the whole conversation as input)", (None,)),
    "conversation": ("stored conversations (send the whole conversation as input)", (None,)),
    "background": ("background responses", (None, False)), "prompt": ("prompt templates", (None,)),
    "reasoning": ("reasoning models", (None, {})), "truncation": ("truncation", (None, "disabled")),
    "text": ("structured output", (None, {}, {"format": {"type": "text"}})),
    "stream_options": ("stream obfuscation", (None, {}, {"include_obfuscation": False})),
    "priority": ("request priorities", (None, 0)),
}
RENAMED = {"max_tokens": "max_output_tokens", "messages": "input"}  # chat field -> this API's field
LOGPROBS = "message.output_text.logprobs"  # include value: each output_text part's logprobs (top_logprobs each)
# include values (openai's ResponseIncludable) that are not served: what they would include
NOT_INCLUDED = {"file_search_call.results": "file search", "web_search_call.results": "web search",
                "web_search_call.action.sources": "web search", "message.input_image.image_url": "image input",
                "computer_call_output.output.image_url": "computer use", "code_interpreter_call.outputs": "code interpreter"}
VACUOUS = {"reasoning.encrypted_content"}  # accepted: no reasoning item is produced, so there is nothing to include
MAX_TOP_LOGPROBS = 20  # OpenAI's


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses (the fields of openai's ``ResponseCreateParams`` read here)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = None  # accepted; nothing is stored (module docstring)
    metadata: dict[str, str] | None = None
    user: str | None = None  # an end-user id in OpenAI's API; no effect on output
    safety_identifier: str | None = None  # the same, its newer name
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    seed: int | None = None  # vLLM's extension of the Responses API
    truncation: str | None = None
    service_tier: SERVICE_TIERS | None = None  # accepted; a tier other than auto / default is logged (chat path)
    text: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    priority: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


def parse(raw: bytes) -> ResponsesRequest:
    """The request of a raw body, every field checked except what the chat path checks.

    Raises:
        ApiError: bad JSON or types, an unknown field, an unsupported one (named, with its value).
    """
    body = parse_request(raw, ResponsesRequest)
    for name, (what, allowed) in DEFAULTS_ONLY.items():
        value = getattr(body, name)
        if value not in allowed:
            raise ApiError(f"unsupported field {name!r}: {what} is not supported by this server (got {value!r})",
                           param=name, code="unsupported_field")
    check_metadata(body.metadata)
    for i, value in enumerate(body.include or ()):
        if value != LOGPROBS and value not in VACUOUS:
            what = NOT_INCLUDED.get(value)
            why = f"{what} is not supported by this server" if what else "not an includable output of this API"
            raise ApiError(f"unsupported value {value!r} in include: {why} (served: {LOGPROBS!r})",
                           param=f"include.{i}", code="unsupported_field")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.top_logprobs}", param="top_logprobs")
    return body


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether the output text's logprobs are asked for (``include`` holds ``LOGPROBS``, as vLLM
    reads it; top_logprobs alone asks for nothing)."""
    return LOGPROBS in (body.include or ())


def _text(text: str, param: str) -> str:
    """``text`` itself; raises ApiError when it is not valid Unicode (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(f"{param} is not valid Unicode: {exc.reason} at character {exc.start}", param=param,
                       code="invalid_unicode") from None
    return text


def _content(content, param: str) -> str:
    """A message's content as one string: a string, or its text parts joined with newlines."""
    if isinstance(content, str):
        return _text(content, param)
    if not isinstance(content, list) or not content:
        raise ApiError(f"{param} must be a string or a non-empty list of text parts", param=param, code="invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(f"{param}[{j}]: only text parts ({{'type': 'input_text', 'text': ...}}, or 'output_text' "
                           f"of an earlier answer) are supported, got type {kind!r}", param=f"{param}.{j}",
                           code="unsupported_field")
        texts.append(_text(part["text"], f"{param}.{j}.text"))
    return "\n".join(texts)


def messages(body: ResponsesRequest) -> list[ChatMessage]:
    """``instructions`` (as a system message) then the ``input`` messages, as chat messages.

    Raises:
        ApiError: an empty input list, an item that is not a message (function calls,
            reasoning, item references), a role outside ``ROLES``, a non-text content part.
    """
    out = [] if body.instructions is None else [ChatMessage(role="system", content=_text(body.instructions,
                                                                                              "instructions"))]
    if isinstance(body.input, str):
        return out + [ChatMessage(role="user", content=_text(body.input, "input"))]
    if not body.input:
        raise ApiError("input must be a string or a non-empty list of messages", param="input")
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind != "message":
            raise ApiError(f"input[{i}]: only message items are supported, got type {kind!r} (tool calls, reasoning "
                           "and item references are not supported)", param=f"input.{i}.type", code="unsupported_field")
        if item.get("role") not in ROLES:
            raise ApiError(f"input[{i}].role must be one of {', '.join(ROLES)}, got {item.get('role')!r}",
                           param=f"input.{i}.role")
        out.append(ChatMessage(role=item["role"], content=_content(item.get("content"), f"input.{i}.content")))
    return out


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates this response (``max_output_tokens`` as the completion limit;
    logprobs with ``top_logprobs`` alternatives when ``include`` asks for them)."""
    logprobs = wants_logprobs(body)
    return ChatCompletionRequest(model=body.model, messages=messages(body), max_completion_tokens=body.max_output_tokens,
                                 temperature=body.temperature, top_p=body.top_p, stream=bool(body.stream),
                                 top_k=body.top_k, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                                 seed=body.seed, logprobs=logprobs, top_logprobs=body.top_logprobs if logprobs else None,
                                 service_tier=body.service_tier)


def renamed(exc: ApiError) -> ApiError:
    """``exc`` of the chat path with its field names in this API's terms (``RENAMED``)."""
    def rename(text: str) -> str:
        return re.sub(r"\b(" + "|".join(RENAMED) + r")\b", lambda m: RENAMED[m.group(1)], text)

    return ApiError(rename(exc.message), param=exc.param and rename(exc.param), status=exc.status, code=exc.code,
                    headers=exc.headers)


FAILED = ("error", "abort")  # finish reasons that fail a response


@dataclass
class ResponseDraft:
    """What one response has so far: its request, ids, text, and (at the end) its finish."""

    request: ResponsesRequest
    model: str
    input_tokens: int
    max_output_tokens: int  # the limit applied (the request's, or the default: what the context leaves)
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list = field(default_factory=list)  # the text's ``engine.sampling.TokenLogprob`` reports

    @property
    def status(self) -> str:
        if self.finish_reason is None:
            return "in_progress"
        if self.finish_reason in FAILED:
            return "failed"
        return "incomplete" if self.finish_reason == "length" else "completed"

    def part(self) -> dict:
        """The output_text part (openai's ``ResponseOutputText``), its logprobs those asked for."""
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": output_logprobs(self.logprobs)}

    def message(self) -> dict:
        """The assistant message item (no content yet while in progress)."""
        status = "completed" if self.status == "failed" else self.status
        content = [] if self.finish_reason is None else [self.part()]
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def usage(self) -> dict:
        return {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + self.output_tokens}

    def body(self) -> dict:
        """The Response object as it stands (openai's ``types.responses.Response``)."""
        r, status, done = self.request, self.status, self.finish_reason is not None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None,
                "error": {"code": "server_error", "message": self.error} if status == "failed" else None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": r.instructions, "max_output_tokens": self.max_output_tokens, "model": self.model,
                "output": [self.message()] if done and status != "failed" else [],
                "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
                "previous_response_id": None, "reasoning": None, "store": False,
                "temperature": 1.0 if r.temperature is None else r.temperature,
                "text": {"format": {"type": "text"}}, "tool_choice": r.tool_choice or "auto", "tools": [],
                "top_logprobs": r.top_logprobs, "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled",
                "usage": self.usage() if done else None, "user": r.user, "metadata": r.metadata or {}}


def output_logprobs(entries) -> list[dict]:
    """An output_text part's logprobs (openai's ``ResponseOutputText.Logprob``: token, bytes,
    logprob, top_logprobs of {token, bytes, logprob}) of ``engine.sampling.TokenLogprob`` reports."""
    def one(text: str, lp: float) -> dict:
        return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": lp}

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, _, lp in e.top]} for e in entries]


def delta_logprobs(entries) -> list[dict]:
    """A text delta's (and the done event's) logprobs (openai's ``ResponseTextDeltaEvent.Logprob``:
    token, logprob, top_logprobs of {token, logprob}; no bytes)."""
    return [{"token": e.token, "logprob": e.logprob,
             "top_logprobs": [{"token": t, "logprob": lp} for t, _, lp in e.top]} for e in entries]


def event(kind: str, number: int, **fields) -> str:
    """One server-sent event of the Responses API: ``event:`` and ``data:`` lines, a blank line."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number, **fields}, allow_nan=False)}\n\n"


class ResponsesServing:
    """POST /v1/responses over an ``OpenAIServing`` (its admission, scheduler, metrics, shutdown)."""

    def __init__(self, serving) -> None:
        self.serving = serving

    def _admit(self, raw: bytes, parsed: list) -> Prepared:
        """Parse and check a body (kept in ``parsed`` for the answer), then the chat path's
        admission; its errors renamed to this API's fields. Runs in a worker thread."""
        body = parse(raw)
        parsed.append(body)
        try:
            return self.serving.admit_body(to_chat(body))
        except ApiError as exc:
            raise renamed(exc) from None

    async def serve(self, http):
        """Answer one POST /v1/responses: the Response object, or a StreamingResponse of its
        events. Raises ApiError (as ``OpenAIServing.serve``: 503, 4xx, 429; 500 / 503 when a
        whole answer fails)."""
        parsed: list = []
        ex = await self.serving.accept(http, "responses", lambda raw: self._admit(raw, parsed))
        draft = ResponseDraft(parsed[0], self.serving.config.served_model_name, len(ex.prepared.prompt_ids[0]),
                              ex.prepared.sequences[0].max_new_tokens)
        if ex.prepared.stream:
            return StreamingResponse(self._stream(ex, draft), media_type="text/event-stream")
        gone = await self.serving.finished(ex, http)
        if gone is not None:
            return gone
        self._finish(draft, ex.choices[0])
        return draft.body()

    @staticmethod
    def _finish(draft: ResponseDraft, choice) -> None:
        draft.text, draft.output_tokens = "".join(choice.text), choice.completion_tokens
        draft.finish_reason, draft.error, draft.logprobs = choice.finish_reason, choice.error, list(choice.logprobs)

    async def _stream(self, ex, draft: ResponseDraft):
        numbers = iter(range(2**62))
        item = {"item_id": draft.message_id, "output_index": 0, "content_index": 0}
        try:
            yield event("response.created", next(numbers), response=draft.body())
            yield event("response.in_progress", next(numbers), response=draft.body())
            yield event("response.output_item.added", next(numbers), output_index=0, item=draft.message())
            yield event("response.content_part.added", next(numbers), **item, part=draft.part())
            async for choice, text, entries, ev in self.serving.events(ex):
                if ev.finish_reason == "cancelled":
                    return  # the client is gone
                if ev.finish_reason in FAILED:
                    self._finish(draft, choice)
                    yield event("response.failed", next(numbers), response=draft.body())
                    return
                if text or entries:
                    yield event("response.output_text.delta", next(numbers), **item, delta=text,
                                logprobs=delta_logprobs(entries))
                if ev.finish_reason is not None:
                    self._finish(draft, choice)
        finally:  # the client left (at any yield), or the stream ended early: cancel what still runs
            self.serving.cancel_unfinished(ex)
        yield event("response.output_text.done", next(numbers), **item, text=draft.text,
                    logprobs=delta_logprobs(draft.logprobs))
        yield event("response.content_part.done", next(numbers), **item, part=draft.part())
        yield event("response.output_item.done", next(numbers), output_index=0, item=draft.message())
        yield event(f"response.{draft.status}", next(numbers), response=draft.body())
