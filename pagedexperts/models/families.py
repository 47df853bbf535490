"""The supported MoE families: what each one's config says about its layers, and its quirks.

Owns: the table of families (keyed by config.json ``model_type``), each family's rule for which
decoder layers are MoE layers (the others are dense: no pager), the name of its shared-expert
module if it has one, and a one-line note of its hub checkpoint layout. Standard library only:
it reads a transformers config object or a plain config.json dict alike.
Does not: discover tensors or modules (``models.sites``), read checkpoints (``loading``).

What each family needs from the pager is nothing special: its router (softmax top-k with or
without renormalisation, sigmoid + selection-only correction bias + grouped top-k, scaling
factors) and its shared experts stay the model's own code, because only the modules that
transformers dispatches through its experts registry are paged; layouts (gpt-oss's transposed,
interleaved gate_up with per-expert biases and clamped SwiGLU) are handled by the model's own
experts implementation running over the slot tensors under the module's own names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One architecture family.

    Which layers are MoE layers is the one config rule (``models.config.is_moe_layer``) for
    every family; ``shared_expert`` is the attribute of the MoE block holding the always-resident shared expert (None: none);
    ``router`` the attribute of the MoE block holding its router module, whose forward maps
    hidden [T, H] -> (logits, weights [T, k], top-k ids [T, k]) in every family (prefetch runs it);
    ``transposed_experts``: transformers' experts module stores the routed experts' weights
    transposed ([in, out], its ``is_transposed``: gpt-oss), else nn.Linear's [out, in] (a quantized
    format publishes a layout for one of the two: ``formats.format_for_config``).
    """

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
    """Whether the family of ``config`` (a transformers config or a config.json dict) stores its
    routed experts transposed (``Family.transposed_experts``); False for a model type outside
    ``FAMILIES`` (nn.Linear's layout), None for a config without ``model_type`` (not known)."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    if model_type is None:
        return None
    family = FAMILIES.get(model_type)
    return family is not None and family.transposed_experts
