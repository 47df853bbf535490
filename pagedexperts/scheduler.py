"""Continuous batching for the server; now ``pagedexperts.serving.scheduler`` (kept for old imports)."""

from pagedexperts.serving.sampling import stop_cut as _stop_cut  # noqa: F401
from pagedexperts.serving.batching import decode_mask  # noqa: F401
from pagedexperts.serving.scheduler import (  # noqa: F401
    BatchScheduler, Event, QueueFull, Request, SchedulerConfig, SchedulerStats)
