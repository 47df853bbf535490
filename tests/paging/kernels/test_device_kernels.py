"""The device-planned step's kernels against their torch references and hand counts (CPU).

The torch backends (``*_torch``) are checked against hand-computed writes and run
without triton; the Triton kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (set here
before the kernel modules are imported: Triton reads it when a kernel is defined) with tiny
shapes, and must write exactly what the references write: every plan buffer and every state
tensor (decide), every slot byte (page-in, for every dtype a format stores: float, bf16, FP8,
int32 packed words, odd-sized uint8 rows), every entry (remap).
"""

from __future__ import annotations

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pagedexperts.paging.kernels import HAVE_TRITON, check_backend  # noqa: E402
from pagedexperts.paging.kernels.decide import (  # noqa: E402
    DecidePlan, DecideRule, decide_torch, remap_torch,
)
from pagedexperts.paging.kernels.decide import DecideState, num_waves_for  # noqa: E402
from pagedexperts.paging.kernels.page_in import page_in_torch  # noqa: E402

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (pip install 'pagedexperts[gpu]')")
PLAN_FIELDS = ("src", "dst", "count", "expert_slot", "expert_wave", "step")
STATE_FIELDS = ("slot_of_expert", "expert_of_slot", "last_use", "count", "scalars")


def store_and_slots(num_experts: int, num_slots: int):
    """{name: [E, ...]} rows of every dtype a format stores, and zeroed [K, ...] slots."""
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (num_experts, 1000), generator=gen, dtype=torch.uint8)
    store = {
        "w_f32": torch.randn(num_experts, 3, 5, generator=gen),
        "w_bf16": torch.randn(num_experts, 7, generator=gen).to(torch.bfloat16),
        "w_fp8": torch.randn(num_experts, 4, 4, generator=gen).to(torch.float8_e4m3fn),
        "qweight_i32": torch.randint(-2**31, 2**31 - 1, (num_experts, 2, 3), generator=gen, dtype=torch.int32),
        "zeros_u8_odd": raw[:, :3].contiguous(),  # 3 bytes a row: copied as bytes, not words
        "scales_big": raw.view(torch.int32).float(),  # 250 words: several chunks if BLOCK is small
    }
    slots = {name: torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype) for name, t in store.items()}
    return store, slots


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def test_page_in_torch_copies_exactly_count_rows():
    store, slots = store_and_slots(6, 4)
    src, dst, count = torch.tensor([5, 2, -1, -1]), torch.tensor([3, 0, 1, 2]), torch.tensor(2)
    page_in_torch(store, slots, src, dst, count)
    for name in store:
        got, want = as_bytes(slots[name]), as_bytes(store[name])
        assert torch.equal(got[3], want[5]) and torch.equal(got[0], want[2]), name
        assert not got[1].any() and not got[2].any(), f"{name}: rows past count must stay as they were"


def test_remap_torch_gathers_slot_and_wave():
    ids = torch.tensor([[3, 1], [1, 0]])
    expert_slot, expert_wave = torch.tensor([2, 0, -1, 1]), torch.tensor([1, 0, -1, 0])
    slot, wave = torch.empty(4, dtype=torch.long), torch.empty(4, dtype=torch.long)
    remap_torch(ids, expert_slot, expert_wave, slot, wave)
    assert slot.tolist() == [1, 0, 0, 2] and wave.tolist() == [0, 0, 0, 1]


def test_backend_errors_name_the_fix():
    with pytest.raises(ValueError, match="choose one of"):
        check_backend("cuda-c", "cpu")
    assert check_backend("torch", "cpu") == "torch"


@needs_triton
class TestTritonKernels:
    """Each Triton kernel writes what its torch reference writes (interpreter on CPU)."""

    @pytest.mark.parametrize("rule", [DecideRule(False), DecideRule(True, 3), DecideRule(True, 0)],
                             ids=["lru", "lfu-half-life-3", "lfu-no-aging"])
    @pytest.mark.parametrize("num_experts,num_slots,top_k", [(8, 3, 2), (12, 5, 3), (6, 1, 1)])
    def test_decide_kernel_equals_reference(self, rule, num_experts, num_slots, top_k):
        from pagedexperts.paging.kernels.decide import decide_triton

        rng = random.Random(num_experts + num_slots)
        ref, tri = DecideState.empty(num_experts, num_slots, "cpu"), DecideState.empty(num_experts, num_slots, "cpu")
        for t in range(12):
            rows = rng.choice([1, 2, 4])  # 4 x k > K: multi-wave steps
            ids = torch.tensor([rng.choices(range(num_experts), k=top_k) for _ in range(rows)])
            w = num_waves_for(ids.numel(), num_slots, num_experts)
            want, got = (DecidePlan.empty(w, num_experts, num_slots, "cpu") for _ in range(2))
            decide_torch(ref, ids, want, rule)
            decide_triton(tri, ids, got, rule)
            for f in PLAN_FIELDS:
                assert torch.equal(getattr(got, f), getattr(want, f)), f"step {t} plan.{f}"
            for f in STATE_FIELDS:
                assert torch.equal(getattr(tri, f), getattr(ref, f)), f"step {t} state.{f}"

    @pytest.mark.parametrize("count", [0, 2, 4])
    def test_page_in_kernel_equals_reference(self, count, monkeypatch):
        """Wave 1 of a two-wave plan (the plan's base pointers and the wave index, as the
        pager passes them), two programs striding over each row's chunks, a word-sized
        launch and a byte-sized one (the odd-sized rows)."""
        from pagedexperts.paging.kernels import page_in

        monkeypatch.setattr(page_in, "BLOCK_WORDS", 64)  # several chunks a row
        store, want = store_and_slots(6, 4)
        _, got = store_and_slots(6, 4)
        src, dst = torch.tensor([[1, 0, 4, 2], [5, 2, 0, 3]]), torch.tensor([[0, 1, 2, 3], [3, 0, 1, 2]])
        counts = torch.tensor([3, count])
        page_in.page_in_torch(store, want, src[1], dst[1], counts[1])
        pager = page_in.PageIn(store, got, "cpu", backend="triton", programs_per_row=2)
        assert [g.bytewise for g in pager.groups] == [False, True]
        pager(src, dst, counts, 1, max_loads=4)
        for name in store:
            assert torch.equal(as_bytes(got[name]), as_bytes(want[name])), name

    def test_page_in_grid_is_the_wave_s_most_loads(self, monkeypatch):
        """The grid: max_loads x tensors x programs per row, not K x every chunk (a K = 92
        bf16 layer at batch 1 launched 212K programs a layer-step before)."""
        from pagedexperts.paging.kernels import page_in

        store, slots = store_and_slots(6, 4)
        launches = []

        class Spy:
            def __getitem__(self, grid):
                launches.append(grid)
                return lambda *args, **kwargs: None

        monkeypatch.setattr(page_in, "_page_in_kernel", Spy())
        pager = page_in.PageIn(store, slots, "cpu", backend="triton", programs_per_row=3)
        plan = torch.zeros((1, 4), dtype=torch.long)
        pager(plan, plan, torch.zeros(1, dtype=torch.long), 0, max_loads=2)
        words = [n for n, t in store.items() if page_in.as_words(t).dtype == torch.int32]
        assert launches == [(2, len(words), 1), (2, len(store) - len(words), 1)]  # rows of one chunk: P = 1
        monkeypatch.setattr(page_in, "BLOCK_WORDS", 16)
        launches.clear()
        pager = page_in.PageIn(store, slots, "cpu", backend="triton", programs_per_row=3)  # grids built once
        pager(plan, plan, torch.zeros(1, dtype=torch.long), 0, max_loads=2)
        assert launches[0] == (2, len(words), 3)  # 250 words = 16 chunks: P programs per row

    def test_remap_kernel_equals_reference(self):
        from pagedexperts.paging.kernels.decide import remap_triton

        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 9, (70, 4), generator=gen)  # 280 entries: two programs
        expert_slot, expert_wave = torch.randint(-1, 5, (9,), generator=gen), torch.randint(-1, 3, (9,), generator=gen)
        out = [torch.empty(280, dtype=torch.long) for _ in range(4)]
        remap_torch(ids, expert_slot, expert_wave, out[0], out[1])
        remap_triton(ids, expert_slot, expert_wave, out[2], out[3])
        assert torch.equal(out[0], out[2]) and torch.equal(out[1], out[3])


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_decide_kernel_on_a_real_trace(policy):
    """The Triton decide through the first Qwen1.5-MoE recorded steps (11-91 rows, multi-wave
    at K = 8) makes the host residency's decisions (test_device_decide's comparison)."""
    from support.decisions import assert_same_decisions, trace_steps

    label, num_experts, _, steps = next(t for t in trace_steps() if t[0].startswith("qwen15") and "recorded" in t[0])
    compared = assert_same_decisions(policy, None, num_experts, 8, steps[:12], where=label, backend="triton")
    assert compared == 12
