"""Remap: each routed entry of a step -> the slot and wave its expert got from the decide.

entry_slot[s] = expert_slot[ids[s]], entry_wave[s] = expert_wave[ids[s]] over the step's S = T k
entries (flat, token-major), from the tables a decide writes (``kernels.decide.DecidePlan``'s
``expert_slot`` / ``expert_wave`` [E]). Two functions of identical semantics: ``remap_torch``
(torch indexing, any device) and ``remap_triton`` (a Triton kernel, grid ceil(S / REMAP_BLOCK);
CUDA, or CPU under ``TRITON_INTERPRET=1``). Does not: decide the residency (``kernels.decide``)
or copy bytes (``kernels.page_in``).

Legend: T tokens, k top_k, S = T k entries, E experts.
"""

from __future__ import annotations

import torch

from pagedexperts.paging.kernels._triton import HAVE_TRITON, tl, triton

REMAP_BLOCK = 256  # entries per program: fixed, so no variant per batch size


def remap_torch(ids: torch.Tensor, expert_slot: torch.Tensor, expert_wave: torch.Tensor,
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
    """``remap_torch`` by the Triton kernel."""
    flat = ids.reshape(-1).contiguous()
    n = flat.numel()
    _remap_kernel[(triton.cdiv(n, REMAP_BLOCK),)](flat, expert_slot, expert_wave, entry_slot, entry_wave, n,
                                                  BLOCK=REMAP_BLOCK)
