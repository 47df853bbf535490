"""Experts runners of a loaded model: one per MoE layer, prefetch, ``repage``, random weights.

Owns: which runner each MoE layer gets (a host or device executor over the slot table
``slot_table`` chooses, as ``PagingRuntime.resolved`` says, or a baseline of
``paging.baselines``; the one module that imports the executors), ``install_prefetch``,
``repage`` (another mode or K over the same stores) and ``random_fill``. Does not: read
checkpoints or plan memory (``loading.build``), page (``paging``) or decide residency.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from pagedexperts import integration
from pagedexperts.formats import FORMATS, slots
from pagedexperts.formats.cpu_pack import CpuPackedSlots, plan_layout
from pagedexperts.formats.slots import SlotTable
from pagedexperts.loading.config import check_config
from pagedexperts.loading.resolved import resolve, resolve_implementation
from pagedexperts.models.sites import router_of
from pagedexperts.paging import prefetch
from pagedexperts.paging.baselines import CpuExpertsRunner, OffloadRunner, ResidentRunner, make_staging
from pagedexperts.paging.device_executor import DeviceExecutor
from pagedexperts.paging.host_executor import HostExecutor
from pagedexperts.paging.runner_contract import PagedExecutor
from pagedexperts.paging.steps.contract import SlotSetup
from pagedexperts.paging.steps.table import FUSED, PACKED
from pagedexperts.residency.policies import make_policy
from pagedexperts.storage.host_store import HostExpertStore

logger = logging.getLogger(__name__)


def repage(model, *, mode: str = "paged", num_resident: int | None = None, policy: str | None = None,
           experts_implementation: str | None = None, beyond_k: str | None = None) -> None:
    """Re-attach fresh runners (new mode, K, policy, experts implementation or beyond-K rule; empty
    slots, zeroed stats, the disk tier's too) over the same stores, the choices resolved again into a
    new ``Resolved``. The experts implementation stays the resolved one unless given; prefetch is off,
    and a disk tier reads ahead as after a load (unless --no-read-ahead).

    Raises:
        ConfigError (ValueError): unknown mode, K out of [top_k, E], any other problem of the options.
    """
    rt = model.pagedexperts
    options = rt.config
    cfg = dataclasses.replace(options, num_resident=num_resident, mode=mode, policy=policy or options.policy,
                              experts_implementation=experts_implementation or rt.resolved.experts_implementation,
                              beyond_k=beyond_k or options.beyond_k, prefetch=False, prefetch_budget=None)
    fmt = FORMATS[rt.expert_format]
    implementation = resolve_implementation(cfg, fmt, model.config)
    check_config(cfg, model.config, experts_implementation=implementation)
    dev = torch.device(rt.resolved.device)
    for runner in rt.runners.values():
        runner.release()  # copies in flight into its slots finish before the slots are freed
    rt.runners.clear()
    rt.buffers.clear()  # the shared scratch / staging are sized for K
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    rt.config = cfg
    old = rt.resolved
    rt.resolved = resolve(cfg, fmt, experts_implementation=implementation, num_experts=rt.num_experts, top_k=rt.top_k, device=dev,
                          dtype=getattr(torch, old.dtype), sites=rt.sites, layouts=rt.layouts,
                          memory=rt.host_memory, stores=rt.stores)
    if "stored_layout" in old.reasons:  # the stores read what they read before (the load's choice)
        rt.resolved = dataclasses.replace(rt.resolved, stored_layout=old.stored_layout,
                                          reasons={**rt.resolved.reasons, "stored_layout": old.reasons["stored_layout"]})
    attach_runners(rt, dev)
    rt.reset_stats()  # the stores outlive the runners: their tier counters start again with them
    if cfg.mode == "paged" and cfg.read_ahead and rt.host_memory.disk_tier:
        install_prefetch(model, page_in=False)  # the disk tier's read-ahead, as the load installs it


def random_fill(model, sites, stores, device, *, seed: int = 0, std: float = 0.02) -> None:
    """Fill a model from ``loading.build.build_paged_model`` with random weights (norm weights = 1),
    for benchmarks at a real model's scale: bytes moved and kernel times are representative, hit
    rates are not (random weights route near-uniformly).
    """
    gen = torch.Generator().manual_seed(seed)
    if any(not isinstance(store, HostExpertStore) for store in stores.values()):
        raise ValueError("random weights need the full host store; the disk tier reads a checkpoint (raise --host-memory-gb)")
    for store in stores.values():
        for t in store.tensors.values():
            _tile_random(t, gen, std)
    for name, p in list(model.named_parameters()):
        if p.device.type != "meta":
            continue
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if "norm" in name:
            value = torch.ones(p.shape, dtype=p.dtype)
        else:
            value = (torch.randn(p.shape, generator=gen) * std).to(p.dtype)
        module._parameters[attr] = torch.nn.Parameter(value.to(device), requires_grad=p.requires_grad)


RANDOM_BLOCK = (1 << 22) + 1  # elements of the random block tiled over store tensors


def _tile_random(t: torch.Tensor, gen: torch.Generator, std: float) -> None:
    """Fill ``t`` in place with one random normal block (RANDOM_BLOCK elements, std ``std``) repeated,
    at memory speed; the block length divides no expert's size, so experts differ.
    """
    flat = t.view(-1)
    block = (torch.randn(min(RANDOM_BLOCK, flat.numel()), generator=gen) * std).to(t.dtype)
    for i in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - i)
        flat[i : i + n].copy_(block[:n])


def install_prefetch(model, *, budget: int | None = None, page_in: bool = True) -> list:
    """Give every paged MoE layer but the last a prefetcher into the next one (its router on
    this layer's input; ``paging.prefetch``). ``budget``: page-ins per layer per step at most
    (None: top_k). ``page_in`` False: the disk tier's read-ahead only (no slot changes); the disk
    tier reads ahead only where the config allows (``read_ahead``: --no-read-ahead).

    Raises:
        ValueError: budget < 1 (``--prefetch-budget``, the configuration check).
    """
    rt = model.pagedexperts
    if page_in and (not rt.config.prefetch or budget != rt.config.prefetch_budget):  # else: checked at load
        check_config(dataclasses.replace(rt.config, prefetch=True, prefetch_budget=budget))
    executors = {i: r for i, r in rt.runners.items() if isinstance(r, PagedExecutor)}
    routers = {s.layer: router_of(model, s) for s in rt.sites if s.layer in executors}
    return prefetch.install(executors, routers, budget=rt.top_k if budget is None else budget, page_in=page_in,
                            read_ahead=rt.config.read_ahead)


def attach_runners(runtime, dev) -> None:
    """One experts runner per MoE layer (an executor, or a baseline of ``paging.baselines``) for
    the runtime's config and its resolved choices (``PagingRuntime.resolved``), over its stores,
    attached to each experts module."""
    cfg, resolved = runtime.config, runtime.resolved
    host_paged = cfg.mode == "paged" and resolved.decide == "host"
    copy_stream = torch.cuda.Stream(dev) if dev.type == "cuda" and host_paged else None
    staging = make_staging(runtime.stores[runtime.sites[0].name], dev) if cfg.mode == "offload" else None
    for i, site in enumerate(runtime.sites):
        layout = runtime.layouts.get(site.name)
        common = dict(layer=site.layer, store=runtime.stores[site.name], device=dev,
                      inner=resolved.experts_implementation)
        if cfg.mode == "paged":
            runner = _executor(runtime, layout, dev, copy_stream, **common)
        elif cfg.mode == "offload":
            runner = OffloadRunner(staging=staging, layout=layout, **common)
        elif cfg.mode == "cpu-experts" and i < cfg.cpu_expert_layers:
            runner = CpuExpertsRunner(layout=layout, **common)
        else:
            runner = ResidentRunner(layout=layout, **common)
        runtime.runners[site.layer] = runner
        integration.attach(site.module, runner)


def _executor(runtime, layout, dev, copy_stream, **common) -> PagedExecutor:
    """The layer-step executor of one paged layer, host- or device-planned as ``PagingRuntime.decide``
    says, over the slot table ``slot_table`` chose.
    """
    cfg, resolved = runtime.config, runtime.resolved
    k = resolved.num_resident
    table, inner = slot_table(runtime, layout, dev, layer=common["layer"], store=common["store"])
    setup, common = SlotSetup(table, layout=layout), dict(common, inner=inner)
    if resolved.decide == "device":
        return DeviceExecutor(num_slots=k, policy=cfg.policy, backend=cfg.device_kernels, setup=setup,
                              beyond_k=resolved.beyond_k, admit_per_step=resolved.admit_per_step, **common)
    return HostExecutor(num_slots=k, policy=make_policy(cfg.policy, k), copy_stream=copy_stream, setup=setup, **common)


def slot_table(runtime, layout, dev, *, layer: int, store) -> tuple[SlotTable | None, str]:
    """The slot table of one paged layer and the implementation the layer runs over it (the one
    factory of slot tables): ``packed``: ``formats.cpu_pack.CpuPackedSlots`` with the store converted
    to the kernels' layout here (a layer the kernels cannot take: the tables below and
    ``grouped_mm``); ``fused`` or dense experts: None, the plain table the executor allocates; a
    quantized format under a dense kernel: ``formats.slots.DequantizingSlots`` (``--slot-format
    packed``) or ``formats.slots.DenseSlots`` (``dense``).
    """
    resolved = runtime.resolved
    k, inner = resolved.num_resident, resolved.experts_implementation
    if inner == PACKED and layer not in resolved.experts_fallbacks:
        table = CpuPackedSlots(layout, plan_layout(layout), k, dev)
        if isinstance(store, HostExpertStore) and set(store.tensors) != set(table):  # once: repage keeps it
            store.convert_rows(table.specs, table.convert_many)
        return table, inner
    if inner == PACKED:
        inner = "grouped_mm"
    if inner == FUSED or layout is None or layout.is_dense:
        return None, inner
    if resolved.slot_format == "packed":
        if "scratch" not in runtime.buffers:
            runtime.buffers["scratch"] = slots.allocate(layout.dense_specs, k, dev)
        return slots.DequantizingSlots(layout, slots.allocate(store.specs, k, dev), runtime.buffers["scratch"]), inner
    if "staging" not in runtime.buffers:
        runtime.buffers["staging"] = slots.allocate(layout.packed_specs, 1, dev)
    return slots.DenseSlots(layout, slots.allocate(layout.dense_specs, k, dev), runtime.buffers["staging"]), inner
