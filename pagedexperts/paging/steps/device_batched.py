"""``batched_mm`` planned on the device: every entry, each with its own wave's slot, fixed shapes.

Owns ``DeviceBatchedStep``, the ``steps.contract.LayerStep`` body that runs transformers'
``batched_mm`` experts over the K slots of a device-planned step: every entry in the unpaged model's
token-major order through ``_batched_linear``, each with its own slot
(``contract.DeviceRouting``); entries of other waves are computed and dropped by a mask, so
nothing is read back and every shape is fixed by T and k. The gate and the post-expert norm run
on the full [S, ...] buffer as unpaged (why: ``steps.host_grouped``). Packed slots of a
quantized format are dequantized all K at once. Does not: decide or page in
(``paging.device_executor``).

Legend: T tokens, H hidden, k top_k, K slots, S = T k entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedexperts.paging.steps.contract import DenseKernelStep, DeviceRouting


@dataclass
class DeviceBatchedWork:
    """One step: hidden [T, H], k, its routing, and the entry outputs [S, H] (zeros until a
    wave writes them)."""

    hidden: torch.Tensor
    top_k: int
    routing: DeviceRouting
    entry_out: torch.Tensor | None = None


class DeviceBatchedStep(DenseKernelStep):
    """``batched_mm`` in the unpaged model's token-major entry order (module docstring)."""

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
