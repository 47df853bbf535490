"""Sizing: the arithmetic of K resident slots, KV cache, link speed and miss rates.

Pure keyword-only functions (standard library only) from a model's shape (MoE layers L, E, k,
expert bytes) and a device (memory, link) to slot bytes, KV tokens, batch caps, miss-rate bounds
and an automatic K; a checkpoint's bytes from its safetensors headers; ``format_bytes``.
MB = 1e6, GB = 1e9 bytes, GB/s = 1e9 B/s; rates in [0, 1]. Does not: print or read config.json.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pagedexperts.models.config import RUN_DTYPE_BYTES
from pagedexperts.storage.safetensors_files import checkpoint_files, read_header_json

MB = 1e6
GB = 1e9
REUSE_FACTOR = 0.8  # verdict threshold: allowed miss rate < 0.8 x uniform -> "reuse implied"
_FLOAT_STORAGE = {"F64", "F32", "F16", "BF16"}  # safetensors dtypes a --dtype run converts


# ---------------------------------------------------------------------------------------------
# Slots, host store, KV
# ---------------------------------------------------------------------------------------------


def slot_bytes(*, expert_bytes: int, moe_layers: int) -> int:
    """Bytes of one slot across the model: ``expert_bytes x L`` (one expert per MoE layer)."""
    return expert_bytes * moe_layers


def host_bytes(*, slot_bytes: int, num_experts: int) -> int:
    """Bytes of the host expert store: ``slot_bytes x E`` (every routed expert of every layer)."""
    return slot_bytes * num_experts


def kv_tokens_per_slot(*, slot_bytes: int, kv_bytes_per_token: int) -> float:
    """KV tokens the memory of one slot would hold: ``slot_bytes / kv_bytes_per_token``."""
    return slot_bytes / kv_bytes_per_token


def kv_reserve_bytes(*, context_length: int, max_running_requests: int, kv_bytes_per_token: int) -> int:
    """KV bytes reserved for ``max_running_requests`` requests of ``context_length`` tokens."""
    return context_length * max_running_requests * kv_bytes_per_token


def non_expert_bytes(*, layers: int, moe_layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                     num_experts: int, vocab_size: int, tied: bool, dtype_bytes: int) -> int:
    """Estimated bytes of the weights that stay on the device: per layer q ``H x heads x D``, k and v
    ``2 x H x kv_heads x D``, o ``heads x D x H``, two norms ``2 x H``; per MoE layer the router
    ``H x E``; embeddings ``V x H``, lm_head ``V x H`` unless ``tied``, final norm ``H``; times
    ``dtype_bytes``. Not counted: attention biases, per-head norms, shared experts, dense MLPs."""
    attention = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim + 2 * hidden
    embeddings = vocab_size * hidden * (1 if tied else 2) + hidden
    return (layers * attention + moe_layers * hidden * num_experts + embeddings) * dtype_bytes


# ---------------------------------------------------------------------------------------------
# Waves, misses, link speed
# ---------------------------------------------------------------------------------------------


def disk_bytes_per_token(*, moe_layers: int, top_k: int, expert_bytes: int, device_miss_rate: float,
                         host_miss_rate: float) -> float:
    """Disk bytes per token with the disk tier: ``L x k x expert bytes x device miss rate x host miss
    rate``; an upper bound at decode batch 1."""
    return moe_layers * top_k * expert_bytes * device_miss_rate * host_miss_rate


def disk_bound_tok_s(*, disk_gbps: float, disk_bytes_per_token: float) -> float:
    """Decode tokens/s if reading from disk were the only cost: disk GB/s / bytes per token."""
    return float("inf") if disk_bytes_per_token <= 0 else disk_gbps * GB / disk_bytes_per_token


def single_wave_batch_cap(*, num_resident: int, top_k: int) -> int:
    """Decode batch guaranteed to fit one wave: ``K // k``."""
    return num_resident // top_k


def link_bytes_per_token(*, miss_rate: float, all_miss_bytes_per_token: float) -> float:
    """Link bytes per decode token at ``miss_rate``: ``miss_rate x L x k x expert_bytes``, whether a
    miss is paged (``--beyond-k waves``) or read in place."""
    return miss_rate * all_miss_bytes_per_token


def all_miss_bytes_per_token(*, moe_layers: int, top_k: int, expert_bytes: int) -> int:
    """Bytes paged per decode token if every activation missed: ``L x k x expert_bytes``."""
    return moe_layers * top_k * expert_bytes


def uniform_miss_rate(*, num_resident: int, num_experts: int) -> float:
    """Miss rate of uniform-random routing with any policy in steady state: ``1 - K / E``."""
    return 1.0 - num_resident / num_experts


def max_miss_rate_allowed(*, link_gbps: float, tok_s: float, all_miss_bytes_per_token: int) -> float:
    """Highest miss rate a measured decode speed allows: ``link GB/s / (tok/s x all-miss bytes/token)``
    (above 1: the link does not bound it)."""
    return link_gbps * GB / (tok_s * all_miss_bytes_per_token)


def reuse_verdict(*, max_miss_rate: float, uniform_miss_rate: float) -> str:
    """"reuse implied" if ``max_miss_rate < 0.8 x uniform_miss_rate``, else "inconclusive"."""
    return "reuse implied" if max_miss_rate < REUSE_FACTOR * uniform_miss_rate else "inconclusive"


def prefill_page_in_bytes(*, num_experts: int, num_resident: int, slot_bytes: int) -> int:
    """Bytes a long prefill pages in when it routes to every expert: ``(E - K) x slot_bytes``."""
    return (num_experts - num_resident) * slot_bytes


def transfer_seconds(*, num_bytes: float, link_gbps: float) -> float:
    """Seconds to move ``num_bytes`` at ``link_gbps``: ``bytes / (GB/s x 1e9)``."""
    return num_bytes / (link_gbps * GB)


# ---------------------------------------------------------------------------------------------
# Device memory budget
# ---------------------------------------------------------------------------------------------


def auto_num_resident(
    *,
    device_memory_gb: float,
    non_expert_bytes: int,
    kv_reserve_bytes: int,
    runtime_reserve_gb: float,
    slot_bytes: int,
    top_k: int,
    num_experts: int,
) -> int:
    """K that fits a device: ``floor((device - non-expert - KV reserve - runtime) / slot_bytes)``,
    clamped to [top_k, E]."""
    free = device_memory_gb * GB - non_expert_bytes - kv_reserve_bytes - runtime_reserve_gb * GB
    k = math.floor(free / slot_bytes) if slot_bytes > 0 else num_experts
    return max(top_k, min(num_experts, k))


def memory_needed_bytes(
    *, non_expert_bytes: int, kv_reserve_bytes: int, runtime_reserve_gb: float, num_resident: int, slot_bytes: int
) -> float:
    """Device bytes a configuration needs: ``non-expert + KV reserve + runtime + K x slot_bytes``."""
    return non_expert_bytes + kv_reserve_bytes + runtime_reserve_gb * GB + num_resident * slot_bytes


def context_tokens_allowed(
    *,
    device_memory_gb: float,
    non_expert_bytes: int,
    runtime_reserve_gb: float,
    num_resident: int,
    slot_bytes: int,
    kv_bytes_per_token: int,
) -> int:
    """KV tokens (all requests) the budget leaves at K: ``floor((device - non-expert - runtime - K x
    slot_bytes) / kv_bytes_per_token)``, 0 if it does not fit."""
    free = device_memory_gb * GB - non_expert_bytes - runtime_reserve_gb * GB - num_resident * slot_bytes
    return max(0, math.floor(free / kv_bytes_per_token))


def changes_that_fit(
    *,
    device_memory_gb: float,
    non_expert_bytes: int,
    kv_reserve_bytes: int,
    runtime_reserve_gb: float,
    num_resident: int,
    slot_bytes: int,
    top_k: int,
    kv_bytes_per_token: int,
    context_length: int,
    max_running_requests: int,
) -> dict[str, float | int]:
    """Each single flag change that makes the configuration fit, the others unchanged: flag -> its
    largest fitting value (empty when it fits or nothing alone does): ``--runtime-reserve-gb``
    (down to 0.01), ``--num-resident`` (in [top_k, K)), ``--context-length``,
    ``--max-running-requests`` (from ``context_tokens_allowed``)."""
    device = device_memory_gb * GB
    over = memory_needed_bytes(non_expert_bytes=non_expert_bytes, kv_reserve_bytes=kv_reserve_bytes,
                               runtime_reserve_gb=runtime_reserve_gb, num_resident=num_resident,
                               slot_bytes=slot_bytes) - device
    if over <= 0:
        return {}
    changes: dict[str, float | int] = {}
    runtime = math.floor((runtime_reserve_gb - over / GB) * 100) / 100
    if runtime >= 0:
        changes["--runtime-reserve-gb"] = runtime
    free_for_slots = device - non_expert_bytes - kv_reserve_bytes - runtime_reserve_gb * GB
    k = math.floor(free_for_slots / slot_bytes) if slot_bytes > 0 else -1
    if top_k <= k < num_resident:
        changes["--num-resident"] = k
    kv_tokens = context_tokens_allowed(device_memory_gb=device_memory_gb, non_expert_bytes=non_expert_bytes,
                                       runtime_reserve_gb=runtime_reserve_gb, num_resident=num_resident,
                                       slot_bytes=slot_bytes, kv_bytes_per_token=kv_bytes_per_token)
    if 1 <= kv_tokens // max_running_requests < context_length:
        changes["--context-length"] = kv_tokens // max_running_requests
    if 1 <= kv_tokens // context_length < max_running_requests:
        changes["--max-running-requests"] = kv_tokens // context_length
    return changes


# ---------------------------------------------------------------------------------------------
# Display
# ---------------------------------------------------------------------------------------------

_BYTE_UNITS = (("TB", 1e12), ("GB", GB), ("MB", MB), ("kB", 1e3))


def format_bytes(num_bytes: float) -> str:
    """``num_bytes`` in the largest decimal unit it holds one of, 3 significant digits or more
    ("117 MB", "9.83 MB", "512 B")."""
    for unit, size in _BYTE_UNITS:
        if abs(num_bytes) >= size:
            value = num_bytes / size
            digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
            return f"{value:.{digits}f} {unit}"
    return f"{num_bytes:.0f} B"


# ---------------------------------------------------------------------------------------------
# Model directory: config.json and safetensors headers
# ---------------------------------------------------------------------------------------------

_PER_EXPERT = re.compile(r"layers\.(\d+)\..*\.experts\.(\d+)\.")
_STACKED = re.compile(r"layers\.(\d+)\..*\.experts\.[A-Za-z_]\w*$")


@dataclass(frozen=True)
class CheckpointSizes:
    """Byte counts from a checkpoint's headers: ``expert_bytes`` (one routed expert of one MoE layer),
    ``expert_tensor_bytes`` (all routed-expert tensors), ``non_expert_bytes`` (the rest)."""

    expert_bytes: int
    expert_tensor_bytes: int
    non_expert_bytes: int
    expert_layers: tuple[int, ...]


def checkpoint_sizes(
    *, model_path: str, num_experts: int, dtype: str | None = None, keep_fp32: tuple[str, ...] = (),
    skip: frozenset[str] = frozenset(),
) -> CheckpointSizes:
    """Expert and non-expert bytes of a checkpoint from its safetensors headers: per-expert keys
    (``layers.N...experts.J.*``) or stacked ones (leading dim E); ``expert_bytes`` from the first
    expert layer. ``dtype``: as ``load_model(dtype=...)`` allocates (floating tensors at that dtype,
    ``keep_fp32`` names at 4 bytes; None: as stored); ``skip``: keys not counted.
    Raises FileNotFoundError: no safetensors file; ValueError: no expert tensor, or a stacked
    tensor whose leading dim is not E."""
    per_layer: dict[int, int] = {}  # layer -> bytes of one expert
    expert_total = other_total = 0
    for path in checkpoint_files(model_path):
        for name, info in read_header_json(path)[0].items():
            if name in skip:
                continue
            begin, end = info["data_offsets"]
            nbytes = _run_bytes(name, info, end - begin, dtype, keep_fp32)
            m = _PER_EXPERT.search(name)
            s = None if m else _STACKED.search(name)
            if m:
                layer, j = int(m.group(1)), int(m.group(2))
                per_layer[layer] = per_layer.get(layer, 0) + (nbytes if j == 0 else 0)
                expert_total += nbytes
            elif s and info["shape"] and info["shape"][0] == num_experts:
                layer = int(s.group(1))
                per_layer[layer] = per_layer.get(layer, 0) + nbytes // num_experts
                expert_total += nbytes
            elif s and info["shape"]:
                raise ValueError(
                    f"{name}: stacked expert tensor with leading dim {info['shape'][0]}, expected E={num_experts}"
                )
            else:
                other_total += nbytes
    if not per_layer:
        raise ValueError(f"no routed-expert tensor (…experts.J.* or stacked …experts.*) in {model_path!r}")
    layers = tuple(sorted(per_layer))
    return CheckpointSizes(
        expert_bytes=per_layer[layers[0]],
        expert_tensor_bytes=expert_total,
        non_expert_bytes=other_total,
        expert_layers=layers,
    )


def _run_bytes(name: str, info: dict, stored: int, dtype: str | None, keep_fp32: tuple[str, ...]) -> int:
    """Bytes of one checkpoint tensor once loaded in ``dtype`` (``checkpoint_sizes``)."""
    if dtype is None or info.get("dtype") not in _FLOAT_STORAGE:
        return stored
    per_value = 4 if any(k in name for k in keep_fp32) else RUN_DTYPE_BYTES[dtype]
    return math.prod(info["shape"]) * per_value
