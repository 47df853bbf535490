"""Build a paged model: parameters on meta, host stores for the experts, one runner per MoE layer.

Owns: ``build_paged_model`` (the one build, for a checkpoint or random weights;
``build_from_options`` checks keyword options first): the transformers model with its
parameters on meta, the float32-kept tensors, the host-memory plan counted before any
allocation, the host stores (full, or the disk tier's), the ``Resolved`` record, and the
runtime, runners and integration installed on the model. Does not: check options
(``loading.config``), read checkpoints (``loading.fill``), or page.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from pagedexperts import integration
from pagedexperts.formats import format_for_config
from pagedexperts.formats.base import ExpertFormat, ExpertLayout
from pagedexperts.formats.cpu_pack import kernel_specs, plan_layout
from pagedexperts.loading.config import PagingConfig, check_config, check_device, disk_tier_problem, resolve_dtype
from pagedexperts.loading.resolved import resolve, resolve_implementation
from pagedexperts.loading.linears import plan_model_linears
from pagedexperts.loading.runners import attach_runners
from pagedexperts.loading.runtime import PagingRuntime
from pagedexperts.loading.checkpoint import expert_sources
from pagedexperts.models import config as model_config
from pagedexperts.models.families import experts_transposed
from pagedexperts.models.sites import ExpertsSite, find_experts_sites
from pagedexperts.paging.steps.table import PACKED, transformers_inner
from pagedexperts.storage import host_memory
from pagedexperts.storage.host_memory import HostMemoryPlan, plan_host_memory
from pagedexperts.storage.host_store import HostExpertStore
from pagedexperts.storage.host_tier import ReadAhead, TieredExpertStore

logger = logging.getLogger(__name__)

READ_AHEAD_EXPERTS_PER_TOP_K = 2  # disk tier staging: read-ahead buffers = 2 x top_k experts
KV_ESTIMATE_TOKENS = 4096  # tokens of KV cache counted in host memory on a CPU device (one long request)


@dataclass(frozen=True)
class MetaBuild:
    """A model of ``config`` with its parameters on meta and what the build derives from it before any
    allocation: the format ``fmt``, the experts ``sites`` and their ``layouts``, the device, the run
    dtype, top_k and the host-memory ``memory`` plan."""

    model: torch.nn.Module
    fmt: ExpertFormat
    sites: list[ExpertsSite]
    layouts: dict[str, ExpertLayout]  # site name -> its experts' layout
    dev: torch.device
    dtype: torch.dtype
    top_k: int
    memory: HostMemoryPlan
    available_bytes: int | None  # what the plan took as available (None: unknown)


def meta_build(config, cfg: PagingConfig, *, experts_implementation: str, expert_format=None,
               files=None, held_later_bytes: int = 0) -> MetaBuild:
    """``build_paged_model``'s first part: the model on meta, its sites and layouts, and the host-memory
    plan checked (``_plan_memory``); nothing is read from the checkpoint but ``files``' headers and
    nothing is allocated, so a caller can refuse a budget before other work (``check`` does, per K,
    before its reference loads). ``held_later_bytes``: what the process will hold beyond what it holds
    now when the real load plans (``check``: its unpaged reference), counted as held in the plan.

    Raises:
        MemoryError / ValueError: host memory (``storage.host_memory.plan_host_memory``; a disk tier
            that mode or ``--decide device`` cannot serve).
    """
    fmt = expert_format if expert_format is not None else format_for_config(
        config, transposed_experts=experts_transposed(config))
    dev, dtype = check_device(cfg.device), resolve_dtype(cfg.dtype, config)
    model = _meta_model(config, dtype, cfg.experts_implementation)
    sites = find_experts_sites(model)
    num_experts, top_k = sites[0].num_experts, int(config.num_experts_per_tok)
    sources = expert_sources(config.model_type)
    layouts = {s.name: fmt.layout(s.specs, sources=sources, transposed=bool(getattr(s.module, "is_transposed", False)))
               for s in sites}
    packed = experts_implementation == PACKED
    linears = None if files is None or fmt.name == "dense" else plan_model_linears(model, files, fmt, packed=packed)
    memory, available = _plan_memory(model, config, sites, layouts, dev, dtype, cfg, top_k=top_k, linears=linears,
                                     packed=packed, k_slots=cfg.resident_slots(num_experts=num_experts, top_k=top_k),
                                     held_later_bytes=held_later_bytes)
    return MetaBuild(model=model, fmt=fmt, sites=sites, layouts=layouts, dev=dev, dtype=dtype, top_k=top_k,
                     memory=memory, available_bytes=available)


def build_paged_model(config, fill, cfg: PagingConfig, *, experts_implementation: str, expert_format=None, files=None,
                      before_fill=None):
    """Build ``config``'s model with parameters on meta, host stores for the experts, and runners.

    ``cfg``: the options, checked (``loading.config.check_config``) with ``experts_implementation``,
    ``loading.resolved.resolve_implementation``'s value, which the memory plan reads too; every
    choice is resolved here once (``loading.resolved.resolve``) into ``model.pagedexperts.resolved``.
    ``fill(model, sites, stores, device)`` puts the weights in place (``loading.fill``, or
    ``loading.runners.random_fill``) and returns the ``loading.linears.QuantizedLinears`` or None.
    ``expert_format``: the checkpoint's format (None: from ``config``); ``files``: its shards, whose
    quantized non-expert modules the host-memory plan counts. ``before_fill(runtime)``: called once the
    stores exist, before ``fill`` (``load_model`` reads a stored kernel layout into them).

    Raises:
        MemoryError / ValueError: host memory (``meta_build``).
        ConfigError: ``cuda_graphs`` "on" where capture cannot work.
    """
    meta = meta_build(config, cfg, experts_implementation=experts_implementation, expert_format=expert_format,
                      files=files)
    model, sites, layouts, memory, dev = meta.model, meta.sites, meta.layouts, meta.memory, meta.dev
    logger.info("host memory (budget: %s): %s", _budget_source(cfg, meta.available_bytes), memory.describe())
    stores, read_ahead = _make_stores(sites, layouts, memory, cfg.policy, dev)
    num_experts, top_k = sites[0].num_experts, meta.top_k
    resolved = resolve(cfg, meta.fmt, experts_implementation=experts_implementation, num_experts=num_experts,
                       top_k=top_k, device=dev, dtype=meta.dtype, sites=sites, layouts=layouts, memory=memory,
                       stores=stores)
    runtime = PagingRuntime(config=cfg, resolved=resolved, num_experts=num_experts, top_k=top_k,
                            expert_format=meta.fmt.name, layouts=layouts, sites=sites, stores=stores,
                            read_ahead=read_ahead)
    if before_fill is not None:
        before_fill(runtime)
    runtime.quantized_linears = fill(model, {s.name: s for s in sites}, runtime.stores, dev)
    attach_runners(runtime, dev)
    _install(model, runtime, dev)
    return model


def build_from_options(config, fill, *, expert_format=None, files=None, **options):
    """``build_paged_model`` from ``PagingConfig`` keyword ``options``, checked first against ``config``
    (a ``ConfigError`` listing every problem at once).
    """
    fmt = expert_format if expert_format is not None else format_for_config(
        config, transposed_experts=experts_transposed(config))
    cfg = PagingConfig(**options)
    implementation = resolve_implementation(cfg, fmt, config)
    check_config(cfg, config, fmt, experts_implementation=implementation)
    return build_paged_model(config, fill, cfg, experts_implementation=implementation, expert_format=fmt, files=files)


def _install(model, runtime: PagingRuntime, dev: torch.device) -> None:
    """The model on its device, in eval mode, with its runtime object and the integration."""
    model.to(dev)
    model.eval()
    model.pagedexperts = runtime
    integration.install_padding_hook(model, runtime.runners)
    integration.set_implementation(model, integration.IMPLEMENTATION_NAME)
    integration.follow_decode_switch(model, runtime.runners)


@contextlib.contextmanager
def _parameters_on_meta():
    """Create every nn.Parameter on the meta device (buffers stay real: rotary tables etc.)."""
    original = torch.nn.Module.register_parameter

    def register_parameter(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def _meta_model(config, dtype: torch.dtype, experts_implementation: str):
    """The transformers model of ``config`` with its parameters on meta, float32-kept tensors
    in float32 (``_keep_in_fp32``)."""
    from transformers import AutoModelForCausalLM

    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 experts_implementation=transformers_inner(experts_implementation))
    _keep_in_fp32(model, dtype)
    return model


def _make_stores(sites, layouts, memory: HostMemoryPlan, policy: str, dev: torch.device):
    """({site name: store}, the disk tier's ``ReadAhead`` or None): one store per experts site
    (full, or the disk tier's R host rows); the experts modules keep no [E, ...] tensor
    afterwards (only the runners' slots and stores hold experts)."""
    pin, read_ahead = dev.type == "cuda", None
    if memory.disk_tier:
        specs0 = list(layouts[sites[0].name].packed_specs)
        read_ahead = ReadAhead(specs0, num_buffers=memory.staging_bytes // memory.expert_bytes, pin=pin)
    stores = {}
    for site in sites:
        specs = list(layouts[site.name].packed_specs)
        if memory.disk_tier:
            stores[site.name] = TieredExpertStore(specs, site.num_experts, memory.host_rows, policy=policy,
                                                  pin=pin, layer=site.layer, read_ahead=read_ahead)
        else:
            stores[site.name] = HostExpertStore(specs, site.num_experts, pin=pin)
        for spec in site.specs:
            site.module._parameters.pop(spec.name, None)
            site.module._buffers.pop(spec.name, None)
    return stores, read_ahead


def _plan_memory(model, config, sites, layouts, dev, dtype, cfg: PagingConfig, *, k_slots: int, top_k: int,
                 linears=None, packed: bool = False, held_later_bytes: int = 0) -> tuple[HostMemoryPlan, int | None]:
    """(plan, available bytes it took): everything that will live in host memory, counted before any allocation
    (``storage.host_memory``); the disk tier (R < E) for mode "paged" only. Slots count at the
    larger slot size; ``packed``: slots (and a converted store) in the kernels' layout; ``linears``
    kept packed at their kernel layout's bytes. The available memory is credited with the part of
    the runtime allowance this process already holds (MemAvailable and the cgroup's room exclude it);
    ``held_later_bytes`` join the runtime allowance as held, not the credit (not yet taken from MemAvailable).
    """
    packed_specs = layouts[sites[0].name].packed_specs
    expert_bytes = sum(s.row_bytes for s in packed_specs)
    slot_expert_bytes = max(expert_bytes, sum(s.row_bytes for s in sites[0].specs))
    kernel = _kernel_expert_bytes(layouts[sites[0].name]) if packed else None
    if kernel is not None:  # packed on the CPU: slots (and a converted store) hold the kernels' layout
        slot_expert_bytes, expert_bytes = kernel, max(expert_bytes, kernel)
    on_cpu, paged = dev.type == "cpu", cfg.mode == "paged"
    runtime, held = host_memory.runtime_allowance(dev.type)
    available = host_memory.host_memory_available_bytes()
    if available is not None:
        available += held  # MemAvailable and the cgroup's room exclude what the process holds
    runtime, held = runtime + held_later_bytes, held + held_later_bytes
    memory = plan_host_memory(
        budget_bytes=None if cfg.host_memory_gb is None else int(cfg.host_memory_gb * 1e9),
        available_bytes=available,
        num_layers=len(sites), num_experts=sites[0].num_experts, expert_bytes=expert_bytes,
        slot_bytes_on_host=k_slots * len(sites) * slot_expert_bytes if on_cpu and paged else 0,
        staging_bytes=READ_AHEAD_EXPERTS_PER_TOP_K * top_k * expert_bytes,
        non_expert_bytes_on_host=_non_expert_bytes(model, sites, linears) if on_cpu else 0,
        kv_bytes_on_host=_kv_estimate_bytes(config, dtype) if on_cpu else 0,
        runtime_bytes=runtime, runtime_held_bytes=held,
        # packed slots on a CPU read a full store's rows in place: their own rows are never written
        slots_read_full_store=on_cpu and packed and all(_kernel_expert_bytes(layouts[s.name]) is not None
                                                        for s in sites),
    )
    if memory.disk_tier and not paged:
        raise ValueError(
            f"mode {cfg.mode!r} needs all E experts in host memory ({memory.num_experts * len(sites) * expert_bytes:,} "
            f"bytes) but {memory.describe()}; use --mode paged for the disk tier or raise --host-memory-gb"
        )
    problem = disk_tier_problem(cfg, disk_tier=memory.disk_tier, described=memory.describe())
    if problem is not None:
        raise ValueError(problem)
    return memory, available


def _budget_source(cfg: PagingConfig, available: int | None) -> str:
    """Where the host-memory budget came from, in words (the start-up line's)."""
    if cfg.host_memory_gb is not None:
        return f"--host-memory-gb {cfg.host_memory_gb}"
    return ("none given: what is available, the smaller of MemAvailable and the memory cgroup's room, "
            f"{'unknown' if available is None else f'{available / 1e9:.3g} GB'}")


def _kernel_expert_bytes(layout) -> int | None:
    """Bytes of one expert in torch's CPU kernel layouts (``formats.cpu_pack``), or None where
    the kernels cannot take ``layout``."""
    plans = plan_layout(layout)
    return None if isinstance(plans, str) else sum(s.row_bytes for s in kernel_specs(layout, plans))


def _non_expert_bytes(model, sites, linears=None) -> int:
    """Bytes of every parameter that is not a routed expert's (they live on the device): a
    quantized module kept packed (``QuantizedLinears.packed``) at its kernel layout's bytes."""
    expert_params = {f"{s.name}.{spec.name}" for s in sites for spec in s.specs}
    packed = set(linears.packed) if linears is not None else set()
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if n not in expert_params and n not in packed)
    return dense + (linears.kernel_bytes if linears is not None else 0)


def _kv_estimate_bytes(config, dtype: torch.dtype) -> int:
    """KV bytes of one KV_ESTIMATE_TOKENS-token request at the run dtype: the one KV formula
    (``models.config.kv_bytes_per_token``: MLA and linear-attention layers as they are)."""
    name = str(dtype).removeprefix("torch.")
    return model_config.kv_bytes_per_token(config.to_dict(), model_dtype=name) * KV_ESTIMATE_TOKENS


def _keep_in_fp32(model, dtype: torch.dtype) -> None:
    """Give float32 to the tensors the model class keeps in float32, as ``from_pretrained`` does
    (``_keep_in_fp32_modules_strict`` under bf16/fp16, ``_keep_in_fp32_modules`` under fp16: e.g.
    DeepSeek-V3's ``e_score_correction_bias``, which in bf16 selects other experts).
    """
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) if dtype in (torch.bfloat16, torch.float16) else set()
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if not keep:
        return
    for name, param in list(model.named_parameters()):
        if param.dtype != torch.float32 and any(k in name for k in keep):
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            module._parameters[attr] = torch.nn.Parameter(param.to(torch.float32), requires_grad=param.requires_grad)
    for name, buf in list(model.named_buffers()):
        if buf.is_floating_point() and buf.dtype != torch.float32 and any(k in name for k in keep):
            module_name, _, attr = name.rpartition(".")
            model.get_submodule(module_name)._buffers[attr] = buf.to(torch.float32)
