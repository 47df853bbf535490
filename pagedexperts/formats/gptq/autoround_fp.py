"""AutoRound's own floating-point exports (``quant_method: auto-round``): ``data_type`` ``fp`` (FP8),
``nv_fp`` (NVFP4) and ``mx_fp`` (MXFP4), as AutoRound 0.16.1 writes them
(``export/export_to_autoround/export_to_fp8.py``, ``qlinear_fp.QuantLinear``).

compressed-tensors' layouts (``formats.compressed_tensors.fp8``, ``formats.compressed_tensors.fp4``)
bound to AutoRound's config fields, with AutoRound's arithmetic where it differs (formats/README.md).
Does not: read files, store, page, or quantize activations.

Legend: n experts, O output features, I input features, G groups.
"""

from __future__ import annotations

import torch

from pagedexperts.formats.base import ExpertFormat, ExpertLayout, QuantizedTensor
from pagedexperts.formats.compressed_tensors.w4a16 import _torch_dtype
from pagedexperts.formats.compressed_tensors.fp4 import CompressedTensorsMxfp4Format, CompressedTensorsNvfp4Format
from pagedexperts.formats.compressed_tensors.fp8 import CompressedTensorsFp8Format
from pagedexperts.formats.gptq.dynamic import IntArgs, expert_args, extra_config_override
from pagedexperts.formats.packing import WeightPacking, fp4_packing

METHODS = ("auto-round", "auto_round")
FP8_PACKINGS = (None, "auto_round:fp8_static", "auto_round:fp8")
FP4_PACKINGS = ("auto_round:llm_compressor",)


def _data_type(qc: dict | None) -> str | None:
    qc = qc or {}
    return str(qc.get("data_type", "int")) if qc.get("quant_method") in METHODS else None


def _saved_dtype(config) -> torch.dtype | None:
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    saved = get("dtype") or get("torch_dtype")
    return saved if isinstance(saved, torch.dtype) else _torch_dtype(saved)


def check_autoround_fp(qc: dict, config, *, data_type: str, packings: tuple, bits: int, group_size) -> None:
    """Refusals shared by the three exports: ``packing_format``, ``bits``, ``group_size``, and
    ``extra_config`` overrides of routed experts.
    Raises ValueError: naming the field and value."""
    what = f"auto-round data_type={data_type!r} checkpoint"
    packing = qc.get("packing_format")
    if packing not in packings:
        raise ValueError(f"{what} with packing_format={packing!r}: only {list(packings)} are supported")
    if qc.get("bits") != bits:
        raise ValueError(f"{what} with bits={qc.get('bits')!r}: only {bits} is supported")
    if group_size is not None and qc.get("group_size") != group_size:
        raise ValueError(f"{what} with group_size={qc.get('group_size')!r}: only {group_size} is supported")
    if qc.get("extra_config") and config is not None:
        base = IntArgs(bits, _hashable(qc.get("group_size")), bool(qc.get("sym", True)))
        bound = expert_args(base, config, lambda m: extra_config_override(qc["extra_config"], m),
                            what="auto-round extra_config")
        changed = {dense: args for dense, args in bound.items() if args != base}
        if changed:
            raise ValueError(f"auto-round extra_config gives routed experts {changed}: per-module overrides of "
                             f"the experts of a data_type={data_type!r} checkpoint are not supported")


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def autoround_linear_format(fmt: ExpertFormat, module: str, quantization_config: dict | None) -> ExpertFormat | None:
    """``ExpertFormat.linear_format`` of the FP exports: ``fmt``, or None for a module ``extra_config``
    leaves unquantized (``bits`` 16).
    Raises ValueError: an ``extra_config`` entry that changes the module's scheme (names it)."""
    override = extra_config_override((quantization_config or {}).get("extra_config"), module)
    if override is False:
        return None
    changed = {k: v for k, v in (override or {}).items()
               if k in ("bits", "group_size", "data_type", "sym") and _hashable(v) != _hashable((quantization_config or {}).get(k))}
    if changed:
        raise ValueError(f"auto-round extra_config for {module} changes {changed}: a non-expert module in another "
                         "scheme than the checkpoint's is not supported")
    return fmt


class AutoRoundFp8Format(CompressedTensorsFp8Format):
    """AutoRound FP8 (``data_type: fp``): per tensor (group_size 0), row (-1) or ``weight_block_size``
    block, read as compressed-tensors FP8 with a per-row scale [O]."""

    name = "auto-round-fp8"

    def __init__(self, schemes, *, block_scales: bool = False) -> None:
        super().__init__(schemes)
        self.block_scales = block_scales  # FP8_BLOCK stores ``weight_scale_inv``
        self.scale_suffix = "_scale_inv" if block_scales else "_scale"
        self.serialized_names = {"weight": ("weight", "weight_scale_inv" if block_scales else "weight_scale")}

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        return _data_type(quantization_config) == "fp"

    @classmethod
    def from_config(cls, config, quantization_config: dict | None) -> "AutoRoundFp8Format":
        """Bind the scale strategy from ``group_size`` and the scales' dtype (the model's).
        Raises ValueError: see ``check_autoround_fp``; a group size other than 0, -1 or two positive ints, an
        ``fmt`` other than e4m3."""
        qc = quantization_config or {}
        check_autoround_fp(qc, config, data_type="fp", packings=FP8_PACKINGS, bits=8, group_size=None)
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"auto-round FP8 checkpoint with fmt={qc.get('fmt')!r}: only 'e4m3' is supported")
        group = qc.get("group_size")
        block = qc.get("weight_block_size") or (group if isinstance(group, list) else None)
        if block is not None:
            if len(block) != 2 or min(block) <= 0:
                raise ValueError(f"auto-round FP8 checkpoint with weight_block_size={block!r}: want two positive ints")
            scheme = ("block", (int(block[0]), int(block[1])))
        elif group in (0, -1):
            scheme = ("tensor", None) if group == 0 else ("channel", None)
        else:
            raise ValueError(f"auto-round FP8 checkpoint with group_size={group!r}: only 0 (per tensor), -1 (per "
                             "row) or a [128, 128] block are supported")
        dtype = _saved_dtype(config) if config is not None else None
        schemes = {d: (*scheme, dtype or torch.bfloat16) for d in ("gate_up_proj", "down_proj")}
        return cls(schemes, block_scales=block is not None)

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None) -> "AutoRoundFp8Format":
        return cls.from_config(None, quantization_config)

    def with_stored_dtypes(self, dtypes) -> "AutoRoundFp8Format":
        """Bound to the dtype the checkpoint stores the scales in."""
        stored = dtypes.get(self.serialized_names["weight"][1])
        if stored is None:
            return self
        return type(self)({d: (strategy, block, stored) for d, (strategy, block, _) in self.schemes.items()},
                          block_scales=self.block_scales)

    def linear_format(self, module: str, quantization_config: dict | None) -> ExpertFormat | None:
        return autoround_linear_format(self, module, quantization_config)

    def _scale_shape(self, dense: str, out_features: int, in_features: int, sources: int) -> tuple[int, ...]:
        """As compressed-tensors, but a per-row scale is [O] (AutoRound's ``weight_scale.view(-1)``)."""
        if self.schemes[dense][0] == "channel":
            return (sources * out_features,)
        return super()._scale_shape(dense, out_features, in_features, sources)


class _AutoRoundFp4:
    """Shared by AutoRound's NVFP4 and MXFP4 (a mixin before the compressed-tensors class)."""

    data_type = ""

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        return _data_type(quantization_config) == cls.data_type

    @classmethod
    def from_config(cls, config, quantization_config: dict | None):
        """Raises ValueError: see ``check_autoround_fp`` (the format's group size, 4 bits)."""
        qc = quantization_config or {}
        check_autoround_fp(qc, config, data_type=cls.data_type, packings=FP4_PACKINGS, bits=4, group_size=cls.group_size)
        return cls._from_checked(qc)

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None):
        return cls.from_config(None, quantization_config)

    def experts_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype

    def layout(self, dense_specs, *, sources=None, transposed: bool = False) -> ExpertLayout:
        return ExpertFormat.layout(self, dense_specs, sources=sources, transposed=transposed)

    def linear_format(self, module: str, quantization_config: dict | None) -> ExpertFormat | None:
        return autoround_linear_format(self, module, quantization_config)


class AutoRoundNvfp4Format(_AutoRoundFp4, CompressedTensorsNvfp4Format):
    """AutoRound NVFP4 (``data_type: nv_fp``): compressed-tensors' layout, AutoRound's arithmetic."""

    name = "auto-round-nvfp4"
    data_type = "nv_fp"

    @classmethod
    def _from_checked(cls, qc: dict) -> "AutoRoundNvfp4Format":
        """``input_global_scale`` is stored when activations are NVFP4 with a static global scale."""
        acts = str(qc.get("act_data_type") or "")
        return cls(static_input=int(qc.get("act_bits") or 16) <= 8 and "nv_fp" in acts)

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """e2m1 [N, K/2], the value times ``1 / g`` of its source, then its e4m3 scale per 16, in float32."""
        name, specs = tensor.dense.name, {p.name: p for p in tensor.packed}
        glob = specs[f"{name}_global_scale"]
        return fp4_packing(tensor, weight=specs[f"{name}_packed"], scale=specs[f"{name}_scale"], scale_codes="e4m3",
                           group_size=self.group_size, sources=glob.shape[0], global_scale=glob,
                           global_op="value_reciprocal")


class AutoRoundMxfp4Format(_AutoRoundFp4, CompressedTensorsMxfp4Format):
    """AutoRound MXFP4 (``data_type: mx_fp``): compressed-tensors' layout, the product in float32."""

    name = "auto-round-mxfp4"
    data_type = "mx_fp"

    @classmethod
    def _from_checked(cls, qc: dict) -> "AutoRoundMxfp4Format":
        return cls()

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """e2m1 [N, K/2] with an E8M0 scale per 32 columns, multiplied in float32."""
        name, specs = tensor.dense.name, {p.name: p for p in tensor.packed}
        return fp4_packing(tensor, weight=specs[f"{name}_packed"], scale=specs[f"{name}_scale"], scale_codes="e8m0",
                           group_size=self.group_size, sources=1)
