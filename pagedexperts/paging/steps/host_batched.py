"""``batched_mm`` planned on the host (``HostBatchedStep``): the entries in the unpaged token-major
order through ``_batched_linear``, each entry's weights gathered by its slot; a one-entry wave is
padded to two (a batch of one takes another CPU kernel). Gate and norm run in the unpaged shape
(``contract.in_unpaged_layout``; docs/exactness.md).

Legend: T tokens, H hidden, k top_k, E experts, K slots, S = T k entries, S_w of one wave.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedexperts.paging.steps.contract import DenseKernelStep, HostRouting, in_unpaged_layout
from pagedexperts.paging.transfer import upload


@dataclass
class BatchedWork:
    """One step: hidden [T, H], top_k_index [T, k], its routing, and the entry outputs [S, H]."""

    hidden: torch.Tensor
    top_k_index: torch.Tensor
    routing: HostRouting
    entry_out: torch.Tensor | None = None


class HostBatchedStep(DenseKernelStep):

    needs_slot_map = True

    def begin(self, module, hidden, top_k_index, routing: HostRouting) -> BatchedWork:
        if self.weights is None:
            self.prepare(module, hidden.device)
        return BatchedWork(hidden, top_k_index, routing)

    def run_wave(self, work: BatchedWork, wave: int, slot_map=None) -> None:
        from transformers.integrations.moe import _batched_linear

        planned, w, hidden = work.routing.waves[wave], self.weights, work.hidden
        self.setup.slots.kernel_tensors(planned.slots)  # the wave readable by the kernel (``w`` views it)
        num_entries, top_k = work.routing.ids.size, work.routing.ids.shape[1]
        ids = slot_map[work.top_k_index.reshape(-1)]  # [S] slot per entry, -1: other wave
        if len(work.routing.waves) == 1:
            entries, run, n = None, ids, num_entries
            x = hidden.repeat_interleave(top_k, dim=0)
        else:
            flat = np.flatnonzero(np.isin(work.routing.ids.reshape(-1), planned.experts))
            entries, n = upload(flat, hidden.device), len(flat)
            # torch.bmm of a batch of one takes another CPU kernel: pad with a copy, drop it after
            run_rows = entries.repeat(2) if n == 1 and num_entries > 1 else entries
            run = ids[run_rows]
            x = hidden[run_rows // top_k]
        bias = w.up_bias[run] if w.up_bias is not None else None
        up = _batched_linear(x, w.up[run], bias=bias, is_transposed=w.is_transposed)[:n]
        act = in_unpaged_layout(w.gate, up, entries, num_entries)
        if run.shape[0] != n:
            act = act.repeat(2, 1)
        bias = w.down_bias[run] if w.down_bias is not None else None
        down = _batched_linear(act, w.down[run], bias=bias, is_transposed=w.is_transposed)[:n]
        if w.post_norm is not None:
            down = in_unpaged_layout(w.post_norm, down, entries, num_entries)
        if entries is None:
            work.entry_out = down
            return
        if work.entry_out is None:
            work.entry_out = down.new_empty((num_entries, down.shape[1]))
        work.entry_out.index_copy_(0, entries, down)
