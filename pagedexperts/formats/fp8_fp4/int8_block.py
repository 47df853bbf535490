"""Block INT8 (``quant_method: blockwise_int8``, ``weight_block_size`` [bm, bn]; DeepSeek-R1-Block-INT8).

The layout SGLang loads (``sglang/srt/layers/quantization/blockwise_int8.py``, ``BlockInt8Config``):
``weight`` int8 [out, in], ``weight_scale_inv`` float32 per block, each source its own grid;
dequantized ``(weight.to(float32) * scale_inv).to(model dtype)``: ``block.BlockFormat``.
transformers has no loader for it (the tests implement the published formula as the
reference); activations run unquantized. Does not: unpack, read or write files.

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
        """Raises ValueError: a ``weight_block_size`` that is not two positive ints, or static
        activations (SGLang's BlockInt8Config refuses both too).
        """
        qc = quantization_config or {}
        block = qc.get("weight_block_size")
        if not block or len(block) != 2 or min(block) <= 0:
            raise ValueError(f"blockwise_int8 checkpoint with weight_block_size {block!r}: want two positive ints")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"blockwise_int8 checkpoint with activation_scheme={qc['activation_scheme']!r}: "
                             "only 'dynamic' is supported")
        return cls(block=(int(block[0]), int(block[1])))
