"""Shared pieces of the tests that replay real routing traces of public models (OLMoE, Qwen1.5-MoE
on GSM8K; JSON lines): not the project's to ship, so they are read from the directory
``$PAGEDEXPERTS_REAL_TRACES`` names (``.ci/run`` sets it where the machine has them) and the
tests skip without it.

``real_trace_steps`` loads each recorded trace and splits it into steps three ways: as logged
(``simulate.recorded_steps``), and replayed as B = 1 and B = 8 request streams
(``simulate.batched_steps`` over ``simulate.request_streams``). Imported by
``test_device_decide`` and ``test_planner_equivalence``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REAL_TRACES_ENV = "PAGEDEXPERTS_REAL_TRACES"
TRACES = Path(os.environ.get(REAL_TRACES_ENV) or "/nonexistent")  # no default: the data is not the project's
needs_real_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"real traces: set {REAL_TRACES_ENV} to their directory")


def real_trace_steps(*, recorded: int | None = None, batch1: int | None = None, batch8: int | None = None):
    """Yield (trace path, trace, label, steps) per real trace and split, label in "recorded",
    "B=1", "B=8"; each split's step list cut to its first ``recorded`` / ``batch1`` / ``batch8``
    steps (None: all). Skips the calling test when the traces are absent."""
    from pagedexperts.analysis import simulate as sim
    from pagedexperts.analysis.trace import load_trace

    if not TRACES.is_dir():
        pytest.skip(f"real traces: set {REAL_TRACES_ENV} to their directory")
    for path in sorted(TRACES.glob("*.jsonl")):
        tr = load_trace(path)
        streams = sim.request_streams(tr, min_streams=8)
        for label, steps, cap in [("recorded", sim.recorded_steps(tr), recorded),
                                  ("B=1", sim.batched_steps(streams, batch_size=1), batch1),
                                  ("B=8", sim.batched_steps(streams, batch_size=8), batch8)]:
            yield path, tr, label, steps[:cap]
