"""Block FP8 (DeepSeek-V3, Qwen3-*-FP8: ``quant_method: fp8``, ``weight_block_size``), and ``quantize_fp8_block``.

Dequantized as transformers 5.24's ``Fp8Dequantize._dequantize_one`` (integrations/finegrained_fp8.py):
the block derived from the grid, ``block.BlockFormat``. Does not: read or write files.

Legend: bm x bn the weight block, out x in one expert weight's (nn.Linear) shape.
"""

from __future__ import annotations

import torch

from pagedexperts.formats.base import ceil_div
from pagedexperts.formats.fp8_fp4.block import BlockFormat

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class Fp8BlockFormat(BlockFormat):
    """Block FP8 with ``block`` = (bm, bn) = ``weight_block_size``."""

    name = "fp8-block"
    weight_dtype = FP8_DTYPE
    codes = "e4m3"
    block_from_grid = True

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        return bool(quantization_config) and quantization_config.get("quant_method") == "fp8"

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None) -> "Fp8BlockFormat":
        qc = quantization_config or {}
        block = qc.get("weight_block_size")
        if block is None or len(block) != 2 or min(block) <= 0:
            # GPTQModel's FP8 (format float8_e4m3fn, group_size -1) stores one weight_scale_inv per ROW
            kind = ("per-row FP8 (GPTQModel: weight_scale_inv [out])" if qc.get("format") == "float8_e4m3fn"
                    or qc.get("checkpoint_format") == "float8_e4m3fn" else "per-tensor FP8")
            raise ValueError(
                f"fp8 checkpoint with weight_block_size {block!r} (format={qc.get('format')!r}, "
                f"group_size={qc.get('group_size')!r}): only block FP8 (two positive ints, e.g. [128, 128]) "
                f"is supported, not {kind}"
            )
        for key, want in (("activation_scheme", "dynamic"), ("scale_fmt", "float"), ("expert_dtype", "fp8")):
            if qc.get(key, want) != want:
                raise ValueError(f"fp8 checkpoint with {key}={qc[key]!r}: only {key}={want!r} is supported")
        return cls(block=(int(block[0]), int(block[1])))

    def reference_kwargs(self) -> dict:
        from transformers import FineGrainedFP8Config

        return {"quantization_config": FineGrainedFP8Config(weight_block_size=list(self.block), dequantize=True)}


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest block FP8 of one weight [out, in]: scale_inv = amax(|block|) / 448 (1.0 for
    an all-zero block), weight = round(W / scale_inv). Returns (e4m3 [out, in], float32
    [ceil(out/bm), ceil(in/bn)]); a dim smaller than its block is one partial block.
    Raises ValueError: a dim larger than its block and not a multiple of it (names --block-size)."""
    out, inp = weight.shape
    bm, bn = block
    for size, b, what in ((out, bm, "rows"), (inp, bn, "cols")):
        if size > b and size % b:
            raise ValueError(f"block FP8: {size} {what} is neither a multiple of the block {b} nor below it (--block-size)")
    sr, sc = ceil_div(out, bm), ceil_div(inp, bn)
    w = weight.to(torch.float32)
    padded = torch.zeros(sr * bm, sc * bn, dtype=torch.float32)
    padded[:out, :inp] = w
    blocks = padded.reshape(sr, bm, sc, bn)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(sr * bm, sc * bn)[:out, :inp].to(FP8_DTYPE)
    return q.contiguous(), scale_inv.contiguous()
