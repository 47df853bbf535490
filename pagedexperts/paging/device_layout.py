"""The experts computation of a device-planned step: ``paging.waves``' layouts, fixed shapes.

Owns the device-planned steps of the wave-compute contract (``paging.waves.StepEntries``): the
per-wave row layout when the wave of each entry is known only on the device
(``kernels.remap``'s entry_slot / entry_wave [S]): the same layouts ``paging.waves`` gives the
host path, written with [S]-shaped masks instead of host-sized index lists, so nothing is read
back and every shape is fixed by T and k.
- ``grouped_mm`` (``DeviceGroupedStep``): the reference's own ``torch.sort`` of the flat ids
  gives the row order; the wave's rows are its positions stably regrouped by slot (a stable
  argsort of key = slot for the wave's positions, K for the others), so the buffer's first
  n_w rows are exactly ``GroupedStep._layout``'s positions (tests/test_device_pager.py checks
  it) and the rows after them lie past the last group offset (not computed).
- ``batched_mm`` (``DeviceBatchedStep``): every entry in token-major order, each with its own
  wave's slot; entries of other waves are computed and dropped by a mask.
Both reuse ``paging.waves``' pieces: ``activate``, ``post_expert_norm``,
``in_reference_layout`` (each wave's rows at their reference positions of a zero [S, ...]
buffer, so each element takes the same vector or scalar path as unpaged) and
``StepEntries.combine`` (the weights and the sum over k). ``eager`` has no device step: its
loop finds the routed experts with ``nonzero`` (a host read; ``paging.inner`` says so).
Does not: decide or page in (``device_residency``, ``kernels``).

Legend: T tokens, H hidden, k top_k, K slots, S = T k entries, W waves.
"""

from __future__ import annotations

import torch

from pagedexperts.paging.waves import StepEntries, activate, in_reference_layout, post_expert_norm, up_and_down_weights


class DeviceStep(StepEntries):
    """One step's entries, each wave known on the device: ``entry_slot``, ``entry_wave`` [S]
    int64 (``kernels.remap``). ``run_wave(view, wave)`` (the contract's; no slot map: the
    entries' slots are ``entry_slot``) fills wave ``wave``'s entry outputs over all K slots; an
    empty wave leaves them as they are; ``combine`` is ``StepEntries.combine``."""

    def __init__(self, module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 entry_slot: torch.Tensor, entry_wave: torch.Tensor) -> None:
        super().__init__(module, hidden, top_k_index)
        self.entry_slot = entry_slot
        self.entry_wave = entry_wave

    def _store_masked(self, entries: torch.Tensor, valid: torch.Tensor, out: torch.Tensor) -> None:
        """entry_out[entries[r]] = out[r] where valid[r] (``entries`` a permutation of [S])."""
        if self.entry_out is None:
            self.entry_out = out.new_zeros((self.num_entries, out.shape[1]))
        self.entry_out[entries] = torch.where(valid.unsqueeze(1), out, self.entry_out[entries])


class DeviceGroupedStep(DeviceStep):
    """``grouped_mm`` with the host path's row order (module docstring)."""

    def __init__(self, module, hidden, top_k_index, entry_slot, entry_wave) -> None:
        super().__init__(module, hidden, top_k_index, entry_slot, entry_wave)
        self.perm = torch.sort(top_k_index.reshape(-1))[1]  # the reference's own sort
        self.pos_slot = entry_slot[self.perm]  # [S] by reference position
        self.pos_wave = entry_wave[self.perm]

    def layout(self, wave: int, num_slots: int):
        """(positions [S]: the wave's reference positions grouped by slot, then the others;
        group offsets [K] int32; valid [S] bool: buffer row r belongs to the wave; slot per
        buffer row [S]). The first offsets[-1] positions equal ``GroupedStep._layout``'s."""
        in_wave = self.pos_wave == wave
        key = torch.where(in_wave, self.pos_slot, num_slots)
        pos = torch.argsort(key, stable=True)
        per_slot = torch.zeros(num_slots + 1, dtype=torch.int64, device=key.device).index_add_(
            0, key, torch.ones_like(key))[:num_slots]
        offsets = torch.cumsum(per_slot, 0).to(torch.int32)
        valid = torch.arange(key.shape[0], device=key.device) < offsets[-1]
        return pos, offsets, valid, key[pos].clamp(max=num_slots - 1)

    def run_wave(self, view, wave: int, slot_map=None) -> None:
        from transformers.integrations.moe import _grouped_linear

        pos, offsets, valid, slot_of_row = self.layout(wave, view.num_experts)
        rows = valid.unsqueeze(1)
        up_w, up_b, down_w, down_b = up_and_down_weights(view)
        x = self.hidden[self.perm[pos] // self.top_k]
        up = _grouped_linear(x, up_w, offsets, is_transposed=view.is_transposed)
        if up_b is not None:
            up.add_(up_b[slot_of_row])
        act = in_reference_layout(lambda p: activate(view, p), torch.where(rows, up, 0), pos, self.num_entries)
        down = _grouped_linear(act, down_w, offsets, is_transposed=view.is_transposed)
        if down_b is not None:
            down.add_(down_b[slot_of_row])
        down = in_reference_layout(lambda p: post_expert_norm(view, p), torch.where(rows, down, 0), pos,
                                   self.num_entries)
        self._store_masked(self.perm[pos], valid, down)


class DeviceBatchedStep(DeviceStep):
    """``batched_mm`` in the reference's token-major entry order (module docstring)."""

    def run_wave(self, view, wave: int, slot_map=None) -> None:
        from transformers.integrations.moe import _batched_linear

        valid = self.entry_wave == wave
        rows = valid.unsqueeze(1)
        run = self.entry_slot.clamp(min=0)
        x = self.hidden.repeat_interleave(self.top_k, dim=0)
        up_w, up_b, down_w, down_b = up_and_down_weights(view)
        bias = up_b[run] if up_b is not None else None
        up = _batched_linear(x, up_w[run], bias=bias, is_transposed=view.is_transposed)
        act = in_reference_layout(lambda p: activate(view, p), torch.where(rows, up, 0), None, self.num_entries)
        bias = down_b[run] if down_b is not None else None
        down = _batched_linear(act, down_w[run], bias=bias, is_transposed=view.is_transposed)
        down = in_reference_layout(lambda p: post_expert_norm(view, p), torch.where(rows, down, 0), None,
                                   self.num_entries)
        self._store_masked(torch.arange(self.num_entries, device=down.device), valid, down)
