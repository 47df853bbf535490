"""The OpenAI Responses API answer (POST /v1/responses): the Response object and its streamed events.

Owns: ``ResponsesServing``, the handler behind the route (it admits through
``responses_api`` and ``OpenAIServing.admit_body``, and queues, waits and streams through
``OpenAIServing.accept`` / ``finished`` / ``events``: the path every generation route
takes), and the shapes of openai's ``types.responses``: ``Response`` (status ``completed``,
or ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens`` when the token
limit ended it), one assistant ``message`` item with one ``output_text`` part, ``usage``
(``input_tokens``, ``output_tokens``, ``total_tokens``).

A stream is server-sent events, each ``event: <type>`` + ``data: <json>`` with a
``sequence_number`` from 0, in the published order: ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
one ``response.output_text.delta`` per piece of text, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then ``response.completed``
(or ``response.incomplete``; ``response.failed`` with ``error`` when generation failed or
the server shut down). No ``[DONE]`` follows (the Responses API sends none).

Does not: validate (``responses_api``), or generate (``scheduler``).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse

from pagedexperts.serving import responses_api
from pagedexperts.serving.validation import Prepared
from pagedexperts.serving.protocol import ApiError

FAILED = ("error", "abort")  # finish reasons that fail a response


@dataclass
class ResponseDraft:
    """What one response has so far: its request, ids, text, and (at the end) its finish."""

    request: responses_api.ResponsesRequest
    model: str
    input_tokens: int
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def status(self) -> str:
        if self.finish_reason is None:
            return "in_progress"
        if self.finish_reason in FAILED:
            return "failed"
        return "incomplete" if self.finish_reason == "length" else "completed"

    def part(self) -> dict:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

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
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
                "output": [self.message()] if done and status != "failed" else [],
                "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
                "previous_response_id": None, "reasoning": None, "store": False,
                "temperature": 1.0 if r.temperature is None else r.temperature,
                "text": {"format": {"type": "text"}}, "tool_choice": r.tool_choice or "auto", "tools": [],
                "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled",
                "usage": self.usage() if done else None, "user": r.user, "metadata": r.metadata or {}}


def event(kind: str, number: int, **fields) -> str:
    """One server-sent event of the Responses API: ``event:`` and ``data:`` lines, a blank line."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number, **fields})}\n\n"


class ResponsesServing:
    """POST /v1/responses over an ``OpenAIServing`` (its admission, scheduler, metrics, shutdown)."""

    def __init__(self, serving) -> None:
        self.serving = serving

    def _admit(self, raw: bytes, parsed: list) -> Prepared:
        """Parse and check a body (kept in ``parsed`` for the answer), then the chat path's
        admission; its errors renamed to this API's fields. Runs in a worker thread."""
        body = responses_api.parse(raw)
        parsed.append(body)
        try:
            return self.serving.admit_body(responses_api.to_chat(body))
        except ApiError as exc:
            raise responses_api.renamed(exc) from None

    async def serve(self, http):
        """Answer one POST /v1/responses: the Response object, or a StreamingResponse of its
        events. Raises ApiError (as ``OpenAIServing.serve``: 503, 4xx, 429; 500 / 503 when a
        whole answer fails)."""
        parsed: list = []
        ex = await self.serving.accept(http, "responses", lambda raw: self._admit(raw, parsed))
        draft = ResponseDraft(parsed[0], self.serving.config.served_model_name, len(ex.prepared.prompt_ids[0]))
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
        draft.finish_reason, draft.error = choice.finish_reason, choice.error

    async def _stream(self, ex, draft: ResponseDraft):
        numbers = iter(range(2**62))
        item = {"item_id": draft.message_id, "output_index": 0, "content_index": 0}
        try:
            yield event("response.created", next(numbers), response=draft.body())
            yield event("response.in_progress", next(numbers), response=draft.body())
            yield event("response.output_item.added", next(numbers), output_index=0, item=draft.message())
            yield event("response.content_part.added", next(numbers), **item, part=draft.part())
            async for choice, text, _, ev in self.serving.events(ex):
                if ev.finish_reason == "cancelled":
                    return  # the client is gone
                if ev.finish_reason in FAILED:
                    self._finish(draft, choice)
                    yield event("response.failed", next(numbers), response=draft.body())
                    return
                if text:
                    yield event("response.output_text.delta", next(numbers), **item, delta=text, logprobs=[])
                if ev.finish_reason is not None:
                    self._finish(draft, choice)
        finally:  # the client left (at any yield), or the stream ended early: cancel what still runs
            self.serving.cancel_unfinished(ex)
        yield event("response.output_text.done", next(numbers), **item, text=draft.text, logprobs=[])
        yield event("response.content_part.done", next(numbers), **item, part=draft.part())
        yield event("response.output_item.done", next(numbers), output_index=0, item=draft.message())
        yield event(f"response.{draft.status}", next(numbers), response=draft.body())
