"""compressed-tensors FP4 experts: ``nvfp4-pack-quantized`` (NVFP4A16, NVFP4) and
``mxfp4-pack-quantized`` (MXFP4A16), as llm-compressor writes them.

Owns: recognising the two formats in config.json, the packed per-expert tensor specs and their
``WeightPacking`` (``formats.unpack`` dequantizes). Does not: read files, store or page, or
quantize activations (see below).

On-disk layout (compressed-tensors 0.19-0.20 ``NVFP4PackedCompressor`` /
``MXFP4PackedCompressor``, ``compressors/nvfp4/{base,helpers}.py``, ``compressors/mx_utils.py``),
per expert projection ``experts.{j}.{gate,up,down}_proj`` of an nn.Linear weight [O, I]:

- ``weight_packed`` uint8 [O, I/2]: two e2m1 codes per byte, column 2c in the low nibble and
  2c + 1 in the high one (bit 3 of a code is the sign, bits 0-2 index 0, .5, 1, 1.5, 2, 3, 4, 6);
- ``weight_scale`` [O, I/g]: NVFP4 float8_e4m3fn per 16 columns (g = 16); MXFP4 uint8 E8M0
  exponents per 32 columns (scale 2 ** (byte - 127));
- NVFP4 only: ``weight_global_scale`` float32 [1] per projection (the block scales are stored
  multiplied by it), and ``input_global_scale`` float32 [1] when activations are quantized
  statically (NVFP4, W4A4).

Dequantize (``compressors.nvfp4.helpers.unpack_fp4_from_uint8`` then ``quantization.lifecycle.
forward._dequantize``), in the library's own dtypes: the codes are looked up in float32,
signed, cast to bfloat16; NVFP4: ``w = q.float() * (scale.bfloat16() / global_scale)`` (a
bfloat16 [O, G, 1] over a float32 [1] promotes to float32), cast to bfloat16; MXFP4:
``w = q * 2.0 ** (e - 127)`` in bfloat16. The routed experts stay in bfloat16 whatever the
model's dtype (``experts_dtype``), as transformers stacks them in the decompressed dtype. The dense reference built
from this decompression (``tools.reference``) runs activations unquantized: NVFP4's
``input_global_scale`` is paged (it is a per-expert tensor of the checkpoint) but unused, as in
the decompressed model on CPU; a W4A4 kernel (vLLM's) is another computation.

Legend: n experts dequantized together, O output features, I input features, G groups.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from pagedexperts.formats.base import ExpertLayout, QuantizedTensor, TensorSpec, store_name
from pagedexperts.formats.compressed_tensors.w4a16 import ct_experts_args, experts_weights_args
from pagedexperts.formats.compressed_tensors.linear import ct_linear_format
from pagedexperts.formats.packing import WeightPacking, fp4_packing
from pagedexperts.formats.unpack import PackedFormat

LIBRARY_DTYPE = torch.bfloat16  # compressed-tensors' unpack_fp4_from_uint8 default dtype


def in_experts_dtype(layout: ExpertLayout, dtype: torch.dtype | None) -> ExpertLayout:
    """``layout`` with every quantized dense tensor in ``dtype`` (None: unchanged); passthrough
    tensors (biases) keep theirs."""
    if dtype is None:
        return layout
    return ExpertLayout(layout.format, tuple(
        t if t.is_passthrough else QuantizedTensor(dataclasses.replace(t.dense, dtype=dtype), t.packed)
        for t in layout.tensors
    ))


class _CompressedTensorsFp4(PackedFormat):
    """Shared: matching one compressed-tensors FP4 format and the specs."""

    checkpoint_format: ClassVar[str] = ""
    group_size: ClassVar[int] = 0
    scale_dtype: ClassVar[torch.dtype] = torch.uint8
    weight_names: ClassVar[tuple[str, ...]] = ("weight_packed", "weight_scale")
    linear_format = ct_linear_format

    def __init__(self, *, static_input: bool = False) -> None:
        self.static_input = static_input  # input_global_scale stored per projection
        names = self.weight_names + (("input_global_scale",) if static_input else ())
        self.serialized_names = {"weight": names}

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        return ct_experts_args(quantization_config, cls.checkpoint_format) is not None

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None) -> "_CompressedTensorsFp4":
        """Raises ValueError: a group size, bit width, type or asymmetry this format does not
        store (names the key and value)."""
        args = experts_weights_args(quantization_config or {}) or {}
        want = {"num_bits": 4, "type": "float", "group_size": cls.group_size, "symmetric": True}
        for key, value in want.items():
            if args.get(key, value) != value:
                raise ValueError(f"{cls.checkpoint_format} experts with {key}={args.get(key)!r}: only {value!r} is supported")
        acts = args.get("input_activations") or {}
        # a static (False) or "local" (NVFP4's per-token group, global scale calibrated)
        # activation scheme stores input_global_scale per projection; True stores nothing
        return cls(static_input=bool(acts) and acts.get("dynamic") is not True)

    def experts_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """bfloat16, whatever ``model_dtype``: compressed-tensors decompresses FP4 into it and
        transformers stacks the routed experts in the decompressed dtype (as for W4A16's scales)."""
        return LIBRARY_DTYPE

    def layout(self, dense_specs, *, sources=None, transposed: bool = False) -> ExpertLayout:
        """As ``ExpertFormat.layout``, the quantized dense tensors in ``experts_dtype``."""
        return in_experts_dtype(super().layout(dense_specs, sources=sources, transposed=transposed), LIBRARY_DTYPE)

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """Specs of one dense [sources * O, I] expert tensor: nn.Linear's [O, I] per source,
        concatenated along dim 0 (a per-tensor scale: one [1] row per source).

        Raises:
            ValueError: transposed experts (gpt-oss), or I not a multiple of the group size.
        """
        if transposed:
            raise ValueError(f"{self.name}: experts stored transposed ([in, out], e.g. gpt-oss) are not supported")
        if len(dense.shape) != 2:
            return (dense,)
        rows, in_features = dense.shape
        if in_features % self.group_size:
            raise ValueError(f"{self.name} {dense.name}: in_features {in_features} is not a multiple of the group size {self.group_size}")
        specs = [
            TensorSpec(f"{dense.name}_packed", (rows, in_features // 2), torch.uint8),
            TensorSpec(f"{dense.name}_scale", (rows, in_features // self.group_size), self.scale_dtype),
        ]
        specs += [TensorSpec(store_name(dense.name, "weight", n), (sources,), torch.float32)
                  for n in self.serialized_names["weight"][2:]]  # per-tensor scales: [1] per source
        return tuple(specs)


class CompressedTensorsNvfp4Format(_CompressedTensorsFp4):
    """compressed-tensors ``nvfp4-pack-quantized``: NVFP4A16, or NVFP4 (W4A4: its
    ``input_global_scale`` is paged, activations are not quantized; module docstring)."""

    name = "nvfp4"
    checkpoint_format = "nvfp4-pack-quantized"
    group_size = 16
    scale_dtype = torch.float8_e4m3fn
    weight_names = ("weight_packed", "weight_scale", "weight_global_scale")

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """e2m1 [N, K/2], e4m3 scales per 16 columns divided by the source's global scale in
        float32, the product rounded to bfloat16 (compressed-tensors' decompression)."""
        name, specs = tensor.dense.name, {p.name: p for p in tensor.packed}
        glob = specs[f"{name}_global_scale"]
        return fp4_packing(tensor, weight=specs[f"{name}_packed"], scale=specs[f"{name}_scale"], scale_codes="e4m3",
                           group_size=self.group_size, sources=glob.shape[0], global_scale=glob, global_op="divide",
                           round_dtype=LIBRARY_DTYPE)


class CompressedTensorsMxfp4Format(_CompressedTensorsFp4):
    """compressed-tensors ``mxfp4-pack-quantized`` (MXFP4A16): not gpt-oss's
    ``quant_method: mxfp4`` (``formats.fp8_fp4.mxfp4``), though the FP4 codes are the same."""

    name = "ct-mxfp4"
    checkpoint_format = "mxfp4-pack-quantized"
    group_size = 32
    scale_dtype = torch.uint8

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """e2m1 [N, K/2] with an E8M0 scale per 32 columns, multiplied in bfloat16."""
        name = tensor.dense.name
        specs = {p.name: p for p in tensor.packed}
        return fp4_packing(tensor, weight=specs[f"{name}_packed"], scale=specs[f"{name}_scale"], scale_codes="e8m0",
                           group_size=self.group_size, sources=1, mul_dtype=LIBRARY_DTYPE, round_dtype=LIBRARY_DTYPE)
