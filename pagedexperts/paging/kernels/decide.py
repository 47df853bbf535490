"""Decide: one MoE layer's residency decision for one step on the device (fixed shapes, no sync):
``residency.planner.Residency`` with LRU / LFU restated over device tensors (``decide_torch``,
``decide_triton``), the remap of entries to slots and waves, and the state it updates. The rule:
docs/device-side-decide.md "The rule as built".

Legend: T tokens, k top_k, E experts, K slots, W waves of the step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedexperts.paging.kernels._triton import HAVE_TRITON, tl, triton
from pagedexperts.residency.planner import begin_step

# scalars[i]: the state's device scalars, one int64 tensor so a step updates them in place
CLOCK, STEPS = 0, 1


@dataclass(frozen=True)
class DecideState:
    """One layer's state, updated in place: slot_of_expert [E], expert_of_slot [K] (-1: none), last_use
    [K], count [E] (LFU), scalars [2] (CLOCK, STEPS); all int64."""

    slot_of_expert: torch.Tensor
    expert_of_slot: torch.Tensor
    last_use: torch.Tensor
    count: torch.Tensor
    scalars: torch.Tensor

    @classmethod
    def empty(cls, num_experts: int, num_slots: int, device) -> "DecideState":
        """Nothing resident, every clock at zero."""
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.full((num_experts,), -1, **i64), torch.full((num_slots,), -1, **i64),
                   torch.zeros(num_slots, **i64), torch.zeros(num_experts, **i64), torch.zeros(2, **i64))


def num_waves_for(num_entries: int, num_slots: int, num_experts: int, *, in_place: bool = False) -> int:
    """W = max(1, ceil(min(T k, E) / K)) for ``num_entries`` = T k; 1 with ``in_place``."""
    if in_place:
        return 1
    return max(1, -(-min(num_entries, num_experts) // num_slots))


@dataclass(frozen=True)
class DecidePlan:
    """What a decide writes, allocated once per W, all int64: src / dst [W, K] (loads), count [W],
    expert_slot / expert_wave [E] (-1: not routed), step [4] (hits, misses, waves, in-place reads),
    scratch [2 E + 3 K]."""

    src: torch.Tensor
    dst: torch.Tensor
    count: torch.Tensor
    expert_slot: torch.Tensor
    expert_wave: torch.Tensor
    step: torch.Tensor
    scratch: torch.Tensor

    @classmethod
    def empty(cls, num_waves: int, num_experts: int, num_slots: int, device) -> "DecidePlan":
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.zeros((num_waves, num_slots), **i64), torch.zeros((num_waves, num_slots), **i64),
                   torch.zeros(num_waves, **i64), torch.zeros(num_experts, **i64),
                   torch.zeros(num_experts, **i64), torch.zeros(4, **i64),
                   torch.zeros(2 * num_experts + 3 * num_slots, **i64))

    @property
    def num_waves(self) -> int:
        return self.count.shape[0]


@dataclass(frozen=True)
class DecideRule:
    """``use_count`` False = LRU, True = LFU aged every ``half_life`` steps (0: never); ``in_place``:
    one wave, at most ``admit`` page-ins (None: K)."""

    use_count: bool
    half_life: int = 0
    in_place: bool = False
    admit: int | None = None

    def admit_limit(self, num_slots: int) -> int:
        """Page-ins a step may admit: ``admit``, or K when None."""
        return num_slots if self.admit is None else self.admit


# -- the torch backend ----------------------------------------------------------------------


class _DevicePolicy:
    """``residency.planner.begin_step``'s hooks over a ``DecideState`` (union and hits as [E] bool
    masks)."""

    def __init__(self, state: DecideState, rule: DecideRule) -> None:
        self.state, self.rule = state, rule

    def on_step(self, routed: torch.Tensor) -> None:
        scalars, count = self.state.scalars, self.state.count
        scalars[STEPS] += 1
        if self.rule.use_count:
            if self.rule.half_life:
                aging = scalars[STEPS] % self.rule.half_life == 0
                count.copy_(torch.where(aging, count // 2, count))
            count.add_(routed.long())

    def on_hits(self, slot_of_expert: torch.Tensor, hit: torch.Tensor) -> None:
        st = self.state
        hit_rank = torch.cumsum(hit, 0) - 1
        held = st.expert_of_slot.clamp(min=0)
        touched = (st.expert_of_slot >= 0) & hit[held]
        st.last_use.copy_(torch.where(touched, st.scalars[CLOCK] + 1 + hit_rank[held], st.last_use))
        st.scalars[CLOCK] += hit.sum()


def _begin_step(state: DecideState, ids: torch.Tensor, rule: DecideRule):
    """Steps 1-3 (``residency.planner.begin_step``): (routed [E], hit [E], queue position [E])."""
    slot_of_expert = state.slot_of_expert
    routed = torch.zeros_like(slot_of_expert, dtype=torch.bool).index_fill_(0, ids.reshape(-1), True)
    hit, _ = begin_step(_DevicePolicy(state, rule), routed,
                        lambda union: (union & (slot_of_expert >= 0), slot_of_expert))
    miss = routed & ~hit
    n_hit = hit.sum()
    queue = torch.where(hit, torch.cumsum(hit, 0) - 1, n_hit + torch.cumsum(miss, 0) - 1)
    return routed, hit, queue


def _victim_order(state: DecideState, protected: torch.Tensor, rule: DecideRule) -> torch.Tensor:
    """Slots [K] in the order misses take them: empty, then unprotected by (count, last_use, slot),
    then protected."""
    expert_of_slot = state.expert_of_slot
    empty = expert_of_slot < 0
    order = torch.argsort(torch.where(empty, 0, state.last_use), stable=True)
    if rule.use_count:
        freq = torch.where(empty, 0, state.count[expert_of_slot.clamp(min=0)])
        order = order[torch.argsort(freq[order], stable=True)]
    klass = torch.where(empty, 0, torch.where(protected, 2, 1))
    return order[torch.argsort(klass[order], stable=True)]


def _wave(state: DecideState, plan: DecidePlan, w: int, in_wave, hit, rule: DecideRule) -> None:
    """Step 4 for wave ``w`` of ``in_wave`` [E] bool: place its misses, update state, write plan row
    ``w``."""
    slot_of_expert, expert_of_slot = state.slot_of_expert, state.expert_of_slot
    num_slots = expert_of_slot.shape[0]
    wave_miss = in_wave & ~hit
    held = expert_of_slot.clamp(min=0)
    order = _victim_order(state, (expert_of_slot >= 0) & in_wave[held] & hit[held], rule)
    m = wave_miss.sum()
    rank_of_slot = torch.argsort(order)  # inverse permutation: slot -> its place in order
    miss_by_rank = torch.argsort((~wave_miss).to(torch.int8), stable=True)[:num_slots]
    taken = rank_of_slot < m
    evicted = (slot_of_expert >= 0) & taken[slot_of_expert.clamp(min=0)]
    new_slot = order[(torch.cumsum(wave_miss, 0) - 1).clamp(min=0, max=num_slots - 1)]
    slot_of_expert.copy_(torch.where(wave_miss, new_slot, torch.where(evicted, -1, slot_of_expert)))
    expert_of_slot.copy_(torch.where(taken, miss_by_rank[rank_of_slot], expert_of_slot))
    state.last_use.copy_(torch.where(taken, state.scalars[CLOCK] + 1 + rank_of_slot, state.last_use))
    state.scalars[CLOCK] += m
    plan.src[w].copy_(torch.where(torch.arange(num_slots, device=m.device) < m, miss_by_rank, -1))
    plan.dst[w].copy_(order)
    plan.count[w].copy_(m)
    plan.expert_slot.copy_(torch.where(in_wave, slot_of_expert, plan.expert_slot))
    plan.expert_wave.copy_(torch.where(in_wave, w, plan.expert_wave))


def decide_torch(state: DecideState, ids: torch.Tensor, plan: DecidePlan, rule: DecideRule) -> None:
    """Decide one step in torch ops: ``ids`` [T, k] int64 in [0, E) (unchecked: a check would read the
    device); W >= ceil(|union| / K) is the caller's to guarantee."""
    routed, hit, queue = _begin_step(state, ids, rule)
    plan.expert_slot.fill_(-1)
    plan.expert_wave.fill_(-1)
    num_slots = state.expert_of_slot.shape[0]
    n_union, n_hit = routed.sum(), hit.sum()
    if rule.in_place:  # one wave: hits, then the admitted misses; the rest read in place
        miss = routed & ~hit
        n_admit = torch.minimum(miss.sum(), num_slots - n_hit).clamp(max=rule.admit_limit(num_slots))
        slotted = hit | (miss & (torch.cumsum(miss, 0) - 1 < n_admit))
        _wave(state, plan, 0, slotted, hit, rule)
        host = routed & ~slotted
        experts = torch.arange(routed.shape[0], device=routed.device)
        plan.expert_slot.copy_(torch.where(host, num_slots + experts, plan.expert_slot))
        plan.expert_wave.copy_(torch.where(routed, 0, -1))
        waves, in_place = (n_union > 0).long(), host.sum()
    else:
        for w in range(plan.num_waves):
            _wave(state, plan, w, routed & (queue // num_slots == w), hit, rule)
        waves, in_place = (n_union + num_slots - 1) // num_slots, torch.zeros_like(n_union)
    plan.step.copy_(torch.stack([n_hit, n_union - n_hit, waves, in_place]))


# -- the Triton kernel -------------------------------------------------------------------------
# One program (one thread block) decides the whole step; its threads share the state through
# global memory, so every read of a location and a later write of it by another thread (or a
# write and a later read) are separated by ``tl.debug_barrier()`` (bar.sync): the state is read
# in one phase, written in the next (tests/paging/kernels/test_kernels_aot.py checks the kernel's source).
# Registers: ids, slots, ranks and classes are int32 (bounded by E and K); the clock, last use
# and counts stay int64 (unbounded counters: the device equals the host's Python ints on any
# run length). Slots are ranked in chunks of RANK_CHUNK against all K, keys held in scratch
# memory: [BLOCK_K, RANK_CHUNK] comparisons live at once, whatever K.

BLOCK_IDS = 256  # top-k ids scattered per loop iteration: fixed, so no variant per batch size
RANK_CHUNK = 16  # slots compared at once while ranking (bounds registers at any K)
NUM_WARPS = 4  # with RANK_CHUNK 16: no spills at K = 40 and 92 on sm_80/89/90 (tests/paging/kernels/test_kernels_aot.py)
KEY_SHIFT = 48  # key = class << 48 | LFU count: counts stay below 2^48 (steps of a run)

if HAVE_TRITON:

    @triton.jit(do_not_specialize=["num_ids", "num_waves", "admit"])
    def _decide_kernel(ids_ptr, num_ids, slot_of_expert_ptr, expert_of_slot_ptr, last_ptr, count_ptr, scalars_ptr,
                       src_ptr, dst_ptr, cnt_ptr, eslot_ptr, ewave_ptr, step_ptr, scratch_ptr, E, K, num_waves, admit,
                       USE_COUNT: tl.constexpr, HALF_LIFE: tl.constexpr, IN_PLACE: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_IDS: tl.constexpr, RANK_CHUNK: tl.constexpr,
                       KEY_SHIFT: tl.constexpr):
        e = tl.arange(0, BLOCK_E)
        e_ok = e < E
        k = tl.arange(0, BLOCK_K)
        k_ok = k < K
        routed_ptr, prot_ptr, byrank_ptr = scratch_ptr, scratch_ptr + E, scratch_ptr + 2 * E
        major_ptr, minor_ptr = scratch_ptr + 2 * E + K, scratch_ptr + 2 * E + 2 * K
        # step 1: the union (routed flags in scratch)
        tl.store(routed_ptr + e, tl.zeros([BLOCK_E], tl.int64), mask=e_ok)
        tl.debug_barrier()
        for start in range(0, num_ids, BLOCK_IDS):
            s = start + tl.arange(0, BLOCK_IDS)
            ids = tl.load(ids_ptr + s, mask=s < num_ids, other=0)
            tl.store(routed_ptr + ids, tl.full([BLOCK_IDS], 1, tl.int64), mask=s < num_ids)
        tl.debug_barrier()
        routed = tl.load(routed_ptr + e, mask=e_ok, other=0) > 0
        # the state the step begins from, read by every thread before any thread writes it
        clock = tl.load(scalars_ptr)
        steps = tl.load(scalars_ptr + 1) + 1
        slot_of = tl.load(slot_of_expert_ptr + e, mask=e_ok, other=-1).to(tl.int32)
        if USE_COUNT:
            count = tl.load(count_ptr + e, mask=e_ok, other=0)
        tl.debug_barrier()
        # steps 1-2 (residency.planner.begin_step): LFU counts (aging first), hits touched in
        # ascending id; step 3: the queue, hits then misses
        tl.store(scalars_ptr + 1, steps)
        if USE_COUNT:
            if HALF_LIFE > 0:
                count = tl.where(steps % HALF_LIFE == 0, count // 2, count)
            tl.store(count_ptr + e, count + routed.to(tl.int64), mask=e_ok)
        hit = routed & (slot_of >= 0)
        miss = routed & (slot_of < 0)
        hit_rank = tl.cumsum(hit.to(tl.int32), 0) - 1
        n_hit = tl.sum(hit.to(tl.int32), 0)
        n_miss = tl.sum(miss.to(tl.int32), 0)
        tl.store(last_ptr + slot_of, clock + 1 + hit_rank, mask=hit)
        clock += n_hit
        miss_rank = tl.cumsum(miss.to(tl.int32), 0) - 1
        if IN_PLACE:  # one wave: hits and the first n_admit misses take slots, the rest host rows
            n_admit = tl.minimum(tl.minimum(n_miss, K - n_hit), admit)
            slotted = hit | (miss & (miss_rank < n_admit))
            wave_of = tl.where(slotted, 0, -1)
            tl.store(ewave_ptr + e, tl.where(routed, 0, -1).to(tl.int64), mask=e_ok)
        else:
            n_admit = n_miss
            wave_of = tl.where(routed, tl.where(hit, hit_rank, n_hit + miss_rank) // K, -1)
            tl.store(ewave_ptr + e, wave_of.to(tl.int64), mask=e_ok)
        tl.store(eslot_ptr + e, tl.full([BLOCK_E], -1, tl.int64), mask=e_ok)
        # step 4, per wave: rank the slots, place the misses
        for w in range(num_waves):
            in_wave = wave_of == w
            wave_miss = in_wave & miss
            m = tl.sum(wave_miss.to(tl.int32), 0)
            tl.store(prot_ptr + e, (in_wave & hit).to(tl.int64), mask=e_ok)
            tl.store(byrank_ptr + k, tl.full([BLOCK_K], -1, tl.int64), mask=k_ok)
            tl.debug_barrier()
            tl.store(byrank_ptr + tl.cumsum(wave_miss.to(tl.int32), 0) - 1, e.to(tl.int64), mask=wave_miss)
            held = tl.load(expert_of_slot_ptr + k, mask=k_ok, other=-1).to(tl.int32)
            occupied = held >= 0
            held = tl.where(occupied, held, 0)
            prot = tl.load(prot_ptr + held, mask=k_ok & occupied, other=0) > 0
            klass = tl.where(k_ok, tl.where(occupied, tl.where(prot, 2, 1), 0), 3)
            # victim order = (class, LFU count, last use) ascending; an empty slot's last use
            # is 0, so its slot id stands in (empties by ascending id); occupied slots' last
            # uses are distinct (each touch takes the next clock): no two keys tie
            major = klass.to(tl.int64) << KEY_SHIFT
            if USE_COUNT:
                major = major | tl.load(count_ptr + held, mask=k_ok & occupied, other=0)
            minor = tl.where(occupied, tl.load(last_ptr + k, mask=k_ok, other=0), k.to(tl.int64))
            tl.store(major_ptr + k, major, mask=k_ok)
            tl.store(minor_ptr + k, minor, mask=k_ok)
            tl.debug_barrier()
            rank = tl.zeros([BLOCK_K], tl.int32)
            for c in range(0, K, RANK_CHUNK):
                b = c + tl.arange(0, RANK_CHUNK)
                major_b = tl.load(major_ptr + b, mask=b < K, other=3 << KEY_SHIFT)
                minor_b = tl.load(minor_ptr + b, mask=b < K, other=0)
                before = (major_b[None, :] < major[:, None]) | (
                    (major_b[None, :] == major[:, None]) & (minor_b[None, :] < minor[:, None]))
                rank += tl.sum(before.to(tl.int32), 1)
            taken = k_ok & (rank < m)
            new_e = tl.load(byrank_ptr + rank, mask=taken, other=-1)
            tl.store(slot_of_expert_ptr + held, tl.full([BLOCK_K], -1, tl.int64), mask=taken & occupied)
            tl.store(slot_of_expert_ptr + new_e, k.to(tl.int64), mask=taken)
            tl.store(expert_of_slot_ptr + k, new_e, mask=taken)
            tl.store(last_ptr + k, clock + 1 + rank, mask=taken)
            clock += m
            tl.store(dst_ptr + w * K + rank, k.to(tl.int64), mask=k_ok)
            tl.store(src_ptr + w * K + k, tl.load(byrank_ptr + k, mask=k_ok, other=-1), mask=k_ok)
            tl.store(cnt_ptr + w, m.to(tl.int64))
            tl.debug_barrier()
            tl.store(eslot_ptr + e, tl.load(slot_of_expert_ptr + e, mask=e_ok, other=-1), mask=in_wave)
            tl.debug_barrier()
        if IN_PLACE:
            tl.store(eslot_ptr + e, (K + e).to(tl.int64), mask=routed & (wave_of < 0))
            tl.store(step_ptr + 2, (n_hit + n_miss > 0).to(tl.int64))
        else:
            tl.store(step_ptr + 2, ((n_hit + n_miss + K - 1) // K).to(tl.int64))
        tl.store(scalars_ptr, clock)
        tl.store(step_ptr, n_hit.to(tl.int64))
        tl.store(step_ptr + 1, n_miss.to(tl.int64))
        tl.store(step_ptr + 3, (n_miss - n_admit).to(tl.int64))


@functools.lru_cache(maxsize=None)
def decide_constexprs(num_experts: int, num_slots: int, rule: DecideRule) -> dict:
    """``_decide_kernel``'s constexprs for E, K and ``rule`` (shared: do not change)."""
    return dict(USE_COUNT=rule.use_count, HALF_LIFE=rule.half_life if rule.use_count else 0, IN_PLACE=rule.in_place,
                BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(num_slots),
                BLOCK_IDS=BLOCK_IDS, RANK_CHUNK=RANK_CHUNK, KEY_SHIFT=KEY_SHIFT)


def decide_triton(state: DecideState, ids: torch.Tensor, plan: DecidePlan, rule: DecideRule) -> None:
    """``decide_torch`` as one Triton program (K^2 pairwise ranking); T and W not specialised on."""
    flat = ids.reshape(-1).contiguous()
    num_experts, num_slots = state.slot_of_expert.shape[0], state.expert_of_slot.shape[0]
    _decide_kernel[(1,)](
        flat, flat.numel(), state.slot_of_expert, state.expert_of_slot, state.last_use, state.count,
        state.scalars, plan.src, plan.dst, plan.count, plan.expert_slot, plan.expert_wave, plan.step,
        plan.scratch, num_experts, num_slots, plan.count.shape[0], rule.admit_limit(num_slots), num_warps=NUM_WARPS,
        **decide_constexprs(num_experts, num_slots, rule))


# -- remap: each entry's slot and wave ----------------------------------------------------------
# entry_slot[s] = expert_slot[ids[s]], entry_wave[s] = expert_wave[ids[s]] over the step's S = T k
# entries (flat, token-major), from the tables a decide writes (``DecidePlan.expert_slot`` /
# ``expert_wave`` [E]): a Triton kernel (grid ceil(S / REMAP_BLOCK)) and torch indexing.

REMAP_BLOCK = 256


def remap_torch(ids: torch.Tensor, expert_slot: torch.Tensor, expert_wave: torch.Tensor,
                    entry_slot: torch.Tensor, entry_wave: torch.Tensor) -> None:
    """ids [T, k] int64 -> entry_slot, entry_wave [S] int64 (written in place)."""
    flat = ids.reshape(-1)
    entry_slot.copy_(expert_slot[flat])
    entry_wave.copy_(expert_wave[flat])


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["n"])  # n = T k: one compiled variant for every batch size
    def _remap_kernel(ids_ptr, slot_ptr, wave_ptr, out_slot_ptr, out_wave_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        e = tl.load(ids_ptr + offs, mask=mask, other=0)
        tl.store(out_slot_ptr + offs, tl.load(slot_ptr + e, mask=mask), mask=mask)
        tl.store(out_wave_ptr + offs, tl.load(wave_ptr + e, mask=mask), mask=mask)


def remap_triton(ids: torch.Tensor, expert_slot: torch.Tensor, expert_wave: torch.Tensor,
                 entry_slot: torch.Tensor, entry_wave: torch.Tensor) -> None:
    """``remap_torch`` by the Triton kernel."""
    flat = ids.reshape(-1).contiguous()
    n = flat.numel()
    _remap_kernel[(triton.cdiv(n, REMAP_BLOCK),)](flat, expert_slot, expert_wave, entry_slot, entry_wave, n,
                                                  BLOCK=REMAP_BLOCK)
