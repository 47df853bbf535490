"""The scheduler's limits (``SchedulerConfig``), counters (``SchedulerStats``) and ``submit``'s
refusals.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_PREFILL_TOKENS = 2048  # prompt tokens per step (vLLM's chunked-prefill budget for online serving)


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits. ``max_queued_requests``: sequences waiting beyond the free running places
    (None: unbounded); ``max_prefill_tokens``: prompt tokens per step with ``chunked_prefill``, else
    padded tokens (B x P_max) per prefill forward; ``static_kv``: KV rows, else
    ``engine.forwards.DynamicForwards``; the graph fields: ``graph_options``."""

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
    """The graph fields from the model's resolved ``--cuda-graphs``: "cuda" captures, anything else
    runs eagerly; strict if --cuda-graphs was asked."""
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
