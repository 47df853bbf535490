"""Continuous batching for the server: one thread owns the model and steps all requests.

Owns: the waiting queue and the running set (at most ``max_running_requests``), the
per-request KV caches, one model step at a time, per-request sampling (temperature, top_p,
seed through a per-request ``torch.Generator``), stop strings and end-of-sequence, and the
text deltas handed back through each request's ``on_event`` callback.

A step (``BatchScheduler.step``) first drops cancelled requests, then admits waiting
requests up to the cap and prefills each alone (batch 1, so a request's first token does not
depend on its neighbours), then decodes every running request together in ONE forward: the
per-request caches are left-padded into one batch cache [B, kv_heads, S_max, D] with a 2D
attention mask, each row at its own position; the new keys and values go back to each
request's own buffer. Requests join and leave between steps. A request alone decodes with
no padding and no mask, exactly like ``model.generate``.

Does not: speak HTTP or validate requests (``server``), or know about paging: paging is the
model's own business, and its counters are read by whoever exports them.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from pagedexperts.generate import SamplingConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits: decode batch cap, and the longest prompt + completion in tokens."""

    max_running_requests: int
    context_length: int


@dataclass(frozen=True)
class Event:
    """What a request reports after a step: new text, and on the last one its finish reason.

    ``finish_reason``: None while running, then "stop" (end of sequence or a stop string),
    "length" (max_tokens reached), "cancelled", or "error" (``error`` holds the message).
    ``time_s`` is ``time.perf_counter()`` when the event was made. The last event also
    carries the request's timing: ``ttft_s`` (arrival to first token) and ``tpot_s`` (mean
    seconds per token after the first; None with fewer than two tokens).
    """

    text: str
    completion_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    time_s: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass
class Request:
    """One generation request and its state inside the scheduler.

    ``prompt_ids``: token ids, already checked against the context length. ``on_event`` is
    called from the scheduler thread; it must not block. Cache buffers are [kv_heads,
    capacity, D] per layer, capacity = prompt + max_new_tokens; ``length`` tokens are filled.
    """

    request_id: int
    prompt_ids: list[int]
    sampling: SamplingConfig
    on_event: Callable[[Event], None]
    submitted_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finished_s: float | None = None
    cancelled: bool = False
    output_ids: list[int] = field(default_factory=list)
    emitted_chars: int = 0
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0
    generator: torch.Generator | None = None


@dataclass
class SchedulerStats:
    """Counters of the scheduler's own work (not paging): steps and rows per step."""

    prefill_steps: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # sum of batch sizes over decode steps
    max_decode_batch: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0


def _sample(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """One token from a row of logits [V]: argmax at temperature 0, else temperature + top_p."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits.float() / sampling.temperature
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = torch.cumsum(probs, dim=-1) - probs > sampling.top_p  # always keeps the first
        scaled = scaled.clone()
        scaled[order[drop]] = float("-inf")
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _stop_cut(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """(text that may be shown, whether a stop string ended it).

    Holds back a tail that could still become a stop string, and an incomplete character.
    """
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut], True
    keep = len(text)
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                keep = min(keep, len(text) - n)
                break
    while keep > 0 and text[keep - 1] == "\ufffd":
        keep -= 1
    return text[:keep], False


class BatchScheduler:
    """Continuous batching over one model; ``start()`` runs ``step()`` in a background thread.

    Thread model: ``submit`` and ``cancel`` may be called from any thread; everything else
    that touches the model runs on the scheduler thread (or the caller of ``step`` in tests,
    with no thread started).
    """

    def __init__(self, model, tokenizer, config: SchedulerConfig, *, recorder=None) -> None:
        if config.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {config.max_running_requests}")
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.recorder = recorder
        self.stats = SchedulerStats()
        self.eos_ids = self._eos_ids(model, tokenizer)
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)

    @staticmethod
    def _eos_ids(model, tokenizer) -> set[int]:
        eos = getattr(model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}

    # ---- any thread ----

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, prompt_ids: list[int], sampling: SamplingConfig, on_event: Callable[[Event], None]) -> Request:
        """Queue a request (never refused for load: it waits for a place in the batch)."""
        req = Request(next(self._ids), list(prompt_ids), sampling, on_event)
        with self._wake:
            self._waiting.append(req)
            self._wake.notify()
        return req

    def cancel(self, req: Request) -> None:
        """Free the request's place at the next step (a client went away)."""
        with self._wake:
            req.cancelled = True
            self._wake.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="pagedexperts-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after the current step; unfinished requests end as cancelled."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for req in list(self._running) + list(self._waiting):
            self._finish(req, "cancelled")
        self._running.clear()
        self._waiting.clear()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stopping:
                    return
            self.step()

    # ---- scheduler thread ----

    def step(self) -> None:
        """Drop cancelled requests, admit and prefill new ones, then one batched decode."""
        with self._wake:
            for req in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(req)
                self._finish(req, "cancelled")
            admitted = []
            while self._waiting and len(self._running) + len(admitted) < self.config.max_running_requests:
                admitted.append(self._waiting.popleft())
        for req in [r for r in self._running if r.cancelled]:
            self._running.remove(req)
            self._finish(req, "cancelled")
        decoding = list(self._running)
        for req in admitted:
            self._guarded([req], lambda: self._prefill(req))
        if decoding:
            self._guarded(decoding, lambda: self._decode(decoding))

    def _guarded(self, reqs: list[Request], fn: Callable[[], None]) -> None:
        """Run a model step; on an exception fail those requests and keep serving others."""
        try:
            with torch.no_grad():
                fn()
        except Exception as exc:  # a failed step must not take the server down
            logger.exception("model step failed for requests %s", [r.request_id for r in reqs])
            for req in reqs:
                if req in self._running:
                    self._running.remove(req)
                if req.finished_s is None:
                    self._finish(req, "error", error=f"{type(exc).__name__}: {exc}")

    def _forward(self, request_ids: list[int], **kwargs):
        if self.recorder is not None:
            self.recorder.request_ids = request_ids
        cache = kwargs.pop("cache")
        return self.model(**kwargs, **{self._cache_kwarg: cache}, use_cache=True, logits_to_keep=1)

    def _prefill(self, req: Request) -> None:
        from transformers import DynamicCache

        device = self.model.device
        ids = torch.tensor([req.prompt_ids], dtype=torch.long, device=device)
        cache = DynamicCache()
        out = self._forward([req.request_id], input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache)
        self.stats.prefill_steps += 1
        capacity = len(req.prompt_ids) + req.sampling.max_new_tokens
        for layer in cache.layers:
            k, v = layer.keys[0], layer.values[0]  # [kv_heads, P, D]
            kb = k.new_empty((k.shape[0], capacity, k.shape[2]))
            vb = v.new_empty((v.shape[0], capacity, v.shape[2]))
            kb[:, : k.shape[1]] = k
            vb[:, : v.shape[1]] = v
            req.keys.append(kb)
            req.values.append(vb)
        req.length = len(req.prompt_ids)
        if req.sampling.temperature > 0:
            req.generator = torch.Generator(device="cpu")
            if req.sampling.seed is None:
                req.generator.seed()  # non-deterministic, and leaves torch's global RNG alone
            else:
                req.generator.manual_seed(req.sampling.seed)
        self._running.append(req)
        self._accept(req, out.logits[0, -1].to("cpu"))

    def _decode(self, reqs: list[Request]) -> None:
        from transformers import DynamicCache

        device = self.model.device
        batch = len(reqs)
        s_max = max(r.length for r in reqs)
        cache = DynamicCache()
        for layer in range(len(reqs[0].keys)):
            if batch == 1:  # alone: no padding, no mask, as model.generate decodes
                k = reqs[0].keys[layer][None, :, : s_max]
                v = reqs[0].values[layer][None, :, : s_max]
            else:
                k = self._left_pad([r.keys[layer][:, : r.length] for r in reqs], s_max)
                v = self._left_pad([r.values[layer][:, : r.length] for r in reqs], s_max)
            cache.update(k, v, layer)
        mask = torch.zeros((batch, s_max + 1), dtype=torch.long, device=device)
        for i, r in enumerate(reqs):
            mask[i, s_max - r.length:] = 1
        ids = torch.tensor([[r.output_ids[-1]] for r in reqs], dtype=torch.long, device=device)
        positions = torch.tensor([[r.length] for r in reqs], dtype=torch.long, device=device)
        out = self._forward(
            [r.request_id for r in reqs], input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache
        )
        self.stats.decode_steps += 1
        self.stats.decode_rows += batch
        self.stats.max_decode_batch = max(self.stats.max_decode_batch, batch)
        for layer, cl in enumerate(cache.layers):
            for i, r in enumerate(reqs):
                r.keys[layer][:, r.length] = cl.keys[i, :, -1]
                r.values[layer][:, r.length] = cl.values[i, :, -1]
        logits = out.logits[:, -1].to("cpu")
        for i, r in enumerate(reqs):
            r.length += 1
            self._accept(r, logits[i])

    @staticmethod
    def _left_pad(rows: list[torch.Tensor], s_max: int) -> torch.Tensor:
        """[kv_heads, S_i, D] each -> [B, kv_heads, s_max, D], zeros on the left."""
        first = rows[0]
        out = first.new_zeros((len(rows), first.shape[0], s_max, first.shape[2]))
        for i, row in enumerate(rows):
            out[i, :, s_max - row.shape[1]:] = row
        return out

    def _accept(self, req: Request, logits: torch.Tensor) -> None:
        """Sample the next token of ``req``, emit its new text, finish it if done."""
        token = _sample(logits, req.sampling, req.generator)
        now = time.perf_counter()
        if req.first_token_s is None:
            req.first_token_s = now
        req.output_ids.append(token)
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        shown, stopped = _stop_cut(text, req.sampling.stop)
        finish = None
        if stopped or token in self.eos_ids:
            finish = "stop"
        elif len(req.output_ids) >= req.sampling.max_new_tokens:
            finish = "length"
        if finish is not None and not stopped:
            shown = text  # the text is complete: release any tail held back for stop strings
        delta = shown[req.emitted_chars:]
        req.emitted_chars = len(shown)
        if finish is None:
            if delta:
                req.on_event(Event(delta, len(req.output_ids), time_s=now))
            return
        self._running.remove(req)
        self._finish(req, finish, text=delta)

    def _finish(self, req: Request, reason: str, *, text: str = "", error: str | None = None) -> None:
        req.finished_s = now = time.perf_counter()
        req.keys, req.values = [], []
        counter = {"cancelled": "cancelled", "error": "failed"}.get(reason, "finished")
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        n = len(req.output_ids)
        first = req.first_token_s
        ttft = None if first is None else first - req.submitted_s
        tpot = (now - first) / (n - 1) if first is not None and n > 1 else None
        req.on_event(Event(text, n, reason, error, now, ttft, tpot))
