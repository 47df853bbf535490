"""Every choice a load resolves from its checked options: one frozen record, made once.

Owns: ``Resolved`` (K, device, dtype, experts implementation, slot format, decide, CUDA graphs,
the beyond-K rule, the host-memory plan, packed fallbacks, each with its reason), ``resolve``,
which makes it, and ``resolve_implementation``, the one evaluation per load of the experts
implementation's rule (made before the check and the memory plan, which read its value). The
runtime, the start-up line, ``/server_info`` and the stats read resolved choices from the record
only. The rules live beside the checks that share their predicates (``loading.config``). Does
not: check options or build.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from pagedexperts.formats.cpu_pack import plan_layout
from pagedexperts.loading.config import (AUTO, PagingConfig, known_run_dtype, planned_on_device, resolve_cuda_graphs,
                                         resolve_decide, resolve_experts_implementation, slot_format_of)
from pagedexperts.paging.steps.table import PACKED
from pagedexperts.storage.host_memory import HostMemoryPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resolved:
    """The choices one load (or ``loading.runners.repage``) resolved, and why; every "auto" and None resolved.

    Attributes:
        device: the torch device string ("cpu", "cuda:0"); dtype: the run dtype ("bfloat16", ...).
        num_resident: K, the slots per MoE layer (all E outside mode "paged").
        experts_implementation: the experts kernel; slot_format: "packed" or "dense".
        decide: "host" or "device"; cuda_graphs: "cuda" (captured), "eager" (no capture) or "off".
        beyond_k: "waves" or "in-place"; admit_per_step: in-place page-ins per layer-step (None: K).
        host_memory: the ``storage.host_memory.HostMemoryPlan`` (the disk tier where R < E).
        experts_fallbacks: MoE layer -> why it runs grouped_mm although packed was resolved.
        stored_layout: the stored kernel layout the packed disk tier reads, or a full packed store
            was read from or wrote at load (``loading.stored_layout``; None: it converts, or no
            experts run packed); its reason says which and why.
        reasons: choice name -> why it resolved so (the flag given, auto's rule, a default).

    The mappings are the record's own: read them, never write them.
    """

    device: str
    dtype: str
    num_resident: int
    experts_implementation: str
    slot_format: str
    decide: str
    cuda_graphs: str
    beyond_k: str
    admit_per_step: int | None
    host_memory: HostMemoryPlan
    experts_fallbacks: Mapping[int, str]
    reasons: Mapping[str, str]
    stored_layout: str | None = None

    def as_dict(self) -> dict:
        """The choices and their reasons as JSON-ready values (``/server_info``, reports)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("host_memory", "experts_fallbacks", "reasons")}
        out.update(host_memory=self.host_memory.describe(), disk_tier=self.host_memory.disk_tier,
                   experts_fallbacks={str(k): v for k, v in self.experts_fallbacks.items()},
                   reasons=dict(self.reasons))
        return out


def resolve_implementation(cfg: PagingConfig, fmt, model_config) -> str:
    """The experts implementation a load of ``cfg`` runs for format ``fmt`` (None: dense) and the
    transformers ``model_config``: "auto" resolved by ``loading.config.resolve_experts_implementation``
    at the run dtype (an unknown ``--dtype`` counts as bfloat16; the check names it). Safe on
    unchecked options.
    """
    return resolve_experts_implementation(cfg, fmt, known_run_dtype(cfg, model_config))


def resolve(cfg: PagingConfig, fmt, *, experts_implementation: str | None = None, num_experts: int, top_k: int, device: torch.device,
            dtype: torch.dtype, sites, layouts: Mapping, memory: HostMemoryPlan, stores: Mapping) -> Resolved:
    """The ``Resolved`` record of checked ``cfg`` for a model of ``num_experts`` experts per layer
    routing ``top_k`` at run ``dtype``, format ``fmt`` (None: dense), running
    ``experts_implementation`` (``resolve_implementation``'s value; None: resolved here), its
    ``sites`` and ``layouts``, the host-memory plan ``memory`` and host ``stores`` (page-locked or
    not decides auto's ``decide``). Logs auto's fallback WARNINGs once.

    Raises:
        ConfigError: ``cuda_graphs`` "on" where capture cannot work (``resolve_cuda_graphs``).
    """
    k = cfg.resident_slots(num_experts=num_experts, top_k=top_k)
    implementation = experts_implementation or resolve_experts_implementation(cfg, fmt, dtype)
    quantized = any(lay is not None and not lay.is_dense for lay in layouts.values())
    decide = resolve_decide(cfg, disk_tier=memory.disk_tier, pinned=all(s.pinned for s in stores.values()),
                            quantized=quantized)
    graphs, graphs_reason = resolve_cuda_graphs(cfg, decide)
    fallbacks = {}
    if implementation == PACKED:
        for site in sites:
            plans = plan_layout(layouts.get(site.name))
            if isinstance(plans, str):
                fallbacks[site.layer] = plans
        _warn_fallbacks(fallbacks)
    reasons = dict(
        dtype=f"--dtype {cfg.dtype}" if cfg.dtype not in (None, AUTO) else "the checkpoint's",
        num_resident=_k_reason(cfg, k, num_experts=num_experts, top_k=top_k),
        experts_implementation=(f"auto: {implementation} for {fmt.name if fmt is not None else 'dense'} on "
                                f"{device.type}" if cfg.experts_implementation == AUTO else
                                _option(cfg, "experts_implementation")),
        slot_format=(f"unused: every MoE layer's slots hold torch's CPU kernel layout (--experts-implementation "
                     f"{cfg.experts_implementation})" if implementation == PACKED and not fallbacks
                     else _option(cfg, "slot_format") if cfg.slot_format != AUTO else
                     f"auto: {slot_format_of(cfg)} for {implementation} on {device.type}"),
        decide=_decide_reason(cfg, decide, device),
        cuda_graphs=graphs_reason or _option(cfg, "cuda_graphs"),
        beyond_k=_option(cfg, "beyond_k"),
        host_memory=(f"--host-memory-gb {cfg.host_memory_gb:g}" if cfg.host_memory_gb is not None
                     else "the available memory")
        + (": the disk tier" if memory.disk_tier else ""),
    )
    return Resolved(device=str(device), dtype=str(dtype).removeprefix("torch."), num_resident=k, experts_implementation=implementation,
                    slot_format=slot_format_of(cfg), decide=decide, cuda_graphs=graphs, beyond_k=cfg.beyond_k,
                    admit_per_step=cfg.admit_per_step, host_memory=memory,
                    experts_fallbacks=fallbacks, reasons=reasons)


def _option(cfg: PagingConfig, name: str) -> str:
    """'--flag value', and '(the default)' where the value is the field's default."""
    value = getattr(cfg, name)
    default = next(f.default for f in fields(PagingConfig) if f.name == name)
    return f"--{name.replace('_', '-')} {value}" + (" (the default)" if value == default else "")


def _k_reason(cfg: PagingConfig, k: int, *, num_experts: int, top_k: int) -> str:
    if cfg.mode != "paged":
        return f"mode {cfg.mode}: all E={num_experts} resident"
    if cfg.num_resident is not None:
        return f"--num-resident {k}"
    return f"the default max(top_k, E // 4) = max({top_k}, {num_experts} // 4) = {k}"


def _decide_reason(cfg: PagingConfig, decide: str, device: torch.device) -> str:
    if cfg.decide != AUTO:
        return _option(cfg, "decide")
    if planned_on_device(cfg):
        return "auto: the fused kernels run on the device-planned step"
    return f"auto: {decide} on {device.type}" + (" (the WARNING above says why)" if device.type == "cuda"
                                                  and decide == "host" else "")



def _warn_fallbacks(fallbacks: dict[int, str]) -> None:
    """One WARNING per reason a layer runs grouped_mm under --experts-implementation packed, naming its layers."""
    by_reason: dict[str, list[int]] = {}
    for layer, why in sorted(fallbacks.items()):
        by_reason.setdefault(why, []).append(layer)
    for why, layers in by_reason.items():
        logger.warning("--experts-implementation packed: MoE layers %s run grouped_mm instead (%s)", layers, why)
