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
   outputs of the wave's entries.
4. ``combine(work, top_k_weights [T, k]) -> [T, H]``: the routing weights and the sum over k,
   in the order of the unpaged implementation (``grouped_mm``'s unless a body says otherwise).

Each body is one module of ``paging.steps``; ``steps.table`` says which body runs which experts
implementation on which path. This module also holds what the bodies that run transformers'
own kernels share: ``DenseKernelStep``, ``SlotView``, ``weights_of``, ``in_unpaged_layout``,
``LayerStep.combine``.
Does not: page in, decide, time or count (the executors), or build a slot table
(``loading.runners``).

Legend: T tokens, H hidden, k top_k, E experts, K slots, S = T k entries (flat, s = t k + j).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class SlotSetup:
    """What a body is prepared from, once per layer.

    Attributes:
        slots: the [K, ...] slot table the page-ins write (``paging.transfer.PackedSlots``:
            the store's rows as they are; ``formats.slots.DenseSlots``: dequantized at page-in);
            None until the executor allocates packed slots like the store's tensors.
        dequantizer: for packed slots of a quantized format computed by a dense kernel, what
            turns a wave's slots into dense tensors (``formats.slots.WaveDequantizer``); None:
            the slots are what the kernel reads, or the body reads them packed.
        layout: the layer's quantized ``formats.base.ExpertLayout`` (how packed slot rows are
            read), None for dense experts.
        store: the layer's host store (``storage.host_store.ExpertStore``), for a body that reads
            host rows in place.
        in_place: the routing's entries carry host rows (row K + e: expert e read in place from
            ``store``) beside slot rows (``--beyond-k in-place``; a body that reads them has
            ``reads_in_place``).
    """

    slots: Mapping[str, torch.Tensor] | None = None
    dequantizer: Any = None
    layout: Any = None
    store: Any = None
    in_place: bool = False


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
    """

    planned = "host"
    needs_slot_map = False

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
        (the independence check reads it): the slot tensors, or the wave's dense tensors."""
        return SlotView(module, self.wave_tensors(wave_slots))

    def wave_tensors(self, wave_slots) -> Mapping[str, torch.Tensor]:
        """{dense name: [K, ...]}: the slots, or for packed slots of a quantized format the
        wave's slots dequantized into the shared scratch (other rows: stale, never selected)."""
        setup = self.setup
        if setup.dequantizer is None:
            return setup.slots
        return setup.dequantizer.wave_tensors(setup.slots, wave_slots)

    def dense_tensors(self) -> Mapping[str, torch.Tensor]:
        """The tensors ``wave_tensors`` returns, without dequantizing anything (the same objects
        every wave: a body keeps views of them from its first step)."""
        setup = self.setup
        return setup.slots if setup.dequantizer is None else setup.dequantizer.scratch

    def capture_problem(self) -> str | None:
        """Why a CUDA graph cannot hold this body's waves, or None (the caller judges the rest)."""
        if self.setup.dequantizer is not None:
            return ("packed slots of a quantized format dequantize each wave with constants built on the host "
                    "(formats: torch.tensor(...) per call, a host-to-device copy a capture cannot hold); use "
                    "--no-cuda-graphs")
        return None


class DenseKernelStep(LayerStep):
    """A body that runs transformers' own dense kernels over the slot tensors (or the dense
    scratch): its ``weights`` (``Weights``, built at the first step by ``prepare``: the module is
    known then) and ``all_slots`` [K] (what a device-planned wave of packed slots dequantizes)."""

    def __init__(self, setup: SlotSetup) -> None:
        super().__init__(setup)
        self.weights: Weights | None = None
        self.all_slots: torch.Tensor | None = None

    def prepare(self, module, device: torch.device) -> None:
        """Build what is fixed for the layer (once, at its first step)."""
        self.weights = weights_of(module, self.dense_tensors())
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
