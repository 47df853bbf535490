"""Block INT8 (``quant_method: blockwise_int8``; DeepSeek-R1-Block-INT8), as SGLang loads it
(``sglang/srt/layers/quantization/blockwise_int8.py``): ``block.BlockFormat`` with int8 values,
each source its own grid. transformers has no loader (the tests implement the formula).
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
        """Raises ValueError: ``weight_block_size`` not two positive ints, or static activations."""
        qc = quantization_config or {}
        block = qc.get("weight_block_size")
        if not block or len(block) != 2 or min(block) <= 0:
            raise ValueError(f"blockwise_int8 checkpoint with weight_block_size {block!r}: want two positive ints")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"blockwise_int8 checkpoint with activation_scheme={qc['activation_scheme']!r}: "
                             "only 'dynamic' is supported")
        return cls(block=(int(block[0]), int(block[1])))
