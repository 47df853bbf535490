"""``packed`` planned on the host (``HostPackedStep``): one ``formats.cpu_pack.packed_matmul`` call per
routed expert and projection over a ``formats.cpu_pack.CpuPackedSlots`` table, no dense weight copy;
everything around the calls batched per step or wave. Exact to all E resident (docs/formats.md
"Computed packed on a CPU"): each expert's rows in one call, the gate and norm over the all-resident
[S, ...] shape.

Legend: T tokens, H hidden, k top_k, E experts, K slots, S = T k entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedexperts.formats.cpu_pack import KernelTensor, packed_matmul, plan_layout
from pagedexperts.paging.steps.contract import HostRouting, LayerStep, SlotSetup
from pagedexperts.paging.transfer import upload


@dataclass
class PackedWork:
    """One step: ``x`` [T, H], routing, the stable expert-sorted ``order`` [S] and ``x_sorted`` [S, H],
    ``waves``, entry outputs [S, H]."""

    hidden: torch.Tensor
    x: torch.Tensor
    routing: HostRouting
    order: np.ndarray
    x_sorted: torch.Tensor
    waves: list
    entry_out: torch.Tensor


@dataclass(frozen=True)
class WaveRows:
    """One wave's experts (``slots``, ``sizes``), rows' expert-sorted ``positions`` (None: all), flat
    ``entries``."""

    slots: list
    sizes: list
    positions: torch.Tensor | None
    entries: torch.Tensor


@dataclass(frozen=True)
class PackedProjection:
    """One projection's ``plan`` (``KernelTensor``) and the names of its ``weight`` and ``scales`` in
    a slot's rows."""

    plan: KernelTensor
    weight: str
    scales: str


@dataclass(frozen=True)
class PackedLayer:
    """One layer's up (or gate_up) and down projections, bias names or None, gate, optional norm; the
    slots' rows are read each wave (``CpuPackedSlots.slot_rows``)."""

    up: PackedProjection
    down: PackedProjection
    up_bias: str | None
    down_bias: str | None
    gate: object
    post_norm: object


class HostPackedStep(LayerStep):
    """``packed`` over a ``formats.cpu_pack.CpuPackedSlots`` table. ValueError at construction: a layer
    the kernels cannot compute or a table not in their layouts."""

    def __init__(self, setup: SlotSetup) -> None:
        super().__init__(setup)
        self.projections = packed_projections(setup)
        self.layer: PackedLayer | None = None

    def begin(self, module, hidden, top_k_index, routing: HostRouting) -> PackedWork:
        """The index math for all waves (numpy on the read-back ids) and the hidden rows in
        expert-sorted order."""
        if self.layer is None:
            self.layer = self._packed_layer(module)
        flat = routing.ids.reshape(-1)
        order = np.argsort(flat, kind="stable")
        waves = wave_rows(routing.waves, flat, order, hidden.device)
        x = hidden.to(self.layer.up.plan.dtype).contiguous()
        x_sorted = x.index_select(0, upload(order // routing.ids.shape[1], hidden.device))
        out = torch.empty((flat.shape[0], hidden.shape[1]), dtype=x.dtype, device=hidden.device)
        return PackedWork(hidden, x, routing, order, x_sorted, waves, out)

    def run_wave(self, work: PackedWork, wave: int, slot_map=None) -> None:
        """One up (or gate_up) and one down call per expert; gate, norm, biases and the copy batched."""
        rows, layer = work.waves[wave], self.layer
        slot_rows = self.setup.slots.kernel_tensors(work.routing.waves[wave].slots).slot_rows
        if not rows.sizes:
            return
        num_rows = work.x_sorted.shape[0]
        x = work.x_sorted if rows.positions is None else work.x_sorted.index_select(0, rows.positions)
        out = _per_expert(layer.up, slot_rows, rows, x)
        if layer.up_bias is not None:
            out = out + _bias_rows(slot_rows, layer.up_bias, rows)
        act = _at_sorted_positions(layer.gate, out, rows.positions, num_rows).contiguous()
        out = _per_expert(layer.down, slot_rows, rows, act)
        if layer.down_bias is not None:
            out = out + _bias_rows(slot_rows, layer.down_bias, rows)
        if layer.post_norm is not None:
            out = _at_sorted_positions(layer.post_norm, out, rows.positions, num_rows)
        work.entry_out.index_copy_(0, rows.entries, out)

    def combine(self, work: PackedWork, top_k_weights: torch.Tensor) -> torch.Tensor:
        """grouped_mm's combine, kept in this module so a step crosses no other
        (tests/paging/test_step_walk.py)."""
        num_tokens, top_k = top_k_weights.shape
        weighted = work.entry_out.view(num_tokens, top_k, -1) * top_k_weights.unsqueeze(-1)
        return weighted.sum(dim=1).to(work.hidden.dtype)

    def _packed_layer(self, module) -> PackedLayer:
        """The ``PackedLayer`` of the experts ``module`` over the projections."""
        gated, biased = module.has_gate, module.has_bias
        up_name = "gate_up_proj" if gated else "up_proj"
        norm = module.post_expert_norm if getattr(module, "has_post_expert_norm", False) else None
        tensors = self.setup.slots.kernel_tensors(())
        bias = {name: name if biased and name in tensors else None for name in (f"{up_name}_bias", "down_proj_bias")}
        return PackedLayer(self.projections[up_name], self.projections["down_proj"], bias[f"{up_name}_bias"],
                           bias["down_proj_bias"], module._apply_gate if gated else module.act_fn, norm)

    def wave_view(self, module, wave_slots):
        """The module itself: packed slots are compared row for row by the independence check."""
        return module


def wave_rows(waves, flat: np.ndarray, order: np.ndarray, device) -> list[WaveRows]:
    """Each wave's ``WaveRows`` from the flat ids [S] and their stable expert-sorted ``order`` [S]."""
    counts = np.bincount(flat)
    if len(waves) == 1:  # every entry in one wave (all E resident, or every routed expert resident)
        sorted_wave = None
    else:
        wave_of = np.full(counts.shape[0], -1, dtype=np.int64)
        for w, planned in enumerate(waves):
            wave_of[np.asarray(planned.experts, dtype=np.int64)] = w
        sorted_wave = wave_of[flat[order]]  # each expert-sorted entry's wave
    out = []
    for w, planned in enumerate(waves):
        experts = np.asarray(planned.experts, dtype=np.int64)
        rank = np.argsort(experts, kind="stable")
        slots, sizes = np.asarray(planned.slots, dtype=np.int64)[rank], counts[experts[rank]]
        if sorted_wave is None:
            positions, entries = None, order
        else:
            where = np.flatnonzero(sorted_wave == w)
            positions, entries = upload(where, device), order[where]
        out.append(WaveRows(slots.tolist(), sizes.tolist(), positions, upload(entries, device)))
    return out


def _at_sorted_positions(fn, rows: torch.Tensor, positions: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """``contract.in_unpaged_layout`` over the all-resident sorted buffer (kept in this module for the
    walk)."""
    if positions is None:
        return fn(rows)
    full = rows.new_zeros((num_rows, rows.shape[1]))
    full[positions] = rows
    return fn(full)[positions]


def _per_expert(proj: PackedProjection, slot_rows, rows: WaveRows, x: torch.Tensor) -> torch.Tensor:
    """[n_w, N]: each expert's rows of ``x`` times its slot's matrix, one call per expert, each handed
    a fresh copy of its rows (faster than a view: docs/benchmarks.md)."""
    plan, weight, scales = proj.plan, proj.weight, proj.scales
    outs = [packed_matmul(plan, slot_rows[slot][weight], slot_rows[slot][scales], rows_e.clone())
            for rows_e, slot in zip(x.split(rows.sizes), rows.slots)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _bias_rows(slot_rows, name: str, rows: WaveRows) -> torch.Tensor:
    """[n_w, N]: each wave row's expert bias ``name``, in the wave's expert-sorted order."""
    return torch.cat([slot_rows[slot][name].expand(size, -1) for slot, size in zip(rows.slots, rows.sizes)])


def packed_projections(setup: SlotSetup) -> dict[str, PackedProjection]:
    """{dense name: PackedProjection} of the slot table's projections. ValueError: a layout the
    kernels cannot compute, or a table not in their layouts."""
    plans = plan_layout(setup.layout)
    if isinstance(plans, str):
        raise ValueError(f"--experts-implementation packed: {plans}; use --experts-implementation grouped_mm")
    tensors = setup.slots.kernel_tensors(())
    missing = [name for p in plans for name in (p.weight_name, p.scale_name) if name not in tensors]
    if missing:
        raise ValueError(f"--experts-implementation packed reads slots in torch's CPU kernel layouts; this layer's "
                         f"slot table holds no {missing[0]!r} (it was built for another experts implementation)")
    return {p.name: PackedProjection(p, p.weight_name, p.scale_name) for p in plans}
