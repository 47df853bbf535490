"""Sizing: the arithmetic of K resident slots, KV cache, link speed and miss rates.

Owns: pure, keyword-only functions (standard library only) that turn a model's shape (MoE
layers L, routed experts E, top_k k, expert bytes) and a device (memory, link GB/s) into slot
bytes, KV tokens, batch caps, miss-rate bounds and an automatic K; and the reading of a model
directory's ``config.json`` and safetensors *headers* (never the weights) for those inputs.
Does not: print (``commands/preflight``), measure a link (``linkbench``) or replay routing
(``simulate``).

Units: MB = 1e6 bytes, GB = 1e9 bytes, GB/s = 1e9 bytes per second. Rates are fractions in
[0, 1] (0.28 = 28%). Formulas follow DESIGN.md and issue 4 (published Qwen3-30B-A3B analysis).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

MB = 1e6
GB = 1e9
REUSE_FACTOR = 0.8  # verdict threshold: allowed miss rate < 0.8 x uniform -> "reuse implied"
KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
_CONFIG_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
RUN_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # load_model's --dtype choices
_FLOAT_STORAGE = {"F64", "F32", "F16", "BF16"}  # safetensors dtypes a --dtype run converts
_LINEAR_ATTENTION_TYPES = {"linear_attention", "mamba", "gated_delta_net"}


# ---------------------------------------------------------------------------------------------
# Slots, host store, KV
# ---------------------------------------------------------------------------------------------


def slot_bytes(*, expert_bytes: int, moe_layers: int) -> int:
    """Bytes of one slot across the model: ``expert_bytes x L`` (one expert per MoE layer)."""
    return expert_bytes * moe_layers


def host_bytes(*, slot_bytes: int, num_experts: int) -> int:
    """Bytes of the host expert store: ``slot_bytes x E`` (every routed expert of every layer)."""
    return slot_bytes * num_experts


def kv_bytes_per_token(*, config: dict, kv_dtype: str = "auto", model_dtype: str | None = None) -> int:
    """KV-cache bytes one token keeps across all layers, from a Hugging Face ``config`` dict.

    Standard attention: ``layers with KV x 2 (K and V) x kv heads x head dim x dtype bytes``.
    DeepSeek MLA (``kv_lora_rank`` in the config): ``(kv_lora_rank + qk_rope_head_dim) x dtype
    bytes`` per layer, no factor 2 (one compressed latent). Linear-attention layers (Qwen3-Next
    ``layer_types`` / ``full_attention_interval``) keep no per-token KV and are not counted.
    ``kv_dtype``: "auto" (the cache takes the model's dtype: ``model_dtype`` when given, e.g.
    "bfloat16" from ``--dtype``, else the config's dtype, bf16 if absent), "bf16", "fp16", "fp32"
    or "fp8" (1 byte: half of bf16). Example: Qwen3-30B-A3B, 48 x 2 x 4 x 128 x 2 = 98,304 bytes.

    Raises:
        ValueError: unknown ``kv_dtype`` (lists the choices; flag ``--kv-dtype``).
    """
    cfg = _text_config(config)
    dtype_bytes = _kv_dtype_bytes({**cfg, "dtype": model_dtype} if model_dtype else cfg, kv_dtype)
    layers = _kv_layers(cfg)
    if cfg.get("kv_lora_rank"):
        return layers * (int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 0))) * dtype_bytes
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def kv_tokens_per_slot(*, slot_bytes: int, kv_bytes_per_token: int) -> float:
    """KV tokens the memory of one slot would hold: ``slot_bytes / kv_bytes_per_token``."""
    return slot_bytes / kv_bytes_per_token


def kv_reserve_bytes(*, context_length: int, max_running_requests: int, kv_bytes_per_token: int) -> int:
    """KV bytes reserved for ``max_running_requests`` requests of ``context_length`` tokens."""
    return context_length * max_running_requests * kv_bytes_per_token


# ---------------------------------------------------------------------------------------------
# Waves, misses, link speed
# ---------------------------------------------------------------------------------------------


def disk_bytes_per_token(*, moe_layers: int, top_k: int, expert_bytes: int, device_miss_rate: float,
                         host_miss_rate: float) -> float:
    """Bytes read from disk per token with the disk tier: L x top_k x expert bytes x (device
    misses per routed expert) x (host misses per device miss). An upper bound at decode batch
    1 (each routed expert a distinct access); DESIGN.md "Tiers"."""
    return moe_layers * top_k * expert_bytes * device_miss_rate * host_miss_rate


def disk_bound_tok_s(*, disk_gbps: float, disk_bytes_per_token: float) -> float:
    """Decode tokens/s if reading from disk were the only cost: disk GB/s / bytes per token."""
    return float("inf") if disk_bytes_per_token <= 0 else disk_gbps * GB / disk_bytes_per_token


def single_wave_batch_cap(*, num_resident: int, top_k: int) -> int:
    """Decode batch guaranteed to fit one wave: ``K // k`` (B tokens route to <= B x k experts).

    Overlapping routing often lets larger batches fit too; ``simulate`` measures how much.
    """
    return num_resident // top_k


def all_miss_bytes_per_token(*, moe_layers: int, top_k: int, expert_bytes: int) -> int:
    """Bytes paged per decode token if every activation missed: ``L x k x expert_bytes``."""
    return moe_layers * top_k * expert_bytes


def uniform_miss_rate(*, num_resident: int, num_experts: int) -> float:
    """Miss rate of uniform-random routing with any policy in steady state: ``1 - K / E``."""
    return 1.0 - num_resident / num_experts


def max_miss_rate_allowed(*, link_gbps: float, tok_s: float, all_miss_bytes_per_token: int) -> float:
    """Highest miss rate a measured decode speed allows: ``link GB/s / (tok/s x all-miss GB/token)``.

    A run at ``tok_s`` cannot have paged more than the link moves per second, so its miss rate
    is at most this. Values above 1 mean the link does not bound the miss rate at that speed.
    """
    return link_gbps * GB / (tok_s * all_miss_bytes_per_token)


def reuse_verdict(*, max_miss_rate: float, uniform_miss_rate: float) -> str:
    """"reuse implied" if ``max_miss_rate < 0.8 x uniform_miss_rate``, else "inconclusive".

    Below the uniform rate by a margin, the measured speed is only possible if the router reuses
    experts from token to token (the cache beats chance).
    """
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
    """K that fits a device: ``floor((device - non-expert - KV reserve - runtime) / slot_bytes)``.

    Clamped to [top_k, E]: below k one token cannot fit one wave; above E there is nothing to
    page. Use ``memory_needed_bytes`` to see whether the clamped K actually fits.
    """
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
    """KV tokens (all requests together) the budget leaves at K; 0 if it does not fit.

    ``floor((device - non-expert - runtime - K x slot_bytes) / kv_bytes_per_token)``; divide by
    the running requests for the context per request.
    """
    free = device_memory_gb * GB - non_expert_bytes - runtime_reserve_gb * GB - num_resident * slot_bytes
    return max(0, math.floor(free / kv_bytes_per_token))


# ---------------------------------------------------------------------------------------------
# Model config
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEShape:
    """The routed-expert shape of a model: E, k, decoder layers and the MoE layer indices."""

    num_experts: int
    top_k: int
    num_layers: int
    moe_layers: tuple[int, ...]


def moe_shape(*, config: dict) -> MoEShape:
    """E (``num_experts`` / ``num_local_experts`` / ``n_routed_experts``), k
    (``num_experts_per_tok``) and MoE layer indices from a config dict.

    MoE layers: explicit ``mlp_layer_types`` or ``moe_layers`` when present; otherwise every
    layer except ``mlp_only_layers``, those before ``first_k_dense_replace``, and those off the
    ``decoder_sparse_step`` ((i + 1) % step == 0), ``moe_layer_freq`` (i % freq == 0) or
    ``interleave_moe_layer_step`` ((i + 1) % step == 0) pattern.

    Raises:
        ValueError: not a MoE config (no expert count, no top_k, or no MoE layer).
    """
    cfg = _text_config(config)
    e = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    k = cfg.get("num_experts_per_tok") or cfg.get("moe_top_k")
    if not e or not k:
        raise ValueError(
            "config is not a Mixture-of-Experts config: it needs num_experts / num_local_experts / "
            f"n_routed_experts and num_experts_per_tok (model_type={cfg.get('model_type')!r})"
        )
    n = int(cfg["num_hidden_layers"])
    layers = [i for i in range(n) if _is_moe_layer(cfg, i)]
    if not layers:
        raise ValueError(f"config has {e} experts but no MoE layer (check mlp_only_layers etc.)")
    return MoEShape(num_experts=int(e), top_k=int(k), num_layers=n, moe_layers=tuple(layers))


def dense_expert_bytes(*, config: dict, dtype: str | None = None) -> int:
    """Bytes of one routed expert dequantized to ``dtype`` (None: the config's ``dtype`` /
    ``torch_dtype``, else bfloat16): what a dense slot holds per layer.

    Formula: (2 x I x H gate and up + H x I down) x dtype bytes, plus gpt-oss's biases
    ((2 x I + H) x dtype bytes); I = ``moe_intermediate_size``, else ``intermediate_size``
    (Mixtral, gpt-oss), H = ``hidden_size``.

    Raises:
        ValueError: an unknown dtype (lists the choices).
    """
    cfg = _text_config(config)
    name = str(dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").replace("torch.", "")
    if name not in RUN_DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(RUN_DTYPE_BYTES)} (--dtype)")
    h = int(cfg["hidden_size"])
    i = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    biases = 2 * i + h if cfg.get("model_type") == "gpt_oss" else 0
    return (3 * h * i + biases) * RUN_DTYPE_BYTES[name]


def _is_moe_layer(cfg: dict, i: int) -> bool:
    if cfg.get("mlp_layer_types"):
        return cfg["mlp_layer_types"][i] in ("sparse", "moe")
    if cfg.get("moe_layers") is not None:
        return i in cfg["moe_layers"]
    if i in (cfg.get("mlp_only_layers") or []):
        return False
    if i < int(cfg.get("first_k_dense_replace") or 0):
        return False
    step = int(cfg.get("decoder_sparse_step") or 1)
    freq = int(cfg.get("moe_layer_freq") or 1)
    interleave = int(cfg.get("interleave_moe_layer_step") or 1)
    return (i + 1) % step == 0 and i % freq == 0 and (i + 1) % interleave == 0


def _text_config(config: dict) -> dict:
    """The language-model part of a config (multimodal configs nest it under text_config)."""
    return config.get("text_config") or config


def _kv_layers(cfg: dict) -> int:
    n = int(cfg["num_hidden_layers"])
    if cfg.get("layer_types"):
        return sum(t not in _LINEAR_ATTENTION_TYPES for t in cfg["layer_types"][:n])
    interval = cfg.get("full_attention_interval")
    if interval:
        return sum((i + 1) % int(interval) == 0 for i in range(n))
    return n


def _kv_dtype_bytes(cfg: dict, kv_dtype: str) -> int:
    if kv_dtype == "auto":
        name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
        return _CONFIG_DTYPE_BYTES.get(name, 2)
    try:
        return KV_DTYPE_BYTES[kv_dtype]
    except KeyError:
        raise ValueError(
            f"unknown KV dtype {kv_dtype!r}; choose one of {['auto', *KV_DTYPE_BYTES]} (--kv-dtype)"
        ) from None


# ---------------------------------------------------------------------------------------------
# Model directory: config.json and safetensors headers
# ---------------------------------------------------------------------------------------------

_PER_EXPERT = re.compile(r"layers\.(\d+)\..*\.experts\.(\d+)\.")
_STACKED = re.compile(r"layers\.(\d+)\..*\.experts\.[A-Za-z_]\w*$")


@dataclass(frozen=True)
class CheckpointSizes:
    """Byte counts of a checkpoint read from its headers.

    ``expert_bytes``: all tensors of one routed expert in one MoE layer (weights, biases,
    scales, zero points); ``expert_tensor_bytes``: every routed-expert tensor of the model;
    ``non_expert_bytes``: everything else (attention, embeddings, shared experts, dense MLPs).
    """

    expert_bytes: int
    expert_tensor_bytes: int
    non_expert_bytes: int
    expert_layers: tuple[int, ...]


def read_config(model_path: str) -> dict:
    """The parsed ``config.json`` of a model directory.

    Raises:
        FileNotFoundError: the directory or its config.json is missing (flag ``--model-path``).
    """
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {model_path!r} (--model-path)")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_safetensors_header(path: str) -> dict:
    """The JSON header of one safetensors file: name -> {dtype, shape, data_offsets}.

    Format: 8-byte little-endian unsigned header length N, then N bytes of JSON; the tensor
    data follow and are never read. The ``__metadata__`` entry is dropped.

    Raises:
        ValueError: the file is too short or its header is not valid JSON.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        raw = f.read(n)
    if len(raw) < n:
        raise ValueError(f"{path}: truncated safetensors header ({len(raw)} of {n} bytes)")
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: safetensors header is not valid JSON: {exc}") from None
    header.pop("__metadata__", None)
    return header


def safetensors_files(model_path: str) -> list[str]:
    """The safetensors files of a model: the shards named by ``model.safetensors.index.json``,
    else every ``*.safetensors`` file in the directory, sorted.

    Raises:
        ValueError: the directory holds no safetensors file.
    """
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {model_path!r}; pass a checkpoint directory (--model-path)")
    return [os.path.join(model_path, f) for f in files]


def run_dtype(*, config: dict, dtype: str | None = None) -> str:
    """The dtype ``load_model`` runs a checkpoint in: ``dtype`` (``--dtype``), else config.json's
    ``dtype`` / ``torch_dtype``, else float32 (as ``loader.resolve_dtype``).

    Raises:
        ValueError: an unknown dtype (lists the --dtype choices).
    """
    cfg = _text_config(config)
    name = dtype if dtype not in (None, "auto") else str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    if name not in RUN_DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(RUN_DTYPE_BYTES)} (--dtype)")
    return name


def checkpoint_sizes(
    *, model_path: str, num_experts: int, dtype: str | None = None, keep_fp32: tuple[str, ...] = ()
) -> CheckpointSizes:
    """Expert and non-expert bytes of a checkpoint, from its safetensors headers only.

    ``dtype`` (a RUN_DTYPE_BYTES name): the bytes ``load_model(dtype=...)`` allocates, i.e. every
    floating tensor (F64, F32, F16, BF16) at numel x that dtype's bytes, except those whose name
    contains an entry of ``keep_fp32`` (the model class's fp32-kept modules) at 4 bytes; integer
    and 8-bit float (packed, quantized) tensors keep their stored bytes. None: stored bytes.

    Expert tensors are per-expert keys (``model.layers.N.mlp.experts.J.*``, Mixtral's
    ``block_sparse_moe.experts.J.w1``) or stacked keys (``...mlp.experts.gate_up_proj``, leading
    dim E). ``expert_bytes`` sums, in the first layer that has experts, expert 0's per-expert
    tensors plus 1/E of each stacked tensor. Sizes come from the headers' data offsets.

    Raises:
        ValueError: no safetensors file, no expert tensor, or a stacked tensor whose leading
            dim is not E.
    """
    per_layer: dict[int, int] = {}  # layer -> bytes of one expert
    expert_total = other_total = 0
    for path in safetensors_files(model_path):
        for name, info in read_safetensors_header(path).items():
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
