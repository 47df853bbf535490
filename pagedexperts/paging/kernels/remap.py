"""Remap: a step's top-k expert ids -> the slot and the wave of each entry, on the device.

Owns the gather ``entry_slot[s] = expert_slot[ids[s]]``, ``entry_wave[s] = expert_wave[ids[s]]``
over the step's S = T k entries (flat, token-major), from the tables ``decide`` writes
(``DecidePlan.expert_slot`` / ``expert_wave`` [E]). ``remap_triton`` (a Triton kernel, grid
ceil(S / BLOCK)) and ``remap_reference`` (torch indexing) write the same [S] int64 outputs.
Does not: decide, page in or compute.
"""

from __future__ import annotations

import torch

from pagedexperts.paging.kernels._triton import HAVE_TRITON, tl, triton

BLOCK = 256


def remap_reference(ids: torch.Tensor, expert_slot: torch.Tensor, expert_wave: torch.Tensor,
                    entry_slot: torch.Tensor, entry_wave: torch.Tensor) -> None:
    """ids [T, k] int64 -> entry_slot, entry_wave [S] int64 (written in place)."""
    flat = ids.reshape(-1)
    entry_slot.copy_(expert_slot[flat])
    entry_wave.copy_(expert_wave[flat])


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["n"])  # n = T k: one compiled variant for every batch size
    def _remap_kernel(ids_ptr, slot_ptr, wave_ptr, out_slot_ptr, out_wave_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        e = tl.load(ids_ptr + offs, mask=mask, other=0)
        tl.store(out_slot_ptr + offs, tl.load(slot_ptr + e, mask=mask), mask=mask)
        tl.store(out_wave_ptr + offs, tl.load(wave_ptr + e, mask=mask), mask=mask)


def remap_triton(ids: torch.Tensor, expert_slot: torch.Tensor, expert_wave: torch.Tensor,
                 entry_slot: torch.Tensor, entry_wave: torch.Tensor) -> None:
    """``remap_reference`` by the Triton kernel."""
    flat = ids.reshape(-1).contiguous()
    n = flat.numel()
    _remap_kernel[(triton.cdiv(n, BLOCK),)](flat, expert_slot, expert_wave, entry_slot, entry_wave, n, BLOCK=BLOCK)
