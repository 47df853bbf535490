"""Decide: one step's residency decision of one MoE layer, on the device, fixed shapes, no sync.

Owns the decision rule of ``residency.Residency`` + ``eviction`` (LRU, and LFU with aging)
restated over device tensors: from the step's top-k ids [T, k] it updates the slot map and the
policy state in place and writes the page-in plan of every wave (src, dst, count) and each
routed expert's slot and wave. Two functions of identical semantics: ``decide_reference``
(torch ops, any device) and ``decide_triton`` (one Triton program; CUDA, or CPU under
``TRITON_INTERPRET=1``). Does not: copy bytes (``page_in``), remap ids (``remap``) or own the
state's lifetime (``device_residency``).

The rule, step by step, as ``Residency.plan`` makes it (read off residency.py / eviction.py):
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
    step [3] int64: this step's (hits, misses, waves).
    """

    src: torch.Tensor
    dst: torch.Tensor
    count: torch.Tensor
    expert_slot: torch.Tensor
    expert_wave: torch.Tensor
    step: torch.Tensor

    @classmethod
    def empty(cls, num_waves: int, num_experts: int, num_slots: int, device) -> "DecidePlan":
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.zeros((num_waves, num_slots), **i64), torch.zeros((num_waves, num_slots), **i64),
                   torch.zeros(num_waves, **i64), torch.zeros(num_experts, **i64),
                   torch.zeros(num_experts, **i64), torch.zeros(3, **i64))

    @property
    def num_waves(self) -> int:
        return self.count.shape[0]


@dataclass(frozen=True)
class DecideRule:
    """The eviction rule of a decide: ``use_count`` False = LRU, True = LFU with aging every
    ``half_life`` steps (0: never), as ``eviction.LRUPolicy`` / ``eviction.LFUPolicy``."""

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


def decide_triton(state: DecideState, ids: torch.Tensor, plan: DecidePlan, rule: DecideRule) -> None:
    """``decide_reference`` as one Triton program (same arguments, same writes)."""
    raise NotImplementedError
