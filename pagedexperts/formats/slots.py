"""The slot tables: how the K slots of one layer hold its experts, and what a kernel reads of them.

Owns ``SlotTable``, the contract of every slot table (docs/design-layer-step.md, "Slot tables"),
and the two tables of a quantized layer read by dense kernels (``--slot-format``):
``DequantizingSlots`` (packed, dequantized per wave into a scratch) and ``DenseSlots``
(dequantized at page-in through a staging buffer); scratch and staging are one layer's, shared
by the layers of a model. Does not: decide residency, count, choose a table, or know a format.

Legend: K slots, n experts of a wave, E experts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping, Sequence

import torch

from pagedexperts.formats.base import ExpertLayout

SLOT_FORMATS = ("auto", "packed", "dense")
# "auto": dense slots on CPU, packed on CUDA (measured: docs/formats.md)
DEFAULT_SLOT_FORMAT = "auto"


def check_slot_format(slot_format: str) -> str:
    """Raises ValueError naming --slot-format and its choices for an unknown value."""
    if slot_format not in SLOT_FORMATS:
        raise ValueError(f"unknown slot format {slot_format!r}; choose one of {list(SLOT_FORMATS)} (--slot-format)")
    return slot_format


def resolve_slot_format(slot_format: str, device) -> str:
    """"packed" or "dense": ``slot_format``, with "auto" meaning dense on CPU, packed on CUDA.
    Raises ValueError: unknown slot format (names --slot-format)."""
    check_slot_format(slot_format)
    if slot_format != "auto":
        return slot_format
    return "dense" if torch.device(device).type == "cpu" else "packed"


def allocate(specs, num_rows: int, device) -> dict[str, torch.Tensor]:
    """{spec.name: zeros [num_rows, *spec.shape]} on ``device``."""
    return {s.name: torch.zeros((num_rows, *s.shape), dtype=s.dtype, device=device) for s in specs}


class SlotTable(dict, ABC):
    """The K slots of one layer, {name: [K, ...]}: stores page rows in through ``hold_rows`` (a copy,
    ``write_rows``, unless the table reads host rows in place) or ``copy_rows``; a body calls
    ``kernel_tensors`` each wave, never asking which table it holds."""

    @abstractmethod
    def write_rows(self, rows: Mapping[str, torch.Tensor], slot: int, *, pinned: bool) -> None:
        """Page one expert's rows {name: [*spec.shape]} (host memory, page-locked when ``pinned``:
        non-blocking to a CUDA slot) into row ``slot``."""

    def copy_rows(self, source: Mapping[str, torch.Tensor], loads, *, pinned: bool) -> int:
        """A wave's page-ins from host rows {name: [E, ...]} that stay unchanged while the model runs (a
        full store): row ``expert`` into slot ``slot`` for each (expert, slot) of ``loads``. Returns
        how many the slots read in place (``hold_rows``)."""
        held = 0
        for expert, slot in loads:
            held += self.hold_rows({name: rows[expert] for name, rows in source.items()}, slot, pinned=pinned)
        return held

    def hold_rows(self, rows: Mapping[str, torch.Tensor], slot: int, *, pinned: bool) -> bool:
        """Page one expert's rows into ``slot``: True when the slot reads ``rows`` in place from now on
        (the caller changes them only after ``release_rows``), False when it copied them (``write_rows``).
        This table copies."""
        self.write_rows(rows, slot, pinned=pinned)
        return False

    def release_rows(self, rows: Mapping[str, torch.Tensor], slot: int) -> Mapping[str, torch.Tensor]:
        """The caller is about to overwrite ``rows``, which ``hold_rows`` may have left ``slot`` reading
        in place: the rows it may overwrite instead (another of the same shapes when the slot still
        reads these), else ``rows``."""
        return rows

    @abstractmethod
    def kernel_tensors(self, wave_slots: Sequence[int] | torch.Tensor) -> Mapping[str, torch.Tensor]:
        """What the kernel reads once ``wave_slots`` (slot ids, or an int64 [n] device tensor) are paged
        in: {name: [K, ...]}, rows outside the wave stale. The same tensor objects every call."""

    def capture_problem(self) -> str | None:
        """Why a CUDA graph cannot hold a wave over this table, or None."""
        return None

    def device_page_in_problem(self) -> str | None:
        """Why ``paging.kernels.page_in`` cannot write this table, or None."""
        return None


class DequantizingSlots(SlotTable):
    """Packed slot tensors of a quantized layer: ``kernel_tensors`` dequantizes the wave's slots into
    ``scratch`` ({dense name: [K, ...]}, shared by the layers). ``layout``: the layer's (not dense)."""

    def __init__(self, layout: ExpertLayout, tensors: dict[str, torch.Tensor], scratch: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.layout = layout
        self.scratch = scratch

    def write_rows(self, rows, slot: int, *, pinned: bool) -> None:
        """Copy one expert's packed rows into row ``slot``, as they are."""
        for name, row in rows.items():
            dst = self[name][slot]
            dst.copy_(row, non_blocking=pinned and dst.is_cuda)

    def kernel_tensors(self, wave_slots) -> dict[str, torch.Tensor]:
        """Dequantize ``wave_slots``' packed rows into the same rows of the scratch; return the scratch."""
        if len(wave_slots) == 0:
            return self.scratch
        idx = torch.as_tensor(wave_slots, dtype=torch.long).to(next(iter(self.values())).device, non_blocking=True)
        dense = self.layout.dequantize({s.name: self[s.name].index_select(0, idx) for s in self.layout.packed_specs})
        for name, rows in dense.items():
            self.scratch[name].index_copy_(0, idx, rows)
        return self.scratch

    def capture_problem(self) -> str | None:
        return ("packed slots of a quantized format dequantize each wave with constants built on the host "
                "(formats: torch.tensor(...) per call, a host-to-device copy a capture cannot hold); use "
                "--no-cuda-graphs")


class DenseSlots(SlotTable):
    """Dense slot tensors of a quantized layer, dequantized at page-in through ``staging``
    ({packed name: [1, ...]} on the device, shared by the layers)."""

    def __init__(self, layout: ExpertLayout, tensors: dict[str, torch.Tensor], staging: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.layout = layout
        self.staging = staging

    def write_rows(self, rows, slot: int, *, pinned: bool) -> None:
        """Copy one expert's packed rows to the staging buffer, dequantize them into row ``slot``."""
        for spec in self.layout.packed_specs:
            dst = self.staging[spec.name]
            dst[0].copy_(rows[spec.name], non_blocking=pinned and dst.is_cuda)
        dense = self.layout.dequantize(self.staging)
        for name, rows in dense.items():
            self[name][slot].copy_(rows[0])

    def kernel_tensors(self, wave_slots) -> "DenseSlots":
        """The slot tensors themselves."""
        return self

    def device_page_in_problem(self) -> str | None:
        return ("dense slots of a quantized layer dequantize at page-in on the host path; "
                "use --slot-format packed with --decide device")
