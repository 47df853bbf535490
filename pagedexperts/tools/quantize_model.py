"""What ``quantize --format w4a16 --scope model`` quantizes beyond the routed experts, and its refusal.

Owns: ``plan_whole_model`` (from the config and shard headers: the non-expert nn.Linear weights
quantized to int4 with the experts' group args, lm_head's weight at int8 per channel,
``LM_HEAD_ARGS``, and the ``ignore`` list: routers and gates, a tied lm_head; as
llm-compressor's whole-model exports write them) and the refusal, before anything is written,
of a module torch's CPU kernels cannot compute packed (naming the module and the reason). Why
int8 for lm_head: docs/formats.md, "Whole-model int4". Does not: quantize or write
(``tools.quantize``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

LM_HEAD = "lm_head"
# lm_head's weights: int8, one scale per output row, symmetric (compressed-tensors' W8A16 per channel)
LM_HEAD_ARGS = dict(num_bits=8, type="int", symmetric=True, strategy="channel")
# the last part of a module name that makes it a router or gate (kept unquantized, as llm-compressor's
# default ignore: ``re:.*mlp.gate$``; Qwen2-MoE's shared_expert_gate [1, H] too)
ROUTER_SUFFIXES = ("gate", "shared_expert_gate", "router")
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass(frozen=True)
class WholeModelPlan:
    """The non-expert part of a whole-model w4a16 export: ``linear_keys`` (weight keys quantized to
    int4 with the experts' group args), ``lm_head_key`` (int8 per channel; None when tied to the
    embeddings) and ``ignore`` (nn.Linear module names left unquantized, sorted).
    """

    linear_keys: frozenset[str]
    lm_head_key: str | None
    ignore: tuple[str, ...]

    @property
    def keys(self) -> frozenset[str]:
        """Every non-expert weight key quantized (the int4 linears and lm_head's)."""
        return self.linear_keys | ({self.lm_head_key} if self.lm_head_key else set())

    def scheme_of(self, key: str, scheme):
        """The compressed-tensors ``QuantizationScheme`` weight ``key`` is written in: lm_head's
        (``lm_head_scheme``), else ``scheme`` (the experts' group, targets ``Linear``)."""
        return lm_head_scheme() if key == self.lm_head_key else scheme

    def config_groups(self, scheme) -> dict:
        """config.json's ``config_groups``: ``scheme`` (targets ``Linear``) first, as llm-compressor
        writes it and transformers reads the experts' scheme from, then lm_head's group."""
        return {"group_0": scheme, **({"group_1": lm_head_scheme()} if self.lm_head_key else {})}


def lm_head_scheme():
    """lm_head's compressed-tensors scheme: ``LM_HEAD_ARGS``, pack-quantized, targets ``lm_head``."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=[LM_HEAD], weights=QuantizationArgs(**LM_HEAD_ARGS), format="pack-quantized")


def plan_whole_model(config: dict, headers: dict[Path, dict], expert_keys: set[str], *, group_size: int,
                     symmetric: bool) -> WholeModelPlan:
    """``WholeModelPlan`` of a checkpoint (config.json's dict, {shard: header}, the routed expert
    weight keys): every nn.Linear of the model's skeleton whose weight the checkpoint stores, but
    routers and gates (``ROUTER_SUFFIXES``).

    Raises:
        ValueError: a module torch's CPU kernels cannot compute packed at ``group_size`` (names the
            module, the reason and the flags), or in_features not a multiple of ``group_size``;
            nothing has been written then.
    """
    from pagedexperts.formats.compressed_tensors.schemes import non_expert_linear_names
    from pagedexperts.loading.checkpoint import KeyMap

    infos = {k: info for h in headers.values() for k, info in h.items()}
    rename = KeyMap(config["model_type"], {}).rename
    linears = set(non_expert_linear_names(config) or ())
    weights = {k.removesuffix(".weight"): k for k, info in infos.items()
               if k.endswith(".weight") and len(info["shape"]) == 2 and k not in expert_keys}
    routers = {m for m in weights if m.rpartition(".")[2] in ROUTER_SUFFIXES}
    quantized = {m for m in weights if rename(m) in linears and m not in routers and m != LM_HEAD}
    tied = bool(config.get("tie_word_embeddings", False))
    lm_head_key = weights.get(LM_HEAD) if LM_HEAD in linears and not tied else None
    for module in sorted(quantized):
        _check_packable(module, infos[weights[module]], group_size=group_size, symmetric=symmetric)
    kept = {m for m in linears if m not in {rename(q) for q in quantized} and (m != LM_HEAD or lm_head_key is None)}
    return WholeModelPlan(frozenset(weights[m] for m in quantized), lm_head_key, tuple(sorted(kept | routers)))


def _check_packable(module: str, info: dict, *, group_size: int, symmetric: bool) -> None:
    """Raises ValueError when module's int4 weight at ``group_size`` is one torch's CPU int4
    kernel cannot compute packed (``formats.cpu_pack.plan_tensor``'s reason)."""
    from pagedexperts.formats.compressed_tensors.w4a16 import CompressedTensorsW4A16Format
    from pagedexperts.formats.cpu_pack import plan_tensor

    out_features, in_features = info["shape"]
    what = f"--scope model: {module} (weight [{out_features}, {in_features}])"
    if in_features % group_size:
        raise ValueError(f"{what}: in_features {in_features} is not a multiple of --group-size {group_size}; pass a "
                         "group size that divides every quantized module's input size, or --scope experts")
    dtype = _SAFETENSORS_DTYPES.get(info["dtype"], torch.float32)
    fmt = CompressedTensorsW4A16Format(group_size=group_size, symmetric=symmetric)
    plan = plan_tensor(fmt, fmt.linear_tensor((out_features, in_features), dtype), dtype)
    if isinstance(plan, str):
        raise ValueError(f"{what}: torch's CPU kernels cannot compute it packed ({plan}); choose another "
                         "--group-size, or --scope experts to quantize the routed experts only")
