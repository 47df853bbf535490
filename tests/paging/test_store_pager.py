"""Host store and per-layer pager on a tiny synthetic experts layer (CPU).

The oracle is the experts module's own unpaged computation with the same implementation.
After every step, each occupied slot holds exactly the host rows of the expert the residency
says it holds (every per-expert tensor, including extra ones such as a per-expert scale), and
the counters match a hand count of a scripted routing sequence.

Legend: T tokens, H hidden, k top_k, E experts, K slots, I expert intermediate.
"""

from __future__ import annotations

import copy

import pytest
import torch

from support.tiny import assert_same
from pagedexperts.models.sites import per_expert_specs
from pagedexperts.paging.host_executor import HostExecutor
from pagedexperts.paging.steps.table import INNER_IMPLEMENTATIONS, PACKED, STEP_BODIES, resolve_inner
from pagedexperts.residency.eviction import EMPTY
from pagedexperts.formats.base import TensorSpec
from pagedexperts.paging.steps.contract import PackedSlots
from pagedexperts.storage.host_store import HostExpertStore
from support.synthetic_layer import E, H, I, SCRIPT, TOP_K, paged, step_inputs, synthetic_experts, unpaged

DTYPES = [torch.float32, torch.bfloat16]

def inner_dtype_cases():
    """(inner, dtype) pairs over every inner implementation with a host step that computes dense
    experts (this file pages a dense synthetic layer through the host executor; fused runs on the
    device path only: tests/paging/kernels/test_fused_paged.py; packed computes int4 / int8
    experts: tests/paging/test_packed_cpu_exact.py) and dtype."""
    return [
        pytest.param(inner, dtype, id=f"{inner}-{str(dtype).removeprefix('torch.')}")
        for inner in INNER_IMPLEMENTATIONS if STEP_BODIES[inner].host is not None and inner != PACKED
        for dtype in DTYPES
    ]


def test_packed_over_a_table_its_kernels_cannot_read_is_refused():
    """An executor told to run ``packed`` over dense experts (``loading.runners`` gives such a
    layer grouped_mm, with a WARNING) refuses at once, naming the reason and the flag."""
    with pytest.raises(ValueError, match="--experts-implementation packed: dense experts.*grouped_mm"):
        paged(synthetic_experts(torch.float32), num_slots=3, inner="packed")


def assert_slots_hold_host_rows(pager: HostExecutor) -> None:
    for slot, expert in enumerate(pager.residency.expert_of_slot):
        if expert == EMPTY:
            continue
        for name, host in pager.store.tensors.items():
            assert_same(pager.slots[name][slot], host[expert], f"slot {slot} tensor {name!r} vs expert {expert}")


@pytest.mark.parametrize("inner,dtype", inner_dtype_cases())
def test_scripted_sequence_slots_counters_and_output(inner, dtype):
    module = synthetic_experts(dtype)
    pager = paged(module, num_slots=3, inner=inner)
    expert_bytes = (2 * I * H + H * I) * torch.empty((), dtype=dtype).element_size()
    assert pager.store.expert_bytes == expert_bytes
    for n, (routing, (hits, misses, waves), resident) in enumerate(SCRIPT):
        before = pager.stats.hits, pager.stats.misses, pager.stats.waves
        hidden, ids, weights = step_inputs(routing, dtype, seed=n)
        out = pager.step(module, hidden, ids, weights)
        assert_same(out, unpaged(module, inner, hidden, ids, weights), f"step {n + 1} output")
        after = pager.stats.hits, pager.stats.misses, pager.stats.waves
        assert tuple(a - b for a, b in zip(after, before)) == (hits, misses, waves), f"step {n + 1}"
        assert pager.residency.resident() == resident, f"step {n + 1} slot map"
        assert_slots_hold_host_rows(pager)
    s = pager.stats
    assert (s.steps, s.tokens, s.hits, s.misses, s.page_ins) == (5, 9, 5, 8, 8)
    assert s.bytes_paged == 8 * expert_bytes
    assert (s.waves, s.multi_wave_steps) == (6, 1)
    assert (s.union_last, s.union_max, s.union_sum) == (2, 4, 13)
    assert s.hit_rate == 5 / 13 and s.misses_per_token == 8 / 9
    assert s.page_in_s >= 0 and s.plan_s >= 0 and s.sync_s >= 0


def has_single_entry_wave(pager: HostExecutor, ids: torch.Tensor) -> bool:
    """Whether the next step over ``ids`` [T, k] plans a wave that holds exactly one entry."""
    plan = copy.deepcopy(pager.residency).plan(ids.unique().tolist())
    return any(int(torch.isin(ids, torch.tensor(w.experts)).sum()) == 1 for w in plan.waves)


@pytest.mark.parametrize("inner,dtype", inner_dtype_cases())
@pytest.mark.parametrize("num_slots", [TOP_K, 3, E // 2, E])
def test_random_routing_is_exact_and_slots_match(num_slots, inner, dtype):
    """Random routing, T in {1, 2, 5, 9, 16}; K <= 3 makes multi-wave steps."""
    module = synthetic_experts(dtype, seed=num_slots)
    pager = paged(module, num_slots=num_slots, inner=inner)
    gen = torch.Generator().manual_seed(num_slots)
    for n, tokens in enumerate([1, 5, 16, 2, 9]):
        routing = [torch.randperm(E, generator=gen)[:TOP_K].tolist() for _ in range(tokens)]
        hidden, ids, weights = step_inputs(routing, dtype, seed=100 + n)
        out = pager.step(module, hidden, ids, weights)
        assert_same(out, unpaged(module, inner, hidden, ids, weights), f"step {n} ({tokens} tokens)")
        assert_slots_hold_host_rows(pager)
    for tensor in pager.slots.values():
        assert tensor.shape[0] == num_slots
    if num_slots <= 3:
        assert pager.stats.multi_wave_steps > 0


@pytest.mark.parametrize("inner,dtype", inner_dtype_cases())
def test_wave_with_a_single_entry_is_exact(inner, dtype):
    """K = k = 2, tokens [0, 1] and [2, 0]: waves [0, 1] then [2], whose only entry is (1, 0)."""
    module = synthetic_experts(dtype)
    pager = paged(module, num_slots=TOP_K, inner=inner)
    hidden, ids, weights = step_inputs([[0, 1], [2, 0]], dtype, seed=0)
    assert has_single_entry_wave(pager, ids)
    out = pager.step(module, hidden, ids, weights)
    assert (pager.stats.waves, pager.stats.misses) == (2, 3)
    assert_same(out, unpaged(module, inner, hidden, ids, weights), "output")


def test_all_resident_pages_each_expert_once():
    module = synthetic_experts()
    pager = paged(module, num_slots=E)
    warm = [[e, (e + 1) % E] for e in range(E)]
    pager.step(module, *step_inputs(warm, torch.float32, seed=0))
    assert pager.stats.misses == E
    gen = torch.Generator().manual_seed(1)
    for n in range(5):
        routing = [torch.randperm(E, generator=gen)[:TOP_K].tolist() for _ in range(7)]
        pager.step(module, *step_inputs(routing, torch.float32, seed=n))
    assert pager.stats.misses == E and pager.stats.page_ins == E
    assert pager.stats.waves == pager.stats.steps == 6


def test_extra_per_expert_buffer_is_discovered_and_paged():
    """Every tensor with leading dim E is per-expert: a per-expert buffer goes to the store too."""
    module = synthetic_experts(scale_buffer=True)
    specs = {s.name: s for s in per_expert_specs(module, "experts")}
    assert set(specs) == {"gate_up_proj", "down_proj", "scale"}
    assert specs["scale"] == TensorSpec("scale", (4,), torch.float32)
    pager = paged(module, num_slots=3)
    assert pager.store.expert_bytes == (2 * I * H + H * I + 4) * 4
    for n, (routing, _, _) in enumerate(SCRIPT):
        hidden, ids, weights = step_inputs(routing, torch.float32, seed=n)
        assert_same(pager.step(module, hidden, ids, weights), unpaged(module, "grouped_mm", hidden, ids, weights))
        assert_slots_hold_host_rows(pager)
        for slot, expert in enumerate(pager.residency.expert_of_slot):
            if expert != EMPTY:
                assert_same(pager.slots["scale"][slot], module.scale[expert])


def test_tensor_without_leading_e_is_refused():
    module = synthetic_experts()
    module.register_buffer("table", torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"'table' of shape \(3, 4\) has no leading dim E=8"):
        per_expert_specs(module, "model.layers.0.mlp.experts")


def test_store_allocates_one_tensor_per_spec_at_exact_size():
    specs = [TensorSpec("a", (4, 3), torch.float32), TensorSpec("b", (5,), torch.bfloat16)]
    store = HostExpertStore(specs, 6, pin=False)
    assert {n: (tuple(t.shape), t.dtype) for n, t in store.tensors.items()} == {
        "a": ((6, 4, 3), torch.float32),
        "b": ((6, 5), torch.bfloat16),
    }
    assert store.expert_bytes == 4 * 3 * 4 + 5 * 2
    assert store.host_bytes == 6 * store.expert_bytes
    assert store.fallback is None and not store.pinned


def test_store_write_row_and_copy_to_slot():
    specs = [TensorSpec("w", (2, 3), torch.float32)]
    store = HostExpertStore(specs, 4, pin=False)
    store.write_row("w", 2, torch.arange(6.0).view(2, 3))
    store.write_row("w", 3, torch.ones(1, 3), rows=slice(1, 2))
    slots = PackedSlots({"w": torch.zeros(2, 2, 3)})
    store.copy_to_slot(2, 1, slots)
    assert_same(slots["w"][1], torch.arange(6.0).view(2, 3))
    assert_same(slots["w"][0], torch.zeros(2, 3))
    assert_same(store.tensors["w"][3][1], torch.ones(3))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda s: s.write_row("nope", 0, torch.zeros(2, 3)), r"no per-expert tensor 'nope'; have \['w'\]"),
        (lambda s: s.write_row("w", 4, torch.zeros(2, 3)), r"expert 4 outside \[0, E=4\)"),
        (lambda s: s.write_row("w", 0, torch.zeros(3, 2)), r"checkpoint shape \(3, 2\) does not match .*\(2, 3\)"),
    ],
)
def test_store_write_row_errors(call, match):
    store = HostExpertStore([TensorSpec("w", (2, 3), torch.float32)], 4, pin=False)
    with pytest.raises(ValueError, match=match):
        call(store)


def test_unknown_inner_implementation_lists_choices():
    with pytest.raises(ValueError, match=r"'sonic'.*grouped_mm.*--experts-implementation"):
        resolve_inner(synthetic_experts(), "sonic")
