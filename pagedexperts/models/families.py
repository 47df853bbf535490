"""The supported MoE families (by config.json ``model_type``) and what the pager reads of each:
shared-expert and router attributes, transposed experts, the hub layout. Standard library only.
Does not: discover modules (``models.sites``) or decide MoE layers (``models.config.is_moe_layer``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One architecture family: ``shared_expert`` (the MoE block's always-resident shared expert, or
    None), ``router`` (the block's router, hidden [T, H] -> (logits, weights [T, k], ids [T, k])),
    ``transposed_experts`` (experts stored [in, out]: gpt-oss; else nn.Linear's [out, in])."""

    name: str
    shared_expert: str | None
    checkpoint_layout: str
    router: str = "gate"
    transposed_experts: bool = False


FAMILIES: dict[str, Family] = {
    "deepseek_v2": Family(
        "DeepSeek-V2", "shared_experts",
        "per-expert mlp.experts.{j}.gate_proj/up_proj/down_proj",
    ),
    "deepseek_v3": Family(
        "DeepSeek-V3", "shared_experts",
        "per-expert mlp.experts.{j}.gate_proj/up_proj/down_proj",
    ),
    "gpt_oss": Family(
        "gpt-oss", None,
        "stacked mlp.experts.gate_up_proj [E, H, 2I] (interleaved), down_proj [E, I, H], and biases",
        router="router", transposed_experts=True,
    ),
    "mixtral": Family(
        "Mixtral", None,
        "per-expert block_sparse_moe.experts.{j}.w1/w2/w3",
    ),
    "olmoe": Family(
        "OLMoE", None,
        "per-expert mlp.experts.{j}.gate_proj/up_proj/down_proj",
    ),
    "qwen2_moe": Family(
        "Qwen2-MoE", "shared_expert",
        "per-expert mlp.experts.{j}.gate_proj/up_proj/down_proj",
    ),
    "qwen3_moe": Family(
        "Qwen3-MoE", None,
        "per-expert mlp.experts.{j}.gate_proj/up_proj/down_proj",
    ),
    "qwen3_next": Family(
        "Qwen3-Next", "shared_expert",
        "per-expert mlp.experts.{j}.gate_proj/up_proj/down_proj",
    ),
}


def experts_transposed(config) -> bool | None:
    """Whether ``config``'s family stores its routed experts transposed: False outside ``FAMILIES``,
    None without a ``model_type``."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    if model_type is None:
        return None
    family = FAMILIES.get(model_type)
    return family is not None and family.transposed_experts
