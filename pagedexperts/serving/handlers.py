"""What the generation routes do: admitting a request, queueing its sequences, answering, shutdown.

Owns: ``ServeConfig``; ``OpenAIServing``, the handler behind POST /v1/completions and
/v1/chat/completions and the shared path of every generation route (``accept``: body,
admission off the event loop, queueing; ``finished``; ``events``: a stream's events), each
refusal logged and counted (``refuse``); n > 1 and several prompts (one sequence each); client
disconnects (the sequence cancelled at once); graceful shutdown (``begin_shutdown``). Parsing,
validation and tokenization run in a worker thread, detokenization on the scheduler thread: the
event loop only moves bytes. Does not: admit (``admission``), validate (``validation``), sample
or batch (``engine.scheduler``), shape bodies (``bodies``, ``responses_api``) or declare routes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from fastapi import Request as HttpRequest
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from pagedexperts.serving import bodies, protocol, validation
from pagedexperts.serving.admission import RETRY_AFTER_S, client_disconnected, shutting_down
from pagedexperts.serving.connections import (DEFAULT_BODY_DEADLINE_S, DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                                              DEFAULT_MAX_CONNECTIONS)
from pagedexperts.serving.metrics import Metrics
from pagedexperts.serving.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from pagedexperts.engine.speculative.config import SpeculativeConfig
from pagedexperts.engine.scheduler import BatchScheduler
from pagedexperts.engine.scheduler_config import (DEFAULT_MAX_PREFILL_TOKENS, QueueFull, SchedulerConfig,
                                                   SchedulerStopped, graph_options)

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05
ID_PREFIX = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_"}  # OpenAI's id prefixes


@dataclass(frozen=True)
class ServeConfig:
    """How the server serves.

    ``served_model_name``: the name clients must send. ``max_running_requests``,
    ``max_queued_requests`` (sequences that wait beyond the free running places; None =
    unbounded), ``max_prefill_tokens``: the scheduler's limits (``SchedulerConfig``). ``context_length``: longest prompt + completion, tokens.
    ``max_body_bytes``: request body limit (None = ``admission.default_max_body_bytes``).
    ``api_key``: when set, /v1/* needs ``Authorization: Bearer <key>``. ``shutdown_timeout_s``:
    how long running requests may finish after SIGTERM. ``record_trace``: .npz path.
    ``model_path``: the checkpoint directory, reported to a router (``/server_info``).
    ``speculative``: an ``engine.speculative.config.SpeculativeConfig`` (--speculative), None = plain decoding.
    ``chunked_prefill``: prompt chunks share the decode forward (``SchedulerConfig``).
    ``header_timeout_s``, ``body_timeout_s``, ``body_deadline_s``, ``max_connections``: connection limits
    (``connections``).
    ``cuda_graph_max_batch``: the largest decode bucket captured on CUDA (--cuda-graph-max-batch);
    None = every bucket up to ``max_running_requests``.
    """

    served_model_name: str
    max_running_requests: int
    context_length: int
    record_trace: str | None = None
    max_queued_requests: int | None = None
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    max_body_bytes: int | None = None
    api_key: str | None = None
    shutdown_timeout_s: float = 30.0
    model_path: str | None = None
    speculative: SpeculativeConfig | None = None
    chunked_prefill: bool = True
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    body_deadline_s: float = DEFAULT_BODY_DEADLINE_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    cuda_graph_max_batch: int | None = None


@dataclass
class Lifecycle:
    """Whether the server still admits requests (False from the start of a shutdown)."""

    admitting: bool = True


@dataclass
class _Exchange:
    """One HTTP generation request in flight: its sequences, their choices, its event queue."""

    endpoint: str
    prepared: validation.Prepared
    queue: asyncio.Queue
    head: dict
    choices: list[bodies.Choice]
    reqs: list = field(default_factory=list)
    unfinished: int = 0
    outcome: str = "ok"

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"


class OpenAIServing:
    """The serving state of one app: model, tokenizer, scheduler, metrics, lifecycle."""

    def __init__(self, model, tokenizer, config: ServeConfig, *, recorder=None) -> None:
        self.model, self.tokenizer, self.config, self.recorder = model, tokenizer, config, recorder
        self.vocab_size = int(getattr(model.config, "vocab_size", 0) or len(tokenizer))
        self.scheduler = BatchScheduler(model, tokenizer, SchedulerConfig(
            config.max_running_requests, config.context_length, max_queued_requests=config.max_queued_requests,
            max_prefill_tokens=config.max_prefill_tokens, chunked_prefill=config.chunked_prefill,
            **{**graph_options(model.pagedexperts), "cuda_graph_max_batch": config.cuda_graph_max_batch}),
            recorder=recorder,
            speculative=config.speculative)
        self.metrics = Metrics(self.scheduler, model.pagedexperts)
        self.lifecycle = Lifecycle()

    # ---- refusals ----

    def refuse(self, method: str, path: str, exc: ApiError) -> None:
        """Log and count one refusal (every 4xx / 5xx answer goes through here)."""
        logger.warning("refused %s %s: %d %s: %s", method, path, exc.status, exc.code, exc.message)
        self.metrics.refused.labels(str(exc.status), exc.code).inc()

    # ---- admission (worker thread) ----

    def admit(self, raw: bytes, chat: bool) -> validation.Prepared:
        """Parse, check and tokenize a completions / chat body; raises ApiError (runs off the event loop)."""
        return self.admit_body(protocol.parse_request(raw, ChatCompletionRequest if chat else CompletionRequest))

    def admit_body(self, body) -> validation.Prepared:
        """Check and tokenize a parsed completions / chat request; raises ApiError, also for
        more sequences (prompts x n) than an idle server takes (every running place plus
        ``max_queued_requests``): such a request could never be queued, so it is a 400, not a
        429 to retry."""
        validation.check_model(body.model, self.config.served_model_name)
        prepared = validation.prepare(body, self.tokenizer, context_length=self.config.context_length,
                                      vocab_size=self.vocab_size)
        cap, needed = self.config.max_queued_requests, len(prepared.sequences)
        if cap is not None and needed > cap + self.config.max_running_requests:
            raise ApiError(f"prompts x n = {len(prepared.prompt_ids)} x {prepared.n} = {needed} sequences; at most "
                           f"{self.config.max_running_requests + cap} fit an idle server (--max-running-requests "
                           f"{self.config.max_running_requests} + --max-queued-requests {cap})", param="n")
        return prepared

    async def serve(self, http: HttpRequest, *, chat: bool):
        """Answer one POST /v1/completions (``chat`` False) or /v1/chat/completions: a JSON
        body, or a StreamingResponse of server-sent events. Raises ApiError (503 while
        shutting down, 4xx from validation, 429 when the queue is full)."""
        ex = await self.accept(http, "chat" if chat else "completions", lambda raw: self.admit(raw, chat))
        if ex.prepared.stream:
            return StreamingResponse(self._stream(ex), media_type="text/event-stream")
        return await self._complete(ex, http)

    async def accept(self, http: HttpRequest, endpoint: str, admit) -> _Exchange:
        """Read the body, run ``admit(raw) -> Prepared`` in a worker thread, queue its sequences.

        Raises ApiError: 503 while shutting down (also when the drain began during admission),
        499 when the client left before its body arrived, what ``admit`` raises, 429 when the
        queue is full."""
        if not self.lifecycle.admitting:
            raise shutting_down()
        try:
            raw = await http.body()
        except ClientDisconnect:
            raise client_disconnected() from None
        prepared = await run_in_threadpool(admit, raw)
        if not self.lifecycle.admitting:  # the drain began during admission
            raise shutting_down()
        return self._submit(endpoint, prepared)

    def _submit(self, endpoint: str, prepared: validation.Prepared) -> _Exchange:
        loop = asyncio.get_running_loop()
        created = int(time.time())
        ex = _Exchange(endpoint, prepared, asyncio.Queue(), {}, [bodies.Choice(i) for i in
                                                                range(len(prepared.sequences))])
        items = []
        for i, params in enumerate(prepared.sequences):
            ids = prepared.prompt_ids[i // prepared.n]
            items.append((ids, params, self._on_event(ex, i, loop)))
        ex.unfinished = len(items)
        try:
            ex.reqs = self.scheduler.submit_many(items)
        except QueueFull as exc:
            raise ApiError(f"too many requests queued: {exc}", status=429, code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except SchedulerStopped:
            raise shutting_down() from None
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prepared.prompt_ids))
        ex.head.update(id=f"{ID_PREFIX[endpoint]}{ex.reqs[0].request_id}", created=created,
                       model=self.config.served_model_name)
        return ex

    def _on_event(self, ex: _Exchange, index: int, loop):
        def on_event(event) -> None:  # scheduler thread
            if event.finish_reason is not None:
                self.metrics.observe_finish(event)
                ex.unfinished -= 1
                if event.finish_reason in ("cancelled", "error", "abort"):
                    ex.outcome = event.finish_reason
                if ex.unfinished == 0:
                    self.metrics.requests.labels(ex.endpoint, ex.outcome).inc()
            try:
                loop.call_soon_threadsafe(ex.queue.put_nowait, (index, event))
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass

        return on_event

    # ---- answering ----

    def _apply(self, ex: _Exchange, index: int, event) -> tuple[str, list]:
        """Record an event in its choice; returns (text, logprob reports) to send, echo included."""
        c, p = ex.choices[index], ex.prepared
        text, entries = event.text, list(event.logprobs)
        if event.prompt_logprobs is not None:
            entries = list(event.prompt_logprobs) + entries
        if p.echo and not c.echoed:
            c.echoed = True
            text = p.prompt_texts[index // p.n] + text
        c.text.append(text)
        c.logprobs += entries
        c.completion_tokens = event.completion_tokens
        if event.finish_reason is not None:
            c.finish_reason, c.stop_reason, c.error = event.finish_reason, event.stop_reason, event.error
        return text, entries

    def _usage(self, ex: _Exchange) -> dict:
        return bodies.usage(sum(len(p) for p in ex.prepared.prompt_ids), sum(c.completion_tokens for c in ex.choices))

    async def finished(self, ex: _Exchange, http: HttpRequest) -> Response | None:
        """Wait until every choice of ``ex`` has finished (cancelled at once if the client
        leaves). Returns a bare 499 when the client is gone, None when all went well.

        Raises ApiError: 503 when the server cut a choice while shutting down, 500 when one failed.
        """
        watcher = asyncio.create_task(self._watch_disconnect(http, ex))
        try:
            for _ in ex.choices:
                while True:
                    index, event = await ex.queue.get()
                    self._apply(ex, index, event)
                    if event.finish_reason is not None:
                        break
        finally:
            watcher.cancel()
        reasons = {c.finish_reason for c in ex.choices}
        if "cancelled" in reasons:
            return Response(status_code=499)  # the client is gone; nobody reads this
        failed = next((c for c in ex.choices if c.finish_reason in ("error", "abort")), None)
        if failed is not None:
            shutdown = failed.finish_reason == "abort"
            raise ApiError(f"generation {'cut' if shutdown else 'failed'}: {failed.error}", status=503 if shutdown else 500,
                           code="server_shutting_down" if shutdown else "generation_failed",
                           headers={"Retry-After": str(RETRY_AFTER_S)} if shutdown else None)
        return None

    async def _complete(self, ex: _Exchange, http: HttpRequest):
        gone = await self.finished(ex, http)
        if gone is not None:
            return gone
        logprobs = ex.prepared.sequences[0].logprobs is not None
        obj = "chat.completion" if ex.chat else "text_completion"
        return {**ex.head, "object": obj, "usage": self._usage(ex),
                "choices": [bodies.choice_body(c, chat=ex.chat, logprobs=logprobs) for c in ex.choices]}

    async def _watch_disconnect(self, http: HttpRequest, ex: _Exchange) -> None:
        """Cancel the request's sequences as soon as the client disconnects (the body is read,
        so the next ASGI message is the disconnect)."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        for req in ex.reqs:
            self.scheduler.cancel(req)

    async def events(self, ex: _Exchange):
        """Each event of ``ex`` as (choice, text, logprob reports, event), recorded in its choice,
        until every choice has finished; closing the generator early (the client left)
        cancels the sequences still running."""
        try:
            left = len(ex.choices)
            while left:
                index, event = await ex.queue.get()
                text, entries = self._apply(ex, index, event)
                left -= event.finish_reason is not None
                yield ex.choices[index], text, entries, event
        finally:  # also reached when the client disconnects (the generator is closed)
            self.cancel_unfinished(ex)

    def cancel_unfinished(self, ex: _Exchange) -> None:
        """Cancel the sequences of ``ex`` still running (its client left mid-stream)."""
        for req in ex.reqs:
            if req.finished_s is None:
                self.scheduler.cancel(req)

    async def _stream(self, ex: _Exchange):
        chat, p = ex.chat, ex.prepared
        logprobs = p.sequences[0].logprobs is not None
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(c, text, entries, finish, first=False):
            choice = bodies.chunk_choice(c, text, entries, finish, chat=chat, logprobs=logprobs, first=first)
            usage = {"usage": None} if p.include_usage else {}  # OpenAI: null until the final usage chunk
            if p.continuous_usage:  # vLLM's continuous_usage_stats: every chunk, its choice's tokens so far
                usage = {"usage": bodies.usage(len(p.prompt_ids[c.index // p.n]), c.completion_tokens)}
            return bodies.sse({**ex.head, "object": obj, "choices": [choice], **usage})

        try:
            if chat:
                for c in ex.choices:
                    yield chunk(c, "", [], None, first=True)
            async for c, text, entries, event in self.events(ex):
                if event.finish_reason in ("error", "abort", "cancelled"):
                    yield bodies.sse(self._stream_error(c, event))
                    continue
                if text or entries:
                    yield chunk(c, text, entries, None)
                if event.finish_reason is not None:
                    yield chunk(c, "", [], event.finish_reason)
            if p.include_usage:
                yield bodies.sse({**ex.head, "object": obj, "choices": [], "usage": self._usage(ex)})
            yield bodies.sse("[DONE]")
        finally:  # the client left: the events generator may not be closed yet
            self.cancel_unfinished(ex)

    @staticmethod
    def _stream_error(c: bodies.Choice, event) -> dict:
        code = {"abort": "server_shutting_down", "cancelled": "cancelled"}.get(event.finish_reason, "generation_failed")
        what = {"abort": "cut", "cancelled": "cancelled"}.get(event.finish_reason, "failed")
        return {"error": {"message": f"generation of choice {c.index} {what} after {event.completion_tokens} tokens: "
                                     f"{event.error or event.finish_reason}", "type": "server_error", "param": None,
                          "code": code}}

    # ---- shutdown ----

    def begin_shutdown(self, timeout_s: float | None = None) -> None:
        """Stop admitting (503 + Retry-After), let running sequences finish for up to
        ``timeout_s`` (default ``shutdown_timeout_s``), then end every remaining one with a
        final event. Blocking; call from any thread but the event loop's."""
        timeout_s = self.config.shutdown_timeout_s if timeout_s is None else timeout_s
        self.lifecycle.admitting = False
        s = self.scheduler
        logger.info("shutting down: %d running, %d queued; waiting up to %.1fs", s.num_running, s.num_waiting, timeout_s)
        deadline = time.monotonic() + timeout_s
        while (s.num_running or s.num_waiting) and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_S)
        left = s.num_running + s.num_waiting
        s.stop(reason=f"the server is shutting down (--shutdown-timeout {timeout_s:g}s passed)")
        logger.info("scheduler stopped; %d unfinished sequences were ended", left)
