"""How the K slots of a layer hold a quantized format's experts: packed or dense.

Owns the two slot formats (``--slot-format``; "auto", the default, is dense on CPU and packed
on CUDA: see DEFAULT_SLOT_FORMAT) and the device buffers they need:
- ``packed``: slots hold the packed rows (what a page-in copies: the plain slot table,
  ``paging.transfer.PackedSlots``); ``WaveDequantizer`` turns only the current wave's slots into
  a dense scratch [K, ...] just before the model's experts kernel runs (per wave, every step).
- ``dense``: slots hold dequantized rows; ``DenseSlots.write_rows`` copies an expert's packed
  rows into a one-expert staging buffer on the device and dequantizes them into its slot once,
  at page-in (fewer slots fit in the same memory; no per-step dequantization).
The scratch and the staging are [K, ...] / [1, ...] buffers of ONE layer, shared by every layer
of a model: layers run one after another on one compute stream (packed) or one copy stream
(dense), so a buffer is never read by one layer while another writes it.
Does not: decide residency, time or count (``paging``), or know any format's arithmetic.

Legend: K slots, n experts of a wave.
"""

from __future__ import annotations

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


class WaveDequantizer:
    """Packed slots -> the dense tensors of one wave, in a dense scratch shared by all layers.

    Args:
        layout: the layer's ExpertLayout (not dense).
        scratch: {dense name: [K, ...]} on the slots' device (``allocate(layout.dense_specs,
            K, device)``), shared by the layers of one model.
    """

    def __init__(self, layout: ExpertLayout, scratch: dict[str, torch.Tensor]) -> None:
        self.layout = layout
        self.scratch = scratch

    def wave_tensors(self, slots: dict[str, torch.Tensor], wave_slots) -> dict[str, torch.Tensor]:
        """Dequantize the packed ``slots`` rows listed in ``wave_slots`` into the same rows of
        the scratch; return the scratch ({dense name: [K, ...]}). Rows outside the wave hold
        whatever an earlier wave or layer left: the wave's top-k ids never select them."""
        idx = torch.as_tensor(wave_slots, dtype=torch.long).to(next(iter(slots.values())).device, non_blocking=True)
        dense = self.layout.dequantize({s.name: slots[s.name].index_select(0, idx) for s in self.layout.packed_specs})
        for name, rows in dense.items():
            self.scratch[name].index_copy_(0, idx, rows)
        return self.scratch


class DenseSlots(dict):
    """Dense slot tensors {dense name: [K, ...]} of a quantized layer, filled at page-in.

    The same slot-table contract as the plain table, ``paging.transfer.PackedSlots``
    (``write_rows``), which every store's ``copy_to_slot`` calls. ``staging``: {packed name: [1, ...]} on the device, shared by the
    layers of one model.
    """

    def __init__(self, layout: ExpertLayout, tensors: dict[str, torch.Tensor], staging: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.layout = layout
        self.staging = staging

    def write_rows(self, rows: dict[str, torch.Tensor], slot: int, *, pinned: bool) -> None:
        """Copy one expert's packed rows {packed name: [*spec.shape]} (host memory, page-locked
        when ``pinned``) to the staging buffer, dequantize into row ``slot``."""
        for spec in self.layout.packed_specs:
            dst = self.staging[spec.name]
            dst[0].copy_(rows[spec.name], non_blocking=pinned and dst.is_cuda)
        dense = self.layout.dequantize(self.staging)
        for name, rows in dense.items():
            self[name][slot].copy_(rows[0])
