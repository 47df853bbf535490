"""The layer-step contract ``LayerStep`` (docs/design-layer-step.md "The step contract"), its routings,
the plain slot table (``PackedSlots``) and what bodies running transformers' kernels share. Does not
page in, decide, count or choose a table.

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
    """What a body is prepared from: ``slots`` (a ``formats.slots.SlotTable``, None until allocated),
    ``layout`` (None for dense), ``store`` and ``in_place`` (host rows K + e)."""

    slots: SlotTable | None = None
    layout: ExpertLayout | None = None
    store: ExpertStore | None = None
    in_place: bool = False


class PackedSlots(SlotTable):
    """The plain slot table: {name: [K, ...]} holding the store's rows as they are, read as they are."""

    def write_rows(self, rows, slot: int, *, pinned: bool) -> None:
        """Copy one expert's rows into row ``slot`` (non-blocking from page-locked memory)."""
        for name, row in rows.items():
            dst = self[name][slot]
            dst.copy_(row, non_blocking=pinned and dst.is_cuda)

    def copy_rows(self, source, loads, *, pinned: bool) -> int:
        """A wave's page-ins from a store holding every row in memory, one tensor at a time (none read
        in place: 0)."""
        for name, table in self.items():
            src, non_blocking = source[name], pinned and table.is_cuda
            for expert, slot in loads:
                table[slot].copy_(src[expert], non_blocking=non_blocking)
        return 0

    def kernel_tensors(self, wave_slots) -> "PackedSlots":
        """The slot tensors themselves."""
        return self


class HostRouting(NamedTuple):
    """Host-planned routing: ``ids`` [T, k] int64 numpy and ``waves`` (``residency.planner.Wave``)."""

    ids: np.ndarray
    waves: Sequence


class DeviceRouting(NamedTuple):
    """Device-planned routing: ``entry_slot`` and ``entry_wave`` [S] int64 on the device."""

    entry_slot: torch.Tensor
    entry_wave: torch.Tensor


class LayerStep(ABC):
    """A layer's way of computing its experts over K slots; ``planned`` "host" / "device",
    ``needs_slot_map``, ``reads_in_place``."""

    planned = "host"
    needs_slot_map = False
    reads_in_place = False

    def __init__(self, setup: SlotSetup) -> None:
        self.setup = setup

    @abstractmethod
    def begin(self, module, hidden: torch.Tensor, top_k_index: torch.Tensor, routing) -> Any:
        """Start a step: hidden [T, H], top_k_index [T, k], routing -> the step's work."""

    @abstractmethod
    def run_wave(self, work, wave: int, slot_map: torch.Tensor | None = None) -> None:
        """Compute wave ``wave``'s entries; ``slot_map`` [E] int64 (-1 outside the wave) if
        ``needs_slot_map``."""

    def combine(self, work, top_k_weights: torch.Tensor) -> torch.Tensor:
        """[T, H]: entry outputs times weights [T, k], summed over k, as ``grouped_mm`` ends (``view(T,
        k, H).sum(dim=1)``)."""
        num_tokens, top_k = top_k_weights.shape
        weighted = work.entry_out.view(num_tokens, top_k, -1) * top_k_weights.unsqueeze(-1)
        return weighted.sum(dim=1).to(work.hidden.dtype)

    def wave_view(self, module, wave_slots: Sequence[int]) -> "SlotView":
        """The module as this body's kernels read it once ``wave_slots`` are paged in."""
        return SlotView(module, self.setup.slots.kernel_tensors(wave_slots))

    def capture_problem(self) -> str | None:
        """Why a CUDA graph cannot hold this body's waves (the slot table's answer), or None."""
        return self.setup.slots.capture_problem()


class DenseKernelStep(LayerStep):
    """A body running transformers' dense kernels over the slot table's kernel tensors (``weights``,
    ``all_slots``)."""

    def __init__(self, setup: SlotSetup) -> None:
        super().__init__(setup)
        self.weights: Weights | None = None
        self.all_slots: torch.Tensor | None = None

    def prepare(self, module, device: torch.device) -> None:
        """Build the layer's ``weights`` once: views of the slot table's kernel tensors."""
        self.weights = weights_of(module, self.setup.slots.kernel_tensors(()))
        self.all_slots = torch.arange(self.weights.up.shape[0], device=device)


class SlotView:
    """An experts module during one wave: the [K, ...] slot tensors and ``num_experts`` = K, the rest
    its own."""

    def __init__(self, module: torch.nn.Module, slots: Mapping[str, torch.Tensor]) -> None:
        self.__dict__.update(slots)
        self.num_experts = next(iter(slots.values())).shape[0]
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


@dataclass(frozen=True)
class Weights:
    """The up (or gate_up) and down weights [K, ...], biases, gate, optional post-expert norm and
    ``is_transposed`` of one layer."""

    up: torch.Tensor
    up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    gate: Callable[[torch.Tensor], torch.Tensor]
    post_norm: Callable[[torch.Tensor], torch.Tensor] | None
    is_transposed: bool


def weights_of(module, tensors: Mapping[str, torch.Tensor]) -> Weights:
    """The ``Weights`` of ``module`` over ``tensors`` {dense name: [K, ...]}, read through a
    ``SlotView``."""
    view = SlotView(module, tensors)
    gated, biased = view.has_gate, view.has_bias
    norm = view.post_expert_norm if getattr(view, "has_post_expert_norm", False) else None
    return Weights(view.gate_up_proj if gated else view.up_proj,
                   (view.gate_up_proj_bias if gated else view.up_proj_bias) if biased else None,
                   view.down_proj, view.down_proj_bias if biased else None,
                   view._apply_gate if gated else view.act_fn, norm, bool(view.is_transposed))


def in_unpaged_layout(fn: Callable, rows: torch.Tensor, positions: torch.Tensor | None, num_rows: int):
    """``fn`` of ``rows`` [S_w, D] as if at ``positions`` of a zero [num_rows, D] buffer (None:
    ``rows`` is it)."""
    if positions is None:
        return fn(rows)
    full = rows.new_zeros((num_rows, rows.shape[1]))
    full[positions] = rows
    return fn(full)[positions]
