"""Block FP8: float8_e4m3fn weights with one float32 ``weight_scale_inv`` per weight block.

The layout of DeepSeek-V3 and the Qwen3-*-FP8 checkpoints (``quantization_config``:
``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}``): every quantized nn.Linear-shaped weight [out, in] is
stored as ``weight`` float8_e4m3fn [out, in] and ``weight_scale_inv`` float32
[ceil(out / bm), ceil(in / bn)], the dequantization multiplier of each (bm x bn) block:
W[r, c] = weight[r, c] * weight_scale_inv[r // bm, c // bn].

Dequantization follows transformers' ``Fp8Dequantize._dequantize_one``
(integrations/finegrained_fp8.py, transformers 5.24): the block size is derived from the scale
grid (``rows // scale_rows``), both operands go to float32, one multiply, one cast to the
model's dtype. Owns also ``quantize_fp8_block``, a round-to-nearest quantizer (tests and the
``quantize`` command). Does not: read or write files.

Legend: n experts, bm x bn the weight block, out x in one expert weight's (nn.Linear) shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from pagedexperts.formats.base import ExpertFormat, QuantizedTensor, TensorSpec, ceil_div
from pagedexperts.formats.packing import WeightPacking, derived_block, float8_packing

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True, repr=False)
class Fp8BlockFormat(ExpertFormat):
    """Block FP8 with ``block`` = (bm, bn) = ``weight_block_size``."""

    block: tuple[int, int] = (128, 128)

    name = "fp8-block"
    serialized_names = {"weight": ("weight", "weight_scale_inv")}

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

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """A 2-D [out, in] weight -> (fp8 weight [out, in], float32 scale_inv [sources x
        ceil(out / sources / bm), ceil(in / bn)]); anything else stays dense."""
        if len(dense.shape) != 2:
            return (dense,)
        if transposed:
            raise ValueError(
                f"block FP8 of a transposed experts module ({dense.name} {dense.shape}) has no "
                "published layout"
            )
        out, inp = dense.shape
        bm, bn = self.block
        scale_rows = sources * ceil_div(out // sources, bm)
        return (
            TensorSpec(dense.name, dense.shape, FP8_DTYPE),
            TensorSpec(dense.name + SCALE_SUFFIX, (scale_rows, ceil_div(inp, bn)), torch.float32),
        )

    def dequantize(self, tensor: QuantizedTensor, packed: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """fp8 [n, out, in] x scale_inv [n, sr, sc] -> [n, out, in] in the dense dtype.

        Per source, transformers dequantizes [out/s, in] with its own [sr/s, sc] grid; the
        sources share block sizes, so dequantizing their concatenation is the same arithmetic.

        Raises:
            ValueError: weight rows/cols not divisible by the scale grid (as transformers).
        """
        weight = packed[tensor.dense.name]
        scales = packed[tensor.dense.name + SCALE_SUFFIX]
        return dequantize_fp8_block(weight, scales, tensor.dense.dtype)

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """fp8 [N, K], one float32 scale per block; the block derived from the scale grid over
        the whole (gate + up) tensor, as ``dequantize_fp8_block``."""
        weight, scale = tensor.packed
        return float8_packing(tensor, scale=scale, strategy="block", sources=1,
                              block=derived_block(weight.shape, scale.shape))


def dequantize_fp8_block(weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Block-FP8 dequantization as transformers' ``Fp8Dequantize._dequantize_one``:
    weight [..., rows, cols] (float8_e4m3fn), scales [..., sr, sc] (float32) -> [..., rows, cols]
    in ``dtype``; block = (rows // sr, cols // sc).

    Raises:
        ValueError: rows or cols not divisible by the scale grid.
    """
    q = weight.to(torch.float32)
    rows, cols = q.shape[-2:]
    scale_rows, scale_cols = scales.shape[-2:]
    if rows % scale_rows or cols % scale_cols:
        raise ValueError(f"Weight shape ({rows}, {cols}) not divisible by scale grid ({scale_rows}, {scale_cols}).")
    block_m, block_n = rows // scale_rows, cols // scale_cols
    s = scales.to(torch.float32).reshape(-1, scale_rows, scale_cols).unsqueeze(-1).unsqueeze(2)
    blocks = q.reshape(-1, scale_rows, block_m, scale_cols, block_n)
    return (blocks * s).to(dtype).reshape(q.shape)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest block FP8 of one weight [out, in] (any float dtype).

    Each (bm x bn) block gets scale_inv = amax(|block|) / 448 (1.0 for an all-zero block);
    weight = round(W / scale_inv) to float8_e4m3fn. Returns (float8_e4m3fn [out, in], float32
    [ceil(out/bm), ceil(in/bn)]). A dim smaller than its block is one partial block.

    Raises:
        ValueError: a dim larger than its block and not a multiple of it: transformers derives
            the block from the grid (``rows // scale_rows``) and would read other blocks.
    """
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
