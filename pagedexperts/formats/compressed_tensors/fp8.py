"""compressed-tensors FP8 experts: ``float-quantized`` / ``naive-quantized`` (llm-compressor FP8,
FP8_DYNAMIC, FP8_BLOCK; FP8 static per channel) and ``mxfp8-quantized`` (MXFP8, MXFP8A16).

Owns: recognising the format, the per-expert packed specs and their ``WeightPacking``
(``formats.unpack`` dequantizes). Does not: read files, store, page, or quantize activations
(see below).

On-disk layout (compressed-tensors 0.19/0.20 ``FloatQuantizationCompressor``, as llm-compressor
0.14 writes it), per expert projection ``experts.{j}.{gate,up,down}_proj`` of an nn.Linear
weight [O, I]:

- ``weight`` float8_e4m3fn [O, I] (round-to-nearest of W / scale, clamped to +-448);
- ``weight_scale`` float32 (or the group's ``scale_dtype``): ``tensor`` strategy [1] (FP8),
  ``channel`` [O, 1] (FP8_DYNAMIC), ``block`` [ceil(O / bm), ceil(I / bn)] (FP8_BLOCK,
  ``block_structure`` [bm, bn] = [128, 128]; a partial edge block has its own scale),
  ``group`` [O, I / g]; ``mxfp8-quantized`` (``MXFP8QuantizationCompressor``): group 32 with
  uint8 E8M0 exponents, scale ``2 ** (e - 127)`` (``mx_utils.decompress_mx_scale``);
- ``input_scale`` float32 [1] with static activations (FP8's ``static_minmax`` observer).

Dequantize, as compressed-tensors' own ``_dequantize`` (``x_q.to(scale.dtype) * scale``, the
scale broadcast over its tensor / row / block), in the dtype the checkpoint stores the scale in
(``with_stored_dtypes``), then the model's dtype. For float32 scales this is transformers
5.24's loading of MoE experts too (``CompressedTensorsDequantize.convert``, FP8 branch:
``(weight.to(float32) * weight_scale.to(float32)).to(model dtype)``); for bfloat16 scales
(llm-compressor on a bfloat16 model) the two agree at bfloat16 (the fp8 x bf16 product is exact
in float32, rounded once either way) and differ only when such a checkpoint runs at float32,
where transformers' experts keep the exact product and compressed-tensors' decompression (the
reference ``check`` then picks) the bfloat16 one.
MXFP8 (``mxfp8-quantized``): the E8M0 scale (``2 ** (e - 127)``, decoded to bfloat16 as
``decompress_mx_scale``) is a power of two and an E4M3 value has 4 significant bits, so the
product is exact in bfloat16 and float32 alike.

Activations. The unpaged reference (transformers' loading, on CPU and on a GPU alike, since
its FP8 kernel path ``use_optimized_inference`` is opt-in and covers nn.Linear only) stacks the
experts dequantized and runs them on unquantized activations: the static ``input_scale`` keys
are unused (transformers drops them; pagedexperts logs them as unused), and dynamic per-token /
per-group activation quantization is not applied. pagedexperts computes the same, so paged ==
unpaged bit for bit; a W8A8 FP8 kernel (vLLM's) is another computation with its own reference.

Non-expert modules in FP8 groups (attention, shared experts, dense MLPs: a ``Linear`` target,
llm-compressor's default recipe) are dequantized once at load the same way (``formats.compressed_tensors.linear``)
and run on unquantized activations, as the library's dense reference (``tools.reference``)
computes them; transformers instead runs them through compressed-tensors' forward, which
quantizes their input activations (another computation, so ``check`` does not take it as the
reference there).

Legend: n experts dequantized together, O output features, I input features, bm x bn a block.
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

    Raises:
        ValueError: a format, strategy, asymmetry or dynamic weights this module does not read.
    """
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
    """compressed-tensors FP8 weights, per tensor, per channel or per block, bound per dense
    experts tensor (config groups may give gate/up and down different strategies)."""

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

        Raises:
            ValueError: see ``_check_scheme``.
        """
        schemes = dense_schemes(quantization_config or {})
        return cls({dense: _check_scheme(dense, s) for dense, s in schemes.items()})

    def with_stored_dtypes(self, dtypes) -> "CompressedTensorsFp8Format":
        """Bound to the dtype the checkpoint stores ``weight_scale`` in (llm-compressor writes the
        weights' dtype unless ``scale_dtype`` is set): the store holds the scales uncast and
        ``dequantize`` multiplies in their dtype, as compressed-tensors' ``_dequantize`` (module
        docstring)."""
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
        """fp8 [N, K] with its scheme's per-tensor / per-channel / per-block / per-group scale, per
        source, multiplied in the scale's dtype (E8M0 exponents: bfloat16, as compressed-tensors'
        ``decompress_mx_scale``), as compressed-tensors' ``_dequantize`` computes."""
        if tensor.is_passthrough:
            return dense_packing(tensor, transposed=transposed)
        strategy, block, _ = self.schemes[tensor.dense.name]
        scale = tensor.packed[1]
        e8m0 = scale.dtype == torch.uint8
        return float8_packing(tensor, scale=scale, strategy=strategy, block=block,
                              sources=dense_source_count(tensor.dense.name), scale_codes="e8m0" if e8m0 else "float",
                              mul_dtype=torch.bfloat16 if e8m0 else scale.dtype)
