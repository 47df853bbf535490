"""Block-scaled 8-bit experts: the one class behind block FP8 (``fp8_block``) and block INT8 (``int8_block``).

``BlockFormat``: 8-bit ``weight`` [out, in] and float32 ``weight_scale_inv`` [ceil(out / bm),
ceil(in / bn)]: ``W[r, c] = weight[r, c] * weight_scale_inv[r // bm, c // bn]`` in float32, cast to
the model's dtype; a merged tensor's row holds each source's grid in turn. Does not: read files.

Legend: bm x bn the weight block, out x in one expert weight's (nn.Linear) shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pagedexperts.formats.base import QuantizedTensor, TensorSpec, ceil_div
from pagedexperts.formats.compressed_tensors.schemes import dense_source_count
from pagedexperts.formats.packing import WeightPacking, derived_block, float8_packing
from pagedexperts.formats.unpack import PackedFormat

SCALE_SUFFIX = "_scale_inv"  # store name of weight_scale_inv: dense name + "_scale_inv"


@dataclass(frozen=True, repr=False)
class BlockFormat(PackedFormat):
    """8-bit weights with a float32 scale per ``block`` = (bm, bn) = ``weight_block_size``."""

    block: tuple[int, int] = (128, 128)

    serialized_names = {"weight": ("weight", "weight_scale_inv")}
    weight_dtype: ClassVar[torch.dtype] = torch.int8  # the stored values' dtype
    codes: ClassVar[str] = "int"  # their ``WeightPacking`` code
    # True: the block is derived from the whole tensor's grid (``rows // scale_rows``, as
    # transformers' block FP8 reads a merged gate_up); False: ``block`` within each source
    block_from_grid: ClassVar[bool] = False

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """A 2-D [out, in] weight -> (8-bit weight, float32 scale_inv [sources x ceil(out / sources / bm),
        ceil(in / bn)]); else dense. Raises ValueError: transposed experts (gpt-oss)."""
        if len(dense.shape) != 2:
            return (dense,)
        if transposed:
            raise ValueError(f"{self.name}: experts stored transposed ([in, out], e.g. gpt-oss) are not supported")
        out, inp = dense.shape
        bm, bn = self.block
        return (TensorSpec(dense.name, dense.shape, self.weight_dtype),
                TensorSpec(dense.name + SCALE_SUFFIX, (sources * ceil_div(out // sources, bm), ceil_div(inp, bn)),
                           torch.float32))

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """One float32 scale per block, the block per source or (``block_from_grid``) from the whole grid.
        Raises ValueError: (``block_from_grid``) a weight not a multiple of its grid."""
        weight, scale = tensor.packed
        if self.block_from_grid:
            return float8_packing(tensor, scale=scale, strategy="block", codes=self.codes, sources=1,
                                  block=derived_block(weight.shape, scale.shape))
        return float8_packing(tensor, scale=scale, strategy="block", codes=self.codes,
                              sources=dense_source_count(tensor.dense.name), block=self.block)
