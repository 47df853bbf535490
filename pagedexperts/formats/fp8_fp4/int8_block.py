"""Block INT8: int8 weights with one float32 ``weight_scale_inv`` per weight block.

The published layout SGLang loads as block INT8 (``sglang/srt/layers/quantization/
blockwise_int8.py``, ``BlockInt8Config``; DeepSeek-R1-Block-INT8): ``quantization_config``
``{"quant_method": "blockwise_int8", "activation_scheme": "dynamic", "weight_block_size":
[bm, bn]}``; every quantized nn.Linear weight [out, in] is stored as ``weight`` int8 [out, in]
and ``weight_scale_inv`` float32 [ceil(out / bm), ceil(in / bn)] (an edge block may be partial),
the dequantization multiplier of each block: W[r, c] = weight[r, c] * weight_scale_inv[r // bm,
c // bn]. SGLang's fused MoE stacks w13 scales as 2 x ceil(I / bm) rows: gate's and up's grids
one after the other, which is also how the store's ``gate_up_proj_scale_inv`` row is filled.

Dequantize: ``(weight.to(float32) * scale_inv.to(float32)).to(model dtype)`` per source:
``block.BlockFormat``, the class of block FP8 too (transformers has no loader for this
quant_method; the tests implement the published formula independently as the reference). Activations: SGLang's kernel
quantizes them per token group at run time (``activation_scheme: dynamic``); pagedexperts runs
the model's own experts kernel on the dequantized weights and unquantized activations, as a
dequantized reference does. Owns the config's recognition. Does not: unpack
(``formats.unpack``), read or write files.

Legend: n experts, bm x bn the weight block, out x in one expert weight's (nn.Linear) shape.
"""

from __future__ import annotations

import torch

from pagedexperts.formats.fp8_fp4.block import BlockFormat


class Int8BlockFormat(BlockFormat):
    """Block INT8 with ``block`` = (bm, bn) = ``weight_block_size``, each source its own grid."""

    name = "int8-block"
    weight_dtype = torch.int8
    codes = "int"

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
