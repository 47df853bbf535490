"""The fused experts step of a device-planned layer-step (``--experts-implementation fused``).

Owns ``slot_rows`` (the address tables of one layer's [K, ...] packed slot tensors, the
``kernels.fused_moe.ProjectionRows`` of gate_up and down: built once per slot table, never
per step) and ``DeviceFusedStep``, the wave-compute contract's device step for the fused
kernels (``paging.waves.StepEntries``): per wave, the entries of the wave keep their slot as
row id and the others get -1, and ``kernels.fused_moe.fused_entries`` (align by slot, gate-up
GEMM dequantizing in registers, the module's own gate, down GEMM) writes the wave's entry
outputs straight from the packed slots: no dense scratch, no host constant, no read-back.
Does not: decide, page in or remap (``paging.device_executor``), or launch anything itself.

Exactness: an entry's output bits depend only on its token, its expert's packed bytes and the
step's entry count (tile sizes are a function of S and the packing, never of K, E, the slot or
the wave: ``kernels.fused_moe``), and the weights are applied by ``StepEntries.combine``. So a
paged step equals the same kernel with all E experts resident (K = E), bit for bit
(tests/test_fused_paged.py). Against transformers' dequantized experts it is within a
tolerance (docs/exactness.md).

Legend: T tokens, H hidden, k top_k, K slots, S = T k entries.
"""

from __future__ import annotations

from typing import Mapping

import torch

from pagedexperts.formats.base import ExpertLayout, TensorSpec
from pagedexperts.formats.dense import DenseFormat
from pagedexperts.paging.device_layout import DeviceStep
from pagedexperts.paging.kernels.fused_moe import ProjectionRows, fused_entries
from pagedexperts.paging.waves import activate, post_expert_norm

PROJECTIONS = ("gate_up_proj", "down_proj")  # what the fused kernels compute, in order


def slot_rows(layout: ExpertLayout | None, slots: Mapping[str, torch.Tensor], *,
              transposed: bool) -> dict[str, ProjectionRows]:
    """{"gate_up_proj": ProjectionRows, "down_proj": ...} over the [K, ...] ``slots`` (row id
    = slot). ``layout``: the layer's quantized ``ExpertLayout``, or None for dense experts
    (their slot tensors are the weights); ``transposed``: the experts module's
    ``is_transposed`` (gpt-oss: [in, out] weights, with biases).

    Raises:
        ValueError: an experts module without a fused gate_up (e.g. a separate up_proj), or
            slots that do not match the layout (names the tensor and the flag).
        NotImplementedError: a format without a ``WeightPacking`` (names the format).
    """
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


class DeviceFusedStep(DeviceStep):
    """``fused``: the wave's entries computed from the packed slot rows the view carries
    (``view.fused_rows``, ``slot_rows``; the executor builds them once). Entries of other
    waves keep their outputs (``DeviceStep._store_masked``)."""

    def run_wave(self, view, wave: int, slot_map=None) -> None:
        in_wave = self.entry_wave == wave
        row_ids = torch.where(in_wave, self.entry_slot, -1).view(self.num_tokens, self.top_k)
        rows = view.fused_rows
        hidden = self.hidden.to(rows["gate_up_proj"].packing.dense_dtype)  # experts in another dtype: as grouped_mm
        out = fused_entries(hidden, row_ids, rows["gate_up_proj"], rows["down_proj"],
                            activation=lambda p: activate(view, p), post_expert=lambda p: post_expert_norm(view, p))
        self._store_masked(torch.arange(self.num_entries, device=out.device), in_wave, out)
