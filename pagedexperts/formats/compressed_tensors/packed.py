"""compressed-tensors ``pack-quantized`` experts beyond uniform int4 (which ``w4a16`` reads):
8-bit (W8A16), a scheme per projection (config groups), activation order (``weight_g_idx``).

Layout and dequantization as compressed-tensors 0.20 ``PackedQuantizationCompressor`` +
``pack_to_int32`` (``weight_g_idx``: 0.12's ``_process_quantization``, ``(q - zp[g]) * s[g]`` per
column's group): formats/README.md "Packings". Does not: read files, store, page.

Legend: n experts, O output features, I input features, b bits, G groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from pagedexperts.formats.base import LINEAR_WEIGHT, ExpertLayout, QuantizedTensor, TensorSpec, ceil_div
from pagedexperts.formats.compressed_tensors.w4a16 import _torch_dtype, in_experts_dtype
from pagedexperts.formats.compressed_tensors.linear import ct_linear_format
from pagedexperts.formats.compressed_tensors.schemes import ExpertScheme, dense_source_count, expert_in_features, resolved_schemes
from pagedexperts.formats.packing import WeightPacking, dense_packing, int_packing
from pagedexperts.formats.unpack import PackedFormat

BITS = (4, 8)


@dataclass(frozen=True)
class PackedArgs:
    """One dense tensor's pack-quantized weights: bits, group size (None: channel), symmetry, g_idx stored."""

    num_bits: int
    group_size: int | None
    symmetric: bool
    g_idx: bool

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else ceil_div(in_features, self.group_size)


def _bind(dense: str, scheme: ExpertScheme) -> PackedArgs:
    """Raises ValueError naming the key and value of anything this module does not read."""
    w = scheme.weights
    if w.get("num_bits") not in BITS:
        raise ValueError(f"pack-quantized experts ({dense}) with num_bits={w.get('num_bits')!r}: only {BITS} are supported")
    if w.get("strategy") not in ("group", "channel"):
        raise ValueError(f"pack-quantized experts ({dense}) with strategy={w.get('strategy')!r}: "
                         "only 'group' and 'channel' are supported")
    if scheme.input_activations:
        raise ValueError(f"pack-quantized experts ({dense}) with input_activations set: only weight-only (A16) is supported")
    group_size = w.get("group_size") if w.get("strategy") == "group" else None
    if w.get("strategy") == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise ValueError(f"pack-quantized experts ({dense}) with group_size={group_size!r}: must be a positive int")
    actorder = w.get("actorder")
    if actorder not in (None, "group", "weight", "static"):
        raise ValueError(f"pack-quantized experts ({dense}) with actorder={actorder!r}: not a compressed-tensors value")
    return PackedArgs(int(w["num_bits"]), group_size, bool(w.get("symmetric", True)),
                      g_idx=actorder == "group" and group_size is not None)


def pack_schemes(quantization_config: dict | None) -> dict[str, ExpertScheme]:
    """Dense tensor -> scheme when every experts scheme is pack-quantized int, else {}."""
    schemes = resolved_schemes(quantization_config)
    if not schemes or any(s.format != "pack-quantized" or s.weights.get("type", "int") != "int" for s in schemes.values()):
        return {}
    return schemes


class CompressedTensorsPackedFormat(PackedFormat):
    """pack-quantized int weights bound per dense experts tensor; subclasses say which they ``matches``."""

    serialized_names = {"weight": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")}
    linear_format = ct_linear_format

    def __init__(self, args: Mapping[str, PackedArgs], *, scale_dtype: torch.dtype | None = None) -> None:
        self.args = dict(args)  # dense name -> PackedArgs
        if len(set(self.args.values())) == 1:  # one scheme: a plain nn.Linear weight takes it too
            self.args.setdefault(LINEAR_WEIGHT, next(iter(self.args.values())))
        self.scale_dtype = scale_dtype  # None: the dense dtype
        names = ["weight_packed", "weight_scale"]
        if any(not a.symmetric for a in self.args.values()):
            names.append("weight_zero_point")
        names.append("weight_shape")
        if any(a.g_idx for a in self.args.values()):
            names.append("weight_g_idx")
        self.serialized_names = {"weight": tuple(names)}

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None):
        schemes = pack_schemes(quantization_config)
        dtypes = {_torch_dtype(s.weights.get("scale_dtype")) for s in schemes.values()}
        if len(dtypes) > 1:
            raise ValueError(f"pack-quantized experts with scale_dtypes {sorted(map(str, dtypes))}: one is supported")
        return cls({d: _bind(d, s) for d, s in schemes.items()}, scale_dtype=dtypes.pop() if dtypes else None)

    @classmethod
    def from_config(cls, config, quantization_config: dict | None):
        """As ``from_quantization_config``, the scales' dtype defaulting to the saved dtype.
        Raises ValueError: a group size that does not divide its projection's input features."""
        fmt = cls.from_quantization_config(quantization_config)
        get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k, None))
        if fmt.scale_dtype is None:
            saved = get("dtype") or get("torch_dtype")
            fmt.scale_dtype = saved if isinstance(saved, torch.dtype) else _torch_dtype(saved)
        for dense, in_features in expert_in_features(config).items():
            args = fmt.args.get(dense)
            if args is not None and args.group_size is not None and in_features % args.group_size:
                raise ValueError(f"expert {dense} in_features {in_features} is not a multiple of its config group's "
                                 f"group_size {args.group_size}")
        return fmt

    def with_stored_dtypes(self, dtypes) -> "CompressedTensorsPackedFormat":
        """Bound to the dtype the checkpoint stores ``weight_scale`` in."""
        stored = dtypes.get("weight_scale")
        return self if stored is None or stored == self.scale_dtype else type(self)(self.args, scale_dtype=stored)

    def experts_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.scale_dtype or model_dtype

    def layout(self, dense_specs, *, sources=None, transposed: bool = False) -> ExpertLayout:
        """As ``ExpertFormat.layout``, quantized dense tensors in the scales' dtype when bound."""
        return in_experts_dtype(super().layout(dense_specs, sources=sources, transposed=transposed), self.scale_dtype)

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """Per source nn.Linear's [O, I] layout, concatenated along dim 0 (g_idx [I] per source)."""
        args = self.args.get(dense.name)
        if args is None or len(dense.shape) != 2:
            return (dense,)
        if transposed:
            raise ValueError(f"{self.name}: experts stored transposed ([in, out], e.g. gpt-oss) are not supported")
        rows, in_features = dense.shape
        out_features, groups = rows // sources, args.groups(in_features)
        specs = [TensorSpec(f"{dense.name}_packed", (rows, ceil_div(in_features * args.num_bits, 32)), torch.int32),
                 TensorSpec(f"{dense.name}_scale", (rows, groups), self.scale_dtype or dense.dtype)]
        if not args.symmetric:
            specs.append(TensorSpec(f"{dense.name}_zero_point",
                                    (sources * ceil_div(out_features * args.num_bits, 32), groups), torch.int32))
        specs.append(TensorSpec(f"{dense.name}_shape", (2 * sources,), torch.int64))
        if args.g_idx:
            specs.append(TensorSpec(f"{dense.name}_g_idx", (sources * in_features,), torch.int32))
        return tuple(specs)

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """b-bit values along K, scales [N, G], zero points along N per source, ``weight_g_idx`` when stored."""
        name, args = tensor.dense.name, self.args.get(tensor.dense.name)
        if args is None or tensor.is_passthrough:
            return dense_packing(tensor, transposed=transposed)
        specs = {p.name: p for p in tensor.packed}
        scale, in_features = specs[f"{name}_scale"], tensor.dense.shape[1]
        return int_packing(tensor, weight=specs[f"{name}_packed"], scale=scale, bits=args.num_bits, packed_dim="in",
                           sources=dense_source_count(name), group_size=in_features // scale.shape[1],
                           zero=specs.get(f"{name}_zero_point"), g_idx=specs.get(f"{name}_g_idx"))


class CompressedTensorsW8A16Format(CompressedTensorsPackedFormat):
    """Every routed-expert projection 8-bit pack-quantized (llm-compressor W8A16)."""

    name = "w8a16"

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        schemes = pack_schemes(quantization_config)
        return bool(schemes) and all(s.weights.get("num_bits") == 8 for s in schemes.values())


class CompressedTensorsMixedPackedFormat(CompressedTensorsPackedFormat):
    """pack-quantized experts with a scheme per projection (config groups with different group
    sizes or bits) or activation order (``weight_g_idx``): what ``w4a16`` reads one scheme for."""

    name = "ct-pack-mixed"

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        schemes = pack_schemes(quantization_config)
        weights = [s.weights for s in schemes.values()]
        return bool(schemes) and (any(w != weights[0] for w in weights)
                                  or any(w.get("actorder") == "group" for w in weights))
