"""Launchers of the fused MoE kernels over packed rows and what they read: ``ProjectionRows`` (a base
tensor and int64 row offsets per packed role: slot s is row s, host rows joined after as K + e),
``FusedBlocks`` (tiles from S and the packing only), ``KernelTarget``. docs/fused-kernels.md "Kernel
internals".

Legend: S = T k entries, R addressable rows, ``out_features`` / ``in_features``, I expert
intermediate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from pagedexperts.formats.packing import ROLES, WeightPacking
from pagedexperts.paging.kernels._triton import check_backend, tl, triton
from pagedexperts.paging.kernels.fused_align import Alignment
from pagedexperts.paging.kernels import fused_moe_kernel as kernels  # its @triton.jit names exist only with triton
from pagedexperts.paging.kernels.fused_moe_kernel import Arithmetic, packing_args



def _tl_dtype(dtype: torch.dtype):
    """The Triton type of float32, float16 or bfloat16 (ValueError otherwise)."""
    table = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    if dtype not in table:
        raise ValueError(f"fused kernels compute in no {dtype}; supported: {list(table)}")
    return table[dtype]


def row_offsets(rows: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """int64 [R]: each row of ``rows`` [R, ...] as an element offset from ``base`` (same dtype).
    ValueError: a non-contiguous row, other dtype, or allocations not whole elements apart."""
    size = rows.element_size()
    distance = rows.data_ptr() - base.data_ptr()
    if rows.dtype != base.dtype or distance % size or not rows[0].is_contiguous():
        raise ValueError(f"row offsets need contiguous {base.dtype} rows element-aligned with the base; got "
                         f"{rows.dtype}, strides {rows.stride()}, distance {distance} bytes")
    return distance // size + torch.arange(rows.shape[0], dtype=torch.int64, device=base.device) * rows.stride(0)


def _alignment(rows: torch.Tensor) -> int:
    """The largest power of two <= 16 bytes dividing every row start, in elements."""
    size = rows.element_size()
    align = 16
    while align > size and (rows.data_ptr() % align or (rows.stride(0) * size) % align):
        align //= 2
    return max(align // size, 1)


@dataclass(frozen=True)
class RoleRows:
    """One role's rows: row r at ``base + offsets[r]`` elements, offsets multiples of ``align``."""

    base: torch.Tensor
    offsets: torch.Tensor
    align: int

    @classmethod
    def of(cls, table: torch.Tensor) -> "RoleRows":
        """The rows of one [R, ...] table (float8 tables are read as bytes)."""
        table = table.view(torch.uint8) if table.dtype == torch.float8_e4m3fn else table
        return cls(table, row_offsets(table, table), _alignment(table))

    def join(self, other: "RoleRows") -> "RoleRows":
        """These rows then ``other``'s (ValueError: other dtype or misaligned allocations)."""
        size, distance = self.base.element_size(), other.base.data_ptr() - self.base.data_ptr()
        if other.base.dtype != self.base.dtype or distance % size:
            raise ValueError(f"cannot join {other.base.dtype} rows {distance} bytes away to {self.base.dtype} rows")
        offsets = torch.cat([self.offsets, other.offsets.to(self.offsets.device) + distance // size])
        return RoleRows(self.base, offsets, math.gcd(self.align, other.align))


@dataclass(frozen=True)
class ProjectionRows:
    """One projection's rows: ``roles`` -> ``RoleRows``, ``bias`` or None, ``keepalive`` (what offsets
    point into)."""

    packing: WeightPacking
    roles: Mapping[str, RoleRows]
    bias: RoleRows | None = None
    keepalive: tuple = field(default=(), repr=False)

    @property
    def num_rows(self) -> int:
        return self.roles["weight"].offsets.shape[0]

    @property
    def device(self) -> torch.device:
        return self.roles["weight"].offsets.device

    @classmethod
    def from_tables(cls, packing: WeightPacking, tables: Mapping[str, torch.Tensor],
                    bias: torch.Tensor | None = None) -> "ProjectionRows":
        """Rows of [R, ...] ``tables`` (slots or the store); ``bias`` [R, N] or None. ValueError names
        a bad table."""
        roles, kept = {}, []
        for role, spec in packing.tensors:
            table = tables.get(spec.name)
            if table is None or tuple(table.shape[1:]) != spec.shape or table.dtype != spec.dtype:
                got = None if table is None else (tuple(table.shape), table.dtype)
                raise ValueError(f"{spec.name} ({role}): want [R, *{spec.shape}] {spec.dtype}, got {got}")
            roles[role] = RoleRows.of(table)
            kept.append(table)
        if bias is not None and tuple(bias.shape[1:]) != (packing.out_features,):
            raise ValueError(f"bias rows must be [R, {packing.out_features}], got {tuple(bias.shape)}")
        return cls(packing, roles, None if bias is None else RoleRows.of(bias),
                   tuple(kept) + ((bias,) if bias is not None else ()))

    def join(self, other: "ProjectionRows") -> "ProjectionRows":
        """``self``'s rows then ``other``'s (R_self + r). ValueError: packings or bias presence differ."""
        if other.packing != self.packing or (other.bias is None) != (self.bias is None):
            raise ValueError("join needs rows of one packing, with or without bias alike")
        roles = {role: rows.join(other.roles[role]) for role, rows in self.roles.items()}
        bias = None if self.bias is None else self.bias.join(other.bias)
        return ProjectionRows(self.packing, roles, bias, self.keepalive + other.keepalive)


@dataclass(frozen=True)
class FusedBlocks:
    """Tile sizes of one GEMM and its launch options."""

    block_m: int = 16
    block_out: int = 64  # output features per tile
    block_in: int = 64  # input features per tile
    num_warps: int = 4
    num_stages: int = 3


def block_m_for(num_entries: int) -> int:
    """BLOCK_M of a step with S entries: 16 for decode-sized steps, 64 for prefill (S >= 1024)."""
    return 16 if num_entries < 1024 else 64


def choose_blocks(num_entries: int, packing: WeightPacking) -> FusedBlocks:
    """BLOCK_IN 64, or the group size where it lies in [32, 64) (one scale per column per tile)."""
    block_in = packing.group_size if 32 <= packing.group_size < 64 else 64
    return FusedBlocks(block_m=block_m_for(num_entries), block_in=block_in)


@dataclass(frozen=True)
class KernelTarget:
    """The interpreter (``arch`` 0: bfloat16 emulated, float32 dot) or a CUDA arch (80, 89, 90)."""

    arch: int = 0

    @classmethod
    def of(cls, device) -> "KernelTarget":
        """The target for tensors on ``device`` (ValueError: ``check_backend``'s)."""
        device = torch.device(device)
        check_backend("triton", device)
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            return cls(10 * major + minor)
        return cls(0)

    def constexprs(self, packing: WeightPacking) -> dict:
        """The ``ARITHMETIC`` constexpr of ``packing`` on this target (dtypes and emulation)."""
        dense = _tl_dtype(packing.dense_dtype)
        return {"ARITHMETIC": Arithmetic(mul=_tl_dtype(packing.mul_dtype),
                                         round=_tl_dtype(packing.round_dtype or packing.dense_dtype), dense=dense,
                                         dot=tl.float32 if self.arch == 0 else dense, emulate_bf16=self.arch == 0,
                                         fp8_native=self.arch >= 89)}


@dataclass(frozen=True)
class Launch:
    """One kernel launch: grid, arguments by name (tensors and ints), constexprs, options."""

    grid: tuple[int, ...]
    args: dict
    constexprs: dict
    num_warps: int
    num_stages: int


def _tables(rows: ProjectionRows) -> tuple[dict, dict]:
    """(role tables in ``ROLES`` order, ``ALIGNS``); a missing role gets the weight's (never read)."""
    tables = tuple((rows.roles.get(role, rows.roles["weight"]).base, rows.roles.get(role, rows.roles["weight"]).offsets)
                   for role in ROLES)
    aligns = tuple(rows.roles[role].align if role in rows.roles else 1 for role in ("weight", "scale", "zero"))
    return {"tables": tables}, {"ALIGNS": aligns}


def gemm_launch(a: torch.Tensor, c: torch.Tensor, rows: ProjectionRows, alignment: Alignment, *, a_row_div: int,
                blocks: FusedBlocks, target: KernelTarget) -> Launch:
    """The GEMM launch computing ``c`` [S, N] from ``a`` rows (entry s reads ``a[s // a_row_div]``)."""
    args, constexprs, options = gemm_arguments(rows, alignment.num_entries, alignment.block_m,
                                               a_row_div=a_row_div, blocks=blocks, target=target)
    args.update(a_ptr=a, c_ptr=c, alignment=(alignment.sorted_entry, alignment.block_row, alignment.num_padded),
                stride_am=a.stride(0), stride_cm=c.stride(0))
    grid = (alignment.max_blocks, triton.cdiv(rows.packing.out_features, blocks.block_out))
    return Launch(grid, args, constexprs, **options)


def gemm_arguments(rows: ProjectionRows, num_entries: int, block_m: int, *, a_row_div: int, blocks: FusedBlocks,
                   target: KernelTarget) -> tuple[dict, dict, dict]:
    """(arguments, constexprs, options) of a GEMM fixed for S = ``num_entries``: all but the step's
    tensors."""
    packing = rows.packing
    ints, constexprs = packing_args(packing)
    tables, aligns = _tables(rows)
    bias = rows.bias or rows.roles["weight"]
    args = dict(**tables, bias=(bias.base, bias.offsets), out_features=packing.out_features,
                in_features=packing.in_features, num_entries=num_entries, a_row_div=a_row_div, **ints)
    arithmetic = target.constexprs(packing)
    constexprs.update(arithmetic, **aligns, HAS_BIAS=rows.bias is not None,
                      DOT_PRECISION="ieee" if arithmetic["ARITHMETIC"].dot == tl.float32 else None,
                      BLOCK_M=block_m, BLOCK_OUT=blocks.block_out, BLOCK_IN=blocks.block_in)
    return args, constexprs, dict(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def dequantize_launch(out: torch.Tensor, rows: ProjectionRows, row_ids: torch.Tensor, *, target: KernelTarget,
                      block_out: int = 64, block_in: int = 64) -> Launch:
    """The launch writing ``out`` [n, out, in] (dense dtype) from the rows ``row_ids`` [n] lists."""
    packing = rows.packing
    ints, constexprs = packing_args(packing)
    tables, aligns = _tables(rows)
    args = dict(out_ptr=out, rows_ptr=row_ids, **tables, **ints, out_features=packing.out_features,
                in_features=packing.in_features)
    constexprs.update(target.constexprs(packing), **aligns, BLOCK_OUT=block_out, BLOCK_IN=block_in)
    grid = (row_ids.shape[0], triton.cdiv(packing.out_features, block_out), triton.cdiv(packing.in_features, block_in))
    return Launch(grid, args, constexprs, 4, 1)


def dequantize_rows(rows: ProjectionRows, row_ids: torch.Tensor) -> torch.Tensor:
    """W of rows ``row_ids``: [n, out_features, in_features], equal to the format's ``dequantize``."""
    packing = rows.packing
    out = torch.empty((row_ids.shape[0], packing.out_features, packing.in_features), dtype=packing.dense_dtype,
                      device=row_ids.device)
    launch = dequantize_launch(out, rows, row_ids, target=KernelTarget.of(row_ids.device))
    kernels.dequantize_kernel[launch.grid](**launch.args, **launch.constexprs, num_warps=launch.num_warps)
    return out
