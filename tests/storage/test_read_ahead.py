"""Read-ahead of the disk tier, driven step by step with controlled routing, counted exactly.

One synthetic MoE layer (E = 16 experts of two float32 tensors, each expert's values its own,
stacked in one safetensors file), R = 4 host rows under LRU, 2 staging rows, K = 2 slots. A
"step" does what the runtime does to a layer (``paging.prefetch``, ``storage.host_tier``): the
read-ahead of the experts predicted for it (``TieredExpertStore.read_ahead``), then the
page-ins of the experts its router picked (``copy_to_slots``). Expert ids come from one cycle
over the E experts, so an expert is in no host row when it comes round again (R < E / 2), and
whether a step's read-ahead is used is chosen by the test: "used" demands the predicted expert,
"unused" demands the next one.

What the README ("Experts larger than host memory: the disk tier") promises, asserted as
counts: a layer that used under half (READ_AHEAD_MIN_USED) of its last READ_AHEAD_WINDOW
read-aheads skips read-ahead for READ_AHEAD_PAUSE steps, then tries again, and keeps reading
ahead while the reads pay (each window judged on its own); no read-ahead reads an expert held
in a host row or already read ahead; every expert read is one disk read of its bytes, counted
once, whether on demand or ahead.

Legend: E experts, R host rows, K slots.
"""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from pagedexperts.formats.base import TensorSpec
from pagedexperts.paging.steps.contract import PackedSlots
from pagedexperts.paging.prefetch import NextLayerPrefetcher
from pagedexperts.residency.planner import Load
from pagedexperts.stats.accounting import PrefetchStats
from pagedexperts.storage import host_tier
from pagedexperts.storage.host_tier import ReadAhead, TieredExpertStore
from pagedexperts.storage.safetensors_index import expert_extents, read_header

E, R, K, STAGING = 16, 4, 2, 2
SHAPES = {"gate_up_proj": (6, 4), "down_proj": (4, 3)}
EXPERT_BYTES = sum(a * b for a, b in SHAPES.values()) * 4  # float32
WINDOW, PAUSE = host_tier.READ_AHEAD_WINDOW, host_tier.READ_AHEAD_PAUSE


def expert_rows(expert: int) -> dict[str, torch.Tensor]:
    """Expert ``expert``'s tensors: values 100 x expert + position (each expert distinct)."""
    return {name: 100.0 * expert + torch.arange(a * b, dtype=torch.float32).view(a, b)
            for name, (a, b) in SHAPES.items()}


@pytest.fixture
def layer(tmp_path):
    """A fresh synthetic layer over its own checkpoint file: (store, slots); pools shut down after."""
    path = tmp_path / "experts.safetensors"
    save_file({name: torch.stack([expert_rows(e)[name] for e in range(E)]) for name in SHAPES}, str(path))
    header = read_header(path)
    specs = [TensorSpec(name, shape, torch.float32) for name, shape in SHAPES.items()]
    extents = {spec.name: [[ext] for _, ext in expert_extents(header[spec.name], spec=spec, expert=None, num_experts=E,
                                                             src_index=0, n_src=1, key=spec.name)]
               for spec in specs}
    read_ahead = ReadAhead(specs, num_buffers=STAGING)
    store = TieredExpertStore(specs, E, R, policy="lru", pin=False, layer=3, read_ahead=read_ahead)
    assert store.fill_from(extents) == []
    yield store, PackedSlots({s.name: torch.zeros((K, *s.shape)) for s in specs})
    read_ahead.pool.shutdown(wait=True)
    read_ahead.extent_pool.shutdown(wait=True)


def settle(store) -> None:
    """Wait for the read-aheads in flight (a step's compute gives them time; here, exactly all)."""
    for future, _ in list(store._ahead.values()):
        future.result()


def step(store, slots, predicted: list[int], demanded: list[int]) -> int:
    """One layer step: read ahead ``predicted``, then page ``demanded`` into the slots (their
    contents checked against the checkpoint). Returns the read-aheads started."""
    started = store.read_ahead(predicted)
    settle(store)
    page_in(store, slots, demanded)
    return started


def page_in(store, slots, demanded: list[int]) -> None:
    """Page ``demanded`` into slots 0, 1, ... and check their contents against the checkpoint."""
    store.copy_to_slots([Load(e, s) for s, e in enumerate(demanded)], slots)
    for s, e in enumerate(demanded):
        for name, want in expert_rows(e).items():
            assert torch.equal(slots[name][s], want), (e, name)


class Routing:
    """Steps over one cycle of the E experts: ``used`` demands the predicted expert, ``unused``
    a different one (the predicted one is never demanded)."""

    def __init__(self, store, slots):
        self.store, self.slots, self.experts = store, slots, itertools.cycle(range(E))

    def run(self, steps: int, *, used: bool) -> list[int]:
        """The read-aheads started at each of ``steps`` steps."""
        out = []
        for _ in range(steps):
            predicted = next(self.experts)
            demanded = predicted if used else next(self.experts)
            out.append(step(self.store, self.slots, [predicted], [demanded]))
        return out


def counts(store) -> tuple:
    t = store.tier_stats
    return (t.read_ahead_issued, t.read_ahead_used, t.read_ahead_paused, t.disk_reads, t.disk_bytes_read,
            t.host_hits, t.host_misses)


def test_a_pause_lifts_and_read_ahead_resumes_once_the_reads_pay(layer, caplog):
    """A window of unused read-aheads pauses the layer for exactly PAUSE steps; the next step
    reads ahead again and, its reads used, the layer keeps reading ahead at every step. Two
    more unused windows: two more pauses (the pause re-arms; one WARNING in all). Then used
    read-aheads resume for good: each window is judged alone (over the whole run, under half
    of the read-aheads were used when the last phase starts)."""
    store, slots = layer
    routing = Routing(store, slots)
    phases = [("unused", WINDOW, 1), ("pause", PAUSE, 0), ("used", WINDOW, 1),
              ("unused", WINDOW, 1), ("pause", PAUSE, 0), ("unused", WINDOW, 1), ("pause", PAUSE, 0),
              ("used", 3 * WINDOW, 1)]
    with caplog.at_level(logging.WARNING, logger=host_tier.__name__):
        for i, (what, steps, started) in enumerate(phases):
            got = routing.run(steps, used=what == "used")
            assert got == [started] * steps, f"phase {i} ({what}): read-aheads started {got}"
            pauses = sum(1 for w, _, _ in phases[: i + 1] if w == "pause")
            assert store.tier_stats.read_ahead_paused == pauses * PAUSE, f"phase {i} ({what})"
    on_demand = 3 * (WINDOW + PAUSE)  # unused and paused steps: one disk read each, on demand
    issued, used = 7 * WINDOW, 4 * WINDOW
    assert counts(store) == (issued, used, 3 * PAUSE, issued + on_demand, (issued + on_demand) * EXPERT_BYTES,
                             0, on_demand + used)
    warned = [r for r in caplog.records if "read-ahead paused" in r.getMessage()]
    assert len(warned) == 1 and "layer 3" in warned[0].getMessage()


@pytest.mark.parametrize("used", [WINDOW // 2 - 1, WINDOW // 2, WINDOW - 1])
def test_a_window_pauses_exactly_when_under_half_was_used(layer, used):
    """The first ``used`` read-aheads of a window are used, the rest not (the window is judged
    when its last read-ahead starts, before that one can be used): under half pauses for PAUSE
    steps, half or more does not."""
    store, slots = layer
    routing = Routing(store, slots)
    routing.run(used, used=True)
    routing.run(WINDOW - used, used=False)
    pauses = used < WINDOW // 2
    after = routing.run(PAUSE + 1, used=True)
    assert after == ([0] * PAUSE + [1] if pauses else [1] * (PAUSE + 1))
    t = store.tier_stats
    assert (t.read_ahead_paused, t.read_ahead_issued) == ((PAUSE, WINDOW + 1) if pauses else (0, WINDOW + PAUSE + 1))


def test_read_ahead_reads_no_expert_held_in_a_host_row_or_already_read_ahead(layer):
    """Exact reads: a held expert is never read ahead, nor one read ahead already; a taken
    read-ahead is a held row (hit next time, no read); an expert evicted from the host rows is
    read ahead again."""
    store, slots = layer
    for e in range(R):  # experts 0..3 in the R host rows, read on demand
        page_in(store, slots, [e])
    assert counts(store) == (0, 0, 0, R, R * EXPERT_BYTES, 0, R)
    assert store.read_ahead(list(range(R))) == 0
    assert store.read_ahead([2, 9, 3]) == 1  # 9 only
    settle(store)
    assert store.read_ahead([9, 1]) == 0  # 9 staged already (a staging row is free), 1 held
    assert store.read_ahead([9, 10]) == 1  # 10
    settle(store)
    assert counts(store) == (2, 0, 0, R + 2, (R + 2) * EXPERT_BYTES, 0, R)
    assert step(store, slots, [9, 10], [9]) == 0  # 9 taken from staging: a host miss, no disk read; evicts 0
    assert counts(store) == (2, 1, 0, R + 2, (R + 2) * EXPERT_BYTES, 0, R + 1)
    assert step(store, slots, [9], [9, 1]) == 0  # both in host rows: hits (unused 10 dropped)
    assert counts(store) == (2, 1, 0, R + 2, (R + 2) * EXPERT_BYTES, 2, R + 1)
    assert store.read_ahead([0, 9]) == 1  # 0 was evicted from the host rows: read ahead again
    settle(store)
    assert counts(store) == (3, 1, 0, R + 3, (R + 3) * EXPERT_BYTES, 2, R + 1)


def test_the_prediction_reads_ahead_only_what_neither_the_slots_nor_the_host_rows_hold(layer):
    """``NextLayerPrefetcher`` without page-in (the disk tier's default): of the predicted experts,
    those resident in the next layer's slots are not read ahead (the store's own rule keeps out
    those in host rows); the rest are, most-routed first, into the free staging rows."""
    store, slots = layer
    page_in(store, slots, [0, 1])  # 0 and 1 in host rows
    device_resident = {5}
    target = SimpleNamespace(store=store, is_resident=lambda e: e in device_resident, layer=3,
                             prefetch_stats=PrefetchStats())
    prefetcher = NextLayerPrefetcher(gate=None, target=target, budget=K, page_in=False)
    prefetcher.take_prediction(torch.tensor([[5, 7], [0, 6], [7, 5], [1, 7]]))  # by count: 7, 5, 0, 1, 6
    settle(store)
    assert counts(store) == (2, 0, 0, 4, 4 * EXPERT_BYTES, 0, 2)  # 7 and 6 read ahead
    before = {name: t.clone() for name, t in slots.items()}
    prefetcher.issue()  # read-ahead only: nothing paged into the slots
    assert all(torch.equal(slots[name], t) for name, t in before.items())
    page_in(store, slots, [7, 6])  # the next layer's step
    assert counts(store) == (2, 2, 0, 4, 4 * EXPERT_BYTES, 0, 4)  # both taken from staging
    page_in(store, slots, [5])
    assert counts(store) == (2, 2, 0, 5, 5 * EXPERT_BYTES, 0, 5)  # 5 was not read ahead: read on demand


def test_used_and_wasted_read_aheads_are_counted_with_their_bytes(layer):
    """3 steps whose prediction is not demanded (each dropped, wasted, at the next read-ahead),
    then 3 whose prediction is: by hand, 3 wasted and 3 used, each EXPERT_BYTES."""
    store, slots = layer
    routing = Routing(store, slots)
    routing.run(3, used=False)
    routing.run(3, used=True)
    t = store.tier_stats
    assert (t.read_ahead_issued, t.read_ahead_used, t.read_ahead_wasted) == (6, 3, 3)
    assert (t.read_ahead_bytes_used, t.read_ahead_bytes_wasted) == (3 * EXPERT_BYTES, 3 * EXPERT_BYTES)
    assert t.disk_reads == t.host_misses + t.read_ahead_wasted  # nothing left held: all used or dropped


def test_the_read_aheads_held_are_a_level_issued_less_used_and_wasted(layer):
    """3 steps whose prediction is not demanded: each read-ahead is dropped at the next, the last is
    still held (1); then 2 whose prediction is demanded: the held one is dropped, the new ones
    taken, none held."""
    store, slots = layer
    routing = Routing(store, slots)
    routing.run(3, used=False)
    t = store.tier_stats
    assert t.read_ahead_held == 1 == t.read_ahead_issued - t.read_ahead_used - t.read_ahead_wasted
    routing.run(2, used=True)
    assert (t.read_ahead_held, t.read_ahead_issued, t.read_ahead_used, t.read_ahead_wasted) == (0, 5, 2, 3)
    assert t.as_dict()["read_ahead_held"] == 0


def test_after_the_counters_are_zeroed_held_read_aheads_count_as_issued_and_windows_are_judged(layer):
    """The runtime's reset_stats zeroes a tier's counters over read-aheads still held
    (``TierStats.carried``): issued = used + wasted + held still holds, and the next window of
    unused read-aheads pauses the layer as before (the window starts again with the counters)."""
    from pagedexperts.stats.tiers import TierStats

    store, slots = layer
    routing = Routing(store, slots)
    routing.run(3 * WINDOW + 3, used=True)
    routing.run(1, used=False)  # one read-ahead left held
    store.tier_stats = TierStats.carried(store.tier_stats.read_ahead_held)  # as the runtime's reset_stats
    routing.run(2, used=False)
    t = store.tier_stats
    assert t.read_ahead_issued == t.read_ahead_used + t.read_ahead_wasted + t.read_ahead_held == 3
    assert routing.run(WINDOW - 3 + 1, used=False) == [1] * (WINDOW - 3) + [0]  # judged at WINDOW issued
