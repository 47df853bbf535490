"""Page-in: copy one wave's planned store rows into slot rows as raw bytes, the load count read on the
device. ``PageIn`` is one layer's: "triton" (one launch per wave, a persistent grid; on CUDA it
reads the page-locked store through its device-mapped address: docs/device-side-decide.md "Page-in
kernel") or "torch" (``page_in_torch``). Not ordered against compute: one stream, issue order.

Legend: E experts, K slots, W waves; a "row" is one expert's slice ``tensor[e]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedexperts.paging.kernels._triton import HAVE_TRITON, tl, triton

BLOCK_WORDS = 1024  # words one program copies per iteration (4 KiB of int32 words)
PROGRAMS_PER_SM = 4  # programs in flight per streaming multiprocessor at a wave's most loads


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` [N, ...] as raw words [N, W] (int32 when a row's bytes divide by 4, else uint8);
    ValueError if not contiguous."""
    if not t.is_contiguous():
        raise ValueError(f"page-in needs contiguous per-expert tensors; got strides {t.stride()}")
    raw = t.reshape(t.shape[0], -1).view(torch.uint8)
    return raw.view(torch.int32) if raw.shape[1] % 4 == 0 else raw


def page_in_torch(store: dict[str, torch.Tensor], slots: dict[str, torch.Tensor], src: torch.Tensor,
                      dst: torch.Tensor, count: torch.Tensor) -> None:
    """For j < count: ``slots[name][dst[j]] = store[name][src[j]]`` (``src``, ``dst`` [K] int64,
    ``count`` () int64); rows j >= count rewrite their own bytes."""
    valid = (torch.arange(dst.shape[0], device=dst.device) < count).unsqueeze(1)
    for name, host in store.items():
        words, slot_words = as_words(host), as_words(slots[name])
        rows = torch.where(valid, words[src.clamp(min=0)], slot_words[dst])
        slot_words.index_copy_(0, dst, rows)


if HAVE_TRITON:

    @triton.jit
    def _address_kernel(t_ptr, out_ptr):
        # the address the launcher passes for this tensor (a mapped host tensor's device address)
        tl.store(out_ptr, t_ptr.to(tl.int64, bitcast=True))

    @triton.jit(do_not_specialize=["wave"])
    def _page_in_kernel(table_ptr, src_ptr, dst_ptr, count_ptr, wave, K,
                        BYTES: tl.constexpr, BLOCK: tl.constexpr):
        j = tl.program_id(0)  # load index in the wave
        t = tl.program_id(1)  # tensor
        n = tl.load(count_ptr + wave)
        if j < n:
            word = tl.uint8 if BYTES else tl.int32
            e = tl.load(src_ptr + wave * K + j)
            s = tl.load(dst_ptr + wave * K + j)
            row_words = tl.load(table_ptr + 3 * t + 2)
            store_row = tl.load(table_ptr + 3 * t).to(tl.pointer_type(word)) + e * row_words
            slot_row = tl.load(table_ptr + 3 * t + 1).to(tl.pointer_type(word)) + s * row_words
            stride = tl.num_programs(2) * BLOCK
            for start in range(tl.program_id(2) * BLOCK, row_words, stride):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < row_words
                tl.store(slot_row + offs, tl.load(store_row + offs, mask=mask), mask=mask)


@dataclass(frozen=True)
class _TableGroup:
    """One launch's ``table`` [N, 3] int64 (store address, slot address, words per row), word type and
    largest row."""

    table: torch.Tensor
    bytewise: bool
    max_row_words: int


def _address(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[1] int64: the address Triton's launcher passes for ``t`` (a mapped host tensor's device
    address)."""
    out = torch.zeros(1, dtype=torch.int64, device=device)
    _address_kernel[(1,)](t, out)
    return out


def _table_groups(store: dict[str, torch.Tensor], slots: dict[str, torch.Tensor], device) -> tuple[_TableGroup, ...]:
    groups = []
    for bytewise in (False, True):
        rows = [(as_words(t), as_words(slots[name])) for name, t in store.items()]
        rows = [(w, s) for w, s in rows if (w.dtype == torch.uint8) == bytewise]
        if not rows:
            continue
        entries = [torch.cat([_address(w, device), _address(s, device),
                              torch.tensor([w.shape[1]], dtype=torch.int64, device=device)]) for w, s in rows]
        groups.append(_TableGroup(torch.stack(entries), bytewise, max(w.shape[1] for w, _ in rows)))
    return tuple(groups)


class PageIn:
    """One layer's page-in of ``store`` [E, ...] into ``slots`` [K, ...]; ``programs_per_row`` None:
    PROGRAMS_PER_SM per SM (CUDA), 2 elsewhere. ValueError: a non-contiguous tensor or unknown
    backend."""

    def __init__(self, store: dict[str, torch.Tensor], slots: dict[str, torch.Tensor], device, *,
                 backend: str, programs_per_row: int | None = None) -> None:
        if backend not in ("torch", "triton"):
            raise ValueError(f"unknown page-in backend {backend!r}; choose 'torch' or 'triton'")
        self.store, self.slots, self.backend = store, slots, backend
        self.device = torch.device(device)
        self.num_slots = next(iter(slots.values())).shape[0]
        self.groups = _table_groups(store, slots, self.device) if backend == "triton" else ()
        self.programs_per_row = programs_per_row
        self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count \
            if self.device.type == "cuda" else 0
        self._grids: dict[int, list[tuple[int, int, int]]] = {}  # max_loads -> each group's grid, built once

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor, wave: int, max_loads: int) -> None:
        """Page in wave ``wave``: src, dst [W, K] int64, count [W] int64; ``max_loads`` = min(T k, K)."""
        if self.backend == "torch":
            page_in_torch(self.store, self.slots, src[wave], dst[wave], count[wave])
            return
        grids = self._grids.get(max_loads) or self._grids.setdefault(
            max_loads, [(max_loads, g.table.shape[0], self._programs(max_loads, g)) for g in self.groups])
        for g, grid in zip(self.groups, grids):
            _page_in_kernel[grid](g.table, src, dst, count, wave, self.num_slots, BYTES=g.bytewise, BLOCK=BLOCK_WORDS)

    def _programs(self, max_loads: int, group: _TableGroup) -> int:
        """P: programs per (load, tensor), at most one per chunk of the largest row."""
        chunks = triton.cdiv(group.max_row_words, BLOCK_WORDS)
        if self.programs_per_row is not None:
            return max(1, min(self.programs_per_row, chunks))
        if not self._sms:
            return min(2, chunks)
        return max(1, min(chunks, triton.cdiv(PROGRAMS_PER_SM * self._sms, max_loads * group.table.shape[0])))
