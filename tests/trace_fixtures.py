"""Shared pieces of the tests that replay the real routing traces (../shared/data/traces).

``real_trace_steps`` loads each recorded trace and splits it into steps three ways: as logged
(``simulate.recorded_steps``), and replayed as B = 1 and B = 8 request streams
(``simulate.batched_steps`` over ``simulate.request_streams``). Imported by
``test_device_decide`` and ``test_planner_equivalence``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces"


def real_trace_steps(*, recorded: int | None = None, batch1: int | None = None, batch8: int | None = None):
    """Yield (trace path, trace, label, steps) per real trace and split, label in "recorded",
    "B=1", "B=8"; each split's step list cut to its first ``recorded`` / ``batch1`` / ``batch8``
    steps (None: all). Skips the calling test when the traces are absent."""
    from pagedexperts.analysis import simulate as sim
    from pagedexperts.analysis.trace import load_trace

    if not TRACES.is_dir():
        pytest.skip(f"real traces not found at {TRACES} (../shared/data/traces)")
    for path in sorted(TRACES.glob("*.jsonl")):
        tr = load_trace(path)
        streams = sim.request_streams(tr, min_streams=8)
        for label, steps, cap in [("recorded", sim.recorded_steps(tr), recorded),
                                  ("B=1", sim.batched_steps(streams, batch_size=1), batch1),
                                  ("B=8", sim.batched_steps(streams, batch_size=8), batch8)]:
            yield path, tr, label, steps[:cap]
