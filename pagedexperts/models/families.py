"""The supported MoE families: what each one's config says about its layers, and its quirks.

Owns: the table of families (keyed by config.json ``model_type``), each family's rule for which
decoder layers are MoE layers (the others are dense: no pager), the name of its shared-expert
module if it has one, and a one-line note of its hub checkpoint layout. Standard library only:
it reads a transformers config object or a plain config.json dict alike.
Does not: discover tensors or modules (``pagedexperts.models.sites``), read checkpoints (``loader``).

What each family needs from the pager is nothing special: its router (softmax top-k with or
without renormalisation, sigmoid + selection-only correction bias + grouped top-k, scaling
factors) and its shared experts stay the model's own code, because only the modules that
transformers dispatches through its experts registry are paged; layouts (gpt-oss's transposed,
interleaved gate_up with per-expert biases and clamped SwiGLU) are handled by the model's own
experts implementation running over the slot tensors under the module's own names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``key`` of a config object or a config.json dict (None counts as missing)."""
    value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return default if value is None else value


def num_routed_experts(config: Any) -> int:
    """E: config.json spells it num_experts, num_local_experts or n_routed_experts."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if config_value(config, key) is not None:
            return int(config_value(config, key))
    return 0


def _every_layer(config: Any, layer: int) -> bool:
    return True


def _qwen_sparse_layer(config: Any, layer: int) -> bool:
    """Qwen2-MoE / Qwen3-MoE / Qwen3-Next: not in ``mlp_only_layers``, on the sparse step."""
    step = int(config_value(config, "decoder_sparse_step", 1))
    return (
        layer not in (config_value(config, "mlp_only_layers", []) or [])
        and num_routed_experts(config) > 0
        and (layer + 1) % step == 0
    )


def _deepseek_sparse_layer(config: Any, layer: int) -> bool:
    """DeepSeek-V2 / V3: the first ``first_k_dense_replace`` layers are dense."""
    return layer >= int(config_value(config, "first_k_dense_replace", 0))


@dataclass(frozen=True)
class Family:
    """One architecture family.

    ``is_moe_layer(config, i)`` mirrors the family's decoder-layer constructor; ``shared_expert``
    is the attribute of the MoE block holding the always-resident shared expert (None: none);
    ``router`` the attribute of the MoE block holding its router module, whose forward maps
    hidden [T, H] -> (logits, weights [T, k], top-k ids [T, k]) in every family (prefetch runs it).
    """

    name: str
    is_moe_layer: Callable[[Any, int], bool]
    shared_expert: str | None
    checkpoint_layout: str
    router: str = "gate"


FAMILIES: dict[str, Family] = {
    "deepseek_v2": Family(
        "DeepSeek-V2", _deepseek_sparse_layer, "shared_experts",
        "per-expert mlp.experts.{j}.gate_proj/up_proj/down_proj",
    ),
    "deepseek_v3": Family(
        "DeepSeek-V3", _deepseek_sparse_layer, "shared_experts",
        "per-expert mlp.experts.{j}.gate_proj/up_proj/down_proj",
    ),
    "gpt_oss": Family(
        "gpt-oss", _every_layer, None,
        "stacked mlp.experts.gate_up_proj [E, H, 2I] (interleaved), down_proj [E, I, H], and biases",
        router="router",
    ),
    "mixtral": Family(
        "Mixtral", _every_layer, None,
        "per-expert block_sparse_moe.experts.{j}.w1/w2/w3",
    ),
    "olmoe": Family(
        "OLMoE", _every_layer, None,
        "per-expert mlp.experts.{j}.gate_proj/up_proj/down_proj",
    ),
    "qwen2_moe": Family(
        "Qwen2-MoE", _qwen_sparse_layer, "shared_expert",
        "per-expert mlp.experts.{j}.gate_proj/up_proj/down_proj",
    ),
    "qwen3_moe": Family(
        "Qwen3-MoE", _qwen_sparse_layer, None,
        "per-expert mlp.experts.{j}.gate_proj/up_proj/down_proj",
    ),
    "qwen3_next": Family(
        "Qwen3-Next", _qwen_sparse_layer, "shared_expert",
        "per-expert mlp.experts.{j}.gate_proj/up_proj/down_proj",
    ),
}


def moe_layer_indices(config: Any) -> list[int]:
    """Decoder layers of ``config`` that hold routed experts, by its family's rule.

    Raises:
        KeyError: ``config``'s model_type is not in FAMILIES.
    """
    family = FAMILIES[config_value(config, "model_type")]
    return [i for i in range(int(config_value(config, "num_hidden_layers"))) if family.is_moe_layer(config, i)]
