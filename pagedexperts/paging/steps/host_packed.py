"""``packed`` planned on the host: quantized experts computed in their packed form on a CPU.

Owns ``HostPackedStep``, the ``steps.contract.LayerStep`` body of ``--experts-implementation
packed``: over a slot table in the layouts of torch's own CPU kernels
(``formats.cpu_pack.CpuPackedSlots``), each routed expert of a wave runs the kernel's matmul
(``formats.cpu_pack.packed_matmul``: int4 with group scales and float zero points, or
per-channel int8) for its up (or gate_up) projection, then the same kernel for down; no dense
copy of a weight is made. Everything around those calls is batched: the index math of all waves
once per step (``begin``: numpy on the read-back ids), one gather of the hidden rows in
expert-sorted order, and per wave one call each for the module's own gate (``_apply_gate`` or
``act_fn``) over all its rows, the biases, the post-expert norm and the copy into the entries. A layer whose
format those kernels cannot take is given another table and ``grouped_mm`` by
``loading.runners`` (the reason is in the runtime's stats).

Exactness: one expert's rows are computed by one call per projection, over its entries in
ascending flat order (s = t k + j), whatever the wave: so a paged step equals the same body with
all E experts resident, bit for bit, at any thread count (the same calls on the same rows; a
kernel row's bits do not depend on the other rows of the call, tested). The gate and the norm
run over a buffer of the all-resident shape [S, ...], the wave's rows at their expert-sorted
positions (``_at_sorted_positions``; all E resident: the wave's rows are that buffer), so
an elementwise kernel's vector / scalar split and thread split fall on every row as they do
with all E resident. The weights and the sum
over k are grouped_mm's (``combine``). Against transformers' dequantized model the kernels'
arithmetic differs in the last bits (``formats.cpu_pack``): within tolerance.

Syncs: none (the rows of each expert are found on the host from the read-back ids).

Legend: T tokens, H hidden, k top_k, E experts, K slots, S = T k entries, n_e entries of expert e.
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
    """One step: hidden [T, H] (in the kernels' dtype ``x``), its routing, the entries in
    ascending expert order (stable: ascending s inside an expert: the all-resident layout)
    ``order`` [S] numpy and their hidden rows ``x_sorted`` [S, H], each wave's ``WaveRows``, and
    the unweighted entry outputs [S, H] (flat order) as the waves fill them."""

    hidden: torch.Tensor
    x: torch.Tensor
    routing: HostRouting
    order: np.ndarray
    x_sorted: torch.Tensor
    waves: list
    entry_out: torch.Tensor


@dataclass(frozen=True)
class WaveRows:
    """Where one wave's entries sit, computed once per step: its experts in ascending order with
    their ``slots`` and row counts ``sizes`` (> 0), ``positions`` [n_w] int64 of its rows in the
    expert-sorted order (None: the wave holds every entry), ``entries`` [n_w] int64 their flat
    indices s, ``slot_rows`` [n_w] int64 each row's slot (biased experts only, else None)."""

    slots: list
    sizes: list
    positions: torch.Tensor | None
    entries: torch.Tensor
    slot_rows: torch.Tensor | None


@dataclass(frozen=True)
class PackedProjection:
    """One projection's slot tensors in the kernel's layout, resolved once per layer (a step
    looks up nothing by name): its ``plan`` (``KernelTensor``), ``weight`` [K, ...] and
    ``scales`` [K, ...] (``KernelTensor.specs`` per slot)."""

    plan: KernelTensor
    weight: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True)
class PackedLayer:
    """What the body reads of one layer, fixed for it: the up (or gate_up) and down
    projections, each slot's (weight, scales) views of them (``up_slots``, ``down_slots`` [K]),
    their biases' slot tensors (None without), the gate ([n, 2I] or [n, I] -> [n, I]), the
    optional post-expert norm."""

    up: PackedProjection
    down: PackedProjection
    up_slots: tuple
    down_slots: tuple
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    gate: object
    post_norm: object


class HostPackedStep(LayerStep):
    """``packed``: per routed expert, torch's packed CPU matmuls over its slot (module
    docstring), over a slot table whose kernel tensors are in the kernels' layouts
    (``formats.cpu_pack.CpuPackedSlots``: ``loading.runners.slot_table`` builds it).

    Raises (at construction):
        ValueError: a layer the kernels cannot compute, or a slot table not in their layouts
            (names the reason and the flag).
    """

    def __init__(self, setup: SlotSetup) -> None:
        super().__init__(setup)
        self.projections = packed_projections(setup)
        self.layer: PackedLayer | None = None

    def begin(self, module, hidden, top_k_index, routing: HostRouting) -> PackedWork:
        """The step's index math, once for all its waves (numpy on the read-back ids), and the
        hidden rows in expert-sorted order (one gather)."""
        if self.layer is None:
            self.layer = self._packed_layer(module)
        flat = routing.ids.reshape(-1)
        order = np.argsort(flat, kind="stable")
        biased = self.layer.up_bias is not None or self.layer.down_bias is not None
        waves = wave_rows(routing.waves, flat, order, biased, hidden.device)
        x = hidden.to(self.layer.up.plan.dtype).contiguous()
        x_sorted = x.index_select(0, upload(order // routing.ids.shape[1], hidden.device))
        out = torch.empty((flat.shape[0], hidden.shape[1]), dtype=x.dtype, device=hidden.device)
        return PackedWork(hidden, x, routing, order, x_sorted, waves, out)

    def run_wave(self, work: PackedWork, wave: int, slot_map=None) -> None:
        """The wave's experts over their slots: one up (or gate_up) and one down kernel call
        per expert over its rows (ascending s), everything between batched over the wave's rows:
        the gate (and the post-expert norm) over them at their expert-sorted positions
        (``_at_sorted_positions``: the all-resident buffer's shape, whatever the wave),
        biases gathered by slot, one copy into the entries' rows."""
        rows, layer = work.waves[wave], self.layer
        self.setup.slots.kernel_tensors(work.routing.waves[wave].slots)  # readable by the kernel (``layer`` views it)
        if not rows.sizes:
            return
        up, down, num_rows = layer.up.plan, layer.down.plan, work.x_sorted.shape[0]
        x = work.x_sorted if rows.positions is None else work.x_sorted.index_select(0, rows.positions)
        out = _per_expert(up, layer.up_slots, rows, x)
        if layer.up_bias is not None:
            out = out + layer.up_bias.index_select(0, rows.slot_rows)
        act = _at_sorted_positions(layer.gate, out, rows.positions, num_rows).contiguous()
        out = _per_expert(down, layer.down_slots, rows, act)
        if layer.down_bias is not None:
            out = out + layer.down_bias.index_select(0, rows.slot_rows)
        if layer.post_norm is not None:
            out = _at_sorted_positions(layer.post_norm, out, rows.positions, num_rows)
        work.entry_out.index_copy_(0, rows.entries, out)

    def combine(self, work: PackedWork, top_k_weights: torch.Tensor) -> torch.Tensor:
        """[T, H] in hidden's dtype: grouped_mm's combine (``contract.LayerStep.combine``), the
        entry outputs times their weights [T, k], summed over k. Written here so that a step
        of this body crosses no module but its own and the kernels'
        (tests/paging/test_step_walk.py)."""
        num_tokens, top_k = top_k_weights.shape
        weighted = work.entry_out.view(num_tokens, top_k, -1) * top_k_weights.unsqueeze(-1)
        return weighted.sum(dim=1).to(work.hidden.dtype)

    def _packed_layer(self, module) -> PackedLayer:
        """The ``PackedLayer`` of ``module`` (the experts module: its gate, norm and bias flags,
        as transformers' experts functions read them) over the projections."""
        gated, biased = module.has_gate, module.has_bias
        up_name = "gate_up_proj" if gated else "up_proj"
        norm = module.post_expert_norm if getattr(module, "has_post_expert_norm", False) else None
        tensors = self.setup.slots.kernel_tensors(())
        up, down = self.projections[up_name], self.projections["down_proj"]
        return PackedLayer(up, down, tuple(zip(up.weight.unbind(0), up.scales.unbind(0))),
                           tuple(zip(down.weight.unbind(0), down.scales.unbind(0))),
                           tensors.get(f"{up_name}_bias") if biased else None,
                           tensors.get("down_proj_bias") if biased else None,
                           module._apply_gate if gated else module.act_fn, norm)

    def wave_view(self, module, wave_slots):
        """Packed slots hold the kernels' layouts, not dense tensors: the independence check
        compares those rows themselves (``loading.independence``); here the module itself."""
        return module


def wave_rows(waves, flat: np.ndarray, order: np.ndarray, biased: bool, device) -> list[WaveRows]:
    """Each wave's ``WaveRows`` from the step's flat expert ids ``flat`` [S] (numpy int64) and
    their stable expert-sorted ``order`` [S]; ``biased``: with each row's slot. Every expert of a
    wave is routed (has rows)."""
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
        slot_rows = upload(np.repeat(slots, sizes), device) if biased else None
        out.append(WaveRows(slots.tolist(), sizes.tolist(), positions, upload(entries, device), slot_rows))
    return out


def _at_sorted_positions(fn, rows: torch.Tensor, positions: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """``fn`` of ``rows`` [n_w, D] as if each sat at ``positions`` [n_w] of a [num_rows, D] buffer
    (the all-resident step's expert-sorted rows), the other rows zeros, computed and dropped;
    ``positions`` None: ``rows`` is that buffer (``contract.in_unpaged_layout``, written here so
    that a step crosses no module but its own and the kernels')."""
    if positions is None:
        return fn(rows)
    full = rows.new_zeros((num_rows, rows.shape[1]))
    full[positions] = rows
    return fn(full)[positions]


def _per_expert(plan: KernelTensor, slot_views, rows: WaveRows, x: torch.Tensor) -> torch.Tensor:
    """[n_w, N]: each expert's rows of ``x`` [n_w, K] (contiguous, the wave's experts in
    ascending order) times its slot's matrix, one kernel call per expert, concatenated. Each
    expert's rows are handed to the kernel as a fresh copy, not a view of ``x``: the kernel
    reads x once per block of output columns, and the copy is cached where a view of x is left
    cold by the previous expert's weights (measured: docs/benchmarks.md)."""
    outs = [packed_matmul(plan, *slot_views[slot], rows_e.clone())
            for rows_e, slot in zip(x.split(rows.sizes), rows.slots)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def packed_projections(setup: SlotSetup) -> dict[str, PackedProjection]:
    """{dense name: PackedProjection} of the layer's quantized tensors: the kernels' plans of its
    layout (``formats.cpu_pack.plan_layout``) over the slot table's kernel tensors of those
    names.

    Raises:
        ValueError: the kernels cannot compute the layout (the plan's reason), or the table's
            kernel tensors are not in the kernels' layouts (a table built for another
            implementation)."""
    plans = plan_layout(setup.layout)
    if isinstance(plans, str):
        raise ValueError(f"--experts-implementation packed: {plans}; use --experts-implementation grouped_mm")
    tensors = setup.slots.kernel_tensors(())
    missing = [name for p in plans for name in (p.weight_name, p.scale_name) if name not in tensors]
    if missing:
        raise ValueError(f"--experts-implementation packed reads slots in torch's CPU kernel layouts; this layer's "
                         f"slot table holds no {missing[0]!r} (it was built for another experts implementation)")
    return {p.name: PackedProjection(p, tensors[p.weight_name], tensors[p.scale_name]) for p in plans}
