"""How the K slots of one layer hold its experts, and what a kernel reads of them: the slot tables.

Owns ``SlotTable``, the contract every slot table implements (docs/design-layer-step.md, "Slot
tables"): the [K, ...] tensors a page-in writes (``write_rows``, ``copy_rows``) and what the
body's kernel reads for a wave (``kernel_tensors``), with what a CUDA graph or a device-side
page-in cannot hold (``capture_problem``, ``device_page_in_problem``). The tables of a quantized
format's experts computed by the model's own dense kernels live here (``--slot-format``;
"auto", the default, is dense on CPU and packed on CUDA: see DEFAULT_SLOT_FORMAT):

- ``DequantizingSlots`` (``packed``): the slots hold the packed rows as the store does (a page-in
  copies them); ``kernel_tensors`` dequantizes the current wave's slots into a dense scratch
  [K, ...] just before the kernel runs (per wave, every step).
- ``DenseSlots`` (``dense``): the slots hold dequantized rows; ``write_rows`` copies an expert's
  packed rows into a one-expert staging buffer on the device and dequantizes them into its slot
  once, at page-in (fewer slots fit in the same memory; no per-step dequantization).

The scratch and the staging are [K, ...] / [1, ...] buffers of ONE layer, shared by every layer
of a model: layers run one after another on one compute stream (packed) or one copy stream
(dense), so a buffer is never read by one layer while another writes it. The other tables: the
plain one (``paging.steps.contract.PackedSlots``: the store's rows as they are, read by the
kernel as they are) and the CPU kernels' (``formats.cpu_pack.CpuPackedSlots``).
Does not: decide residency, time or count (``paging``), choose a table (``loading.runners``),
or know any format's arithmetic.

Legend: K slots, n experts of a wave, E experts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping, Sequence

import torch

from pagedexperts.formats.base import ExpertLayout

SLOT_FORMATS = ("auto", "packed", "dense")
# "auto": dense slots on CPU, packed on CUDA. Measured (bench/formats_bench.py, one run, CPU,
# K = E/2): dense slots decode faster than packed at equal K (block FP8 4.9 vs 7.1 ms/token,
# MXFP4 11.4 vs 19.0) and even at equal slot memory (5.6 and 17.6 ms), because on CPU a page-in
# is a memcpy; on CUDA the link is the cost and slots sit in scarce device memory: at equal
# memory dense slots page 3.4x (FP8) and 1.9x (MXFP4) the bytes per decode token.
DEFAULT_SLOT_FORMAT = "auto"


def check_slot_format(slot_format: str) -> str:
    """Raises ValueError naming --slot-format and its choices for an unknown value."""
    if slot_format not in SLOT_FORMATS:
        raise ValueError(f"unknown slot format {slot_format!r}; choose one of {list(SLOT_FORMATS)} (--slot-format)")
    return slot_format


def resolve_slot_format(slot_format: str, device) -> str:
    """"packed" or "dense": ``slot_format``, with "auto" meaning dense on CPU, packed on CUDA.

    Raises:
        ValueError: unknown slot format (names --slot-format).
    """
    check_slot_format(slot_format)
    if slot_format != "auto":
        return slot_format
    return "dense" if torch.device(device).type == "cpu" else "packed"


def allocate(specs, num_rows: int, device) -> dict[str, torch.Tensor]:
    """{spec.name: zeros [num_rows, *spec.shape]} on ``device``."""
    return {s.name: torch.zeros((num_rows, *s.shape), dtype=s.dtype, device=device) for s in specs}


class SlotTable(dict, ABC):
    """The K slots of one layer, {name: [K, ...] tensor}: what a page-in writes, and what the
    body's kernel reads of them (module docstring). An executor pages rows in through
    ``write_rows`` / ``copy_rows``; a body calls ``kernel_tensors`` each wave, after its page-ins
    and before its kernel, and never asks which table it holds.
    """

    @abstractmethod
    def write_rows(self, rows: Mapping[str, torch.Tensor], slot: int, *, pinned: bool) -> None:
        """Page one expert's rows {name: [*spec.shape]} (host memory, page-locked when
        ``pinned``: the copy may then be non-blocking to a CUDA slot) into row ``slot``. Every
        store's ``copy_to_slot(s)`` calls it."""

    def copy_rows(self, source: Mapping[str, torch.Tensor], loads, *, pinned: bool) -> None:
        """A wave's page-ins from a store that holds every row in host memory: row ``expert`` of
        each ``source`` tensor ([E, ...], page-locked when ``pinned``) into row ``slot``, for each
        (expert, slot) of ``loads``. Here: ``write_rows`` of each expert."""
        for expert, slot in loads:
            self.write_rows({name: rows[expert] for name, rows in source.items()}, slot, pinned=pinned)

    @abstractmethod
    def kernel_tensors(self, wave_slots: Sequence[int] | torch.Tensor) -> Mapping[str, torch.Tensor]:
        """What the body's kernel reads once the slots ``wave_slots`` (slot ids; a [n] int64
        tensor on the device; empty: none) are paged in: {name: [K, ...]}, rows outside the wave
        stale (the wave's entries never select them). The same tensor objects every call, so a
        body keeps views of them from its first step; it calls this each wave all the same (a
        table that dequantizes fills its scratch here)."""

    def capture_problem(self) -> str | None:
        """Why a CUDA graph cannot hold a wave over this table (``kernel_tensors`` builds
        tensors from host values), or None. Here: None."""
        return None

    def device_page_in_problem(self) -> str | None:
        """Why the device-planned page-in (a gather of the store's rows as they are into the
        slot tensors, ``paging.kernels.page_in``) cannot write this table, or None. Here: None."""
        return None


class DequantizingSlots(SlotTable):
    """Packed slot tensors {packed name: [K, ...]} (the store's rows as they are) of a quantized
    layer read by a dense kernel: ``kernel_tensors`` dequantizes the wave's slots into
    ``scratch`` ({dense name: [K, ...]} on the slots' device, shared by the layers of one model:
    ``allocate(layout.dense_specs, K, device)``).

    Args:
        layout: the layer's ExpertLayout (not dense); tensors: the slot tensors
            (``allocate(store specs, K, device)``); scratch: as above.
    """

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
        """Dequantize the packed rows of ``wave_slots`` into the same rows of the scratch; return
        the scratch ({dense name: [K, ...]}). Rows outside the wave hold whatever an earlier wave
        or layer left: the wave's top-k ids never select them."""
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
    """Dense slot tensors {dense name: [K, ...]} of a quantized layer, filled at page-in: the
    kernel reads them as they are. ``staging``: {packed name: [1, ...]} on the device, shared by
    the layers of one model."""

    def __init__(self, layout: ExpertLayout, tensors: dict[str, torch.Tensor], staging: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.layout = layout
        self.staging = staging

    def write_rows(self, rows, slot: int, *, pinned: bool) -> None:
        """Copy one expert's packed rows {packed name: [*spec.shape]} (host memory, page-locked
        when ``pinned``) to the staging buffer, dequantize into row ``slot``."""
        for spec in self.layout.packed_specs:
            dst = self.staging[spec.name]
            dst[0].copy_(rows[spec.name], non_blocking=pinned and dst.is_cuda)
        dense = self.layout.dequantize(self.staging)
        for name, rows in dense.items():
            self[name][slot].copy_(rows[0])

    def kernel_tensors(self, wave_slots) -> "DenseSlots":
        """The slot tensors themselves (dequantized at page-in)."""
        return self

    def device_page_in_problem(self) -> str | None:
        return ("dense slots of a quantized layer dequantize at page-in on the host path; "
                "use --slot-format packed with --decide device")
