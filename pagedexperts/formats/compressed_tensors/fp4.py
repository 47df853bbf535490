"""compressed-tensors FP4 experts: ``nvfp4-pack-quantized`` (NVFP4A16, NVFP4) and
``mxfp4-pack-quantized`` (MXFP4A16).

Layout and dequantization as compressed-tensors 0.19-0.20 ``NVFP4PackedCompressor`` /
``MXFP4PackedCompressor`` (``compressors/nvfp4/helpers.py``, ``compressors/mx_utils.py``), in the
library's dtypes: the experts stay in bfloat16 whatever the model's dtype (formats/README.md).
Does not: read files, store, page, or quantize activations.

Legend: n experts, O output features, I input features, G groups.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pagedexperts.formats.base import ExpertLayout, QuantizedTensor, TensorSpec, store_name
from pagedexperts.formats.compressed_tensors.w4a16 import ct_experts_args, experts_weights_args, in_experts_dtype
from pagedexperts.formats.compressed_tensors.linear import ct_linear_format
from pagedexperts.formats.packing import WeightPacking, fp4_packing
from pagedexperts.formats.unpack import PackedFormat

LIBRARY_DTYPE = torch.bfloat16  # compressed-tensors' unpack_fp4_from_uint8 default dtype


class _CompressedTensorsFp4(PackedFormat):
    """Shared: matching one compressed-tensors FP4 format, and its specs."""

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
        """Raises ValueError: a group size, bit width, type or asymmetry it does not store (names it)."""
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
        """bfloat16 whatever ``model_dtype`` (the library decompresses FP4 into it)."""
        return LIBRARY_DTYPE

    def layout(self, dense_specs, *, sources=None, transposed: bool = False) -> ExpertLayout:
        """As ``ExpertFormat.layout``, the quantized dense tensors in ``experts_dtype``."""
        return in_experts_dtype(super().layout(dense_specs, sources=sources, transposed=transposed), LIBRARY_DTYPE)

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """Specs of one dense [sources * O, I] tensor: nn.Linear's [O, I] per source along dim 0.
        Raises ValueError: transposed experts (gpt-oss), or I not a multiple of the group size."""
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
    """compressed-tensors ``nvfp4-pack-quantized`` (NVFP4A16, or NVFP4 with activations unquantized)."""

    name = "nvfp4"
    checkpoint_format = "nvfp4-pack-quantized"
    group_size = 16
    scale_dtype = torch.float8_e4m3fn
    weight_names = ("weight_packed", "weight_scale", "weight_global_scale")

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """e2m1 [N, K/2], e4m3 scales per 16 divided by the source's global scale in float32, rounded to bfloat16.
        """
        name, specs = tensor.dense.name, {p.name: p for p in tensor.packed}
        glob = specs[f"{name}_global_scale"]
        return fp4_packing(tensor, weight=specs[f"{name}_packed"], scale=specs[f"{name}_scale"], scale_codes="e4m3",
                           group_size=self.group_size, sources=glob.shape[0], global_scale=glob, global_op="divide",
                           round_dtype=LIBRARY_DTYPE)


class CompressedTensorsMxfp4Format(_CompressedTensorsFp4):
    """compressed-tensors ``mxfp4-pack-quantized`` (MXFP4A16): gpt-oss's e2m1 codes in another layout."""

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
