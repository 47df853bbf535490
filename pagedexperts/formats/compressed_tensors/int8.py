"""compressed-tensors ``int-quantized`` int8 experts (W8A8 INT8), activations unquantized.

Layout and dequantization as compressed-tensors 0.19-0.20 ``NaiveQuantizationCompressor``
(``compressors/naive_quantized/base.py``) and ``_dequantize``: formats/README.md.
Does not: read files, store, page, or quantize activations.

Legend: n experts, O output features, I input features.
"""

from __future__ import annotations

import torch

from pagedexperts.formats.base import ExpertLayout, QuantizedTensor, TensorSpec
from pagedexperts.formats.compressed_tensors.w4a16 import (_torch_dtype, ct_experts_args, experts_weights_args,
                                                         in_experts_dtype)
from pagedexperts.formats.compressed_tensors.linear import ct_linear_format
from pagedexperts.formats.packing import WeightPacking, float8_packing
from pagedexperts.formats.unpack import PackedFormat


class CompressedTensorsInt8Format(PackedFormat):
    """compressed-tensors ``int-quantized`` 8-bit weights, channel-wise scales (W8A8 INT8)."""

    name = "w8a8-int8"
    serialized_names = {"weight": ("weight", "weight_scale")}
    linear_format = ct_linear_format

    def __init__(self, *, scale_dtype: torch.dtype | None = None) -> None:
        self.scale_dtype = scale_dtype  # None: the model's dtype

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        return ct_experts_args(quantization_config, "int-quantized") is not None

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None) -> "CompressedTensorsInt8Format":
        """Raises ValueError: bits other than 8, a strategy other than channel, or asymmetric
        weights (names the key and value)."""
        args = experts_weights_args(quantization_config or {}) or {}
        if args.get("num_bits") != 8 or args.get("type", "int") != "int":
            raise ValueError(f"int-quantized experts with num_bits={args.get('num_bits')!r}, type={args.get('type')!r}: "
                             "only 8-bit int is supported")
        if args.get("strategy") != "channel":
            raise ValueError(f"int-quantized experts with strategy={args.get('strategy')!r}: only 'channel' is supported")
        if not args.get("symmetric", True):
            raise ValueError("int-quantized experts with symmetric=false: only symmetric int8 is supported")
        return cls()

    @classmethod
    def from_config(cls, config, quantization_config: dict | None) -> "CompressedTensorsInt8Format":
        """As ``from_quantization_config``; the scales are in the checkpoint's saved dtype."""
        fmt = cls.from_quantization_config(quantization_config)
        get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
        saved = get("dtype") or get("torch_dtype")
        fmt.scale_dtype = saved if isinstance(saved, torch.dtype) else _torch_dtype(saved)
        return fmt

    def with_stored_dtypes(self, dtypes) -> "CompressedTensorsInt8Format":
        """Bound to the dtype the checkpoint stores ``weight_scale`` in."""
        stored = dtypes.get("weight_scale")
        return self if stored is None or stored == self.scale_dtype else type(self)(scale_dtype=stored)

    def experts_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The scales' dtype when bound, else ``model_dtype``."""
        return self.scale_dtype or model_dtype

    def layout(self, dense_specs, *, sources=None, transposed: bool = False) -> ExpertLayout:
        """As ``ExpertFormat.layout``, the quantized dense tensors in ``experts_dtype``."""
        return in_experts_dtype(super().layout(dense_specs, sources=sources, transposed=transposed), self.scale_dtype)

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """int8 [sources * O, I] and the scale [sources * O, 1] (sources concatenated on dim 0).
        Raises ValueError: transposed experts (gpt-oss)."""
        if transposed:
            raise ValueError(f"{self.name}: experts stored transposed ([in, out], e.g. gpt-oss) are not supported")
        if len(dense.shape) != 2:
            return (dense,)
        rows, _ = dense.shape
        return (
            TensorSpec(dense.name, dense.shape, torch.int8),
            TensorSpec(f"{dense.name}_scale", (rows, 1), self.scale_dtype or dense.dtype),
        )

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """int8 [N, K], one scale per row, multiplied in the scale's dtype."""
        scale = tensor.packed[1]
        return float8_packing(tensor, scale=scale, strategy="channel", sources=1, codes="int", mul_dtype=scale.dtype)
