"""Device bytes one decode step's routed experts cost per MoE layer: fused vs dequantize-all-K.

``decode_bytes`` counts (not times) what each path reads and writes, routed = min(E, T k):
``fused`` each routed expert's packed rows once; ``dequantize_minimum`` the least
``formats.slots.DequantizingSlots`` can move (K packed rows read, K dense written, routed dense
read); ``dequantize_ops`` that path as its torch ops touch memory (every non-view op of
``kernel_tensors``, on the meta device) plus the routed dense rows; ``dequantize_routed`` only
the routed slots dequantized. Dense layouts: the routed rows. Activations left out.

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
    """Sums the bytes of every tensor input and output of every non-view op (a broadcast input at its
    broadcast size); an in-place op counts its sources twice."""

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
    """Packed bytes the fused GEMMs read per routed expert: every ``WeightPacking`` role, plus biases."""
    total = 0
    for t in layout.tensors:
        if len(t.dense.shape) == 2:
            total += layout.format.packing(t, transposed=transposed).expert_bytes
        else:
            total += t.dense.row_bytes
    return total


def dequantize_ops_bytes(layout: ExpertLayout, num_slots: int) -> int:
    """Bytes the torch ops of one wave's dequantization of ``num_slots`` slots touch (meta tensors)."""
    meta = torch.device("meta")
    slots = DequantizingSlots(layout, allocate(layout.packed_specs, num_slots, meta),
                              allocate(layout.dense_specs, num_slots, meta))
    counter = _ByteCounter()
    with counter:
        slots.kernel_tensors(list(range(num_slots)))
    return counter.bytes


def decode_bytes(layout: ExpertLayout, *, num_slots: int, top_k: int, num_tokens: int = 1, num_experts: int | None = None,
                 transposed: bool = False) -> DecodeBytes:
    """``DecodeBytes`` per MoE layer for one decode step of ``num_tokens`` tokens with K =
    ``num_slots``; ``num_experts`` caps the routed experts (default T k).
    Raises ValueError: K < top_k."""
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
