"""Block INT8: int8 weights with one float32 ``weight_scale_inv`` per weight block.

The published layout SGLang loads as block INT8 (``sglang/srt/layers/quantization/
blockwise_int8.py``, ``BlockInt8Config``; DeepSeek-R1-Block-INT8): ``quantization_config``
``{"quant_method": "blockwise_int8", "activation_scheme": "dynamic", "weight_block_size":
[bm, bn]}``; every quantized nn.Linear weight [out, in] is stored as ``weight`` int8 [out, in]
and ``weight_scale_inv`` float32 [ceil(out / bm), ceil(in / bn)] (an edge block may be partial),
the dequantization multiplier of each block: W[r, c] = weight[r, c] * weight_scale_inv[r // bm,
c // bn]. SGLang's fused MoE stacks w13 scales as 2 x ceil(I / bm) rows: gate's and up's grids
one after the other, which is also how the store's ``gate_up_proj_scale_inv`` row is filled.

Dequantize: ``(weight.to(float32) * scale_inv.to(float32)).to(model dtype)`` per source, the
block FP8 arithmetic of ``fp8`` (transformers has no loader for this quant_method; the tests
implement the published formula independently as the reference). Activations: SGLang's kernel
quantizes them per token group at run time (``activation_scheme: dynamic``); pagedexperts runs
the model's own experts kernel on the dequantized weights and unquantized activations, as a
dequantized reference does. Does not: read or write files.

Legend: n experts, bm x bn the weight block, out x in one expert weight's (nn.Linear) shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from pagedexperts.formats.base import ExpertFormat, QuantizedTensor, TensorSpec, ceil_div
from pagedexperts.formats.ct_fp8 import dequantize_fp8
from pagedexperts.formats.ct_schemes import dense_source_count
from pagedexperts.formats.packing import WeightPacking, float8_packing

SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True, repr=False)
class Int8BlockFormat(ExpertFormat):
    """Block INT8 with ``block`` = (bm, bn) = ``weight_block_size``."""

    block: tuple[int, int] = (128, 128)

    name = "int8-block"
    serialized_names = {"weight": ("weight", "weight_scale_inv")}

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        return bool(quantization_config) and quantization_config.get("quant_method") == "blockwise_int8"

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None) -> "Int8BlockFormat":
        """Raises ValueError: no two positive ints ``weight_block_size``, or static activations
        (SGLang's BlockInt8Config refuses both too)."""
        qc = quantization_config or {}
        block = qc.get("weight_block_size")
        if not block or len(block) != 2 or min(block) <= 0:
            raise ValueError(f"blockwise_int8 checkpoint with weight_block_size {block!r}: want two positive ints")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"blockwise_int8 checkpoint with activation_scheme={qc['activation_scheme']!r}: "
                             "only 'dynamic' is supported")
        return cls(block=(int(block[0]), int(block[1])))

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """A 2-D [out, in] weight -> (int8 weight [out, in], float32 scale_inv [sources x
        ceil(out / sources / bm), ceil(in / bn)]); anything else stays dense."""
        if len(dense.shape) != 2:
            return (dense,)
        if transposed:
            raise ValueError(f"{self.name}: experts stored transposed ([in, out], e.g. gpt-oss) are not supported")
        out, inp = dense.shape
        bm, bn = self.block
        return (TensorSpec(dense.name, dense.shape, torch.int8),
                TensorSpec(dense.name + SCALE_SUFFIX, (sources * ceil_div(out // sources, bm), ceil_div(inp, bn)),
                           torch.float32))

    def dequantize(self, tensor: QuantizedTensor, packed: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """int8 [n, out, in] x scale_inv [n, sr, sc] -> [n, out, in] in the dense dtype, each
        source (gate, up) with its own grid (a partial edge block belongs to its source)."""
        name = tensor.dense.name
        sources = dense_source_count(name)
        weight, scales = packed[name], packed[name + SCALE_SUFFIX]
        parts = [dequantize_fp8(w, s, strategy="block", block=self.block, dtype=tensor.dense.dtype,
                                compute_dtype=torch.float32)
                 for w, s in zip(weight.chunk(sources, dim=1), scales.chunk(sources, dim=1))]
        return parts[0] if sources == 1 else torch.cat(parts, dim=1)

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """int8 [N, K], one float32 scale per (bm x bn) block of each source."""
        return float8_packing(tensor, scale=tensor.packed[1], strategy="block", codes="int",
                              sources=dense_source_count(tensor.dense.name), block=self.block)
