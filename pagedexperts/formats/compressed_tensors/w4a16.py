"""compressed-tensors ``pack-quantized`` int4 experts (W4A16), and the reading of the experts'
config group every compressed-tensors format shares.

Layout and dequantization as compressed-tensors 0.20 ``PackedQuantizationCompressor``
(``compressors/pack_quantized/{base,helpers}.py``, ``quantization.lifecycle.forward._dequantize``):
formats/README.md "Packings"; the experts stay in the scales' dtype, as transformers stacks them.
Does not: write checkpoints, read files, store or page.

Legend: n experts, O output features, I input features, G groups.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedexperts.formats.base import ExpertLayout, QuantizedTensor, TensorSpec, ceil_div
from pagedexperts.formats.compressed_tensors.linear import ct_linear_format
from pagedexperts.formats.packing import WeightPacking, int_packing
from pagedexperts.formats.unpack import PackedFormat

PACK_FACTOR = 8  # int4 values per int32 word


def experts_weights_args(quantization_config: dict) -> dict | None:
    """The ``weights`` args of the config group every routed-expert projection resolves to
    (``schemes.dense_schemes``), or None when they resolve to different groups or none; a config
    ``dense_schemes`` refuses falls back to ``transformers_experts_args``."""
    from pagedexperts.formats.compressed_tensors.schemes import dense_schemes

    try:
        schemes = list(dense_schemes(quantization_config).values())
    except ValueError:
        return transformers_experts_args(quantization_config)
    if not schemes or any(s != schemes[0] for s in schemes):
        return None
    return dict(schemes[0].weights, format=schemes[0].format, input_activations=schemes[0].input_activations)


def transformers_experts_args(quantization_config: dict) -> dict | None:
    """The ``weights`` args of the ONE group transformers 5.24 applies to every expert projection
    (``get_experts_scheme``): an ``re:`` target naming experts, else a non-``re:`` target, else the first."""
    groups = list((quantization_config.get("config_groups") or {}).values())
    if not groups:
        return None
    chosen = next((g for g in groups if any(t.startswith("re:") and "experts" in t for t in g.get("targets", []))), None)
    chosen = chosen or next((g for g in groups if any(not t.startswith("re:") for t in g.get("targets", []))), groups[0])
    return dict(chosen.get("weights") or {}, format=chosen.get("format") or quantization_config.get("format"),
                input_activations=chosen.get("input_activations"))


def ct_experts_args(quantization_config: dict | None, checkpoint_format: str) -> dict | None:
    """``experts_weights_args`` of a compressed-tensors config whose experts' group stores ``checkpoint_format``.
    """
    if not quantization_config or quantization_config.get("quant_method") != "compressed-tensors":
        return None
    args = experts_weights_args(quantization_config)
    return args if args and args.get("format") == checkpoint_format else None


def in_experts_dtype(layout: ExpertLayout, dtype: torch.dtype | None) -> ExpertLayout:
    """``layout`` with every quantized dense tensor in ``dtype`` (None: unchanged; biases keep theirs)."""
    if dtype is None:
        return layout
    return ExpertLayout(layout.format, tuple(
        t if t.is_passthrough else QuantizedTensor(dataclasses.replace(t.dense, dtype=dtype), t.packed)
        for t in layout.tensors
    ))


class CompressedTensorsW4A16Format(PackedFormat):
    """compressed-tensors ``pack-quantized`` int4 (W4A16), symmetric or not, group or channel strategy."""

    name = "w4a16"
    # transformers' CompressedTensorsHfQuantizer declares every name any compressed-tensors
    # format stores; an instance keeps those pack-quantized stores (zero points if asymmetric).
    serialized_names = {"weight": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")}
    linear_format = ct_linear_format

    def __init__(self, *, group_size: int | None, symmetric: bool, scale_dtype: torch.dtype | None = None) -> None:
        self.group_size = group_size  # None: channel strategy (one group per row)
        self.symmetric = symmetric
        self.scale_dtype = scale_dtype  # None: the model's dtype (the checkpoint's own)
        names = ("weight_packed", "weight_scale") + (() if symmetric else ("weight_zero_point",)) + ("weight_shape",)
        self.serialized_names = {"weight": names}

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        args = ct_experts_args(quantization_config, "pack-quantized")
        return args is not None and args.get("type", "int") == "int"

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None) -> "CompressedTensorsW4A16Format":
        """Bind the experts' group size and symmetry.
        Raises ValueError: num_bits other than 4, a strategy other than group / channel, or quantized input
        activations (names the key and value)."""
        args = experts_weights_args(quantization_config or {}) or {}
        if args.get("num_bits") != 4:
            raise ValueError(f"pack-quantized experts with num_bits={args.get('num_bits')!r}: only 4 is supported")
        strategy = args.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(f"pack-quantized experts with strategy={strategy!r}: only 'group' and 'channel' are supported")
        if args.get("input_activations"):
            raise ValueError("pack-quantized experts with input_activations set (W4A8): only W4A16 is supported")
        group_size = args.get("group_size") if strategy == "group" else None
        if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
            raise ValueError(f"pack-quantized group strategy with group_size={group_size!r}: must be a positive int")
        return cls(group_size=group_size, symmetric=bool(args.get("symmetric", True)),
                   scale_dtype=_torch_dtype(args.get("scale_dtype")))

    @classmethod
    def from_config(cls, config, quantization_config: dict | None) -> "CompressedTensorsW4A16Format":
        """As ``from_quantization_config``, the scales' dtype defaulting to the config's saved dtype.
        Raises ValueError: an experts' input dim not a multiple of the group size."""
        fmt = cls.from_quantization_config(quantization_config)
        if fmt.scale_dtype is None:
            get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
            saved = get("dtype") or get("torch_dtype")
            fmt.scale_dtype = saved if isinstance(saved, torch.dtype) else _torch_dtype(saved)
        from pagedexperts.formats.compressed_tensors.schemes import expert_in_features

        for in_features in expert_in_features(config).values():
            fmt._groups(in_features)  # refused here, so preflight refuses what load_model does
        return fmt

    def with_stored_dtypes(self, dtypes) -> "CompressedTensorsW4A16Format":
        """Bound to the dtype the checkpoint stores ``weight_scale`` in."""
        stored = dtypes.get("weight_scale")
        if stored is None or stored == self.scale_dtype:
            return self
        return type(self)(group_size=self.group_size, symmetric=self.symmetric, scale_dtype=stored)

    def experts_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The scales' dtype when bound, else ``model_dtype``."""
        return self.scale_dtype or model_dtype

    def layout(self, dense_specs, *, sources=None, transposed: bool = False) -> ExpertLayout:
        """As ``ExpertFormat.layout``, quantized dense tensors in the scales' dtype when bound."""
        return in_experts_dtype(super().layout(dense_specs, sources=sources, transposed=transposed), self.scale_dtype)

    def _groups(self, in_features: int) -> int:
        if self.group_size is None:
            return 1
        if in_features % self.group_size:
            raise ValueError(
                f"expert in_features {in_features} is not a multiple of the checkpoint's group_size {self.group_size}"
            )
        return in_features // self.group_size

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """Specs of one dense [sources * O, I] tensor: each source's nn.Linear layout along dim 0."""
        if transposed:
            raise ValueError(f"{self.name}: experts stored transposed ([in, out], e.g. gpt-oss) are not supported")
        rows, in_features = dense.shape
        out_features = rows // sources
        groups = self._groups(in_features)
        specs = [
            TensorSpec(f"{dense.name}_packed", (rows, ceil_div(in_features, PACK_FACTOR)), torch.int32),
            TensorSpec(f"{dense.name}_scale", (rows, groups), self.scale_dtype or dense.dtype),
        ]
        if not self.symmetric:
            specs.append(TensorSpec(f"{dense.name}_zero_point",
                                    (sources * ceil_div(out_features, PACK_FACTOR), groups), torch.int32))
        specs.append(TensorSpec(f"{dense.name}_shape", (2 * sources,), torch.int64))
        return tuple(specs)

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """int4 along K, scales multiplied in their dtype, zero points along N per source or offset 8."""
        name, specs = tensor.dense.name, {p.name: p for p in tensor.packed}
        scale, in_features = specs[f"{name}_scale"], tensor.dense.shape[1]
        return int_packing(tensor, weight=specs[f"{name}_packed"], scale=scale, bits=4, packed_dim="in",
                           sources=specs[f"{name}_shape"].shape[0] // 2, group_size=in_features // scale.shape[1],
                           zero=specs.get(f"{name}_zero_point"))


def _torch_dtype(name: str | None) -> torch.dtype | None:
    """``scale_dtype`` from the config ("torch.bfloat16", "bfloat16") -> torch dtype, or None."""
    if not name:
        return None
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"pack-quantized scale_dtype={name!r} is not a torch dtype")
    return dtype
