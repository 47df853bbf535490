"""Quantized experts in the layouts of torch's CPU int4 / int8 matmuls, converted from a format's rows.

Owns which tensors torch's CPU kernels compute packed and why not (``plan_layout``), one tensor's
kernel layout (``KernelTensor``, through ``formats.unpack.int_groups``), the one kernel call
(``packed_matmul``) and ``CpuPackedSlots``. The kernels (torch >= 2.6): int4
``aten._weight_int4pack_mm_for_cpu(x [M, K], packed uint8 [N, K/2], group_size,
scales_and_zeros [K/group_size, N, 2])`` computing ``(q - 8) * scale + zero`` (a format's
``(q - z) * s`` as ``scale = s``, ``zero = (8 - z) * s``); int8 ``aten._weight_int8pack_mm(x,
w int8 [N, K], scales [N])``, no zero point. They round differently from the format in the last
bits (bound: ``tools.packed_bound``). Does not: run a layer-step, decide residency, read files.

Legend: n experts, N output features, K input features, G groups, E experts, K_s slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from pagedexperts.formats.base import ExpertLayout, QuantizedTensor, TensorSpec
from pagedexperts.formats.slots import SlotTable
from pagedexperts.formats.unpack import PackedFormat, int_groups

KERNEL_GROUP_SIZES = (256, 128, 64, 32)  # the int4 CPU kernel's group sizes, largest first
INT4_ROWS_MULTIPLE = 16  # the int4 CPU kernel's N must be a multiple of this
INT4_OFFSET = 8  # the int4 CPU kernel reads q - 8
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class KernelTensor:
    """One dense expert tensor [N, K] as a CPU kernel reads it: ``kind`` "int4" / "int8",
    ``group_size`` (``repeat`` kernel groups per format group), ``dtype`` of x and the scales."""

    tensor: QuantizedTensor
    fmt: PackedFormat
    kind: str
    out_features: int
    in_features: int
    group_size: int
    repeat: int
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return self.tensor.dense.name

    @property
    def weight_name(self) -> str:
        return f"{self.name}.{self.kind}pack"

    @property
    def scale_name(self) -> str:
        return f"{self.name}.scales_zeros" if self.kind == "int4" else f"{self.name}.scales"

    @property
    def specs(self) -> tuple[TensorSpec, TensorSpec]:
        """(weight, scales) of one expert: int4 uint8 [N, K/2] and [K/group_size, N, 2]; int8
        int8 [N, K] and [N]; scales in ``dtype``."""
        n, k = self.out_features, self.in_features
        if self.kind == "int4":
            return (TensorSpec(self.weight_name, (n, k // 2), torch.uint8),
                    TensorSpec(self.scale_name, (k // self.group_size, n, 2), self.dtype))
        return TensorSpec(self.weight_name, (n, k), torch.int8), TensorSpec(self.scale_name, (n,), self.dtype)

    def convert(self, rows: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A format's packed rows of n experts {packed name: [n, ...]} -> {weight_name, scale_name:
        [n, *spec.shape]} in the kernel's layout.
        Raises ValueError: int8 codes minus their zero points outside [-128, 127]."""
        groups = int_groups(self.fmt.packing_of(self.tensor), rows, constant=self.fmt.device_constant)
        if self.kind == "int8":
            q = groups.codes.to(torch.int16) - groups.zeros.to(torch.int16)  # one group: zeros [n, N, 1]
            if bool(((q < -128) | (q > 127)).any()):
                raise ValueError(f"{self.name}: int8 codes minus their zero points leave [-128, 127] (an asymmetric "
                                 "int8 checkpoint): torch's int8 kernel has no zero point; use --experts-implementation "
                                 "grouped_mm")
            return {self.weight_name: q.to(torch.int8), self.scale_name: groups.scales[..., 0].to(self.dtype)}
        scales = groups.scales.to(torch.float32)
        zeros = (INT4_OFFSET - groups.zeros).to(torch.float32) * scales  # [n, N, G]
        pair = torch.stack([scales, zeros], dim=-1).to(self.dtype)  # [n, N, G, 2]
        pair = pair.repeat_interleave(self.repeat, dim=2)[:, :, : self.in_features // self.group_size]
        packed = torch.stack([torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
                              for q in groups.codes])
        return {self.weight_name: packed, self.scale_name: pair.transpose(1, 2).contiguous()}


def packed_matmul(plan: KernelTensor, weight: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [n, K] (contiguous, ``plan.dtype``) @ W^T -> [n, N] in ``plan.dtype``, W in the kernel's
    layout (``weight``, ``scales`` of ``KernelTensor.specs``)."""
    if plan.kind == "int4":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, plan.group_size, scales)
    return torch.ops.aten._weight_int8pack_mm(x, weight, scales)


def plan_tensor(fmt, tensor: QuantizedTensor, dtype: torch.dtype) -> KernelTensor | str:
    """``tensor``'s ``KernelTensor`` at run dtype ``dtype``, or why torch's CPU kernels cannot
    compute it packed (one sentence naming the format and the limit)."""
    what = f"{getattr(fmt, 'name', type(fmt).__name__)} {tensor.dense.name}"
    if dtype not in KERNEL_DTYPES:
        return f"{what}: run dtype {dtype} (torch's packed CPU matmuls take bfloat16, float16, float32)"
    if not isinstance(fmt, PackedFormat) or fmt.transposed_experts is True:
        return f"{what}: no int packing in the module's [out, in] orientation"
    packing = fmt.packing_of(tensor)
    if packing.codes != "int" or packing.global_scale != "none" or packing.round_dtype is not None \
            or packing.scale_op != "multiply":
        return f"{what}: {packing.codes} codes (torch's CPU kernels take integer int4 / int8 with one scale per group)"
    if packing.spec("g_idx") is not None:
        return f"{what}: activation order (g_idx): the int4 kernel takes groups of consecutive input columns"
    if packing.block_rows != 1:
        return f"{what}: a scale per block of {packing.block_rows} output rows (the kernels take one per row)"
    bits, n, k = packing.bits or 8, packing.out_features, packing.in_features
    group = packing.group_size if packing.group_size and packing.group_size < k else k
    if bits == 8:
        if group != k:
            return f"{what}: group-wise int8 (group {group} of {k} columns; torch's int8 kernel takes one scale per row)"
        return KernelTensor(tensor, fmt, "int8", n, k, 0, 1, dtype)
    if bits != 4:
        return f"{what}: {bits}-bit codes (torch's CPU kernels take 4 and 8 bits)"
    if n % INT4_ROWS_MULTIPLE:
        return f"{what}: {n} output rows (the int4 kernel needs a multiple of {INT4_ROWS_MULTIPLE})"
    size = next((s for s in KERNEL_GROUP_SIZES if group % s == 0 and k % s == 0), None)
    if size is None:
        return (f"{what}: group of {group} of {k} input columns (the int4 kernel takes groups of "
                f"{' / '.join(map(str, reversed(KERNEL_GROUP_SIZES)))})")
    return KernelTensor(tensor, fmt, "int4", n, k, size, group // size, dtype)


def plan_layout(layout: ExpertLayout | None, dtype: torch.dtype | None = None) -> tuple[KernelTensor, ...] | str:
    """The ``KernelTensor`` of every quantized tensor of ``layout`` at run dtype ``dtype`` (None: the
    layout's dense dtype), or the first reason one cannot run packed."""
    if layout is None or layout.is_dense:
        return "dense experts: nothing quantized to compute packed"
    dtype = layout.dense_specs[0].dtype if dtype is None else dtype
    plans = []
    for tensor in layout.tensors:
        if tensor.is_passthrough:
            continue
        plan = plan_tensor(layout.format, tensor, dtype)
        if isinstance(plan, str):
            return plan
        plans.append(plan)
    return tuple(plans)


def kernel_specs(layout: ExpertLayout, plans: tuple[KernelTensor, ...]) -> list[TensorSpec]:
    """One expert's tensors in the kernels' layouts: each plan's (weight, scales), then passthrough
    tensors (``CpuPackedSlots``' order)."""
    return [s for p in plans for s in p.specs] + [t.dense for t in layout.tensors if t.is_passthrough]


class CpuPackedSlots(SlotTable):
    """Slot tensors {name: [K_s, ...]} in the CPU kernels' layouts, ``plans`` {dense name:
    KernelTensor}. What slot s's kernels read is ``slot_rows[s]`` {name: [...]}: its own row of the
    tensors (a copy, converting a format's packed rows), or host rows in the kernels' layout read in
    place (``hold_rows``: no copy; both tables are host memory on a CPU). A slot owns one row of
    bytes at any time, ``own_rows[s]``, which ``release_rows`` may swap with the rows it reads.
    Args: layout; plans (``plan_layout(layout, dtype)``); num_slots K_s; device (a CPU)."""

    def __init__(self, layout: ExpertLayout, plans: tuple[KernelTensor, ...], num_slots: int, device) -> None:
        specs = kernel_specs(layout, plans)
        # uninitialised: a slot's own row is read only after a page-in wrote it, and stays untouched
        # (no memory committed) while the slot reads host rows in place
        super().__init__({s.name: torch.empty((num_slots, *s.shape), dtype=s.dtype, device=device) for s in specs})
        self.layout = layout
        self.plans = {p.name: p for p in plans}
        self._specs = {s.name: (tuple(s.shape), s.dtype) for s in specs}
        self.own_rows = [{name: t[slot] for name, t in self.items()} for slot in range(num_slots)]
        self.slot_rows = list(self.own_rows)

    @property
    def specs(self) -> list[TensorSpec]:
        """One expert's rows in the kernels' layouts."""
        return [TensorSpec(name, shape, dtype) for name, (shape, dtype) in self._specs.items()]

    def convert_many(self, rows: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """n experts' packed rows {packed name: [n, ...]} -> {name: [n, ...]} in the kernels' layouts."""
        out = {}
        for tensor in self.layout.tensors:
            if tensor.is_passthrough:
                out[tensor.dense.name] = rows[tensor.dense.name]
                continue
            out.update(self.plans[tensor.dense.name].convert({p.name: rows[p.name] for p in tensor.packed}))
        return out

    def convert(self, rows: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One expert's packed rows -> its slot rows."""
        return {name: t[0] for name, t in self.convert_many({n: r.unsqueeze(0) for n, r in rows.items()}).items()}

    def write_rows(self, rows: Mapping[str, torch.Tensor], slot: int, *, pinned: bool) -> None:
        """Copy one expert's host rows into the slot's own row, converting a format's packed rows."""
        if set(rows) != set(self._specs):
            rows = self.convert(rows)
        own = self.own_rows[slot]
        for name, row in rows.items():
            own[name].copy_(row)
        self.slot_rows[slot] = own

    def hold_rows(self, rows: Mapping[str, torch.Tensor], slot: int, *, pinned: bool) -> bool:
        """Read host rows already in the kernels' layout (names, shapes, dtypes; contiguous, on the CPU)
        in place; any others are copied (``write_rows``)."""
        if not self._in_layout(rows):
            self.write_rows(rows, slot, pinned=pinned)
            return False
        self.slot_rows[slot] = rows
        return True

    def release_rows(self, rows: Mapping[str, torch.Tensor], slot: int) -> Mapping[str, torch.Tensor]:
        """When ``slot`` reads ``rows`` in place, they become its own row and the caller gets the slot's
        former own row (no copy: the two swap owners); else ``rows``."""
        if self.slot_rows[slot] is not rows:
            return rows
        spare, self.own_rows[slot] = self.own_rows[slot], rows
        return spare

    def _in_layout(self, rows: Mapping[str, torch.Tensor]) -> bool:
        specs = self._specs
        return len(rows) == len(specs) and all(
            specs.get(name) == (tuple(t.shape), t.dtype) and t.device.type == "cpu" and t.is_contiguous()
            for name, t in rows.items())

    def kernel_tensors(self, wave_slots) -> "CpuPackedSlots":
        """The table itself: its kernels read ``slot_rows``."""
        return self

    def device_page_in_problem(self) -> str | None:
        return ("slots in torch's CPU kernel layouts are paged in on the host-planned CPU step "
                "(--experts-implementation packed runs with --decide host)")
