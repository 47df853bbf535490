"""The OpenAI-compatible HTTP server: ``pagedexperts serve``.

Owns: the routes (POST /v1/completions, POST /v1/chat/completions, both with ``stream``;
GET /v1/models, /health, /metrics), the pydantic request models, the one validation
function (every 4xx carries a specific message in OpenAI's error shape), the server-sent
event format, the Prometheus metrics, and the scheduler's lifetime (started and stopped with
the app; a routing trace, when recorded, is saved at shutdown). Does not: batch or sample
(``scheduler``), or load models (``loader``).

Chat prompts use the tokenizer's chat template; a tokenizer without one gets the plain
template ``PLAIN_CHAT_TEMPLATE``: one ``Role: content`` line per message (System, User,
Assistant), then ``Assistant:``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from pagedexperts.generate import SamplingConfig
from pagedexperts.scheduler import BatchScheduler, Event, SchedulerConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 128  # when a request gives none (capped by what the context leaves)
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is there
PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}Assistant:"
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


@dataclass(frozen=True)
class ServeConfig:
    """How the server serves: the name clients must use, batching limits, trace output."""

    served_model_name: str
    max_running_requests: int
    context_length: int
    record_trace: str | None = None


class ApiError(Exception):
    """A request the server refuses: HTTP status, message, and the offending parameter."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_Common):
    prompt: str | list[str]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


@dataclass(frozen=True)
class Prepared:
    """A validated request: prompt token ids and sampling options."""

    prompt_ids: list[int]
    sampling: SamplingConfig


def chat_prompt(tokenizer, messages: list[ChatMessage]) -> str:
    """The prompt text of a conversation (the tokenizer's template, else PLAIN_CHAT_TEMPLATE)."""
    template = None if getattr(tokenizer, "chat_template", None) else PLAIN_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(
        [m.model_dump() for m in messages], chat_template=template, tokenize=False, add_generation_prompt=True
    )


def validate_request(body: CompletionRequest | ChatCompletionRequest, tokenizer, config: ServeConfig) -> Prepared:
    """Check a request against the server's limits and tokenize its prompt.

    Raises:
        ApiError: unknown model, n != 1, empty prompt or messages, prompt or max_tokens that
            do not fit the context, temperature / top_p / stop out of range.
    """
    if body.model != config.served_model_name:
        raise ApiError(f"model {body.model!r} is not served here; use {config.served_model_name!r} (GET /v1/models)",
                       param="model", code="model_not_found")
    if body.n != 1:
        raise ApiError(f"n must be 1, got {body.n}", param="n")
    if not 0 <= body.temperature <= MAX_TEMPERATURE:
        raise ApiError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {body.temperature}", param="temperature")
    if not 0 < body.top_p <= 1:
        raise ApiError(f"top_p must be in (0, 1], got {body.top_p}", param="top_p")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters",
                       param="stop")
    if isinstance(body, ChatCompletionRequest):
        if not body.messages:
            raise ApiError("messages must not be empty", param="messages")
        text, param = chat_prompt(tokenizer, body.messages), "messages"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    else:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise ApiError(f"prompt must be one string (batches of prompts are not supported), got {len(prompts)}",
                           param="prompt")
        text, param, max_tokens = prompts[0], "prompt", body.max_tokens
    if not text:
        raise ApiError("prompt must not be empty", param=param)
    prompt_ids = tokenizer(text)["input_ids"]
    room = config.context_length - len(prompt_ids)
    if room <= 0:
        raise ApiError(f"prompt is {len(prompt_ids)} tokens; the context length is {config.context_length} "
                       "(--context-length), leaving no room to generate", param=param, code="context_length_exceeded")
    if max_tokens is not None and max_tokens <= 0:
        raise ApiError(f"max_tokens must be > 0, got {max_tokens}", param="max_tokens")
    if max_tokens is not None and max_tokens > room:
        raise ApiError(f"max_tokens {max_tokens} + prompt {len(prompt_ids)} tokens exceed the context length "
                       f"{config.context_length} (--context-length); ask for at most {room}",
                       param="max_tokens", code="context_length_exceeded")
    sampling = SamplingConfig(
        max_new_tokens=max_tokens if max_tokens is not None else min(DEFAULT_MAX_TOKENS, room),
        temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=stop,
    )
    return Prepared(prompt_ids, sampling)


class Metrics:
    """Prometheus metrics of one server, in its own registry (no process-global state).

    Request metrics are observed as requests finish; batch and paging metrics are read from
    the scheduler and the model's pagers at scrape time.
    """

    def __init__(self, scheduler: BatchScheduler, runtime) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        p = "pagedexperts_"
        self.requests = Counter(p + "requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=self.registry)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests", registry=self.registry)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens", registry=self.registry)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from arrival to first token",
                              buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Mean time per token after the first",
                              buckets=TPOT_BUCKETS_S, registry=self.registry)
        self.registry.register(_LiveCollector(scheduler, runtime))

    def observe_finish(self, event: Event) -> None:
        """Count a finished request's tokens and timing (its last event)."""
        self.generation_tokens.inc(event.completion_tokens)
        if event.ttft_s is not None:
            self.ttft.observe(event.ttft_s)
        if event.tpot_s is not None:
            self.tpot.observe(event.tpot_s)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _LiveCollector:
    """Scrape-time gauges and counters: batch state and every MoE layer's paging counters."""

    PAGING = (("hits", "expert_hits", "Routed experts found resident"),
              ("misses", "expert_misses", "Routed experts paged in"),
              ("bytes_paged", "bytes_paged", "Bytes copied host-to-device"),
              ("waves", "waves", "Waves computed"),
              ("multi_wave_steps", "multi_wave_steps", "Layer steps that needed more than one wave"),
              ("steps", "layer_steps", "Steps through the layer"),
              ("union_sum", "union_size_sum", "Sum over steps of distinct experts routed to"))

    def __init__(self, scheduler: BatchScheduler, runtime) -> None:
        self.scheduler, self.runtime = scheduler, runtime

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s, st, p = self.scheduler, self.scheduler.stats, "pagedexperts_"
        yield GaugeMetricFamily(p + "running_requests", "Requests in the decode batch", value=s.num_running)
        yield GaugeMetricFamily(p + "waiting_requests", "Requests queued for a place", value=s.num_waiting)
        yield GaugeMetricFamily(p + "max_running_requests", "--max-running-requests", value=s.config.max_running_requests)
        yield GaugeMetricFamily(p + "single_wave_cap", "K // top_k: decode batch always one wave",
                                value=self.runtime.num_resident // self.runtime.top_k)
        yield GaugeMetricFamily(p + "max_decode_batch", "Largest decode batch so far", value=st.max_decode_batch)
        yield CounterMetricFamily(p + "decode_steps", "Batched decode steps", value=st.decode_steps)
        yield CounterMetricFamily(p + "decode_rows", "Sum of decode batch sizes", value=st.decode_rows)
        yield CounterMetricFamily(p + "prefill_steps", "Prefill steps", value=st.prefill_steps)
        layers = {i: pager.stats for i, pager in self.runtime.pagers.items()}  # read-only
        for attr, name, doc in self.PAGING:
            fam = CounterMetricFamily(p + name, doc + " (per MoE layer)", labels=["layer"])
            for i, ls in sorted(layers.items()):
                fam.add_metric([str(i)], getattr(ls, attr))
            yield fam
        for attr, doc in (("union_last", "in the last step"), ("union_max", "max over steps")):
            fam = GaugeMetricFamily(p + attr.replace("union", "union_size"), f"Distinct experts routed to {doc}",
                                    labels=["layer"])
            for i, ls in sorted(layers.items()):
                fam.add_metric([str(i)], getattr(ls, attr))
            yield fam
        from pagedexperts.stats import ModelStats

        yield from paging_time_histograms(ModelStats.collect(layers.items()), p)


def paging_time_histograms(stats, prefix: str = "pagedexperts_"):
    """Prometheus histograms of the host times per MoE layer-step, all layers together:
    ``<prefix>plan_seconds``, ``<prefix>topk_readback_seconds``, ``<prefix>page_in_seconds``
    (buckets ``stats.TIME_BUCKETS_S``, cumulative since the start). ``stats``: a ModelStats."""
    from prometheus_client.core import HistogramMetricFamily

    from pagedexperts.stats import TIMED

    names = {"plan_s": "plan_seconds", "sync_s": "topk_readback_seconds", "page_in_s": "page_in_seconds"}
    for kind, dist in stats.time_histograms().items():
        yield HistogramMetricFamily(prefix + names[kind], f"Time of {TIMED[kind]} per MoE layer-step",
                                    buckets=dist.cumulative(), sum_value=dist.sum_s)


def _error(exc: ApiError) -> JSONResponse:
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return JSONResponse({"error": {"message": exc.message, "type": kind, "param": exc.param, "code": exc.code}},
                        status_code=exc.status)


def _sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def create_app(model, tokenizer, config: ServeConfig) -> FastAPI:
    """The FastAPI app serving ``model``; the scheduler runs while the app's lifespan does."""
    recorder = None
    if config.record_trace:
        from pagedexperts.recording import TraceRecorder

        recorder = TraceRecorder.attach(model, model_id=config.served_model_name)
    scheduler = BatchScheduler(model, tokenizer, SchedulerConfig(config.max_running_requests, config.context_length),
                               recorder=recorder)
    metrics = Metrics(scheduler, model.pagedexperts)

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()
            if recorder is not None:
                recorder.save(config.record_trace)
                logger.info("routing trace saved to %s", config.record_trace)

    app = FastAPI(title="pagedexperts", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_types(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(ApiError(f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": ")))
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error(ApiError(f"{where or 'request body'}: {first.get('msg', 'invalid request')}", param=where or None))

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": scheduler.num_running, "waiting": scheduler.num_waiting}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "pagedexperts", "max_model_len": config.context_length}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        return await _serve(body, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HttpRequest):
        return await _serve(body, http, chat=True)

    async def _serve(body, http: HttpRequest, *, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            prepared = validate_request(body, tokenizer, config)
        except ApiError:
            metrics.requests.labels(endpoint, "invalid").inc()
            raise
        metrics.prompt_tokens.inc(len(prepared.prompt_ids))
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def on_event(event: Event) -> None:  # scheduler thread
            if event.finish_reason is not None:
                metrics.observe_finish(event)
                outcome = event.finish_reason if event.finish_reason in ("cancelled", "error") else "ok"
                metrics.requests.labels(endpoint, outcome).inc()
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass

        req = scheduler.submit(prepared.prompt_ids, prepared.sampling, on_event)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{req.request_id}", "created": int(time.time()),
                "model": config.served_model_name}

        def usage(completion_tokens: int) -> dict:
            n_in = len(prepared.prompt_ids)
            return {"prompt_tokens": n_in, "completion_tokens": completion_tokens,
                    "total_tokens": n_in + completion_tokens}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            gen = _stream(queue, req, head, chat=chat, usage=usage if include_usage else None)
            return StreamingResponse(gen, media_type="text/event-stream")
        return await _complete(queue, req, head, http, chat=chat, usage=usage)

    async def _complete(queue, req, head, http, *, chat, usage):
        parts = []
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    scheduler.cancel(req)
                    return Response(status_code=499)
                continue
            parts.append(event.text)
            if event.finish_reason is not None:
                break
        if event.finish_reason == "error":
            raise ApiError(f"generation failed: {event.error}", status=500)
        text = "".join(parts)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": event.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": event.finish_reason}
        obj = "chat.completion" if chat else "text_completion"
        return {**head, "object": obj, "choices": [choice], "usage": usage(event.completion_tokens)}

    async def _stream(queue, req, head, *, chat, usage):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text, finish, first=False):
            if chat:
                delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            return _sse({**head, "object": obj, "choices": [choice]})

        try:
            if chat:
                yield chunk("", None, first=True)
            while True:
                event = await queue.get()
                if event.finish_reason == "error":
                    yield _sse({"error": {"message": f"generation failed: {event.error}", "type": "server_error"}})
                    break
                if event.finish_reason is None:
                    yield chunk(event.text, None)
                    continue
                if event.text:
                    yield chunk(event.text, None)
                yield chunk("", event.finish_reason)
                if usage is not None:
                    yield _sse({**head, "object": obj, "choices": [], "usage": usage(event.completion_tokens)})
                break
            yield _sse("[DONE]")
        finally:  # also reached when the client disconnects (the generator is closed)
            if req.finished_s is None:
                scheduler.cancel(req)

    return app


def single_wave_note(runtime, max_running_requests: int) -> str:
    """The start-up line: the single-wave cap K // top_k next to --max-running-requests."""
    cap = runtime.num_resident // runtime.top_k
    note = (f"single-wave cap K // top_k = {runtime.num_resident} // {runtime.top_k} = {cap} decode requests; "
            f"--max-running-requests {max_running_requests}")
    if max_running_requests > cap:
        note += " (larger batches may need more than one wave per layer step; see pagedexperts_multi_wave_steps)"
    return note


def run_server(model, tokenizer, config: ServeConfig, *, host: str, port: int, log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM (uvicorn's handlers; the scheduler stops with the app)."""
    import uvicorn

    logger.info("%s", single_wave_note(model.pagedexperts, config.max_running_requests))
    app = create_app(model, tokenizer, config)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
