"""MXFP4: the OCP microscaling FP4 layout gpt-oss ships its routed experts in, and ``quantize_mxfp4``.

Stacked ``experts.{gate_up,down}_proj_blocks`` uint8 [E, out, in/32, 16] and ``_scales`` uint8
[E, out, in/32] (E8M0); biases unquantized; the dense module keeps gpt-oss's [in, out].
Dequantization equals transformers 5.24's ``_convert_moe_packed_tensors`` (integrations/mxfp4.py):
its ``ldexp`` is one float32 product rounded once. Does not: read or write files.

Legend: n experts, out x in one expert weight's (nn.Linear) shape.
"""

from __future__ import annotations

import torch

from pagedexperts.formats.base import QuantizedTensor, TensorSpec
from pagedexperts.formats.packing import WeightPacking, fp4_packing
from pagedexperts.formats.unpack import E2M1_MAGNITUDES, PackedFormat

BLOCK = 32  # FP4 values per scale
E8M0_BIAS = 127


class Mxfp4Format(PackedFormat):
    """MXFP4 routed experts (gpt-oss): ``*_blocks`` and ``*_scales`` per weight, biases dense."""

    name = "mxfp4"
    transposed_experts = True
    serialized_names = {
        "gate_up_proj": ("gate_up_proj_blocks", "gate_up_proj_scales"),
        "down_proj": ("down_proj_blocks", "down_proj_scales"),
    }

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        return bool(quantization_config) and quantization_config.get("quant_method") == "mxfp4"

    def reference_kwargs(self) -> dict:
        """transformers' own dequantization (``Mxfp4Config(dequantize=True)``), never the Hub kernels."""
        from transformers import Mxfp4Config

        return {"quantization_config": Mxfp4Config(dequantize=True)}

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """A transposed weight [in, out] -> (blocks uint8 [out, in/32, 16], scales uint8 [out, in/32]).
        Raises ValueError: an input dim not a multiple of 32, or an untransposed module."""
        if len(dense.shape) != 2:
            return (dense,)
        if not transposed or sources != 1:
            raise ValueError(f"MXFP4 {dense.name} {dense.shape}: only gpt-oss's stacked, transposed experts are published")
        inp, out = dense.shape
        if inp % BLOCK:
            raise ValueError(f"MXFP4 {dense.name}: input size {inp} is not a multiple of the block {BLOCK}")
        return (
            TensorSpec(dense.name + "_blocks", (out, inp // BLOCK, BLOCK // 2), torch.uint8),
            TensorSpec(dense.name + "_scales", (out, inp // BLOCK), torch.uint8),
        )

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = True) -> WeightPacking:
        """e2m1 blocks [N, K/32, 16], an E8M0 scale per 32 inputs, in float32; the dense module is [K, N]."""
        blocks, scales = tensor.packed
        in_features, out_features = tensor.dense.shape
        return fp4_packing(tensor, weight=blocks, scale=scales, scale_codes="e8m0", group_size=BLOCK, sources=1,
                           n=out_features, k=in_features)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest MXFP4 of weights [..., out, in], OCP MX v1.0: per 32-value block exponent
    floor(log2(amax)) - 2, each value / 2**exponent rounded to the nearest e2m1 (ties to the lower
    code), clamped to +-6. Returns (blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32]).
    Raises ValueError: ``in`` not a multiple of 32."""
    *prefix, inp = weight.shape
    if inp % BLOCK:
        raise ValueError(f"MXFP4 needs the input size to be a multiple of {BLOCK}, got {inp}")
    w = weight.to(torch.float32).reshape(*prefix, inp // BLOCK, BLOCK)
    amax = w.abs().amax(dim=-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -E8M0_BIAS))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = w / torch.exp2(exponent)
    magnitudes = torch.tensor(E2M1_MAGNITUDES)
    code = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1).to(torch.uint8)
    code = code | ((scaled < 0).to(torch.uint8) << 3)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = (exponent.squeeze(-1) + E8M0_BIAS).to(torch.uint8)
    return packed.contiguous(), scales.contiguous()
