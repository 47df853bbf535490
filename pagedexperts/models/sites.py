"""Architecture adapters: where a family's routed experts live, found from the model, not a list.

Owns the supported architectures and the discovery of experts modules (transformers' experts
registry) and their per-expert tensors (leading dim E). Routers, shared experts and dense layers
stay the model's own, never paged. Does not: read checkpoints or page.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch

from pagedexperts.models.config import EXPERT_COUNT_KEYS, moe_layer_indices
from pagedexperts.models.families import FAMILIES, experts_transposed
from pagedexperts.formats.base import TensorSpec

# model_type (config.json) -> family name. Each entry is covered by an exactness test
# (tests/models/test_families.py); the families' layer rules and quirks are in ``families``.
SUPPORTED_ARCHITECTURES: dict[str, str] = {t: f.name for t, f in FAMILIES.items()}

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertsSite:
    """One routed-experts module of a model: its decoder layer index and per-expert tensors."""

    layer: int
    name: str  # dotted module name, e.g. "model.layers.3.mlp.experts"
    module: torch.nn.Module
    num_experts: int
    specs: tuple[TensorSpec, ...]


def check_supported(config) -> str:
    """The family name of ``config``'s architecture.
    Raises ValueError: not an MoE model, an unsupported architecture (lists them), or a quantized checkpoint
    in no supported expert format (``pagedexperts.formats``)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        what = "an MoE architecture not yet supported" if declares_experts(type(config)) else "not an MoE model"
        raise ValueError(
            f"model_type {model_type!r} is {what}; supported: "
            + ", ".join(f"{k} ({v})" for k, v in sorted(SUPPORTED_ARCHITECTURES.items()))
        )
    from pagedexperts.formats import format_for_config

    # a quantized checkpoint must be a supported expert format, with a layout for this family's experts
    format_for_config(config, transposed_experts=experts_transposed(config))
    return SUPPORTED_ARCHITECTURES[model_type]


def declares_experts(config_class: type) -> bool:
    """Whether a transformers config class declares a routed-expert count (``EXPERT_COUNT_KEYS``)."""
    params = inspect.signature(config_class.__init__).parameters
    return any(hasattr(config_class, key) or key in params for key in EXPERT_COUNT_KEYS)


def is_experts_module(module: torch.nn.Module) -> bool:
    """True for modules of transformers' experts registry (``has_gate``, ``is_transposed``,
    ``num_experts``: every 5.x from 5.17)."""
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "num_experts"))


def find_experts_sites(model: torch.nn.Module) -> list[ExpertsSite]:
    """All routed-experts modules of ``model``, in layer order, with their per-expert tensors.
    Raises ValueError: an experts module whose layout is not understood, or none."""
    sites = []
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        match = _LAYER_RE.search(name + ".")
        if match is None:
            raise ValueError(f"experts module {name!r} has no 'layers.N.' in its name")
        sites.append(
            ExpertsSite(
                layer=int(match.group(1)),
                name=name,
                module=module,
                num_experts=int(module.num_experts),
                specs=per_expert_specs(module, name),
            )
        )
    if not sites:
        raise ValueError(f"{type(model).__name__} has no routed-experts module to page")
    sites.sort(key=lambda s: s.layer)
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) in FAMILIES:
        check_family_layout(model, sites)
    return sites


def check_family_layout(model: torch.nn.Module, sites: list[ExpertsSite]) -> None:
    """Experts modules exactly in the config's MoE layers, each shared expert a plain resident module.
    Raises ValueError: the model's layout disagrees with its family's rules."""
    config = model.config
    family = FAMILIES[config.model_type]
    found = [s.layer for s in sites]
    expected = moe_layer_indices(config)
    if found != expected:
        raise ValueError(
            f"{family.name}: experts modules found in decoder layers {found}, but the config's "
            f"MoE layers are {expected}; this transformers version builds the model differently"
        )
    if family.shared_expert is None:
        return
    for site in sites:
        block = model.get_submodule(site.name.rpartition(".")[0])
        shared = getattr(block, family.shared_expert, None)
        if shared is None or any(is_experts_module(m) for m in shared.modules()):
            raise ValueError(
                f"{family.name}: {site.name.rpartition('.')[0]}.{family.shared_expert} is missing or "
                "is an experts-registry module; shared experts must stay resident, unpaged"
            )


def router_of(model: torch.nn.Module, site: ExpertsSite) -> torch.nn.Module:
    """The router module of ``site``'s MoE block (the family's ``router`` attribute).
    Raises ValueError: the family is unknown or its block has no such module."""
    family = FAMILIES.get(getattr(model.config, "model_type", None))
    block_name = site.name.rpartition(".")[0]
    router = getattr(model.get_submodule(block_name), family.router, None) if family else None
    if not isinstance(router, torch.nn.Module):
        raise ValueError(
            f"no router module found at {block_name}.{family.router if family else '?'} for "
            f"model_type {getattr(model.config, 'model_type', None)!r}; prefetch needs the family's router"
        )
    return router


def per_expert_specs(module: torch.nn.Module, name: str = "") -> tuple[TensorSpec, ...]:
    """Every direct parameter or buffer of ``module`` with leading dim E, as TensorSpecs.
    Raises ValueError: a direct tensor without leading dim E, or none."""
    num_experts = int(module.num_experts)
    specs = []
    tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
    for tname, t in tensors:
        if t.dim() == 0 or t.shape[0] != num_experts:
            raise ValueError(
                f"experts module {name or type(module).__name__}: tensor {tname!r} of shape "
                f"{tuple(t.shape)} has no leading dim E={num_experts}; this layout is not "
                "understood, so it cannot be paged"
            )
        specs.append(TensorSpec(name=tname, shape=tuple(t.shape[1:]), dtype=t.dtype))
    if not specs:
        raise ValueError(f"experts module {name!r} has no per-expert tensor")
    return tuple(specs)
