"""``packed`` planned on the host: quantized experts computed in their packed form on a CPU.

Owns ``HostPackedStep``, the ``steps.contract.LayerStep`` body of ``--experts-implementation
packed``: over a slot table in the layouts of torch's own CPU kernels
(``formats.cpu_pack.CpuPackedSlots``), each routed expert of a wave runs the kernel's matmul
(``formats.cpu_pack.packed_matmul``: int4 with group scales and float zero points, or
per-channel int8) for its up (or gate_up) projection, the module's own gate (``_apply_gate`` or
``act_fn``), then the same kernel for down; no dense copy of a weight is made. A layer whose
format those kernels cannot take is given another table and ``grouped_mm`` by
``loading.runners`` (the reason is in the runtime's stats).

Exactness: one expert's rows are computed by one call per projection, over its entries in
ascending flat order (s = t k + j), whatever the wave: so a paged step equals the same body with
all E experts resident, bit for bit, at any thread count (the same calls on the same rows; a
kernel row's bits do not depend on the other rows of the call, tested). The weights and the sum
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
    """One step: hidden [T, H] (in the kernels' dtype ``x``), its routing, the flat entries in
    ascending expert order (stable: ascending s inside an expert) ``order`` [S], each expert's
    first position ``starts`` and ``counts`` there (numpy, [max id + 1]), and the unweighted
    entry outputs [S, H] as the waves fill them."""

    hidden: torch.Tensor
    x: torch.Tensor
    routing: HostRouting
    order: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    entry_out: torch.Tensor


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
    projections, their biases' slot tensors (None without), the gate ([n, 2I] or [n, I] -> [n, I]),
    the optional post-expert norm."""

    up: PackedProjection
    down: PackedProjection
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
        if self.layer is None:
            self.layer = self._packed_layer(module)
        flat = routing.ids.reshape(-1)
        order = np.argsort(flat, kind="stable")
        counts = np.bincount(flat)
        x = hidden.to(self.layer.up.plan.dtype).contiguous()
        out = torch.empty((flat.shape[0], hidden.shape[1]), dtype=x.dtype, device=hidden.device)
        return PackedWork(hidden, x, routing, order, np.cumsum(counts) - counts, counts, out)

    def run_wave(self, work: PackedWork, wave: int, slot_map=None) -> None:
        """Each expert of the wave over its slot: up, gate, down, into its entries' rows."""
        planned, layer = work.routing.waves[wave], self.layer
        self.setup.slots.kernel_tensors(planned.slots)  # the wave readable by the kernel (``layer`` views it)
        up, down, top_k = layer.up, layer.down, work.routing.ids.shape[1]
        for expert, slot in zip(planned.experts, planned.slots):
            rows_host = work.order[work.starts[expert]: work.starts[expert] + work.counts[expert]]
            rows = upload(rows_host, work.x.device)
            out = packed_matmul(up.plan, up.weight[slot], up.scales[slot], work.x.index_select(0, rows // top_k))
            if layer.up_bias is not None:
                out = out + layer.up_bias[slot]
            act = layer.gate(out).contiguous()
            out = packed_matmul(down.plan, down.weight[slot], down.scales[slot], act)
            if layer.down_bias is not None:
                out = out + layer.down_bias[slot]
            if layer.post_norm is not None:
                out = layer.post_norm(out)
            work.entry_out.index_copy_(0, rows, out)

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
        return PackedLayer(self.projections[up_name], self.projections["down_proj"],
                           tensors.get(f"{up_name}_bias") if biased else None,
                           tensors.get("down_proj_bias") if biased else None,
                           module._apply_gate if gated else module.act_fn, norm)

    def wave_view(self, module, wave_slots):
        """Packed slots hold the kernels' layouts, not dense tensors: the independence check
        compares those rows themselves (``loading.independence``); here the module itself."""
        return module


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
