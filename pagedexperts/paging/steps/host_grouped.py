"""``grouped_mm`` planned on the host (``HostGroupedStep``): each wave runs transformers'
``_grouped_linear`` in the unpaged model's exact row layout over the slots in place, gate and norm
in the unpaged [S, ...] shape, so the output is bit-identical (docs/exactness.md); a CPU step's one
wave of small experts (``GATHER_MAX_BYTES``) is gathered instead.

Legend: T tokens, H hidden, k top_k, K slots, S = T k entries, S_w entries of one wave.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedexperts.paging.steps.contract import DenseKernelStep, HostRouting, in_unpaged_layout
from pagedexperts.paging.transfer import upload


# A CPU step's one wave gathers its experts when their up and down weights take at most this
# many bytes (module docstring). Measured (one thread, CPU time; docs/benchmarks.md, "The
# bundled model's paging overhead"): at the bundled model's shapes (96 KB an expert in float32)
# gathering a decode step's 4 experts takes ~30 us and their 4-group up GEMM ~37 us, against
# ~150 us for the up GEMM over 64 slots in place; at Qwen3-30B-A3B's shapes 8 experts take 75 MB,
# ~40 ms to gather against ~7 ms for the GEMM.
GATHER_MAX_BYTES = 4 << 20


@dataclass
class GroupedWork:
    """One step: hidden, routing, the unpaged sort ``perm`` [S], ``counts`` per expert (rows of e at
    [start_e, start_e + count_e) of ``perm``), entry outputs [S, H]."""

    hidden: torch.Tensor
    routing: HostRouting
    perm: torch.Tensor
    counts: np.ndarray
    entry_out: torch.Tensor | None = None


class HostGroupedStep(DenseKernelStep):
    """``grouped_mm`` in the unpaged row order; ``expert_bytes`` chooses gather or in place."""

    expert_bytes = 0

    def prepare(self, module, device: torch.device) -> None:
        super().prepare(module, device)
        w = self.weights
        self.expert_bytes = w.up[0].numel() * w.up.element_size() + w.down[0].numel() * w.down.element_size()

    def begin(self, module, hidden, top_k_index, routing: HostRouting) -> GroupedWork:
        if self.weights is None:
            self.prepare(module, hidden.device)
        counts = np.bincount(routing.ids.reshape(-1))
        # the unpaged model's own call: the same (unstable, deterministic) sort of the same ids
        return GroupedWork(hidden, routing, torch.sort(top_k_index.reshape(-1))[1], counts)

    def run_wave(self, work: GroupedWork, wave: int, slot_map=None) -> None:
        """The wave through ``_grouped_linear`` (gathered or in place), then gate and norm in unpaged
        order."""
        from transformers.integrations.moe import _grouped_linear

        planned, w, dev = work.routing.waves[wave], self.weights, work.hidden.device
        self.setup.slots.kernel_tensors(planned.slots)  # the wave readable by the kernel (``w`` views it)
        num_entries, top_k = work.perm.shape[0], work.routing.ids.shape[1]
        if (dev.type == "cpu" and len(work.routing.waves) == 1
                and len(planned.slots) * self.expert_bytes <= GATHER_MAX_BYTES):
            # gathered: the routed experts' slots in ascending expert id, one group each, over
            # the unpaged model's sorted rows as they are (no padding, no positions)
            experts, slots = zip(*sorted(zip(planned.experts, planned.slots)))
            lengths, groups = work.counts[list(experts)], torch.tensor(slots)
            up_w, down_w = w.up.index_select(0, groups), w.down.index_select(0, groups)
            offsets = torch.from_numpy(np.cumsum(lengths, dtype=np.int32))
            slot_rows, pos, rows, n = (slots, lengths), None, work.perm, num_entries
        else:
            # in place: the groups are the slots (on CPU those from the wave's lowest to its
            # highest, a view), the wave's rows regrouped by slot and padded to S
            first, num_groups = 0, w.up.shape[0]
            if dev.type == "cpu":
                first = min(planned.slots)
                num_groups = max(planned.slots) - first + 1
            pos_host, offsets_host, slot_rows = _layout(work, planned, first, num_groups)
            n = len(pos_host)
            in_order = len(work.routing.waves) == 1 and bool((pos_host == np.arange(n)).all())
            pos = None if in_order else upload(pos_host, dev)
            offsets = upload(offsets_host, dev).to(torch.int32)
            up_w, down_w = w.up[first:first + num_groups], w.down[first:first + num_groups]
            rows = work.perm if in_order else work.perm[pos]
        # the kernel sees the unpaged model's S rows (CUDA picks its tiles from the row count);
        # rows past the last offset are not computed
        x = work.hidden.index_select(0, rows // top_k)
        if n < num_entries:
            x = F.pad(x, (0, 0, 0, num_entries - n))
        up = _grouped_linear(x, up_w, offsets, is_transposed=w.is_transposed)[:n]
        slot_of_row = upload(np.repeat(*slot_rows), dev) if w.up_bias is not None else None
        if w.up_bias is not None:
            up.add_(w.up_bias[slot_of_row])
        act = in_unpaged_layout(w.gate, up, pos, num_entries)
        if n < num_entries:
            act = F.pad(act, (0, 0, 0, num_entries - n))
        down = _grouped_linear(act, down_w, offsets, is_transposed=w.is_transposed)[:n]
        if w.down_bias is not None:
            down.add_(w.down_bias[slot_of_row])
        if w.post_norm is not None:
            down = in_unpaged_layout(w.post_norm, down, pos, num_entries)
        if work.entry_out is None:
            work.entry_out = down.new_empty((num_entries, down.shape[1]))
        work.entry_out.index_copy_(0, rows, down)


def _layout(work: GroupedWork, wave, first: int, num_groups: int) -> tuple[np.ndarray, np.ndarray, tuple]:
    """(unpaged positions [S_w] grouped by slot, offsets [num_groups], (slots, rows per slot))."""
    experts, slots = np.asarray(wave.experts), np.asarray(wave.slots)
    by_slot = np.argsort(slots, kind="stable")
    experts, slots = experts[by_slot], slots[by_slot]
    lengths = work.counts[experts]
    starts = np.cumsum(work.counts) - work.counts  # expert e's first row in the unpaged order
    group_start = np.cumsum(lengths) - lengths
    pos = np.arange(int(lengths.sum())) + np.repeat(starts[experts] - group_start, lengths)
    per_slot = np.zeros(num_groups, dtype=np.int64)
    per_slot[slots - first] = lengths
    return pos, np.cumsum(per_slot), (slots, lengths)
