"""Continuous batching for the server: one thread owns the model and steps all requests.

Owns: the bounded waiting queue and the running set (at most ``max_running_requests``), the
per-request KV caches, one model step at a time, per-request sampling (``sampling``), and
the events (text deltas, logprobs, finish) handed back through each request's ``on_event``.

A step (``BatchScheduler.step``) drops cancelled requests, admits waiting ones up to the
cap, PREFILLS the admitted prompts together (left-padded into batches of at most
``max_prefill_tokens`` padded tokens, one forward each; a prompt alone is not padded;
prompts whose logprobs are asked for in a batch of their own, the only forward that keeps
every position's logits), then
DECODES every request that was running before the step in ONE forward: the per-request
caches are left-padded into one batch cache [B, kv_heads, S_max, D] with a 2D attention mask
(``decode_mask``), each row at its own position; the new keys and values go back to each
request's own buffer. Requests join and leave between steps. A request alone decodes with no
padding and no mask, exactly like ``model.generate``.

Legend: B requests in a forward, P prompt tokens (P_max the longest of a batch), S cached
tokens, V vocabulary, D head dim.

Does not: speak HTTP or validate requests (``protocol``), or know about paging: paging is
the model's own business, and its counters are read by whoever exports them.
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

from pagedexperts.generation.config import SamplingConfig
from pagedexperts.serving.batching import decode_mask, prefill_batches, prefill_inputs
from pagedexperts.serving.sampling import IncrementalText, SamplingParams, TokenLogprob, sample, token_logprobs

logger = logging.getLogger(__name__)

DEFAULT_MAX_PREFILL_TOKENS = 16384  # padded tokens in one prefill forward (SGLang's default)


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits.

    ``max_running_requests``: decode batch cap. ``context_length``: longest prompt +
    completion in tokens. ``max_queued_requests``: waiting requests beyond which ``submit``
    raises ``QueueFull`` (None = unbounded). ``max_prefill_tokens``: padded tokens
    (B x P_max) in one prefill forward; a prompt longer than that is prefilled alone, so 1
    means one prompt per forward.
    """

    max_running_requests: int
    context_length: int
    max_queued_requests: int | None = None
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS


class QueueFull(Exception):
    """``submit`` would exceed ``max_queued_requests``; nothing was queued."""


class SchedulerStopped(Exception):
    """``submit`` after ``stop``: nothing would ever step the request; nothing was queued."""


@dataclass(frozen=True)
class Event:
    """What a request reports after a step: new text, and on the last one its finish reason.

    ``finish_reason``: None while running, then "stop" (end of sequence or a stop string),
    "length" (max_tokens reached), "cancelled", "error" (``error`` holds the message) or
    "abort" (the server is shutting down; ``error`` says so). ``time_s`` is
    ``time.perf_counter()`` when the event was made. ``logprobs``: reports of the tokens
    generated since the previous event (when asked for); ``prompt_logprobs``: on the first
    event, the prompt's (the first token's logprob is None: nothing predicts it). The last event
    also carries the request's timing: ``ttft_s`` (arrival to first token) and ``tpot_s``
    (mean seconds per token after the first; None with fewer than two tokens).
    """

    text: str
    completion_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    time_s: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass
class Request:
    """One sequence and its state inside the scheduler.

    ``prompt_ids``: token ids, already checked against the context length. ``on_event`` is
    called from the scheduler thread; it must not block. Cache buffers are [kv_heads,
    capacity, D] per layer, capacity = P + max_new_tokens; ``length`` tokens are filled.
    """

    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    on_event: Callable[[Event], None]
    submitted_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finished_s: float | None = None
    cancelled: bool = False
    output_ids: list[int] = field(default_factory=list)
    text: IncrementalText | None = None
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_prompt_logprobs: tuple | None = None
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0
    generator: torch.Generator | None = None


@dataclass
class SchedulerStats:
    """Counters of the scheduler's own work (not paging): forwards, rows and prompts per forward."""

    prefill_steps: int = 0  # prefill forwards
    prefill_rows: int = 0  # prompts prefilled (sum of prefill batch sizes)
    max_prefill_batch: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # sum of batch sizes over decode steps
    max_decode_batch: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    aborted: int = 0


class BatchScheduler:
    """Continuous batching over one model; ``start()`` runs ``step()`` in a background thread.

    Thread model: ``submit``, ``cancel`` and the counts may be called from any thread;
    everything that touches the model runs on the scheduler thread (or the caller of
    ``step`` in tests, with no thread started).
    """

    def __init__(self, model, tokenizer, config: SchedulerConfig, *, recorder=None, speculative=None) -> None:
        if config.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {config.max_running_requests}")
        if config.max_prefill_tokens < 1:
            raise ValueError(f"--max-prefill-tokens must be >= 1, got {config.max_prefill_tokens}")
        self.model, self.tokenizer, self.config, self.recorder = model, tokenizer, config, recorder
        self.stats = SchedulerStats()
        self.eos_ids = self._eos_ids(model, tokenizer)
        self.pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self.speculative = None  # a SpeculativeDecoder with --speculative (a SpeculativeConfig)
        if speculative is not None:
            from pagedexperts.serving.speculative import SpeculativeDecoder

            self.speculative = SpeculativeDecoder(model, tokenizer, speculative, pad_id=self.pad_id)

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
        """Queue one sequence; raises QueueFull when the queue is at ``max_queued_requests``."""
        return self.submit_many([(prompt_ids, sampling, on_event)])[0]

    def submit_many(self, items: list[tuple[list[int], SamplingConfig, Callable[[Event], None]]]) -> list[Request]:
        """Queue several sequences (prompt ids, sampling, on_event), all or none.

        Raises:
            QueueFull: the waiting queue would exceed ``max_queued_requests``.
            SchedulerStopped: ``stop`` was called (the server is shutting down).
        """
        with self._wake:
            if self._stopping:
                raise SchedulerStopped("the scheduler is stopped (the server is shutting down)")
            cap = self.config.max_queued_requests
            if cap is not None and len(self._waiting) + len(items) > cap:
                raise QueueFull(f"{len(self._waiting)} requests are queued and this one needs {len(items)} "
                                f"places; the limit is {cap} (--max-queued-requests)")
            reqs = []
            for ids, sampling, on_event in items:
                params = SamplingParams.of(sampling)
                req = Request(next(self._ids), list(ids), params, on_event, text=IncrementalText(tuple(params.stop)))
                reqs.append(req)
                self._waiting.append(req)
            self._wake.notify()
        return reqs

    def cancel(self, req: Request) -> None:
        """Free the request's place at the next step (a client went away)."""
        with self._wake:
            req.cancelled = True
            self._wake.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="pagedexperts-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0, *, reason: str = "the server is shutting down") -> None:
        """Stop the thread after the current step; each unfinished request ends with
        finish_reason "abort" and ``reason`` (its client gets a final event)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._wake:
            left = list(self._running) + list(self._waiting)
            self._running.clear()
            self._waiting.clear()
        for req in left:
            if req.finished_s is None:
                self._finish(req, "abort", error=reason)

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
        """Drop cancelled requests, admit and prefill new ones together, then one batched decode."""
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
        # prompts to score keep all P rows of logits [B, P, V]: prefilled apart from the rest
        for kind in (False, True):
            same = [r for r in admitted if r.sampling.prompt_logprobs == kind]
            for group in prefill_batches([len(r.prompt_ids) for r in same], self.config.max_prefill_tokens):
                batch = [same[i] for i in group]
                self._guarded(batch, lambda: self._prefill(batch))
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

    def _forward(self, request_ids: list[int], *, logits_to_keep: int = 1, **kwargs):
        if self.recorder is not None:
            self.recorder.request_ids = request_ids
        cache = kwargs.pop("cache")
        return self.model(**kwargs, **{self._cache_kwarg: cache}, use_cache=True, logits_to_keep=logits_to_keep)

    def _prefill(self, reqs: list[Request]) -> None:
        """One forward over the left-padded prompts [B, P_max]; each request keeps its own KV."""
        from transformers import DynamicCache

        device = self.model.device
        ids, mask, positions = prefill_inputs([r.prompt_ids for r in reqs], self.pad_id)
        scores = any(r.sampling.prompt_logprobs for r in reqs)
        cache = DynamicCache()
        out = self._forward([r.request_id for r in reqs], input_ids=ids.to(device), attention_mask=mask.to(device),
                            position_ids=positions.to(device), cache=cache, logits_to_keep=0 if scores else 1)
        self.stats.prefill_steps += 1
        self.stats.prefill_rows += len(reqs)
        self.stats.max_prefill_batch = max(self.stats.max_prefill_batch, len(reqs))
        p_max = ids.shape[1]
        logits = out.logits.to("cpu")  # [B, P_max or 1, V]
        for i, req in enumerate(reqs):
            n = len(req.prompt_ids)
            if req.sampling.prompt_logprobs:
                first = TokenLogprob(req.prompt_ids[0], self._token_text(req.prompt_ids[0]), None)
                rest = self._report(logits[i, p_max - n: p_max - 1], req.prompt_ids[1:], req)
                req.pending_prompt_logprobs = (first, *rest)
            if req.sampling.max_new_tokens == 0:  # scored only
                self._finish(req, "length")
                continue
            self._keep_kv(req, cache, i, p_max - n)
            self._seed(req)
            self._running.append(req)
            self._accept(req, logits[i, -1])

    def _keep_kv(self, req: Request, cache, row: int, start: int) -> None:
        """Copy row ``row`` of the batch cache (columns ``start``:) into the request's buffers."""
        capacity = len(req.prompt_ids) + req.sampling.max_new_tokens
        for layer in cache.layers:
            for src, dst in ((layer.keys, req.keys), (layer.values, req.values)):
                kv = src[row, :, start:]  # [kv_heads, P, D]
                buf = kv.new_empty((kv.shape[0], capacity, kv.shape[2]))
                buf[:, : kv.shape[1]] = kv
                dst.append(buf)
        req.length = len(req.prompt_ids)

    @staticmethod
    def _seed(req: Request) -> None:
        if req.sampling.greedy:
            return
        req.generator = torch.Generator(device="cpu")
        if req.sampling.seed is None:
            req.generator.seed()  # non-deterministic, and leaves torch's global RNG alone
        else:
            req.generator.manual_seed(req.sampling.seed % 2**64)

    def _decode(self, reqs: list[Request]) -> None:
        if self.speculative is not None:  # propose, verify in one forward, roll back (serving.speculative)
            return self.speculative.decode(self, reqs)
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
        mask = decode_mask([r.length for r in reqs], s_max).to(device)
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

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _report(self, logits: torch.Tensor, token_ids: list[int], req: Request) -> list[TokenLogprob]:
        return token_logprobs(logits, token_ids, req.sampling.logprobs or 0, self._token_text)

    def _accept(self, req: Request, logits: torch.Tensor, token: int | None = None) -> None:
        """Sample the next token of ``req`` (or take ``token``, chosen by speculation from these
        logits), emit its new text, finish it if done."""
        if token is None:
            token = sample(logits, req.sampling, req.output_ids, req.generator)
        now = time.perf_counter()
        if req.first_token_s is None:
            req.first_token_s = now
        if req.sampling.logprobs is not None:
            req.pending_logprobs += self._report(logits[None], [token], req)
        req.output_ids.append(token)
        ended = token in self.eos_ids or len(req.output_ids) >= req.sampling.max_new_tokens
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        delta, stopped = req.text.update(text, complete=ended)
        if stopped or ended:
            self._running.remove(req)
            reason = "stop" if stopped or token in self.eos_ids else "length"
            self._finish(req, reason, text=delta)
        elif delta or req.pending_logprobs or req.pending_prompt_logprobs:
            req.on_event(self._event(req, delta, now=now))

    def _event(self, req: Request, text: str, *, now: float, **final) -> Event:
        """An event carrying ``text`` and the logprob reports not yet sent."""
        logprobs, req.pending_logprobs = tuple(req.pending_logprobs), []
        prompt, req.pending_prompt_logprobs = req.pending_prompt_logprobs, None
        return Event(text, len(req.output_ids), time_s=now, logprobs=logprobs, prompt_logprobs=prompt, **final)

    def _finish(self, req: Request, reason: str, *, text: str = "", error: str | None = None) -> None:
        req.finished_s = now = time.perf_counter()
        req.keys, req.values = [], []
        counter = {"cancelled": "cancelled", "error": "failed", "abort": "aborted"}.get(reason, "finished")
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        n = len(req.output_ids)
        first = req.first_token_s
        ttft = None if first is None else first - req.submitted_s
        tpot = (now - first) / (n - 1) if first is not None and n > 1 else None
        req.on_event(self._event(req, text, now=now, finish_reason=reason, error=error, ttft_s=ttft, tpot_s=tpot))
