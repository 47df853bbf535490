"""Decide: one step's residency decision of one MoE layer, on the device, fixed shapes, no sync.

Owns the decision rule of ``residency.planner.Residency`` + ``residency.eviction`` (LRU, and LFU with aging)
restated over device tensors: from the step's top-k ids [T, k] it updates the slot map and the
policy state in place and writes the page-in plan of every wave (src, dst, count) and each
routed expert's slot and wave. Two functions of identical semantics: ``decide_reference``
(torch ops, any device) and ``decide_triton`` (one Triton program; CUDA, or CPU under
``TRITON_INTERPRET=1``). Does not: copy bytes (``page_in``), remap ids (``remap``) or own the
state's lifetime (``device_residency``).

The rule, step by step, as ``Residency.plan`` makes it (read off residency/planner.py and residency/eviction.py):
1. union = distinct routed ids. LFU ``on_step``: steps += 1; every ``half_life`` steps all
   counts are halved (floor) first; then count[e] += 1 for each e in the union.
2. hits = union experts resident at the step's start; misses the rest. Both in ascending id.
   ``on_hits``: last_use[slot of hit i] = clock + 1 + i (i = rank in ascending id).
3. Queue = hits then misses; wave w = queue entries [w K, (w+1) K). A step has at most
   W = ceil(min(T k, E) / K) waves (fixed by the shape); later waves are empty: no-ops.
4. Per wave, its misses (ascending id) take, in order: empty slots (ascending id; slots fill
   once and never empty again), then victims among occupied slots not holding a hit of this
   wave, least rank first; rank = (count of the slot's expert (LFU; 0 for LRU), last_use,
   slot). ``on_loads``: last_use[slot of miss j] = clock + 1 + j.
Slots filled by an earlier wave of the same step are not protected (that wave has run).

Legend: T tokens, k top_k, E experts, K slots, W waves of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedexperts.paging.kernels._triton import HAVE_TRITON, tl, triton

# scalars[i]: the state's device scalars, one int64 tensor so a step updates them in place
CLOCK, STEPS = 0, 1


@dataclass(frozen=True)
class DecideState:
    """The residency state of one layer, device tensors updated in place by each decide.

    slot_of_expert [E] int64 (-1: not resident); expert_of_slot [K] int64 (-1: empty);
    last_use [K] int64 (clock at the slot's last touch, 0 never); count [E] int64 (LFU: steps
    whose union held the expert, halved every ``half_life`` steps; unused by LRU);
    scalars [2] int64: CLOCK (touches so far), STEPS (decides so far).
    """

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


@dataclass(frozen=True)
class DecidePlan:
    """What a decide writes (fixed shapes, fixed addresses: allocate once per W).

    src [W, K] int64: expert of load j of wave w (-1 for j >= count[w]); dst [W, K] int64:
    its slot (for j >= count[w]: the slots that follow in victim order); count [W] int64:
    loads of wave w; expert_slot [E] int64: slot of each routed
    expert during its wave (-1: not routed); expert_wave [E] int64: its wave (-1: not routed);
    step [3] int64: this step's (hits, misses, waves); scratch [2 E + K] int64: the Triton
    kernel's working memory (routed flags, protected flags, misses by rank).
    """

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
                   torch.zeros(num_experts, **i64), torch.zeros(3, **i64),
                   torch.zeros(2 * num_experts + num_slots, **i64))

    @property
    def num_waves(self) -> int:
        return self.count.shape[0]


@dataclass(frozen=True)
class DecideRule:
    """The eviction rule of a decide: ``use_count`` False = LRU, True = LFU with aging every
    ``half_life`` steps (0: never), as ``residency.eviction.LRUPolicy`` / ``LFUPolicy``."""

    use_count: bool
    half_life: int = 0


def num_waves_for(num_entries: int, num_slots: int, num_experts: int) -> int:
    """W = ceil(min(T k, E) / K): the most waves a step of ``num_entries`` = T k routed
    entries needs (its union holds at most min(T k, E) experts); at least 1."""
    return max(1, -(-min(num_entries, num_experts) // num_slots))


# -- the torch reference ----------------------------------------------------------------------


def _begin_step(state: DecideState, ids: torch.Tensor, rule: DecideRule):
    """Steps 1-2: (routed [E], hit [E], queue position [E]); counts, hit touches updated."""
    soe, scalars = state.slot_of_expert, state.scalars
    routed = torch.zeros_like(soe, dtype=torch.bool).index_fill_(0, ids.reshape(-1), True)
    scalars[STEPS] += 1
    if rule.use_count:
        if rule.half_life:
            aging = scalars[STEPS] % rule.half_life == 0
            state.count.copy_(torch.where(aging, state.count // 2, state.count))
        state.count.add_(routed.long())
    hit = routed & (soe >= 0)
    miss = routed & ~hit
    hit_rank = torch.cumsum(hit, 0) - 1
    n_hit = hit.sum()
    eos = state.expert_of_slot
    held = eos.clamp(min=0)
    touched = (eos >= 0) & hit[held]
    state.last_use.copy_(torch.where(touched, scalars[CLOCK] + 1 + hit_rank[held], state.last_use))
    scalars[CLOCK] += n_hit
    queue = torch.where(hit, hit_rank, n_hit + torch.cumsum(miss, 0) - 1)
    return routed, hit, queue


def _victim_order(state: DecideState, protected: torch.Tensor, rule: DecideRule) -> torch.Tensor:
    """Slots [K] in the order a wave's misses take them: empty (ascending id), then occupied
    unprotected by (count, last_use, slot), then protected. Stable sorts, least key last."""
    eos = state.expert_of_slot
    empty = eos < 0
    order = torch.argsort(torch.where(empty, 0, state.last_use), stable=True)
    if rule.use_count:
        freq = torch.where(empty, 0, state.count[eos.clamp(min=0)])
        order = order[torch.argsort(freq[order], stable=True)]
    klass = torch.where(empty, 0, torch.where(protected, 2, 1))
    return order[torch.argsort(klass[order], stable=True)]


def _wave(state: DecideState, plan: DecidePlan, w: int, routed, hit, queue, rule: DecideRule) -> None:
    """Step 4 for wave ``w``: place its misses, update the state, write plan row ``w``."""
    soe, eos = state.slot_of_expert, state.expert_of_slot
    num_slots = eos.shape[0]
    in_wave = routed & (queue // num_slots == w)
    wave_miss = in_wave & ~hit
    held = eos.clamp(min=0)
    order = _victim_order(state, (eos >= 0) & in_wave[held] & hit[held], rule)
    m = wave_miss.sum()
    rank_of_slot = torch.argsort(order)  # inverse permutation: slot -> its place in order
    miss_by_rank = torch.argsort((~wave_miss).to(torch.int8), stable=True)[:num_slots]
    taken = rank_of_slot < m
    evicted = (soe >= 0) & taken[soe.clamp(min=0)]
    new_slot = order[(torch.cumsum(wave_miss, 0) - 1).clamp(min=0, max=num_slots - 1)]
    soe.copy_(torch.where(wave_miss, new_slot, torch.where(evicted, -1, soe)))
    eos.copy_(torch.where(taken, miss_by_rank[rank_of_slot], eos))
    state.last_use.copy_(torch.where(taken, state.scalars[CLOCK] + 1 + rank_of_slot, state.last_use))
    state.scalars[CLOCK] += m
    plan.src[w].copy_(torch.where(torch.arange(num_slots, device=m.device) < m, miss_by_rank, -1))
    plan.dst[w].copy_(order)
    plan.count[w].copy_(m)
    plan.expert_slot.copy_(torch.where(in_wave, soe, plan.expert_slot))
    plan.expert_wave.copy_(torch.where(in_wave, w, plan.expert_wave))


def decide_reference(state: DecideState, ids: torch.Tensor, plan: DecidePlan, rule: DecideRule) -> None:
    """Decide one step in torch ops: ``ids`` [T, k] int64 expert ids on the state's device.

    Updates ``state`` in place and fills ``plan`` (its W waves; W >= ceil(|union| / K) is the
    caller's to guarantee: ``num_waves_for(T k, K)``). No host read, no data-dependent shape.
    Ids must lie in [0, E) (not checked here: a check would read the device).
    """
    routed, hit, queue = _begin_step(state, ids, rule)
    plan.expert_slot.fill_(-1)
    plan.expert_wave.fill_(-1)
    for w in range(plan.num_waves):
        _wave(state, plan, w, routed, hit, queue, rule)
    n_union, n_hit = routed.sum(), hit.sum()
    num_slots = state.expert_of_slot.shape[0]
    plan.step.copy_(torch.stack([n_hit, n_union - n_hit, (n_union + num_slots - 1) // num_slots]))


# -- the Triton kernel -------------------------------------------------------------------------

if HAVE_TRITON:

    @triton.jit
    def _decide_kernel(ids_ptr, num_ids, soe_ptr, eos_ptr, last_ptr, count_ptr, scal_ptr,
                       src_ptr, dst_ptr, cnt_ptr, eslot_ptr, ewave_ptr, step_ptr, scratch_ptr, E, K, W,
                       USE_COUNT: tl.constexpr, HALF_LIFE: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr):
        e = tl.arange(0, BLOCK_E)
        e_ok = e < E
        k = tl.arange(0, BLOCK_K)
        k_ok = k < K
        routed_ptr, prot_ptr, byrank_ptr = scratch_ptr, scratch_ptr + E, scratch_ptr + 2 * E
        # step 1: the union, LFU counts (aging first)
        tl.store(routed_ptr + e, tl.zeros([BLOCK_E], tl.int64), mask=e_ok)
        tl.debug_barrier()
        for start in range(0, num_ids, BLOCK_S):
            s = start + tl.arange(0, BLOCK_S)
            ids = tl.load(ids_ptr + s, mask=s < num_ids, other=0)
            tl.store(routed_ptr + ids, tl.full([BLOCK_S], 1, tl.int64), mask=s < num_ids)
        tl.debug_barrier()
        routed = tl.load(routed_ptr + e, mask=e_ok, other=0) > 0
        steps = tl.load(scal_ptr + 1) + 1
        tl.store(scal_ptr + 1, steps)
        if USE_COUNT:
            count = tl.load(count_ptr + e, mask=e_ok, other=0)
            if HALF_LIFE > 0:
                count = tl.where(steps % HALF_LIFE == 0, count // 2, count)
            tl.store(count_ptr + e, count + routed.to(tl.int64), mask=e_ok)
        # step 2: hits touched in ascending id; step 3: the queue, hits then misses
        soe = tl.load(soe_ptr + e, mask=e_ok, other=-1)
        hit = routed & (soe >= 0)
        miss = routed & (soe < 0)
        hit_rank = tl.cumsum(hit.to(tl.int64), 0) - 1
        n_hit = tl.sum(hit.to(tl.int64), 0)
        n_miss = tl.sum(miss.to(tl.int64), 0)
        clock = tl.load(scal_ptr)
        tl.store(last_ptr + soe, clock + 1 + hit_rank, mask=hit)
        clock += n_hit
        queue = tl.where(hit, hit_rank, n_hit + tl.cumsum(miss.to(tl.int64), 0) - 1)
        wave_of = tl.where(routed, queue // K, -1)
        tl.store(eslot_ptr + e, tl.full([BLOCK_E], -1, tl.int64), mask=e_ok)
        tl.store(ewave_ptr + e, wave_of, mask=e_ok)
        # step 4, per wave: rank the slots, place the misses
        for w in range(W):
            in_wave = wave_of == w
            wave_miss = in_wave & miss
            m = tl.sum(wave_miss.to(tl.int64), 0)
            tl.store(prot_ptr + e, (in_wave & hit).to(tl.int64), mask=e_ok)
            tl.store(byrank_ptr + k, tl.full([BLOCK_K], -1, tl.int64), mask=k_ok)
            tl.debug_barrier()
            tl.store(byrank_ptr + tl.cumsum(wave_miss.to(tl.int64), 0) - 1, e.to(tl.int64), mask=wave_miss)
            eos = tl.load(eos_ptr + k, mask=k_ok, other=-1)
            occupied = eos >= 0
            held = tl.where(occupied, eos, 0)
            prot = tl.load(prot_ptr + held, mask=k_ok & occupied, other=0) > 0
            last = tl.where(occupied, tl.load(last_ptr + k, mask=k_ok, other=0), 0)
            if USE_COUNT:
                freq = tl.load(count_ptr + held, mask=k_ok & occupied, other=0)
            else:
                freq = tl.zeros([BLOCK_K], tl.int64)
            klass = tl.where(k_ok, tl.where(occupied, tl.where(prot, 2, 1), 0), 3)
            # rank[a] = #{b : (klass, freq, last, slot)[b] < that of a}: the victim order
            ka, kb, fa, fb = klass[:, None], klass[None, :], freq[:, None], freq[None, :]
            la, lb, sa, sb = last[:, None], last[None, :], k[:, None], k[None, :]
            before = (kb < ka) | ((kb == ka) & ((fb < fa) | ((fb == fa) & ((lb < la) | ((lb == la) & (sb < sa))))))
            rank = tl.sum(before.to(tl.int64), 1)
            taken = k_ok & (rank < m)
            tl.debug_barrier()
            new_e = tl.load(byrank_ptr + rank, mask=taken, other=-1)
            tl.store(soe_ptr + held, tl.full([BLOCK_K], -1, tl.int64), mask=taken & occupied)
            tl.store(soe_ptr + new_e, k.to(tl.int64), mask=taken)
            tl.store(eos_ptr + k, new_e, mask=taken)
            tl.store(last_ptr + k, clock + 1 + rank, mask=taken)
            clock += m
            tl.store(dst_ptr + w * K + rank, k.to(tl.int64), mask=k_ok)
            tl.store(src_ptr + w * K + k, tl.load(byrank_ptr + k, mask=k_ok, other=-1), mask=k_ok)
            tl.store(cnt_ptr + w, m)
            tl.debug_barrier()
            tl.store(eslot_ptr + e, tl.load(soe_ptr + e, mask=e_ok, other=-1), mask=in_wave)
            tl.debug_barrier()
        tl.store(scal_ptr, clock)
        tl.store(step_ptr, n_hit)
        tl.store(step_ptr + 1, n_miss)
        tl.store(step_ptr + 2, (n_hit + n_miss + K - 1) // K)


def decide_triton(state: DecideState, ids: torch.Tensor, plan: DecidePlan, rule: DecideRule) -> None:
    """``decide_reference`` as one Triton program (same arguments, same writes; W waves looped
    inside the program, slots ranked by pairwise comparison of their keys: K^2 work)."""
    flat = ids.reshape(-1).contiguous()
    num_experts, num_slots = state.slot_of_expert.shape[0], state.expert_of_slot.shape[0]
    _decide_kernel[(1,)](
        flat, flat.numel(), state.slot_of_expert, state.expert_of_slot, state.last_use, state.count,
        state.scalars, plan.src, plan.dst, plan.count, plan.expert_slot, plan.expert_wave, plan.step,
        plan.scratch, num_experts, num_slots, plan.num_waves,
        USE_COUNT=rule.use_count, HALF_LIFE=rule.half_life if rule.use_count else 0,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(num_slots),
        BLOCK_S=min(1024, triton.next_power_of_2(max(flat.numel(), 1))))
