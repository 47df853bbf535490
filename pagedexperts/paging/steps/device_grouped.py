"""``grouped_mm`` planned on the device (``DeviceGroupedStep``): ``steps.host_grouped``'s row layout
built with [S]-shaped masks, so nothing is read back and shapes are fixed by T and k. Packed slots
are dequantized all K at once.

Legend: T tokens, H hidden, k top_k, K slots, S = T k entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedexperts.paging.steps.contract import DenseKernelStep, DeviceRouting, in_unpaged_layout


@dataclass
class DeviceGroupedWork:
    """One step: hidden, k, the unpaged sort ``perm`` [S], ``pos_slot`` / ``pos_wave`` [S], entry
    outputs [S, H]."""

    hidden: torch.Tensor
    top_k: int
    perm: torch.Tensor
    pos_slot: torch.Tensor
    pos_wave: torch.Tensor
    entry_out: torch.Tensor | None = None


class DeviceGroupedStep(DenseKernelStep):

    planned = "device"

    def begin(self, module, hidden, top_k_index, routing: DeviceRouting) -> DeviceGroupedWork:
        if self.weights is None:
            self.prepare(module, hidden.device)
        perm = torch.sort(top_k_index.reshape(-1))[1]  # the unpaged model's own sort
        return DeviceGroupedWork(hidden, top_k_index.shape[1], perm, routing.entry_slot[perm], routing.entry_wave[perm])

    def run_wave(self, work: DeviceGroupedWork, wave: int, slot_map=None) -> None:
        from transformers.integrations.moe import _grouped_linear

        w, top_k = self.weights, work.top_k
        self.setup.slots.kernel_tensors(self.all_slots)  # every slot readable by the kernel (``w`` views them)
        pos, offsets, valid, slot_of_row = grouped_layout(work, wave, w.up.shape[0])
        rows, num_entries = valid.unsqueeze(1), pos.shape[0]
        x = work.hidden[work.perm[pos] // top_k]
        up = _grouped_linear(x, w.up, offsets, is_transposed=w.is_transposed)
        if w.up_bias is not None:
            up.add_(w.up_bias[slot_of_row])
        act = in_unpaged_layout(w.gate, torch.where(rows, up, 0), pos, num_entries)
        down = _grouped_linear(act, w.down, offsets, is_transposed=w.is_transposed)
        if w.down_bias is not None:
            down.add_(w.down_bias[slot_of_row])
        down = torch.where(rows, down, 0)
        if w.post_norm is not None:
            down = in_unpaged_layout(w.post_norm, down, pos, num_entries)
        if work.entry_out is None:
            work.entry_out = down.new_zeros((num_entries, down.shape[1]))
        entries = work.perm[pos]
        work.entry_out[entries] = torch.where(rows, down, work.entry_out[entries])



def grouped_layout(work: DeviceGroupedWork, wave: int, num_slots: int):
    """(positions [S]: the wave's first, grouped by slot; offsets [K] int32; valid [S]; slot per row
    [S]). The first offsets[-1] positions are the host layout's."""
    in_wave = work.pos_wave == wave
    key = torch.where(in_wave, work.pos_slot, num_slots)
    pos = torch.argsort(key, stable=True)
    per_slot = torch.zeros(num_slots + 1, dtype=torch.int64, device=key.device).index_add_(
        0, key, torch.ones_like(key))[:num_slots]
    offsets = torch.cumsum(per_slot, 0).to(torch.int32)
    valid = torch.arange(key.shape[0], device=key.device) < offsets[-1]
    return pos, offsets, valid, key[pos].clamp(max=num_slots - 1)
