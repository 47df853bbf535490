"""Shared by several test modules (moved from paging/test_store_pager.py)."""

from __future__ import annotations

import random

import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
from pagedexperts.models.sites import per_expert_specs
from pagedexperts.paging.host_executor import HostExecutor
from pagedexperts.paging.steps.table import resolve_inner
from pagedexperts.paging.device_executor import DeviceExecutor
from pagedexperts.residency.eviction import LFUPolicy, LRUPolicy
from pagedexperts.storage.host_store import HostExpertStore
from support.tiny import tiny_config


E, H, I, TOP_K = 8, 32, 16, 2


def synthetic_experts(dtype=torch.float32, *, seed: int = 0, scale_buffer: bool = False) -> Qwen3MoeExperts:
    """A Qwen3-MoE experts layer (E=8, H=32, I=16) with random weights; optionally an extra
    per-expert buffer ``scale`` [E, 4] (stands for a quantization scale: it must be paged too)."""
    torch.manual_seed(seed)
    cfg = tiny_config(num_experts=E, hidden_size=H, moe_intermediate_size=I, num_experts_per_tok=TOP_K)
    module = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.3)
        module.down_proj.normal_(0, 0.3)
    if scale_buffer:
        module.register_buffer("scale", torch.randn(E, 4))
    return module.to(dtype).eval()


def paged(module: torch.nn.Module, num_slots: int, inner: str = "grouped_mm") -> HostExecutor:
    """A host executor over a store filled from ``module``'s own [E, ...] tensors, LRU (the
    scripted sequences are counted by hand under LRU)."""
    specs = per_expert_specs(module, "experts")
    store = HostExpertStore(list(specs), int(module.num_experts), pin=False)
    for spec in specs:
        store.tensors[spec.name].copy_(getattr(module, spec.name).detach())
    return HostExecutor(layer=0, store=store, num_slots=num_slots, device="cpu", inner=inner,
                        policy=LRUPolicy(num_slots))


def unpaged(module, inner, hidden, ids, weights) -> torch.Tensor:
    return resolve_inner(module, inner)(module, hidden, ids, weights)


def step_inputs(routing: list[list[int]], dtype, *, seed: int):
    """hidden [T, H], top_k_index [T, k] (the scripted ids), top_k_weights [T, k] (rows sum to 1)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor(routing, dtype=torch.long)
    hidden = torch.randn(ids.shape[0], H, generator=gen).to(dtype)
    weights = torch.softmax(torch.randn(ids.shape, generator=gen), dim=-1).to(dtype)
    return hidden, ids, weights


# A scripted sequence on E=8, K=3, k=2, counted by hand (LRU, ties on the lowest slot):
#  1 [0,1]                 union {0,1}      0 hits 2 misses 1 wave   -> 0:s0 1:s1
#  2 [1,2] [0,2]           union {0,1,2}    2 hits 1 miss   1 wave   -> 2:s2
#  3 [3,4] [5,0]           union {0,3,4,5}  1 hit  3 misses 2 waves  wave 1 [0,3,4]: 3 evicts 1
#                                           (s1), 4 evicts 2 (s2); wave 2 [5]: 5 evicts 0 (s0)
#  4 [0,3]                 union {0,3}      1 hit  1 miss   1 wave   0 evicts 4 (s2)
#  5 [4,5] [5,4] [4,5]     union {4,5}      1 hit  1 miss   1 wave   4 evicts 3 (s1)
SCRIPT = [
    ([[0, 1]], (0, 2, 1), {0: 0, 1: 1}),
    ([[1, 2], [0, 2]], (2, 1, 1), {0: 0, 1: 1, 2: 2}),
    ([[3, 4], [5, 0]], (1, 3, 2), {5: 0, 3: 1, 4: 2}),
    ([[0, 3]], (1, 1, 1), {5: 0, 3: 1, 0: 2}),
    ([[4, 5], [5, 4], [4, 5]], (1, 1, 1), {5: 0, 4: 1, 0: 2}),
]


HOST_POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy}


def host_and_device(module, num_slots, inner, policy, *, backend="torch"):
    """(host pager, device pager) over one store filled from ``module``, same policy."""
    host = paged(module, num_slots, inner)
    host.residency.policy = HOST_POLICIES[policy](num_slots)  # before any step
    dev = DeviceExecutor(layer=0, store=host.store, num_slots=num_slots, device="cpu", inner=inner,
                      policy=policy, backend=backend)
    return host, dev


def routings(seed: int, steps: int, *, num_experts: int = E, top_k: int = TOP_K):
    """Steps of batch 1 and batch 5 (5 x k = 10 entries: multi-wave at K < 10)."""
    rng = random.Random(seed)
    return [[rng.sample(range(num_experts), top_k) for _ in range(rng.choice([1, 1, 5]))] for _ in range(steps)]
