"""Page-in: copy the planned store rows into slot rows, the load count read on the device.

Owns the byte copy of one wave's plan (``DecidePlan`` row w: src [K] experts, dst [K] slots,
count loads) for every per-expert tensor of a layer, whatever its dtype (dense, packed int4
words, FP8, group scales, zero points): each row is copied as raw bytes, as int32 words when
its size allows. ``page_in_triton``: a Triton kernel with a fixed grid of K x chunks programs,
each returning at once when its load index is >= count; on CUDA it reads the page-locked
host store through its device-mapped address (``store.HOST_REGISTER_FLAGS`` registers it
mapped; under UVA the host pointer is the device pointer), on CPU (``TRITON_INTERPRET=1``)
the same kernel reads CPU tensors. ``page_in_reference``: the same writes in torch ops, for
a store on the slots' device (CPU). Does not: decide (``decide``) or order the copy against
compute (one stream: the copy is ordered before the wave's compute by issue order).

Legend: E experts, K slots; a "row" is one expert's slice ``tensor[e]``.
"""

from __future__ import annotations

import torch

from pagedexperts.paging.kernels._triton import HAVE_TRITON, tl, triton

BLOCK_WORDS = 1024  # words one program copies


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` [N, ...] (contiguous) as raw words [N, W]: int32 when a row's bytes divide by 4,
    else uint8. A view: no copy.

    Raises:
        ValueError: ``t`` is not contiguous (a page-in copies whole rows as bytes).
    """
    if not t.is_contiguous():
        raise ValueError(f"page-in needs contiguous per-expert tensors; got strides {t.stride()}")
    raw = t.reshape(t.shape[0], -1).view(torch.uint8)
    return raw.view(torch.int32) if raw.shape[1] % 4 == 0 else raw


def page_in_reference(store: dict[str, torch.Tensor], slots: dict[str, torch.Tensor], src: torch.Tensor,
                      dst: torch.Tensor, count: torch.Tensor) -> None:
    """For j < count: ``slots[name][dst[j]] = store[name][src[j]]`` for every name.

    ``src``, ``dst`` [K] int64 (``dst`` a permutation of the K slots, as ``decide`` writes it),
    ``count`` () int64; store [E, ...] and slots [K, ...] on one device. Rows j >= count are
    rewritten with their own bytes (a fixed-shape no-op)."""
    valid = (torch.arange(dst.shape[0], device=dst.device) < count).unsqueeze(1)
    for name, host in store.items():
        words, slot_words = as_words(host), as_words(slots[name])
        rows = torch.where(valid, words[src.clamp(min=0)], slot_words[dst])
        slot_words.index_copy_(0, dst, rows)


if HAVE_TRITON:

    @triton.jit
    def _page_in_kernel(src_rows, dst_rows, src_ptr, dst_ptr, count_ptr, row_words, BLOCK: tl.constexpr):
        j = tl.program_id(0)
        chunk = tl.program_id(1)
        n = tl.load(count_ptr)
        if j < n:
            e = tl.load(src_ptr + j)
            s = tl.load(dst_ptr + j)
            offs = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = offs < row_words
            words = tl.load(src_rows + e * row_words + offs, mask=mask)
            tl.store(dst_rows + s * row_words + offs, words, mask=mask)


def page_in_triton(store: dict[str, torch.Tensor], slots: dict[str, torch.Tensor], src: torch.Tensor,
                   dst: torch.Tensor, count: torch.Tensor) -> None:
    """``page_in_reference`` by the Triton kernel: one launch per per-expert tensor, grid
    (K, ceil(row words / BLOCK_WORDS)), fixed for the layer. On CUDA ``store`` is the host
    store (page-locked, mapped) and ``slots``, ``src``, ``dst``, ``count`` are on the device."""
    num_loads = dst.shape[0]
    for name, host in store.items():
        words, slot_words = as_words(host), as_words(slots[name])
        row_words = words.shape[1]
        grid = (num_loads, triton.cdiv(row_words, BLOCK_WORDS))
        _page_in_kernel[grid](words, slot_words, src, dst, count, row_words, BLOCK=BLOCK_WORDS)
