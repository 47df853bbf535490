"""The layer-step contract: what an executor holds to compute a paged layer's experts.

A paged layer-step (docs/design-layer-step.md) has two halves. An executor
(``paging.host_executor``, ``paging.device_executor``) owns where the experts are: the
residency, the page-ins, the stats. A body owns how they are computed over the K slots: one
``LayerStep`` per MoE layer, which the executor holds and never looks into:

1. prepare: ``LayerStep(setup)`` once per layer (and again when the experts implementation is
   switched), over the layer's ``SlotSetup``; what the body's kernels need that is fixed for
   the layer (the weight tensors, launch configurations) is built at its first step, once the
   experts module is known, and kept.
2. ``begin(module, hidden [T, H], top_k_index [T, k], routing) -> work``, once per step:
   ``routing`` says where each entry's expert is: ``HostRouting`` (the waves and the ids read
   back, host-planned) or ``DeviceRouting`` (each entry's slot and wave, on the device).
3. ``run_wave(work, wave, slot_map)``, once per wave after its page-ins: fills the unweighted
   outputs of the wave's entries, over what the slot table says its kernel reads
   (``SlotSetup.slots.kernel_tensors``, asked each wave: a body never asks which table it got).
4. ``combine(work, top_k_weights [T, k]) -> [T, H]``: the routing weights and the sum over k,
   in the order of the unpaged implementation (``grouped_mm``'s unless a body says otherwise).

Each body is one module of ``paging.steps``; ``steps.table`` says which body runs which experts
implementation on which path. This module also holds the plain slot table (``PackedSlots``, the
executors' default), and what the bodies that run transformers' own kernels share:
``DenseKernelStep``, ``SlotView``, ``weights_of``, ``in_unpaged_layout``, ``LayerStep.combine``.
Does not: page in, decide, time or count (the executors), or choose a slot table
(``loading.runners``).

Legend: T tokens, H hidden, k top_k, E experts, K slots, S = T k entries (flat, s = t k + j).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from pagedexperts.formats.base import ExpertLayout
from pagedexperts.formats.slots import SlotTable
from pagedexperts.storage.host_store import ExpertStore


@dataclass(frozen=True)
class SlotSetup:
    """What a body is prepared from, once per layer.

    Attributes:
        slots: the layer's slot table (``formats.slots.SlotTable``: what the page-ins write and
            what the kernel reads, ``kernel_tensors``), built by ``loading.runners.slot_table``;
            None until the executor allocates the plain table (``PackedSlots``) like the store's
            tensors.
        layout: the layer's quantized ``formats.base.ExpertLayout`` (how packed slot rows are
            read by a kernel that reads them packed), None for dense experts.
        store: the layer's host store, for a body that reads host rows in place.
        in_place: the routing's entries carry host rows (row K + e: expert e read in place from
            ``store``) beside slot rows (``--beyond-k in-place``; a body that reads them has
            ``reads_in_place``).
    """

    slots: SlotTable | None = None
    layout: ExpertLayout | None = None
    store: ExpertStore | None = None
    in_place: bool = False


class PackedSlots(SlotTable):
    """The plain slot table: {name: [K, ...]} slot tensors that hold the store's rows as they
    are (dense experts, or a quantized format's packed rows that the fused kernels read packed);
    the kernel reads them as they are. A page-in copies each row into its slot."""

    def write_rows(self, rows, slot: int, *, pinned: bool) -> None:
        """Copy one expert's rows {name: [*spec.shape]} (host memory, page-locked when
        ``pinned``) into row ``slot``: non-blocking from page-locked memory to a CUDA slot."""
        for name, row in rows.items():
            dst = self[name][slot]
            dst.copy_(row, non_blocking=pinned and dst.is_cuda)

    def copy_rows(self, source, loads, *, pinned: bool) -> None:
        """A wave's page-ins from a store that holds every row in memory (``SlotTable.copy_rows``),
        one tensor at a time."""
        for name, table in self.items():
            src, non_blocking = source[name], pinned and table.is_cuda
            for expert, slot in loads:
                table[slot].copy_(src[expert], non_blocking=non_blocking)

    def kernel_tensors(self, wave_slots) -> "PackedSlots":
        """The slot tensors themselves."""
        return self


class HostRouting(NamedTuple):
    """Where a host-planned step's entries are: ``ids`` [T, k] int64 numpy (the read-back ids)
    and ``waves`` (``residency.planner.Wave``: experts, slots, loads), in the order they run."""

    ids: np.ndarray
    waves: Sequence


class DeviceRouting(NamedTuple):
    """Where a device-planned step's entries are: ``entry_slot`` and ``entry_wave`` [S] int64
    on the device (``kernels.decide.remap_triton``): each entry's slot and wave."""

    entry_slot: torch.Tensor
    entry_wave: torch.Tensor


class LayerStep(ABC):
    """One layer's way of computing its experts over the K slots (module docstring).

    Attributes:
        planned: the executor that runs it, "host" or "device" (``steps.table``).
        needs_slot_map: ``run_wave`` reads an [E] expert -> slot map (host-planned: the
            executor passes ``transfer.SlotTransfers.slot_map``; else None).
        reads_in_place: it reads host rows K + e when the setup says so (``SlotSetup.in_place``).
    """

    planned = "host"
    needs_slot_map = False
    reads_in_place = False

    def __init__(self, setup: SlotSetup) -> None:
        self.setup = setup

    @abstractmethod
    def begin(self, module, hidden: torch.Tensor, top_k_index: torch.Tensor, routing) -> Any:
        """Start a step: hidden [T, H], top_k_index [T, k] (expert ids on the device), routing
        (``HostRouting`` or ``DeviceRouting``) -> the step's work, handed to the calls below."""

    @abstractmethod
    def run_wave(self, work, wave: int, slot_map: torch.Tensor | None = None) -> None:
        """Compute the entries of wave ``wave`` (0-based, in the step's order), its slots paged
        in; ``slot_map`` [E] int64 (expert -> slot in this wave, -1 elsewhere) when
        ``needs_slot_map``. An empty wave leaves the outputs as they are."""

    def combine(self, work, top_k_weights: torch.Tensor) -> torch.Tensor:
        """[T, H] in hidden's dtype: the entries weighted and summed over k. Here, for a work
        with ``hidden`` [T, H] and ``entry_out`` [S, H] (flat s = t k + j): the entry outputs
        times their weights [T, k], summed over k, as ``grouped_mm`` and ``batched_mm`` end
        (``weighted_out.view(T, k, H).sum(dim=1)``)."""
        num_tokens, top_k = top_k_weights.shape
        weighted = work.entry_out.view(num_tokens, top_k, -1) * top_k_weights.unsqueeze(-1)
        return weighted.sum(dim=1).to(work.hidden.dtype)

    def wave_view(self, module, wave_slots: Sequence[int]) -> "SlotView":
        """The experts module as this body's kernels read it once ``wave_slots`` are paged in
        (the independence check reads it): over the slot table's kernel tensors."""
        return SlotView(module, self.setup.slots.kernel_tensors(wave_slots))

    def capture_problem(self) -> str | None:
        """Why a CUDA graph cannot hold this body's waves, or None (the caller judges the rest):
        the slot table's answer (``SlotTable.capture_problem``)."""
        return self.setup.slots.capture_problem()


class DenseKernelStep(LayerStep):
    """A body that runs transformers' own dense kernels over the slot tensors (or the dense
    scratch): its ``weights`` (``Weights``, built at the first step by ``prepare``: the module is
    known then) and ``all_slots`` [K] (what a device-planned wave of packed slots dequantizes)."""

    def __init__(self, setup: SlotSetup) -> None:
        super().__init__(setup)
        self.weights: Weights | None = None
        self.all_slots: torch.Tensor | None = None

    def prepare(self, module, device: torch.device) -> None:
        """Build what is fixed for the layer (once, at its first step): the weights are views of
        the slot table's kernel tensors, the same objects every wave."""
        self.weights = weights_of(module, self.setup.slots.kernel_tensors(()))
        self.all_slots = torch.arange(self.weights.up.shape[0], device=device)


class SlotView:
    """Stand-in for an experts module during one wave: the module's own attributes and methods,
    except that the per-expert tensors are the [K, ...] slot tensors and ``num_experts`` is K.
    """

    def __init__(self, module: torch.nn.Module, slots: Mapping[str, torch.Tensor]) -> None:
        self.__dict__.update(slots)
        self.num_experts = next(iter(slots.values())).shape[0]
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


@dataclass(frozen=True)
class Weights:
    """What transformers' experts kernels read of one layer, fixed for the layer: the up (or
    gate_up) and down weights [K, ...] and their biases (None without), the gate ([N, 2I] or
    [N, I] -> [N, I]: the module's ``_apply_gate`` or ``act_fn``), the optional post-expert norm
    (transformers >= 5.24 ``has_post_expert_norm``) and ``is_transposed``."""

    up: torch.Tensor
    up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    gate: Callable[[torch.Tensor], torch.Tensor]
    post_norm: Callable[[torch.Tensor], torch.Tensor] | None
    is_transposed: bool


def weights_of(module, tensors: Mapping[str, torch.Tensor]) -> Weights:
    """The ``Weights`` of ``module`` over ``tensors`` ({dense name: [K, ...]}: the slots or the
    dense scratch, the same tensors every step), read as transformers' experts functions read
    them: from a ``SlotView`` (a name the tensors lack is the module's own attribute)."""
    view = SlotView(module, tensors)
    gated, biased = view.has_gate, view.has_bias
    norm = view.post_expert_norm if getattr(view, "has_post_expert_norm", False) else None
    return Weights(view.gate_up_proj if gated else view.up_proj,
                   (view.gate_up_proj_bias if gated else view.up_proj_bias) if biased else None,
                   view.down_proj, view.down_proj_bias if biased else None,
                   view._apply_gate if gated else view.act_fn, norm, bool(view.is_transposed))


def in_unpaged_layout(fn: Callable, rows: torch.Tensor, positions: torch.Tensor | None, num_rows: int):
    """``fn`` applied to ``rows`` [S_w, D] as if each sat at ``positions`` [S_w] of a [num_rows, D]
    buffer (the unpaged buffer's shape); the other rows are zeros, computed and dropped.
    ``positions`` None: ``rows`` already is that buffer."""
    if positions is None:
        return fn(rows)
    full = rows.new_zeros((num_rows, rows.shape[1]))
    full[positions] = rows
    return fn(full)[positions]
