"""The scheduler's forwards over KV rows (``RowForwards``, the default): decode and verification steps
of fixed shapes per bucket (``RowStep``) run by ``generation.graphs.DecodeGraphs`` (captured on
CUDA, verification never), prefill and chunked prefill eagerly; a step built before the rows grew or
the runners changed is rebuilt. docs/server.md "Serving on the fast path".

Legend: B rows of a step, W positions per row, V vocabulary.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict

import torch

from pagedexperts.engine.chunked_prefill import Segment
from pagedexperts.engine.forwards import StepForwards
from pagedexperts.engine.kv_rows import KVRows
from pagedexperts.engine.row_attention import (BatchPlan, ChunkPart, DecodeGroup, PackedPlan, RowAttention,
                                               chunk_mask, grid_mask)
from pagedexperts.generation.capture_checks import decode_waves
from pagedexperts.generation.graphs import DecodeGraphs

INPUTS = ("input_ids", "position_ids", "write_cols", "visible", "pad_col")  # the [B, W] int64 inputs of a step


def bucket_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 below ``max_rows``, then ``max_rows``."""
    return [b for b in (1, 2, 4, 8) if b < max_rows] + list(range(16, max_rows, 8)) + [max_rows]


class RowStep:
    """The static buffers of a decode step over KV rows [0, B) with W <= ``kv.scratch`` positions per
    row, and ``forward`` (-> ``logits`` [B, W, V])."""

    def __init__(self, rows: RowAttention, kv: KVRows, batch: int, width: int, pad_id: int) -> None:
        model = rows.model
        dev = model.device
        self.rows, self.kv, self.batch, self.width, self.pad_id = rows, kv, batch, width, pad_id
        self.generation = kv.generation
        cells = batch * width
        self._inputs = torch.zeros(len(INPUTS) * cells + 1, dtype=torch.int64, device=dev)  # + the padding count
        self._staging = torch.empty_like(self._inputs, device="cpu", pin_memory=True) if dev.type == "cuda" else None
        for i, name in enumerate(INPUTS):
            setattr(self, name, self._inputs[i * cells:(i + 1) * cells].view(batch, width))
        self.padding = self._inputs[-1]
        self.row_ids = torch.arange(batch, device=dev).view(batch, 1)
        self.logits: torch.Tensor | None = None
        self.backend, self.built_for, self.fallback = None, (), None
        self._logits_kw = {"logits_to_keep": 0} if "logits_to_keep" in inspect.signature(type(model).forward).parameters else {}

    def load(self, entries: list[tuple[int, list[int], int]]) -> None:
        """Load ``entries`` (row, tokens, cached length), the rest padding: one copy, asynchronous on
        CUDA."""
        b, w, scratch0 = self.batch, self.width, self.kv.width - self.kv.scratch
        grid = {name: [[v] * w for _ in range(b)] for name, v in (("input_ids", self.pad_id), ("position_ids", 0),
                                                                 ("visible", 0))}
        grid["write_cols"] = [[scratch0 + j for j in range(w)] for _ in range(b)]
        grid["pad_col"] = [list(row) for row in grid["write_cols"]]
        real = 0
        for row, tokens, length in entries:
            real += len(tokens)
            for j, token in enumerate(tokens):
                for name, value in (("input_ids", token), ("position_ids", length + j), ("write_cols", length + j),
                                    ("visible", length + j + 1), ("pad_col", -1)):
                    grid[name][row][j] = value
        host = torch.tensor([v for name in INPUTS for row in grid[name] for v in row] + [b * w - real], dtype=torch.int64)
        if self._staging is not None:
            self._staging.copy_(host)
            host = self._staging
        self._inputs.copy_(host, non_blocking=True)

    def forward(self) -> None:
        """The step over the static buffers (what a CUDA graph holds): ``logits``."""
        mask = grid_mask(self.visible, self.pad_col, self.kv.width, form=self.rows.form, dtype=self.rows.model.dtype)
        plan = BatchPlan(self.kv, self.write_cols, self.row_ids, mask)
        with self.rows.running(plan, padding=self.padding):
            out = self.rows.model(input_ids=self.input_ids, position_ids=self.position_ids, attention_mask=mask,
                                  use_cache=False, **self._logits_kw)
        self.logits = out.logits


class RowForwards(StepForwards):
    """The scheduler's forwards over KV rows. ``max_rows`` R = --max-running-requests; ``max_width``
    W_s; ``backend`` "cuda" or "eager"; ``strict``: a step that cannot be captured raises;
    ``reason``: why steps are not captured. ValueError: the model cannot attend over rows, or a bad
    backend / max_batch."""

    name = "rows"

    def __init__(self, model, *, max_rows: int, context_length: int, max_width: int = 1, backend: str = "eager",
                 max_batch: int | None = None, strict: bool = False, pad_id: int = 0, recorder=None,
                 reason: str | None = None) -> None:
        super().__init__()
        self.reason = reason
        self.rows = RowAttention.of(model)
        self.model, self.pad_id, self.recorder = model, pad_id, recorder
        self.kv = KVRows(rows=max_rows, scratch=max_width, limit=context_length)
        self.graphs = DecodeGraphs(model, backend=backend, max_batch=max_batch or max_rows, strict=strict)
        self.buckets = bucket_sizes(max_rows)
        self.mixes_decodes = backend != "cuda"
        self.steps: dict[tuple[int, int], RowStep] = {}
        params = inspect.signature(type(model).forward).parameters
        self._keep_kw = "logits_to_keep" in params

    # ---- KV rows ----

    def place(self, req) -> None:
        self.kv.place(req.request_id, len(req.prompt_ids) + req.sampling.max_new_tokens)

    def release(self, req) -> None:
        self.kv.release(req.request_id)

    # ---- eager forwards: prefill, chunked prefill ----

    def prefill(self, reqs: list) -> dict[int, torch.Tensor]:
        segments = [Segment(r, tuple(r.prompt_ids), "all" if r.sampling.prompt_logprobs else "last") for r in reqs]
        return self.packed(segments, 0)

    def packed(self, segments: list[Segment], decodes: int) -> dict[int, torch.Tensor]:
        dev = self.model.device
        tokens = [t for s in segments for t in s.token_ids]
        positions = [s.start + j for s in segments for j in range(len(s.token_ids))]
        rows = [self.kv.row_of[s.request.request_id] for s in segments for _ in s.token_ids]
        keep, kept = self._kept(segments)
        plan = PackedPlan(self.kv, torch.tensor(rows, device=dev), torch.tensor(positions, device=dev),
                          self._group(segments[:decodes]), self._chunks(segments, decodes))
        self._record([s.request.request_id for s in segments for _ in s.token_ids],
                     "prefill" if all(s.start == 0 for s in segments) else "decode")
        kw = {"logits_to_keep": torch.tensor(keep, device=dev)} if self._keep_kw else {}
        with self.rows.running(plan):
            out = self.model(input_ids=torch.tensor([tokens], device=dev), position_ids=torch.tensor([positions], device=dev),
                             use_cache=False, **kw)
        for s in segments:
            s.request.length += len(s.token_ids)
        self.counts.packed += decodes > 0
        logits = out.logits[0].to("cpu")
        if not self._keep_kw:
            logits = logits[keep]
        return {s.request.request_id: logits[r] for s, r in zip(segments, kept)}

    @staticmethod
    def _kept(segments: list[Segment]) -> tuple[list[int], list[slice]]:
        """(columns whose logits are kept, each segment's rows of them), as ``chunked_prefill.pack``."""
        keep, kept, offset = [], [], 0
        for s in segments:
            n = len(s.token_ids)
            cols = {"all": range(offset, offset + n), "last": range(offset + n - 1, offset + n), "none": range(0)}[s.keep]
            kept.append(slice(len(keep), len(keep) + len(cols)))
            keep += cols
            offset += n
        return keep or [offset - 1], kept

    def _group(self, decodes: list[Segment]) -> DecodeGroup | None:
        """The decodes of a packed step as one batch over rows [0, max row]."""
        if not decodes:
            return None
        rows = [self.kv.row_of[s.request.request_id] for s in decodes]
        b, w = max(rows) + 1, max(len(s.token_ids) for s in decodes)
        visible = torch.zeros((b, w), dtype=torch.int64)
        pad_col = torch.full((b, w), self.kv.width - 1, dtype=torch.int64)
        slots = []
        for s, row in zip(decodes, rows):
            n = len(s.token_ids)
            visible[row, :n] = torch.arange(s.start + 1, s.start + n + 1)
            pad_col[row, :n] = -1
            slots += range(row * w, row * w + n)
        dev = self.model.device
        mask = grid_mask(visible.to(dev), pad_col.to(dev), self.kv.width, form=self.rows.form, dtype=self.model.dtype)
        return DecodeGroup(b, w, torch.tensor(slots, device=dev), mask)

    def _chunks(self, segments: list[Segment], decodes: int) -> list[ChunkPart]:
        parts, offset = [], sum(len(s.token_ids) for s in segments[:decodes])
        for s in segments[decodes:]:
            n = len(s.token_ids)
            mask = chunk_mask(s.start, n, form=self.rows.form, dtype=self.model.dtype, device=self.model.device)
            parts.append(ChunkPart(offset, n, self.kv.row_of[s.request.request_id], s.start, mask))
            offset += n
        return parts

    # ---- the decode step: fixed shapes per (bucket, width) ----

    def decodes(self, reqs: list, tokens: list[list[int]]) -> torch.Tensor:
        rows = [self.kv.row_of[r.request_id] for r in reqs]
        width = max(len(t) for t in tokens)
        step = self._step(next(b for b in self.buckets if b > max(rows)), width)
        step.load([(row, t, r.length) for row, t, r in zip(rows, tokens, reqs)])
        ids = [-1] * (step.batch * width)
        for row, r, t in zip(rows, reqs, tokens):
            ids[row * width: row * width + len(t)] = [r.request_id] * len(t)
        self._record(ids, "decode")
        if width > 1:  # a verification step (--speculative): eager, never captured
            step.forward()
            logits = step.logits.clone()
            self.counts.static_eager += 1
        else:
            before = self.graphs.counters.captures, self.graphs.counters.replays, self.graphs.counters.invalidations
            logits = self.graphs.run(step)
            self._count_how(before)
        for r, t in zip(reqs, tokens):
            r.length += len(t)
        return logits[torch.tensor(rows, device=logits.device)].to("cpu")

    def _step(self, batch: int, width: int) -> RowStep:
        """The step of (batch, width), made anew when the rows were replaced since it was built."""
        step = self.steps.get((batch, width))
        if step is None or step.generation != self.kv.generation:
            if step is not None and step.backend is not None:
                self.counts.recaptured("kv_rows_grown")
            step = self.steps[(batch, width)] = RowStep(self.rows, self.kv, batch, width, self.pad_id)
        return step

    def _count_how(self, before: tuple[int, int, int]) -> None:
        c, cuda = self.graphs.counters, self.graphs.backend_name == "cuda"
        captured, replayed = c.captures - before[0], c.replays - before[1]
        self.counts.recaptured("runners_changed", c.invalidations - before[2])
        if cuda and captured:
            self.counts.capture += 1
        elif cuda and replayed:
            self.counts.replay += 1
        else:
            self.counts.static_eager += 1

    def _record(self, request_ids: list[int], phase: str) -> None:
        if self.recorder is not None:
            self.recorder.request_ids, self.recorder.phase = request_ids, phase

    def summary(self) -> dict:
        """/server_info's view: rows, columns, bytes, buckets and their waves, counts, backend,
        fallbacks."""
        g = self.graphs
        graphs = dict(backend=g.backend_name, reason=self.reason, max_batch=g.max_batch, **asdict(g.counters),
                      built=sorted(f"{b}x{w}" for (b, w), s in self.steps.items() if s.backend is not None),
                      fallbacks=sorted({s.fallback for s in self.steps.values() if s.fallback}))
        return dict(super().summary(), rows=self.kv.rows, columns=self.kv.width, kv_bytes=self.kv.nbytes(),
                    buckets=self.buckets, bucket_waves={b: decode_waves(self.model, b) for b in self.buckets},
                    steps=graphs)
