"""compressed-tensors FP8 experts: ``float-quantized`` / ``naive-quantized`` (FP8, FP8_DYNAMIC,
FP8_BLOCK) and ``mxfp8-quantized`` (MXFP8), bound per dense tensor.

Layout and dequantization as compressed-tensors 0.19 / 0.20 ``FloatQuantizationCompressor``
(``mx_utils.decompress_mx_scale`` for MXFP8) and ``_dequantize``: ``x_q.to(scale.dtype) * scale``
in the stored scale's dtype (formats/README.md). Does not: read files, store, page, or quantize activations.

Legend: n experts, O output features, I input features, bm x bn a block.
"""

from __future__ import annotations

from typing import Mapping

import torch

from pagedexperts.formats.base import LINEAR_WEIGHT, QuantizedTensor, TensorSpec, ceil_div
from pagedexperts.formats.compressed_tensors.schemes import (ExpertScheme, dense_schemes, dense_source_count, resolved_schemes)
from pagedexperts.formats.compressed_tensors.linear import ct_linear_format
from pagedexperts.formats.packing import WeightPacking, dense_packing, float8_packing
from pagedexperts.formats.unpack import PackedFormat

FP8_DTYPE = torch.float8_e4m3fn
STRATEGIES = ("tensor", "channel", "block", "group")
FORMATS = ("float-quantized", "naive-quantized", "mxfp8-quantized")
SCALE_SUFFIX = "_scale"  # store name of weight_scale: dense name + "_scale"


def is_fp8_scheme(scheme: ExpertScheme) -> bool:
    return scheme.weights.get("type") == "float" and scheme.weights.get("num_bits") == 8


def _check_scheme(dense: str, scheme: ExpertScheme) -> tuple[str, tuple[int, int] | None, torch.dtype]:
    """(strategy, block (group: (1, group_size)) or None, scale dtype) of one dense tensor's FP8 scheme.
    Raises ValueError: a format, strategy, asymmetry or dynamic weights this module does not read."""
    w = scheme.weights
    if scheme.format not in FORMATS:
        raise ValueError(f"fp8 experts ({dense}) with format={scheme.format!r}: only {FORMATS} are supported")
    strategy = w.get("strategy")
    if strategy not in STRATEGIES:
        raise ValueError(f"fp8 experts ({dense}) with strategy={strategy!r}: only {STRATEGIES} are supported")
    if not w.get("symmetric", True) or w.get("dynamic", False):
        raise ValueError(f"fp8 experts ({dense}) with symmetric={w.get('symmetric')!r} dynamic={w.get('dynamic')!r}: "
                         "only symmetric static weights are supported")
    block = None
    if strategy == "block":
        bs = w.get("block_structure")
        if not bs or len(bs) != 2 or min(bs) <= 0:
            raise ValueError(f"fp8 block experts ({dense}) with block_structure={bs!r}: want two positive ints")
        block = (int(bs[0]), int(bs[1]))
    if strategy == "group":
        group_size = w.get("group_size")
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"fp8 group experts ({dense}) with group_size={group_size!r}: want a positive int")
        block = (1, group_size)
    name = str(w.get("scale_dtype") or "float32").removeprefix("torch.")
    scale_dtype = getattr(torch, name, None)
    if not isinstance(scale_dtype, torch.dtype):
        raise ValueError(f"fp8 experts ({dense}) with scale_dtype={w.get('scale_dtype')!r}: not a torch dtype")
    if (scheme.format == "mxfp8-quantized") != (scale_dtype == torch.uint8):
        raise ValueError(f"fp8 experts ({dense}) with format={scheme.format!r} and scale_dtype={w.get('scale_dtype')!r}: "
                         "uint8 (E8M0) scales are read for mxfp8-quantized only, and mxfp8-quantized needs them")
    return strategy, block, scale_dtype


class CompressedTensorsFp8Format(PackedFormat):
    """compressed-tensors FP8 weights per tensor, channel, block or group, bound per dense experts tensor."""

    name = "ct-fp8"
    serialized_names = {"weight": ("weight", "weight_scale")}
    scale_suffix = SCALE_SUFFIX  # the scale's store name: dense name + this
    linear_format = ct_linear_format

    def __init__(self, schemes: Mapping[str, tuple[str, tuple[int, int] | None, torch.dtype]]) -> None:
        self.schemes = dict(schemes)  # dense name -> (strategy, block, scale dtype)
        if len(set(self.schemes.values())) == 1:  # one scheme: a plain nn.Linear weight takes it too
            self.schemes.setdefault(LINEAR_WEIGHT, next(iter(self.schemes.values())))

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        schemes = resolved_schemes(quantization_config)
        return bool(schemes) and all(is_fp8_scheme(s) for s in schemes.values())

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None) -> "CompressedTensorsFp8Format":
        """Bind each dense tensor's strategy, block and scale dtype.
        Raises ValueError: see ``_check_scheme``."""
        schemes = dense_schemes(quantization_config or {})
        return cls({dense: _check_scheme(dense, s) for dense, s in schemes.items()})

    def with_stored_dtypes(self, dtypes) -> "CompressedTensorsFp8Format":
        """Bound to the dtype the checkpoint stores ``weight_scale`` in (multiplied in it)."""
        stored = dtypes.get("weight_scale")
        if stored is None:
            return self
        return type(self)({d: (strategy, block, stored) for d, (strategy, block, _) in self.schemes.items()})

    def _scale_shape(self, dense: str, out_features: int, in_features: int, sources: int) -> tuple[int, ...]:
        strategy, block, _ = self.schemes[dense]
        if strategy == "tensor":
            return (sources,)
        if strategy == "channel":
            return (sources * out_features, 1)
        if strategy == "group" and in_features % block[1]:
            raise ValueError(f"{self.name}: {dense} in_features {in_features} is not a multiple of group_size {block[1]}")
        return (sources * ceil_div(out_features, block[0]), ceil_div(in_features, block[1]))

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """fp8 weight [sources * O, I] + scale (per source, concatenated along dim 0)."""
        if dense.name not in self.schemes or len(dense.shape) != 2:
            return (dense,)
        if transposed:
            raise ValueError(f"{self.name}: experts stored transposed ([in, out], e.g. gpt-oss) are not supported")
        if sources != dense_source_count(dense.name):
            raise ValueError(f"{self.name}: {dense.name} from {sources} checkpoint tensors, expected "
                             f"{dense_source_count(dense.name)}")
        rows, in_features = dense.shape
        shape = self._scale_shape(dense.name, rows // sources, in_features, sources)
        return (TensorSpec(dense.name, dense.shape, FP8_DTYPE),
                TensorSpec(dense.name + self.scale_suffix, shape, self.schemes[dense.name][2]))

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """fp8 [N, K] with its scheme's scale per source, multiplied in the scale's dtype (E8M0: bfloat16)."""
        if tensor.is_passthrough:
            return dense_packing(tensor, transposed=transposed)
        strategy, block, _ = self.schemes[tensor.dense.name]
        scale = tensor.packed[1]
        e8m0 = scale.dtype == torch.uint8
        return float8_packing(tensor, scale=scale, strategy=strategy, block=block,
                              sources=dense_source_count(tensor.dense.name), scale_codes="e8m0" if e8m0 else "float",
                              mul_dtype=torch.bfloat16 if e8m0 else scale.dtype)
