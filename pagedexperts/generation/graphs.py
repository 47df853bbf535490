"""Decode steps over static buffers, captured in CUDA graphs: one capture per decode batch size.

Owns: ``DecodeGraphs``, the decode-step runner of one model: per batch size B <= max batch a
``StaticStep`` (transformers' ``StaticCache`` and fixed input buffers: ids [B, 1], position ids
[B, 1], the cache position [1], the 2-D mask [B, L_max]), its one-step function (the model's
own forward, the 4-D mask built inside the step) and its ``StepBackend``: ``CudaGraphBackend``
(captured once after an eager first step, replayed) or ``EagerBackend`` (the same function
called each step: CPU, tests). Prefill is eager into the same cache. A capture is valid while
``model.pagedexperts.runners`` holds the same runners; a repage invalidates it, counted. Why a
graph of the eager ops and not ``torch.compile``: docs/cuda-graphs.md. What a step needs to be
captured: ``generation.capture_checks``.

Legend: B batch (decode rows), L_max cache positions, V vocabulary.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from pagedexperts.generation.capture_checks import capture_problem_of
from pagedexperts.loading.runtime import runtime_of

logger = logging.getLogger(__name__)
CACHE_ROUND = 64  # cache positions are allocated in multiples of this (fewer re-captures)


class StepBackend(ABC):
    """How a static-buffer step function is run again: built once, then run each step."""

    name = ""

    @abstractmethod
    def build(self, fn: Callable[[], None]) -> None:
        """Prepare ``fn`` (reads and writes only static buffers) to be run by ``run``."""

    @abstractmethod
    def run(self, fn: Callable[[], None]) -> None:
        """Run the step once more over the static buffers."""


class EagerBackend(StepBackend):
    """Calls the function each step: the static-buffer decode without capture (CPU, tests)."""

    name = "eager"

    def build(self, fn) -> None:
        pass

    def run(self, fn) -> None:
        fn()


class CudaGraphBackend(StepBackend):
    """Captures the function in a ``torch.cuda.CUDAGraph`` (memory from ``pool``, shared by
    the model's captures) on ``stream``, the stream its warm-up ran on, and replays it."""

    name = "cuda"

    def __init__(self, pool, stream) -> None:
        self.pool, self.stream = pool, stream
        self.graph: torch.cuda.CUDAGraph | None = None

    def build(self, fn) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            fn()
        self.graph = graph

    def run(self, fn) -> None:
        self.graph.replay()


@dataclass
class GraphCounters:
    """Counts of one model's decode steps: captures (builds; eager backend: the same points),
    replays, eager steps (batch over the cap, or a fallback), invalidations (a repage)."""

    captures: int = 0
    replays: int = 0
    eager_steps: int = 0
    invalidations: int = 0


class StaticStep:
    """The static buffers of decode at batch B = ``batch`` over L_max = ``max_len`` cache positions,
    and the model's one-step function over them (``forward``: logits [B, V] of the step).
    """

    def __init__(self, model, batch: int, max_len: int) -> None:
        from transformers import StaticCache

        dev = model.device
        i64 = dict(dtype=torch.int64, device=dev)
        self.model, self.batch, self.max_len = model, batch, max_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.input_ids = torch.zeros((batch, 1), **i64)
        self.position_ids = torch.zeros((batch, 1), **i64)
        self.cache_position = torch.zeros(1, **i64)
        self.mask2d = torch.zeros((batch, max_len), **i64)
        self.kv_index = torch.arange(max_len, **i64)
        self.logits: torch.Tensor | None = None  # [B, V], written by each run
        self.backend: StepBackend | None = None  # set when built
        self.built_for: tuple = ()
        self.fallback: str | None = None  # why this step runs eagerly (auto), or None
        params = inspect.signature(type(model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5.24 renamed it
        self._with_cache_position = "cache_position" in params  # 5.17 passes it; 5.24 counts in the cache
        self._with_logits_to_keep = "logits_to_keep" in params

    def mask4d(self) -> torch.Tensor:
        """[B, 1, 1, L_max]: cache position j is attended iff j <= the step's position and the
        2-D mask holds it (bool for sdpa, 0 / dtype min added for eager attention)."""
        allowed = ((self.kv_index <= self.cache_position) & (self.mask2d != 0))[:, None, None, :]
        if self.model.config._attn_implementation == "sdpa":
            return allowed
        dtype = self.model.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min)

    def _call(self, **kw):
        kw[self._cache_kw] = self.cache
        if self._with_logits_to_keep:
            kw["logits_to_keep"] = 1
        return self.model(use_cache=True, **kw)

    def forward(self) -> None:
        """The decode step over the static buffers (the function captured): ``logits``."""
        kw = dict(input_ids=self.input_ids, position_ids=self.position_ids, attention_mask=self.mask4d())
        if self._with_cache_position:
            kw["cache_position"] = self.cache_position
        self.logits = self._call(**kw).logits[:, -1, :]

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Eager prefill of the prompt ids [B, L] with its 2-D mask [B, L] into the reset cache;
        returns the last position's logits [B, V] and sets the next position of each row.

        Raises:
            ValueError: L >= L_max (no room to decode).
        """
        b, length = input_ids.shape
        if length >= self.max_len:
            raise ValueError(f"prompt of {length} tokens leaves no room in a cache of {self.max_len}")
        self.cache.reset()
        self.mask2d.zero_()
        self.mask2d[:, :length].copy_(attention_mask)
        positions = attention_mask.long().cumsum(-1) - 1  # as transformers' generate makes them
        positions.masked_fill_(attention_mask == 0, 1)
        kw = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions)
        if self._with_cache_position:
            kw["cache_position"] = torch.arange(length, device=input_ids.device)
        logits = self._call(**kw).logits[:, -1, :]
        self.position_ids.copy_(attention_mask.long().sum(-1, keepdim=True))
        return logits

    def load(self, next_ids: torch.Tensor, position: int) -> None:
        """The step's inputs: ids [B] at cache position ``position`` (no host read)."""
        self.input_ids.copy_(next_ids.view(self.batch, 1))
        self.cache_position.fill_(position)
        self.mask2d[:, position].fill_(1)


class DecodeGraphs:
    """Decode steps of ``model`` over static buffers, replayed by ``backend`` ("cuda": captured CUDA
    graphs; "eager": the same function called again) for batch sizes 1..``max_batch`` (larger
    batches run the function eagerly). With ``model.pagedexperts`` its runners are checked and
    followed. ``strict``: a step that cannot be captured raises (``--cuda-graphs`` on) instead of
    running eagerly with a WARNING (auto).

    Raises:
        ValueError: unknown backend, "cuda" without CUDA, max_batch < 1 (names the flag).
    """

    def __init__(self, model, *, backend: str, max_batch: int, strict: bool = False) -> None:
        if backend not in ("cuda", "eager"):
            raise ValueError(f"unknown decode-graph backend {backend!r}; choose 'cuda' or 'eager'")
        if backend == "cuda" and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, not {model.device} (--no-cuda-graphs)")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"--cuda-graph-max-batch {max_batch} must be an integer >= 1")
        self.model, self.backend_name, self.max_batch, self.strict = model, backend, max_batch, strict
        self.counters = GraphCounters()
        self.steps: dict[int, StaticStep] = {}
        self._pool = torch.cuda.graph_pool_handle() if backend == "cuda" else None
        # warm-ups and captures on one stream: cuBLAS keeps a workspace per (handle, stream),
        # so the warm-up allocates the one the capture uses (a capture on a fresh stream would
        # allocate it inside the graph)
        self._stream = torch.cuda.Stream(model.device) if backend == "cuda" else None

    def step_for(self, batch: int, length: int) -> StaticStep:
        """The static step of batch ``batch`` with room for ``length`` positions (a larger one
        replaces a smaller, its capture dropped)."""
        st = self.steps.get(batch)
        if st is None or st.max_len < length:
            st = StaticStep(self.model, batch, -(-length // CACHE_ROUND) * CACHE_ROUND)
            self.steps[batch] = st
        return st

    def decode(self, st: StaticStep, next_ids: torch.Tensor, position: int) -> torch.Tensor:
        """One decode step: ids [B] (int64, on the device) at cache position ``position`` ->
        logits [B, V] (a copy), through ``run``."""
        st.load(next_ids, position)
        logits = self.run(st)
        st.position_ids.add_(1)
        return logits

    def run(self, st) -> torch.Tensor:
        """Run the step ``st`` once over its loaded static buffers -> a copy of ``st.logits``.
        Replays the capture when valid, else builds it (the step itself runs eagerly first);
        batches over max_batch and fallbacks run eagerly. ``st``: a ``StaticStep`` or any step
        with its fields (``batch``, ``forward``, ``logits``, ``backend``, ``built_for``,
        ``fallback``: the server's ``engine.row_forwards.RowStep``)."""
        key = self._runners_key()
        if (st.backend is not None or st.fallback is not None) and not _same_runners(st.built_for, key):
            self.counters.invalidations += st.backend is not None
            st.backend, st.fallback = None, None  # new runners: capture (or judge) again
        if st.batch > self.max_batch or st.fallback is not None:
            return self._eager(st)
        if st.backend is None:
            problem = self.capture_problem()
            if problem is not None and self.backend_name == "cuda":
                return self._fall_back(st, problem, key)
            return self._build(st, key)
        st.backend.run(st.forward)
        self.counters.replays += 1
        return st.logits.clone()

    def _eager(self, st) -> torch.Tensor:
        st.forward()
        self.counters.eager_steps += 1
        return st.logits.clone()

    def _fall_back(self, st, problem: str, key: tuple) -> torch.Tensor:
        """Raise (strict) or decode ``st`` eagerly from now on until its runners change."""
        if self.strict:
            raise ValueError(f"--cuda-graphs cannot capture this decode step: {problem}; use --no-cuda-graphs")
        logger.warning("--cuda-graphs auto: batch %d decodes without a CUDA graph: %s", st.batch, problem)
        st.fallback, st.built_for = problem, key
        return self._eager(st)

    def _build(self, st, key: tuple) -> torch.Tensor:
        """Run the step eagerly (the warm-up and the real step: a side stream on CUDA), then
        build the backend over the same buffers (capture runs nothing). A capture that fails
        (RuntimeError) raises when strict, else the batch size decodes eagerly (WARNING,
        ``fallbacks``): the step already ran, so the state is the eager one."""
        backend = CudaGraphBackend(self._pool, self._stream) if self.backend_name == "cuda" else EagerBackend()
        with _side_stream(self._stream):
            st.forward()
        logits = st.logits.clone()
        try:
            backend.build(st.forward)
        except RuntimeError as err:  # a sync or copy the review missed: auto keeps decoding eagerly
            if self.strict:
                raise
            logger.warning("--cuda-graphs auto: capture of batch %d failed (%s); decoding it eagerly", st.batch, err)
            st.fallback, st.built_for = f"capture failed: {err}", key
            return logits
        st.backend, st.built_for = backend, key
        self.counters.captures += 1
        return logits

    def _runners_key(self) -> tuple:
        """(weak reference to each runner, its experts implementation) of the model's runtime."""
        rt = runtime_of(self.model)
        runners = rt.runners.values() if rt is not None else ()
        return tuple((weakref.ref(r), r.inner) for r in runners)

    def invalidate(self) -> None:
        """Drop every capture (the next step of each batch size captures again)."""
        for st in self.steps.values():
            if st.backend is not None:
                st.backend = None
                self.counters.invalidations += 1
            st.fallback = None

    def capture_problem(self) -> str | None:
        """Why the model's decode step cannot be captured now (``capture_problem_of``)."""
        return capture_problem_of(self.model)

    def summary(self) -> dict:
        """The stats field: backend, max batch, counters, captured batch sizes, fallbacks."""
        return dict(backend=self.backend_name, max_batch=self.max_batch, **asdict(self.counters),
                    batch_sizes=sorted(b for b, s in self.steps.items() if s.backend is not None),
                    fallbacks=sorted({s.fallback for s in self.steps.values() if s.fallback}))


def _same_runners(built: tuple, now: tuple) -> bool:
    return len(built) == len(now) and all(a() is not None and a() is b() and ia == ib
                                          for (a, ia), (b, ib) in zip(built, now))


@contextlib.contextmanager
def _side_stream(side):
    """With a CUDA stream ``side``: run the body on it, ordered after and before the current
    stream (the warm-up before a capture, as ``torch.cuda.graphs`` recommends); None: nothing."""
    if side is None:
        yield
        return
    main = torch.cuda.current_stream(side.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        yield
    main.wait_stream(side)


def decode_graphs_for(model) -> DecodeGraphs | None:
    """The model's ``DecodeGraphs`` (built on first use from ``model.pagedexperts``'s resolved
    ``cuda_graphs`` and config), or None when graphs are off."""
    rt = model.pagedexperts
    if rt.resolved.cuda_graphs == "off":
        return None
    if rt.decode_graphs is None:
        rt.decode_graphs = DecodeGraphs(model, backend=rt.resolved.cuda_graphs, max_batch=rt.config.cuda_graph_max_batch,
                                        strict=rt.config.cuda_graphs == "on")
    return rt.decode_graphs
