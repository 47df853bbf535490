"""``packed`` planned on the host: quantized experts computed in their packed form on a CPU.

Owns ``HostPackedStep``, the ``steps.contract.LayerStep`` body of ``--experts-implementation
packed``: over a slot table in the layouts of torch's own CPU kernels
(``formats.cpu_pack.CpuPackedSlots``: an expert's rows converted at page-in), each routed expert
of a wave runs ``aten._weight_int4pack_mm_for_cpu`` (int4, group scales and float zero points)
or ``aten._weight_int8pack_mm`` (per-channel int8) for its up (or gate_up) projection, the
module's own gate (``_apply_gate`` or ``act_fn``), then the same kernel for down; no dense copy
of a weight is made. A layer whose format those kernels cannot take was given today's slots by
``loading.runners`` (packed slots dequantized per wave, or dense slots), and runs as
``host_grouped`` (the reason is in the runtime's stats).

Exactness: one expert's rows are computed by one call per projection, over its entries in
ascending flat order (s = t k + j), whatever the wave: so a paged step equals the same body with
all E experts resident, bit for bit, at any thread count (the same calls on the same rows; a
kernel row's bits do not depend on the other rows of the call, tested). The weights and the sum
over k are ``contract.LayerStep.combine`` (grouped_mm's). Against transformers' dequantized model
the kernels' arithmetic differs in the last bits (``formats.cpu_pack``): within tolerance.

Syncs: none (the rows of each expert are found on the host from the read-back ids).

Legend: T tokens, H hidden, k top_k, E experts, K slots, S = T k entries, n_e entries of expert e.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedexperts.formats.cpu_pack import CpuPackedSlots, KernelTensor
from pagedexperts.paging.steps.contract import HostRouting
from pagedexperts.paging.steps.host_grouped import HostGroupedStep
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
    looks up nothing by name): ``weight`` [K, ...] and ``scales`` [K, ...] (``KernelTensor.specs``
    per slot), ``int4`` (else per-channel int8), the kernel's ``group_size``, the kernels' ``dtype``."""

    weight: torch.Tensor
    scales: torch.Tensor
    int4: bool
    group_size: int
    dtype: torch.dtype

    @classmethod
    def of(cls, plan: KernelTensor, slots: CpuPackedSlots) -> PackedProjection:
        return cls(slots[plan.weight_name], slots[plan.scale_name], plan.kind == "int4", plan.group_size, plan.dtype)


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


class HostPackedStep(HostGroupedStep):
    """``packed``: per routed expert, torch's packed CPU matmuls over its slot (module docstring);
    a layer without a ``CpuPackedSlots`` table runs ``HostGroupedStep``."""

    def __init__(self, setup) -> None:
        super().__init__(setup)
        self.packed = isinstance(setup.slots, CpuPackedSlots)
        self.layer: PackedLayer | None = None

    def begin(self, module, hidden, top_k_index, routing: HostRouting):
        if not self.packed:
            return super().begin(module, hidden, top_k_index, routing)
        if self.layer is None:
            self.layer = _packed_layer(module, self.setup.slots)
        flat = routing.ids.reshape(-1)
        order = np.argsort(flat, kind="stable")
        counts = np.bincount(flat)
        x = hidden.to(self.layer.up.dtype).contiguous()
        out = torch.empty((flat.shape[0], hidden.shape[1]), dtype=x.dtype, device=hidden.device)
        return PackedWork(hidden, x, routing, order, np.cumsum(counts) - counts, counts, out)

    def run_wave(self, work, wave: int, slot_map=None) -> None:
        """Each expert of the wave over its slot: up, gate, down, into its entries' rows."""
        if not self.packed:
            return super().run_wave(work, wave, slot_map)
        planned, layer = work.routing.waves[wave], self.layer
        top_k = work.routing.ids.shape[1]
        for expert, slot in zip(planned.experts, planned.slots):
            rows_host = work.order[work.starts[expert]: work.starts[expert] + work.counts[expert]]
            rows = upload(rows_host, work.x.device)
            up = _matmul(layer.up, slot, work.x.index_select(0, rows // top_k))
            if layer.up_bias is not None:
                up = up + layer.up_bias[slot]
            act = layer.gate(up).contiguous()
            down = _matmul(layer.down, slot, act)
            if layer.down_bias is not None:
                down = down + layer.down_bias[slot]
            if layer.post_norm is not None:
                down = layer.post_norm(down)
            work.entry_out.index_copy_(0, rows, down)

    def wave_view(self, module, wave_slots):
        """Packed slots hold the kernels' layouts, not dense tensors: the independence check
        compares those rows themselves (``loading.independence``); here the module itself."""
        return module if self.packed else super().wave_view(module, wave_slots)


def _matmul(proj: PackedProjection, slot: int, x: torch.Tensor) -> torch.Tensor:
    """x [n, K_in] @ W^T of ``proj``'s weight in ``slot`` -> [n, N], in x's dtype."""
    if proj.int4:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, proj.weight[slot], proj.group_size, proj.scales[slot])
    return torch.ops.aten._weight_int8pack_mm(x, proj.weight[slot], proj.scales[slot])


def _packed_layer(module, slots: CpuPackedSlots) -> PackedLayer:
    """The ``PackedLayer`` of ``module`` (the experts module: its gate, norm and bias flags, as
    transformers' experts functions read them) over ``slots``."""
    gated, biased = module.has_gate, module.has_bias
    up_name = "gate_up_proj" if gated else "up_proj"
    norm = module.post_expert_norm if getattr(module, "has_post_expert_norm", False) else None
    return PackedLayer(PackedProjection.of(slots.plans[up_name], slots), PackedProjection.of(slots.plans["down_proj"], slots),
                       slots.get(f"{up_name}_bias") if biased else None, slots.get("down_proj_bias") if biased else None,
                       module._apply_gate if gated else module.act_fn, norm)
