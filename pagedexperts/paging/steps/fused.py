"""``fused`` planned on the device (``FusedStep``): per wave, align the entries by slot row, gate-up
GEMM over the packed slots (dequantized in registers), the module's own gate, down GEMM; launches
bound once per step shape. Exact to all E resident; within a tolerance of transformers
(docs/fused-kernels.md).

Legend: T tokens, H hidden, I expert intermediate, k top_k, K slots, S = T k entries.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from pagedexperts.formats.base import ExpertLayout, TensorSpec
from pagedexperts.formats.dense import DenseFormat
from pagedexperts.paging.kernels import fused_moe_kernel as kernels  # its @triton.jit names exist only with triton
from pagedexperts.paging.kernels._triton import triton
from pagedexperts.paging.kernels.fused_align import AlignLaunch
from pagedexperts.paging.kernels.fused_moe import (FusedBlocks, KernelTarget, ProjectionRows, block_m_for,
                                                   choose_blocks, gemm_arguments)
from pagedexperts.paging.steps.contract import DeviceRouting, LayerStep, SlotView

PROJECTIONS = ("gate_up_proj", "down_proj")  # what the fused kernels compute, in order
MAX_SHAPES = 64  # step shapes (entry counts) whose launches a layer keeps; the oldest go first


def slot_rows(layout: ExpertLayout | None, slots: Mapping[str, torch.Tensor], *,
              transposed: bool) -> dict[str, ProjectionRows]:
    """{"gate_up_proj", "down_proj": ProjectionRows} over ``slots`` (row = slot). ValueError: no fused
    gate_up or slots not matching the layout; NotImplementedError: no ``WeightPacking``."""
    if layout is None:
        specs = tuple(TensorSpec(name, tuple(t.shape[1:]), t.dtype) for name, t in slots.items()
                      if not name.endswith("_bias"))
        layout = DenseFormat().layout(specs, transposed=transposed)
    weights = {t.dense.name: t for t in layout.tensors}
    missing = [name for name in PROJECTIONS if name not in weights]
    if missing:
        raise ValueError(f"--experts-implementation fused computes experts with gate_up_proj and down_proj; this "
                         f"layer has {sorted(weights)} (missing {missing}): use --experts-implementation grouped_mm")
    return {name: ProjectionRows.from_tables(layout.format.packing(weights[name], transposed=transposed), slots,
                                             bias=slots.get(f"{name}_bias"))
            for name in PROJECTIONS}


def layer_rows(setup, *, transposed: bool, device: torch.device) -> dict[str, ProjectionRows]:
    """The K slot rows, then with ``setup.in_place`` the store's E host rows (row K + e)."""
    rows = slot_rows(setup.layout, setup.slots.kernel_tensors(()), transposed=transposed)
    if not setup.in_place:
        return rows
    host = slot_rows(setup.layout, setup.store.gather_source(device), transposed=transposed)
    return {name: rows[name].join(host[name]) for name in PROJECTIONS}


@dataclass(frozen=True)
class PreparedGemm:
    """One projection's GEMM bound once per layer and step shape; ``launch(a_ptr=, c_ptr=, alignment=,
    stride_am=, stride_cm=)`` runs it (output [S, ``out_features``])."""

    launch: Callable
    out_features: int
    dense_dtype: torch.dtype


def prepare_gemm(rows: ProjectionRows, *, align: AlignLaunch, a_row_div: int) -> PreparedGemm:
    """The ``PreparedGemm`` of ``rows`` for ``align``'s steps (ValueError: no triton or interpreter)."""
    packing = rows.packing
    blocks = FusedBlocks(block_m=align.block_m, block_in=choose_blocks(align.num_entries, packing).block_in)
    args, constexprs, options = gemm_arguments(rows, align.num_entries, align.block_m, a_row_div=a_row_div,
                                               blocks=blocks, target=KernelTarget.of(rows.device))
    grid = (align.capacity // align.block_m, triton.cdiv(packing.out_features, blocks.block_out))
    launch = functools.partial(kernels.fused_moe_gemm_kernel[grid], **args, **constexprs, **options)
    return PreparedGemm(launch, packing.out_features, packing.dense_dtype)


@dataclass(frozen=True)
class FusedLaunches:
    """A step's align, gate-up GEMM (entry s reads row s // k) and down GEMM; ``entries`` runs them."""

    align: AlignLaunch
    gate_up: PreparedGemm
    down: PreparedGemm

    @classmethod
    def of(cls, gate_up: ProjectionRows, down: ProjectionRows, *, num_entries: int, top_k: int) -> "FusedLaunches":
        """The launches of S = ``num_entries`` steps (ValueError: row counts differ; no triton or
        interpreter)."""
        if gate_up.num_rows != down.num_rows:
            raise ValueError(f"gate_up has {gate_up.num_rows} rows, down {down.num_rows}: one row id must address both")
        align = AlignLaunch.of(num_entries, gate_up.num_rows, block_m_for(num_entries))
        return cls(align, prepare_gemm(gate_up, align=align, a_row_div=top_k), prepare_gemm(down, align=align, a_row_div=1))

    def entries(self, hidden: torch.Tensor, row_ids: torch.Tensor, gate: Callable[[torch.Tensor], torch.Tensor]):
        """[S, H]: unweighted output of every entry whose row id is >= 0 (others not written); ``gate``
        [S, 2I] -> [S, I]. No sync."""
        alignment = self.align(row_ids)
        up = _gemm(self.gate_up, hidden, alignment)
        return _gemm(self.down, gate(up), alignment)


@dataclass
class FusedWork:
    """One step: hidden, output dtype, routing, launches, gate, norm, entry outputs [S, H]."""

    hidden: torch.Tensor
    dtype: torch.dtype
    routing: DeviceRouting
    launches: FusedLaunches
    gate: Callable[[torch.Tensor], torch.Tensor]
    post_norm: Callable[[torch.Tensor], torch.Tensor] | None
    entry_out: torch.Tensor | None = None


class FusedStep(LayerStep):
    """``fused``: the entries from the packed slot rows (and host rows K + e with
    ``SlotSetup.in_place``)."""

    planned = "device"
    reads_in_place = True  # reads host rows K + e when the setup says so (--beyond-k in-place)

    def __init__(self, setup) -> None:
        super().__init__(setup)
        self.rows: dict[str, ProjectionRows] | None = None  # the slots' address tables, at the first step
        self.launches: dict[int, FusedLaunches] = {}  # S -> its launches

    def begin(self, module, hidden, top_k_index, routing: DeviceRouting) -> FusedWork:
        num_entries = top_k_index.numel()
        launches = self.launches.get(num_entries) or self._prepare(module, hidden, top_k_index)
        dense_dtype = launches.gate_up.dense_dtype
        norm = module.post_expert_norm if getattr(module, "has_post_expert_norm", False) else None
        return FusedWork(hidden.to(dense_dtype), hidden.dtype, routing, launches,  # as grouped_mm casts
                         module._apply_gate if module.has_gate else module.act_fn, norm)

    def run_wave(self, work: FusedWork, wave: int, slot_map=None) -> None:
        routing = work.routing
        in_wave = (routing.entry_wave == wave).unsqueeze(1)
        out = work.launches.entries(work.hidden, torch.where(in_wave[:, 0], routing.entry_slot, -1), work.gate)
        if work.post_norm is not None:
            out = work.post_norm(out)
        if work.entry_out is None:
            work.entry_out = out.new_zeros(out.shape)
        work.entry_out = torch.where(in_wave, out, work.entry_out)

    def combine(self, work: FusedWork, top_k_weights) -> torch.Tensor:
        """[T, H] in the input's dtype: (entries x weights).sum over k, as ``grouped_mm`` ends."""
        num_tokens, top_k = top_k_weights.shape
        weighted = work.entry_out.view(num_tokens, top_k, -1) * top_k_weights.unsqueeze(-1)
        return weighted.sum(dim=1).to(work.dtype)

    def _prepare(self, module, hidden: torch.Tensor, top_k_index: torch.Tensor) -> FusedLaunches:
        """The launches for ``top_k_index``'s shape (MAX_SHAPES kept). ValueError: H or device
        mismatch."""
        if self.rows is None:
            self.rows = layer_rows(self.setup, transposed=bool(module.is_transposed), device=hidden.device)
        gate_up, down = self.rows["gate_up_proj"], self.rows["down_proj"]
        num_entries, top_k = top_k_index.numel(), top_k_index.shape[1]
        if not gate_up.packing.in_features == down.packing.out_features == hidden.shape[1] or \
                gate_up.device != hidden.device:
            raise ValueError(f"hidden {tuple(hidden.shape)} on {hidden.device}: the fused rows read "
                             f"{gate_up.packing.in_features} and write {down.packing.out_features} features on "
                             f"{gate_up.device}")
        launches = FusedLaunches.of(gate_up, down, num_entries=num_entries, top_k=top_k)
        if len(self.launches) >= MAX_SHAPES:
            del self.launches[next(iter(self.launches))]
        self.launches[num_entries] = launches
        return launches

    def wave_view(self, module, wave_slots) -> SlotView:
        """The module over the packed slots with ``fused_rows`` (the independence check reads them)."""
        tensors = self.setup.slots.kernel_tensors(())
        view = SlotView(module, tensors)
        view.fused_rows = self.rows or slot_rows(self.setup.layout, tensors, transposed=bool(module.is_transposed))
        return view


def _gemm(gemm: PreparedGemm, a: torch.Tensor, alignment) -> torch.Tensor:
    """[S, N] in the GEMM's dense dtype: ``gemm`` over ``a`` [M, in] (made contiguous)."""
    a = a.contiguous()
    c = torch.empty((alignment.num_entries, gemm.out_features), dtype=gemm.dense_dtype, device=a.device)
    gemm.launch(a_ptr=a, c_ptr=c, alignment=(alignment.sorted_entry, alignment.block_row, alignment.num_padded),
                stride_am=a.stride(0), stride_cm=c.stride(0))
    return c
