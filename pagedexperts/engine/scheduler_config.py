"""The scheduler's data: its limits (``SchedulerConfig``), its counters (``SchedulerStats``), and
the two refusals of ``BatchScheduler.submit`` (``QueueFull``, ``SchedulerStopped``).

Plain dataclasses and exceptions: what the scheduler's callers (the server's handlers, the
speculative ``generate``, the benches) configure, read and catch. Does not: schedule
(``scheduler``).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_PREFILL_TOKENS = 2048  # prompt tokens per step (vLLM's chunked-prefill budget for online serving)


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits.

    ``max_running_requests``: decode batch cap. ``context_length``: longest prompt +
    completion in tokens. ``max_queued_requests``: how many sequences may wait beyond the free
    running places; one more and ``submit`` raises ``QueueFull`` (None = unbounded). ``chunked_prefill``: prompt chunks share the
    decode forward; ``max_prefill_tokens`` is then the prompt tokens of one step. Without
    it, ``max_prefill_tokens`` is the padded tokens (B x P_max) of one prefill forward; a
    prompt longer than that is prefilled alone, so 1 means one prompt per forward.

    ``static_kv``: the running requests' KV held in place in KV rows, decode steps of fixed
    shapes per batch bucket (``engine.row_forwards``); False: per-request buffers rebuilt into a
    batch cache every step (``engine.forwards.DynamicForwards``, the layout before; benchmarks).
    ``cuda_graphs``: how those decode steps run, "cuda" (captured once per bucket, then
    replayed; verification steps of --speculative stay eager) or "eager" (the same steps op by
    op); ``strict_cuda_graphs``: a step that cannot be captured raises (--cuda-graphs) instead
    of running eagerly with a WARNING; ``cuda_graph_max_batch``: the largest bucket captured
    (None: every bucket); ``cuda_graphs_reason``: why they are not captured (shown, not acted
    on). ``graph_options`` reads the last four from a loaded model.
    """

    max_running_requests: int
    context_length: int
    max_queued_requests: int | None = None
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    chunked_prefill: bool = True
    static_kv: bool = True
    cuda_graphs: str = "eager"
    strict_cuda_graphs: bool = False
    cuda_graph_max_batch: int | None = None
    cuda_graphs_reason: str | None = None  # why decode steps are not captured (/server_info, /metrics)


def graph_options(runtime) -> dict:
    """``SchedulerConfig``'s graph fields from a model's runtime (``model.pagedexperts``, its
    ``--cuda-graphs`` resolved in ``PagingRuntime.resolved``): "cuda" captures,
    anything else ("eager", "off": CPU, --no-cuda-graphs, auto's fallback) runs the same static
    steps eagerly; strict where the user asked --cuda-graphs."""
    cfg, resolved = runtime.config, runtime.resolved
    return dict(cuda_graphs="cuda" if resolved.cuda_graphs == "cuda" else "eager",
                strict_cuda_graphs=cfg.cuda_graphs == "on", cuda_graph_max_batch=cfg.cuda_graph_max_batch,
                cuda_graphs_reason=resolved.reasons["cuda_graphs"] if resolved.cuda_graphs == "off" else None)


class QueueFull(Exception):
    """``submit`` would exceed ``max_queued_requests``; nothing was queued."""


class SchedulerStopped(Exception):
    """``submit`` after ``stop``: nothing would ever step the request; nothing was queued."""


@dataclass
class SchedulerStats:
    """Counters of the scheduler's own work (not paging): forwards, rows and prompts per forward."""

    prefill_steps: int = 0  # forwards that prefill prompts (or prompt chunks)
    prefill_rows: int = 0  # prompts (or prompt chunks) prefilled, summed over those forwards
    prefill_tokens: int = 0  # prompt tokens prefilled
    mixed_steps: int = 0  # forwards that carried prompt chunks and decodes together
    max_prefill_batch: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # sum of batch sizes over decode steps
    max_decode_batch: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    aborted: int = 0

    def count_prefill(self, rows: int, tokens: int) -> None:
        """One forward that prefilled ``rows`` prompts (or chunks) of ``tokens`` prompt tokens."""
        self.prefill_steps += 1
        self.prefill_rows += rows
        self.prefill_tokens += tokens
        self.max_prefill_batch = max(self.max_prefill_batch, rows)

    def count_decode(self, batch: int) -> None:
        """One forward that decoded ``batch`` requests."""
        self.decode_steps += 1
        self.decode_rows += batch
        self.max_decode_batch = max(self.max_decode_batch, batch)
