"""Align a step's entries by row on the device, the grouping the fused MoE GEMM reads
(``align_triton``, ``align_torch``; no host read). Row r's entries (s = t k + j), ascending, fill
``sorted_entry[start_r : start_r + count_r]``, padded with S to a multiple of BLOCK_M;
``block_row[b]`` is block b's row; ids < 0 or >= R are left out.

Legend: T tokens, k top_k, S = T k entries, R addressable rows, P padded capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedexperts.paging.kernels._triton import HAVE_TRITON, tl, triton

HISTOGRAM_BLOCK = 1024  # entries per step of the counting loop
SCATTER_BLOCK = 1024  # entries per step of one row's scan


@dataclass(frozen=True)
class Alignment:
    """``sorted_entry`` int32 [P], ``block_row`` int32 [P / block_m], ``num_padded`` int32 [1]
    (device), ``num_entries`` S."""

    sorted_entry: torch.Tensor
    block_row: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_entries: int

    @property
    def max_blocks(self) -> int:
        """Blocks a GEMM launches (the fixed grid; those past num_padded return at once)."""
        return self.block_row.shape[0]


def padded_capacity(num_entries: int, num_rows: int, block_m: int) -> int:
    """P = S + min(S, R) * (BLOCK_M - 1), rounded up to a multiple of BLOCK_M."""
    worst = num_entries + min(num_entries, num_rows) * (block_m - 1)
    return -(-worst // block_m) * block_m


def _check(row_ids: torch.Tensor, num_rows: int, block_m: int) -> None:
    """Raises ValueError for ids that are not an integer tensor, R < 1 or BLOCK_M < 1."""
    if row_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row ids must be int32 or int64, got {row_ids.dtype}")
    if num_rows < 1 or block_m < 1:
        raise ValueError(f"align needs num_rows >= 1 and block_m >= 1, got {num_rows} and {block_m}")


def align_torch(row_ids: torch.Tensor, num_rows: int, block_m: int) -> Alignment:
    """``row_ids`` [T, k] (or [S]) -> the Alignment, in torch ops (ValueError: ``_check``)."""
    _check(row_ids, num_rows, block_m)
    ids = row_ids.reshape(-1).long()
    num_entries, dev = ids.numel(), ids.device
    capacity = padded_capacity(num_entries, num_rows, block_m)
    key = torch.where((ids >= 0) & (ids < num_rows), ids, num_rows)  # left-out entries sort last
    counts = torch.zeros(num_rows + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_rows] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    rank = torch.arange(num_entries, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_key]
    row_start = (ends - padded)[sorted_key.clamp(max=num_rows - 1)]
    dest = torch.where(sorted_key < num_rows, row_start + rank, capacity + rank)  # left out: past the capacity
    out = torch.full((capacity + num_entries,), num_entries, dtype=torch.int32, device=dev)
    out.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(capacity // block_m, device=dev) * block_m
    block_row = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    return Alignment(out[:capacity], block_row, ends[-1:].to(torch.int32), block_m, num_entries)


if HAVE_TRITON:

    @triton.jit
    def align_count_kernel(ids_ptr, counts_ptr, starts_ptr, num_padded_ptr, num_entries, num_rows,
                           BLOCK_M: tl.constexpr, R_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
        """count[r] (left-out ids in the spare bin R_BLOCK - 1), start[r] (padded prefix sum),
        num_padded."""
        counts = tl.zeros([R_BLOCK], dtype=tl.int32)
        for s0 in range(0, num_entries, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            ids = tl.load(ids_ptr + s, mask=s < num_entries, other=-1)
            bins = tl.where((ids >= 0) & (ids < num_rows), ids, R_BLOCK - 1).to(tl.int32)
            counts += tl.histogram(bins, R_BLOCK)
        r = tl.arange(0, R_BLOCK)
        counts = tl.where(r < num_rows, counts, 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        tl.store(counts_ptr + r, counts, mask=r < num_rows)
        tl.store(starts_ptr + r, ends - padded, mask=r < num_rows)
        tl.store(num_padded_ptr, tl.sum(padded, 0))

    @triton.jit
    def align_scatter_kernel(ids_ptr, counts_ptr, starts_ptr, sorted_ptr, block_row_ptr, num_entries,
                             BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
        """Program r: its entries ascending at start[r] + rank, then padding, then its blocks' row id."""
        r = tl.program_id(0)
        start = tl.load(starts_ptr + r)
        count = tl.load(counts_ptr + r)
        seen = tl.full([], 0, tl.int32)
        for s0 in range(0, num_entries, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            hit = tl.load(ids_ptr + s, mask=s < num_entries, other=-1) == r
            rank = seen + tl.cumsum(hit.to(tl.int32), 0) - 1
            tl.store(sorted_ptr + start + rank, s, mask=hit)
            seen += tl.sum(hit.to(tl.int32), 0)
        padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pad = tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + start + count + pad, tl.full([BLOCK_M], 0, tl.int32) + num_entries,
                 mask=pad < padded - count)
        for b in range(0, padded // BLOCK_M):
            tl.store(block_row_ptr + start // BLOCK_M + b, r)


def align_triton(row_ids: torch.Tensor, num_rows: int, block_m: int) -> Alignment:
    """``align_torch`` by two Triton kernels, grids (1,) and (R,) (ValueError: ``_check``)."""
    _check(row_ids, num_rows, block_m)
    return AlignLaunch.of(row_ids.numel(), num_rows, block_m)(row_ids)


@dataclass(frozen=True)
class AlignLaunch:
    """``align_triton`` with sizes and constexprs fixed for one (S, R, ``block_m``), built by ``of``."""

    num_entries: int
    num_rows: int
    block_m: int
    capacity: int
    r_block: int

    @classmethod
    def of(cls, num_entries: int, num_rows: int, block_m: int) -> "AlignLaunch":
        return cls(num_entries, num_rows, block_m, padded_capacity(num_entries, num_rows, block_m),
                   triton.next_power_of_2(num_rows + 1))

    def __call__(self, row_ids: torch.Tensor) -> Alignment:
        """The ``Alignment`` of ``row_ids`` [T, k] (or [S]) int32 / int64, S = ``num_entries``."""
        ids = row_ids.reshape(-1).contiguous()
        num_rows, block_m, dev = self.num_rows, self.block_m, ids.device
        counts = torch.empty(num_rows, dtype=torch.int32, device=dev)
        starts = torch.empty(num_rows, dtype=torch.int32, device=dev)
        num_padded = torch.empty(1, dtype=torch.int32, device=dev)
        sorted_entry = torch.empty(self.capacity, dtype=torch.int32, device=dev)
        block_row = torch.empty(self.capacity // block_m, dtype=torch.int32, device=dev)
        align_count_kernel[(1,)](ids, counts, starts, num_padded, self.num_entries, num_rows, BLOCK_M=block_m,
                                 R_BLOCK=self.r_block, BLOCK_S=HISTOGRAM_BLOCK)
        align_scatter_kernel[(num_rows,)](ids, counts, starts, sorted_entry, block_row, self.num_entries,
                                          BLOCK_M=block_m, BLOCK_S=SCATTER_BLOCK)
        return Alignment(sorted_entry, block_row, num_padded, block_m, self.num_entries)
