"""``batched_mm`` planned on the device (``DeviceBatchedStep``): every entry in the unpaged token-major
order, each with its own wave's slot; entries of other waves are computed and dropped by a mask, so
nothing is read back and shapes are fixed by T and k. Packed slots are dequantized all K at once.

Legend: T tokens, H hidden, k top_k, K slots, S = T k entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedexperts.paging.steps.contract import DenseKernelStep, DeviceRouting


@dataclass
class DeviceBatchedWork:
    """One step: hidden [T, H], k, its routing, and the entry outputs [S, H]."""

    hidden: torch.Tensor
    top_k: int
    routing: DeviceRouting
    entry_out: torch.Tensor | None = None


class DeviceBatchedStep(DenseKernelStep):

    planned = "device"

    def begin(self, module, hidden, top_k_index, routing: DeviceRouting) -> DeviceBatchedWork:
        if self.weights is None:
            self.prepare(module, hidden.device)
        return DeviceBatchedWork(hidden, top_k_index.shape[1], routing)

    def run_wave(self, work: DeviceBatchedWork, wave: int, slot_map=None) -> None:
        from transformers.integrations.moe import _batched_linear

        w = self.weights
        self.setup.slots.kernel_tensors(self.all_slots)  # every slot readable by the kernel (``w`` views them)
        rows = (work.routing.entry_wave == wave).unsqueeze(1)
        run = work.routing.entry_slot.clamp(min=0)
        x = work.hidden.repeat_interleave(work.top_k, dim=0)
        bias = w.up_bias[run] if w.up_bias is not None else None
        up = _batched_linear(x, w.up[run], bias=bias, is_transposed=w.is_transposed)
        act = w.gate(torch.where(rows, up, 0))
        bias = w.down_bias[run] if w.down_bias is not None else None
        down = torch.where(rows, _batched_linear(act, w.down[run], bias=bias, is_transposed=w.is_transposed), 0)
        if w.post_norm is not None:
            down = w.post_norm(down)
        if work.entry_out is None:
            work.entry_out = down.new_zeros(down.shape)
        work.entry_out = torch.where(rows, down, work.entry_out)
