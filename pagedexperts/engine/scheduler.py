"""Continuous batching (``BatchScheduler``): one thread owns the model and steps every request:
admission, one packed forward of decodes and prompt chunks (or prefill forwards then a decode
forward), sampling, and events through each request's ``on_event``. Per-request work runs isolated:
a fault fails that request alone. docs/server.md.

Legend: B requests in a forward, P prompt tokens, S cached tokens, T tokens of a packed step, V
vocabulary, D head dim.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Callable

import torch

from pagedexperts.generation.config import SamplingConfig
from pagedexperts.engine.batching import prefill_batches
from pagedexperts.engine.chunked_prefill import MASK_FORMS, Segment, step_segments
from pagedexperts.engine.forwards import DynamicForwards, StepForwards
from pagedexperts.engine.isolation import check_inputs, each_isolated
from pagedexperts.engine.row_attention import rows_problem
from pagedexperts.engine.row_forwards import RowForwards
from pagedexperts.engine.sampling import SamplingParams, TokenLogprob, sample, token_logprobs
from pagedexperts.generation.stop_text import REPLACEMENT_CHAR, IncrementalText
from pagedexperts.engine.scheduler_config import QueueFull, SchedulerConfig, SchedulerStats, SchedulerStopped
from pagedexperts.engine.sequence import Event, Request, ends_sequence, eos_ids, held_back, seeded_generator, stop_reason_of
from pagedexperts.engine.speculative.decoder import SpeculativeDecoder

logger = logging.getLogger(__name__)

class BatchScheduler:
    """Continuous batching over one model; ``start()`` runs ``step()`` in a background thread.
    ``submit``, ``cancel`` and the counts may be called from any thread; everything touching the
    model runs on the scheduler thread."""

    def __init__(self, model, tokenizer, config: SchedulerConfig, *, recorder=None, speculative=None) -> None:
        if config.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {config.max_running_requests}")
        if config.max_prefill_tokens < 1:
            raise ValueError(f"--max-prefill-tokens must be >= 1, got {config.max_prefill_tokens}")
        self._mask_form = getattr(model.config, "_attn_implementation", None) or "eager"
        if config.chunked_prefill and self._mask_form not in MASK_FORMS:
            raise ValueError(f"chunked prefill needs attention implementation {list(MASK_FORMS)}, the model has "
                             f"{self._mask_form!r}; serve with --no-chunked-prefill")
        self.model, self.tokenizer, self.config, self.recorder = model, tokenizer, config, recorder
        self.vocab_size = int(getattr(model.config, "vocab_size", 0) or model.get_input_embeddings().num_embeddings)
        self.stats = SchedulerStats()
        self.eos_ids = eos_ids(model, tokenizer)
        self.pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        self.forwards = self._forwards(speculative)
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._places_taken = 0  # admitted and not finished (running, or prefilling apart with --no-chunked-prefill)
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self.speculative = None  # a SpeculativeDecoder with --speculative (a SpeculativeConfig): every step's decodes
        if speculative is not None:
            self.speculative = SpeculativeDecoder(model, tokenizer, speculative, pad_id=self.pad_id)

    def _forwards(self, speculative) -> StepForwards:
        """KV rows where the model can attend over them, else the dynamic layout with a WARNING
        (strict: an error)."""
        c = self.config
        reason = rows_problem(self.model) if c.static_kv else None
        if c.static_kv and reason is None:
            width = 1 + (speculative.num_speculative_tokens if speculative is not None else 0)
            return RowForwards(self.model, max_rows=c.max_running_requests, context_length=c.context_length,
                               max_width=width, backend=c.cuda_graphs, max_batch=c.cuda_graph_max_batch,
                               strict=c.strict_cuda_graphs, pad_id=self.pad_id, recorder=self.recorder,
                               reason=c.cuda_graphs_reason)
        if reason is not None:
            if c.strict_cuda_graphs:
                raise ValueError(f"--cuda-graphs: decode steps over KV rows cannot serve {reason}; use --no-cuda-graphs")
            logger.warning("decode steps rebuild a batch cache every step (dynamic KV): KV rows cannot serve %s", reason)
        return DynamicForwards(self.model, pad_id=self.pad_id, mask_form=self._mask_form, recorder=self.recorder,
                               reason=reason)

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
        """Queue several sequences, all or none. ``max_queued_requests`` bounds those beyond the
        running places still free. Raises QueueFull, or SchedulerStopped after ``stop``."""
        with self._wake:
            if self._stopping:
                raise SchedulerStopped("the scheduler is stopped (the server is shutting down)")
            cap, free = self.config.max_queued_requests, self.free_places
            must_wait = len(self._waiting) + len(items) - free
            if cap is not None and must_wait > cap:
                raise QueueFull(f"{len(self._waiting)} sequences are queued, {free} running places are free "
                                f"(--max-running-requests {self.config.max_running_requests}) and this request "
                                f"needs {len(items)}; at most {cap} may wait (--max-queued-requests)")
            reqs = []
            for ids, sampling, on_event in items:
                params = held_back(SamplingParams.of(sampling), self.eos_ids)
                text = IncrementalText(tuple(params.stop), include=params.include_stop_str_in_output)
                req = Request(next(self._ids), list(ids), params, on_event, text=text)
                reqs.append(req)
                self._waiting.append(req)
            self._wake.notify()
        return reqs

    @property
    def free_places(self) -> int:
        """Running places not held by an admitted, unfinished sequence."""
        return max(0, self.config.max_running_requests - self._places_taken)

    def cancel(self, req: Request) -> None:
        """Free the request's place at the next step (a client went away)."""
        with self._wake:
            req.cancelled = True
            self._wake.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="pagedexperts-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0, *, reason: str = "the server is shutting down") -> None:
        """Stop the thread after this step; unfinished requests end with finish "abort" and ``reason``."""
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
        """Drop cancelled requests, admit new ones, then run the step's forwards."""
        admitted = self._admit()
        if self.config.chunked_prefill:
            self._running += admitted
            self._chunked_step()
            return
        decoding = list(self._running)
        # prompts to score keep all P rows of logits [B, P, V]: prefilled apart from the rest
        for kind in (False, True):
            same = [r for r in admitted if r.sampling.prompt_logprobs == kind]
            for group in prefill_batches([len(r.prompt_ids) for r in same], self.config.max_prefill_tokens):
                batch = [same[i] for i in group]
                self._guarded(batch, lambda: self._prefill(batch))
        if decoding:
            self._guarded(decoding, lambda: self._decode(decoding))

    def _admit(self) -> list[Request]:
        """Finish cancelled requests; take waiting ones up to the cap, each checked alone."""
        with self._wake:
            for req in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(req)
                self._finish(req, "cancelled")
            admitted = []
            while self._waiting and len(self._running) + len(admitted) < self.config.max_running_requests:
                admitted.append(self._waiting.popleft())
            now = time.perf_counter()
            for req in admitted:
                req.admitted_s = now
            self._places_taken += len(admitted)
        for req in [r for r in self._running if r.cancelled]:
            self._running.remove(req)
            self._finish(req, "cancelled")
        return each_isolated(admitted, self._prepare, self._fail, what="preparing")

    def _prepare(self, req: Request) -> None:
        """Check ``req`` alone, then make room for its KV (``StepForwards.place``)."""
        check_inputs(req.prompt_ids, req.sampling, vocab_size=self.vocab_size, context_length=self.config.context_length)
        self.forwards.place(req)

    def _chunked_step(self) -> None:
        """Every decode and the budget's prompt chunks in one forward (two where decodes do not mix)."""
        segments, decodes = step_segments(self._running, self.config.max_prefill_tokens)
        reqs = [s.request for s in segments]
        if decodes < len(segments) and (decodes == 0 or self.forwards.mixes_decodes):
            self._guarded(reqs, lambda: self._packed(segments, decodes))
        elif decodes < len(segments):
            chunks, decoding = segments[decodes:], reqs[:decodes]
            self._guarded(reqs[decodes:], lambda: self._packed(chunks, 0))
            self._guarded(decoding, lambda: self._decode(decoding))
        elif reqs:  # no prompt to prefill: the batched decode
            self._guarded(reqs, lambda: self._decode(reqs))

    def _guarded(self, reqs: list[Request], fn: Callable[[], None]) -> None:
        """Run a model step; on an exception in it fail those requests and keep serving others."""
        try:
            with torch.no_grad():
                fn()
        except Exception as exc:  # a failed step must not take the server down
            logger.exception("model step failed for requests %s", [r.request_id for r in reqs])
            for req in reqs:
                self._fail(req, exc)

    def _fail(self, req: Request, exc: Exception) -> None:
        """End ``req`` with finish "error" (its client gets the message); others are untouched."""
        if req in self._running:
            self._running.remove(req)
        if req.finished_s is None:
            self._finish(req, "error", error=f"{type(exc).__name__}: {exc}")

    def _prefill(self, reqs: list[Request]) -> None:
        """One forward over ``reqs``' whole prompts, then each one's first token."""
        rows = self.forwards.prefill(reqs)
        self.stats.count_prefill(len(reqs), sum(len(r.prompt_ids) for r in reqs))

        def prefilled(req: Request) -> None:
            self._running.append(req)
            self._prompt_done(req, rows[req.request_id], 0)

        each_isolated(reqs, prefilled, self._fail, what="sampling after prefill")

    def _packed(self, segments: list[Segment], decodes: int) -> None:
        """One packed forward of ``segments`` (``decodes`` first; with speculation they carry
        proposals)."""
        proposals = None
        if self.speculative is not None and decodes:
            segments[:decodes], proposals = self.speculative.segments(segments[:decodes])
        rows = self.forwards.packed(segments, decodes)
        self.stats.count_prefill(len(segments) - decodes, sum(len(s.token_ids) for s in segments[decodes:]))
        if decodes:
            self.stats.count_decode(decodes)
            self.stats.mixed_steps += 1
        self._decoded([s.request for s in segments[:decodes]], rows, proposals)
        each_isolated([s.request for s in segments[decodes:]],
                      lambda r: self._prompt_done(r, rows[r.request_id], r.length - len(r.prompt_ids)),
                      self._fail, what="prefill")

    def _decoded(self, reqs: list[Request], rows: dict[int, torch.Tensor], proposals) -> None:
        """After a packed forward: each decode's token, or with speculation its verification."""
        if proposals is None:
            each_isolated(reqs, lambda r: self._accept(r, rows[r.request_id][-1]), self._fail, what="sampling")
            return
        proposal = {r.request_id: p for r, p in zip(reqs, proposals)}
        each_isolated(reqs, lambda r: self.speculative.verify(self, r, rows[r.request_id], proposal[r.request_id]),
                      self._fail, what="verification")

    def _prompt_done(self, req: Request, rows: torch.Tensor, end: int) -> None:
        """After a prompt chunk: its prompt logprobs, then, once the prompt is cached, the first token."""
        if req.sampling.prompt_logprobs:
            start, targets = req.prompt_targets(end, rows.shape[0])
            entries = self._report(rows[: len(targets)], targets, req) if targets else []
            if start == 0:
                entries.insert(0, TokenLogprob(req.prompt_ids[0], self._token_text(req.prompt_ids[0]), None))
            req.pending_prompt_logprobs = (*(req.pending_prompt_logprobs or ()), *entries)
        if end < 0:
            return
        if req.sampling.max_new_tokens == 0:  # scored only
            self._running.remove(req)
            self._finish(req, "length")
            return
        req.generator = seeded_generator(req.sampling)
        self._accept(req, rows[-1])

    def _decode(self, reqs: list[Request]) -> None:
        """One forward decoding every request of ``reqs`` (with speculation
        ``SpeculativeDecoder.decode``)."""
        if self.speculative is not None:  # propose, verify in one forward, roll back
            return self.speculative.decode(self, reqs)
        logits = self.forwards.decodes(reqs, [[r.output_ids[-1]] for r in reqs])
        self.stats.count_decode(len(reqs))
        row = {r.request_id: i for i, r in enumerate(reqs)}
        each_isolated(reqs, lambda r: self._accept(r, logits[row[r.request_id], -1]), self._fail, what="sampling")

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _report(self, logits: torch.Tensor, token_ids: list[int], req: Request) -> list[TokenLogprob]:
        return token_logprobs(logits, token_ids, req.sampling.logprobs or 0, self._token_text)

    def _accept(self, req: Request, logits: torch.Tensor, token: int | None = None) -> None:
        """Sample ``req``'s next token (or take ``token``), emit its text, and finish it on a stop
        token or string (after ``min_tokens``) or ``max_new_tokens``; a stop token's text is hidden
        unless ``include_stop_str_in_output`` (vLLM's V1 detokenizer)."""
        p = req.sampling
        if token is None:
            token = sample(logits, p, req.output_ids, req.generator)
        now = time.perf_counter()
        if req.first_token_s is None:
            req.first_token_s = now
        if p.logprobs is not None:
            req.pending_logprobs += self._report(logits[None], [token], req)
        req.output_ids.append(token)
        n = len(req.output_ids)
        stop_token = ends_sequence(p, token, n, self.eos_ids)
        ended = stop_token or n >= p.max_new_tokens
        shown = req.output_ids[:-1] if stop_token and not p.include_stop_str_in_output else req.output_ids
        text = self.tokenizer.decode(shown, skip_special_tokens=p.skip_special_tokens)
        if n <= p.min_tokens:  # stop strings count only after the text of the first min_tokens tokens
            req.text.stop_from = len(text.rstrip(REPLACEMENT_CHAR))
        delta, stopped = req.text.update(text, complete=ended)
        if stopped or ended:
            self._running.remove(req)
            reason = req.text.matched if stopped else stop_reason_of(p, token, self.tokenizer.eos_token_id) if stop_token else None
            self._finish(req, "stop" if stopped or stop_token else "length", text=delta, stop_reason=reason)
        elif delta or req.pending_logprobs or req.pending_prompt_logprobs:
            req.on_event(self._event(req, delta, now=now))

    def _event(self, req: Request, text: str, *, now: float, **final) -> Event:
        logprobs, req.pending_logprobs = tuple(req.pending_logprobs), []
        prompt, req.pending_prompt_logprobs = req.pending_prompt_logprobs, None
        return Event(text, len(req.output_ids), time_s=now, logprobs=logprobs, prompt_logprobs=prompt, **final)

    def _finish(self, req: Request, reason: str, *, text: str = "", error: str | None = None,
                stop_reason: int | str | None = None) -> None:
        with self._wake:
            if req.admitted_s is not None and req.finished_s is None:
                self._places_taken -= 1  # its place is free for the next step's admission
            req.finished_s = now = time.perf_counter()
        self.forwards.release(req)
        counter = {"cancelled": "cancelled", "error": "failed", "abort": "aborted"}.get(reason, "finished")
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        ttft, tpot = req.timing(now)
        try:
            req.on_event(self._event(req, text, now=now, finish_reason=reason, stop_reason=stop_reason, error=error,
                                     ttft_s=ttft, queue_s=req.queue_s, tpot_s=tpot))
        except Exception:  # the final event is the last thing sent: nothing else to end
            logger.exception("the final event of request %s could not be delivered", req.request_id)
