"""The FastAPI app and its process: routes, error handlers, lifespan, ``run_server``.

Owns: the route table (docs/server.md), the exception handlers that put every error in OpenAI's
shape and count it, the lifespan (the scheduler started and stopped with the app; a routing
trace saved at shutdown), and SIGINT / SIGTERM: the first signal drains
(``OpenAIServing.begin_shutdown``) then stops uvicorn, exit 0; a second ends every request at
once and the process ends by the signal. Does not: handle a request itself (``handlers``).
"""

from __future__ import annotations

import logging
import threading
from contextlib import asynccontextmanager, contextmanager

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedexperts.serving import protocol, worker_info
from pagedexperts.serving.admission import Admission, default_max_body_bytes, error_response
from pagedexperts.serving.handlers import OpenAIServing, ServeConfig
from pagedexperts.serving.protocol import ApiError
from pagedexperts.serving.responses_api import ResponsesServing
from pagedexperts.serving.validation import check_model
from pagedexperts.serving.connections import uvicorn_config

logger = logging.getLogger(__name__)

ROUTES_NOTE = "/v1/models, /v1/completions, /v1/chat/completions, /v1/responses"  # named by a 404
GRACEFUL_CLOSE_S = 5  # uvicorn's wait for open connections after the drain


def create_app(model, tokenizer, config: ServeConfig) -> FastAPI:
    """The FastAPI app serving ``model``; the scheduler runs while the app's lifespan does.

    ``app.state.serving`` is the ``OpenAIServing`` (``begin_shutdown`` drains it),
    ``app.state.scheduler`` and ``app.state.metrics`` its parts.
    """
    recorder = None
    if config.record_trace:
        from pagedexperts.analysis.recording import TraceRecorder

        recorder = TraceRecorder.attach(model, model_id=config.served_model_name)
    serving = OpenAIServing(model, tokenizer, config, recorder=recorder)

    @asynccontextmanager
    async def lifespan(app):
        serving.scheduler.start()
        try:
            yield
        finally:
            serving.scheduler.stop()
            if recorder is not None:
                recorder.save(config.record_trace)
                logger.info("routing trace saved to %s", config.record_trace)

    app = FastAPI(title="pagedexperts", lifespan=lifespan)
    app.state.serving, app.state.scheduler, app.state.metrics = serving, serving.scheduler, serving.metrics
    max_body = config.max_body_bytes or default_max_body_bytes(config.context_length)
    app.add_middleware(Admission, max_body_bytes=max_body, api_key=config.api_key, refuse=serving.refuse)
    _error_handlers(app, serving)
    _routes(app, serving, config)
    return app


def _error_handlers(app: FastAPI, serving: OpenAIServing) -> None:
    def answer(request, exc: ApiError) -> JSONResponse:
        serving.refuse(request.method, request.url.path, exc)
        return error_response(exc)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return answer(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        message = {404: f"no route {request.url.path!r}; see {ROUTES_NOTE}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return answer(request, ApiError(message, status=exc.status_code, code=code, headers=getattr(exc, "headers", None)))

    @app.exception_handler(RequestValidationError)
    async def bad_types(request, exc: RequestValidationError):
        return answer(request, protocol.type_error(list(exc.errors())))

    @app.exception_handler(Exception)
    async def crash(request, exc: Exception):
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return answer(request, ApiError(f"internal error: {type(exc).__name__}", status=500, code="internal_error"))


def _routes(app: FastAPI, serving: OpenAIServing, config: ServeConfig) -> None:
    scheduler = serving.scheduler
    body_doc = {"requestBody": {"content": {"application/json": {"schema": {"type": "object"}}}, "required": True}}

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes (uvicorn sends no body)
    async def health():
        status = "ok" if serving.lifecycle.admitting else "shutting_down"
        body = {"status": status, "running": scheduler.num_running, "waiting": scheduler.num_waiting}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    card = {"id": config.served_model_name, "object": "model", "created": 0, "owned_by": "pagedexperts",
            "max_model_len": config.context_length}  # OpenAI's Model object (+ vLLM's max_model_len)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")  # the openai SDK's models.retrieve; ids may hold "/"
    async def model(model_id: str):
        check_model(model_id, config.served_model_name)
        return card

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus():
        return Response(serving.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions", openapi_extra=body_doc)
    async def completions(http: HttpRequest):
        return await serving.serve(http, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=body_doc)
    async def chat_completions(http: HttpRequest):
        return await serving.serve(http, chat=True)

    responses_serving = ResponsesServing(serving)

    @app.post("/v1/responses", openapi_extra=body_doc)
    async def create_response(http: HttpRequest):
        return await responses_serving.serve(http)

    @app.get("/server_info")
    @app.get("/get_server_info")  # SGLang's older name, still asked by vllm-router
    async def server_info():
        return worker_info.server_info(config, serving.model, scheduler)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return worker_info.model_info(config, serving.model)


def single_wave_note(runtime, max_running_requests: int) -> str:
    """The start-up line: the single-wave cap K // top_k next to --max-running-requests, or
    with --beyond-k in-place that every decode step is one wave."""
    if runtime.resolved.beyond_k == "in-place":
        return (f"experts beyond K = {runtime.num_resident} read in place (--beyond-k in-place): every decode step "
                f"is one wave per layer at any batch up to --max-running-requests {max_running_requests}; rows read "
                "in place in pagedexperts_paging_in_place_rows_total")
    cap = runtime.num_resident // runtime.top_k
    note = (f"single-wave cap K // top_k = {runtime.num_resident} // {runtime.top_k} = {cap} decode requests; "
            f"--max-running-requests {max_running_requests}")
    if max_running_requests > cap:
        note += " (larger batches may need more than one wave per layer step; see pagedexperts_paging_multi_wave_steps_total)"
    return note


def speculation_note(speculative) -> str:
    """The start-up line's word on speculative decoding (``speculative``: a
    ``SpeculativeConfig`` or None) and where its figures are."""
    if speculative is None:
        return "speculative decoding off"
    source = f"draft {speculative.draft_model_path}" if speculative.method == "draft" else speculative.method
    return (f"speculative decoding on: {source}, {speculative.num_speculative_tokens} proposals per request per step "
            "(acceptance in /metrics: pagedexperts_spec_decode_*)")


def run_server(model, tokenizer, config: ServeConfig, *, host: str, port: int, log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM; the first signal drains (see the module docstring)."""
    logger.info("%s; %s", single_wave_note(model.pagedexperts, config.max_running_requests),
                speculation_note(config.speculative))
    app = create_app(model, tokenizer, config)
    uv = uvicorn_config(app, header_timeout_s=config.header_timeout_s, body_timeout_s=config.body_timeout_s,
                        body_deadline_s=config.body_deadline_s, max_connections=config.max_connections,
                        host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_CLOSE_S)
    draining_server_class()(uv, app.state.serving).run()


def draining_server_class():
    """A ``uvicorn.Server`` subclass whose first exit signal drains the app (uvicorn is
    imported here, lazily: it belongs to the server extra)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server whose first exit signal drains the app before uvicorn stops. After
        a drain that no second signal cut short, the process exits 0: uvicorn would re-raise the
        signal it caught once it stopped (status 143 for SIGTERM), reporting a clean stop as a kill."""

        def __init__(self, config, serving: OpenAIServing) -> None:
            super().__init__(config)
            self.serving, self._draining, self._exit_lock = serving, False, threading.Lock()
            self._drained = self._forced = False

        @contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                if self._drained:
                    self._captured_signals.clear()  # nothing to re-raise: the stop was the clean one asked for

        def handle_exit(self, sig, frame) -> None:
            if self._draining:  # a second signal: end every request now, each with its final event
                with self._exit_lock:
                    self._forced = True
                threading.Thread(target=self._stop_now, args=(sig, frame), name="pagedexperts-stop", daemon=True).start()
                return
            self._draining = True
            threading.Thread(target=self._drain, args=(sig, frame), name="pagedexperts-drain", daemon=True).start()

        def _drain(self, sig, frame) -> None:
            self.serving.begin_shutdown()
            with self._exit_lock:
                self._drained = not self._forced
            self._exit_once(sig, frame)

        def _stop_now(self, sig, frame) -> None:
            self.serving.scheduler.stop(reason="the server is shutting down (a second exit signal)")
            self._exit_once(sig, frame)

        def _exit_once(self, sig, frame) -> None:
            """uvicorn's graceful exit, once: a repeated SIGINT would make it a forced one,
            before the final events are sent."""
            with self._exit_lock:
                if not self.should_exit:
                    super().handle_exit(sig, frame)

    return DrainingServer
