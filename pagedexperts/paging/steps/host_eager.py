"""``eager`` planned on the host (``HostEagerStep``): the experts class's own loop over a
``contract.SlotView``, each entry a token with top_k 1 and weight 1 in k-major order, so an expert's
rows are the unpaged ones. No device twin: the loop reads experts back.

Legend: T tokens, H hidden, k top_k, E experts, K slots, S = T k entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedexperts.paging.steps.contract import HostRouting, LayerStep, SlotView
from pagedexperts.paging.transfer import upload


@dataclass
class EagerWork:
    """One step: module, hidden, ids, routing, entries as tokens [k T, H] with their ids and unit
    weights, outputs."""

    module: torch.nn.Module
    hidden: torch.Tensor
    top_k_index: torch.Tensor
    routing: HostRouting
    entry_hidden: torch.Tensor
    entry_ids: torch.Tensor
    unit: torch.Tensor
    entry_out: torch.Tensor | None = None


class HostEagerStep(LayerStep):

    needs_slot_map = True

    def begin(self, module, hidden, top_k_index, routing: HostRouting) -> EagerWork:
        top_k = top_k_index.shape[1]
        entry_ids = top_k_index.t().reshape(-1, 1)
        return EagerWork(module, hidden, top_k_index, routing, hidden.repeat(top_k, 1), entry_ids,
                         torch.ones_like(entry_ids, dtype=hidden.dtype))

    def run_wave(self, work: EagerWork, wave: int, slot_map=None) -> None:
        module = work.module
        planned = work.routing.waves[wave]
        view = SlotView(module, self.setup.slots.kernel_tensors(planned.slots))
        loop = type(module).forward.__wrapped__
        slots = slot_map[work.entry_ids]
        if len(work.routing.waves) == 1:
            work.entry_out = loop(view, work.entry_hidden, slots, work.unit)
            return
        flat = np.flatnonzero(np.isin(work.routing.ids.T.reshape(-1), planned.experts))
        rows = upload(flat, work.hidden.device)
        out = loop(view, work.entry_hidden[rows], slots[rows], work.unit[rows])
        if work.entry_out is None:
            work.entry_out = out.new_empty((work.entry_hidden.shape[0], out.shape[1]))
        work.entry_out.index_copy_(0, rows, out)

    def combine(self, work: EagerWork, top_k_weights) -> torch.Tensor:
        """[T, H]: entries weighted, added one by one in ascending expert id (eager's ``index_add_``
        loop)."""
        dtype, (num_tokens, top_k) = work.hidden.dtype, work.top_k_index.shape
        entries = work.entry_out.view(top_k, num_tokens, -1).transpose(0, 1)
        weighted = entries * top_k_weights.unsqueeze(-1)
        order = torch.argsort(work.top_k_index, dim=1, stable=True)  # ascending expert id per token
        ordered = torch.gather(weighted, 1, order.unsqueeze(-1).expand_as(weighted))
        out = torch.zeros(weighted.shape[0], weighted.shape[2], dtype=dtype, device=weighted.device)
        for j in range(top_k):
            out = out + ordered[:, j].to(dtype)
        return out
