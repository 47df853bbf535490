"""Device bytes one decode token's routed experts cost per MoE layer: fused vs dequantize-all-K.

Owns ``decode_bytes``, the model the benchmarks report (counted from what each path reads and
writes, not timed):

- ``fused``: the fused GEMMs read each routed expert's packed rows once (every role of both
  projections' ``WeightPacking`` and the bias rows): ``routed x packed bytes per expert``, with
  ``routed = min(E, T k)`` (no two tokens sharing an expert; decode T = 1: k);
- ``dequantize_minimum``: today's packed-slot path dequantizes every one of the K slots each
  wave (``formats.slots.DequantizingSlots``) at the least it can move: the K packed rows read, the
  K dense rows written to the scratch, the routed dense rows read by the dense experts kernel;
- ``dequantize_ops``: the same path as its torch ops touch memory: the bytes of every input and
  output of every non-view op of ``DequantizingSlots.kernel_tensors`` over K slots (the packed rows
  gathered, the format's unpack / cast / gather temporaries, the scratch written), counted on the
  meta device (shapes only: no memory, no compute), plus the routed dense rows read;
- ``dequantize_routed``: the dequantizing path once it dequantizes only the wave's routed slots
  (docs/design.md "Formats"), at the least it can move: the routed packed rows read, their
  dense rows written, then read by the dense experts kernel.
A dense (unquantized) layout has nothing to dequantize: all three are the routed rows.
Activations (S x (H + 2I + I + H) elements, about 0.1 MB at Qwen3-30B-A3B's decode) are left
out of all three. Does not: time anything or touch a device.

Legend: E experts, K slots, k top_k, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagedexperts.formats.base import ExpertLayout
from pagedexperts.formats.slots import DequantizingSlots, allocate


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes per layer for one decode step (module docstring)."""

    fused: int
    dequantize_minimum: int
    dequantize_ops: int
    dequantize_routed: int = 0


class _ByteCounter(TorchDispatchMode):
    """Sums the bytes of every tensor input and output of every op that is not a view (a
    broadcast input counts its broadcast size: every element is a load); an in-place op counts
    its sources twice (read, then written)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):  # views and in-place outputs alias
            flat = list(args) + list((kwargs or {}).values()) + (list(out) if isinstance(out, (tuple, list)) else [out])
            self.bytes += sum(t.numel() * t.element_size() for t in _tensors(flat))
        elif func._schema.is_mutable:  # in place (index_copy_, copy_): its sources read, as many bytes written
            self.bytes += 2 * sum(t.numel() * t.element_size() for t in _tensors(list(args)[1:]))
        return out


def _tensors(items):
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (list, tuple)):
            yield from _tensors(item)


def fused_expert_bytes(layout: ExpertLayout, *, transposed: bool = False) -> int:
    """Packed bytes the fused GEMMs read per routed expert: every role of every quantized
    weight's ``WeightPacking``, plus passthrough 1-D rows (biases)."""
    total = 0
    for t in layout.tensors:
        if len(t.dense.shape) == 2:
            total += layout.format.packing(t, transposed=transposed).expert_bytes
        else:
            total += t.dense.row_bytes
    return total


def dequantize_ops_bytes(layout: ExpertLayout, num_slots: int) -> int:
    """Bytes the torch ops of one wave's dequantization of all ``num_slots`` slots touch (meta
    tensors: shapes only)."""
    meta = torch.device("meta")
    slots = DequantizingSlots(layout, allocate(layout.packed_specs, num_slots, meta),
                              allocate(layout.dense_specs, num_slots, meta))
    counter = _ByteCounter()
    with counter:
        slots.kernel_tensors(list(range(num_slots)))
    return counter.bytes


def decode_bytes(layout: ExpertLayout, *, num_slots: int, top_k: int, num_tokens: int = 1, num_experts: int | None = None,
                 transposed: bool = False) -> DecodeBytes:
    """Per MoE layer, one decode step of ``num_tokens`` tokens with K = ``num_slots`` packed slots:
    ``DecodeBytes`` (module docstring). ``num_experts`` caps the routed experts (default: T k).

    Raises:
        ValueError: K < top_k (a step must fit one wave's routed experts per token)."""
    if num_slots < top_k:
        raise ValueError(f"num_slots {num_slots} is below top_k {top_k}")
    routed = min(num_experts or num_tokens * top_k, num_tokens * top_k)
    dense = layout.dense_expert_bytes
    if layout.is_dense:  # nothing to dequantize: the experts kernel reads the routed slot rows
        return DecodeBytes(routed * dense, routed * dense, routed * dense, routed * dense)
    minimum = num_slots * (layout.expert_bytes + dense) + routed * dense
    return DecodeBytes(fused=routed * fused_expert_bytes(layout, transposed=transposed), dequantize_minimum=minimum,
                       dequantize_ops=dequantize_ops_bytes(layout, num_slots) + routed * dense,
                       dequantize_routed=routed * (layout.expert_bytes + 2 * dense))
