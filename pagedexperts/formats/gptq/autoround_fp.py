"""AutoRound's own floating-point exports (``quant_method: auto-round``, ``format="auto_round"``):
``data_type`` ``fp`` (FP8: the FP8_STATIC, FP8_BLOCK and FPW8A16 schemes), ``nv_fp`` (NVFP4)
and ``mx_fp`` (MXFP4), as AutoRound 0.16.1 writes them.

Owns: recognising the three exports in config.json, binding them to the compressed-tensors
formats whose key names and layouts they share (``formats.compressed_tensors.fp8``, ``formats.compressed_tensors.fp4``), the ``WeightPacking``
of AutoRound's own dequantization arithmetic where it differs (``formats.unpack`` dequantizes),
and ``extra_config`` for non-expert modules. Does not: read files, store, page, unpack, or
quantize activations (the FP8_STATIC / NVFP4 / MXFP4 schemes
quantize them at run time in AutoRound's forward; pagedexperts runs them unquantized, as for the
compressed-tensors W4A4 / W8A8 formats).

On-disk layout (AutoRound 0.16.1 ``export/export_to_autoround/export_to_fp8.py`` ``FP8QLinear`` /
``FP8BlockQLinear`` and ``qlinear_fp.QuantLinear``), per expert projection of an nn.Linear
weight [O, I]:

- ``fp`` FPW8A16 (group_size 0, no packing_format): ``weight`` e4m3 [O, I], ``weight_scale``
  [1]; AutoRound cannot load it (transformers' AutoRoundConfig: "group_size must be greater
  than 0 or equal to -1");
- ``fp`` FP8_STATIC (group_size -1, ``auto_round:fp8_static``): ``weight`` e4m3 [O, I],
  ``weight_scale`` [O], ``input_scale`` [1] (paged, unused); AutoRound's
  ``WeightFP8ActFP8StaticQuantLinear``: ``weight.to(bfloat16) * weight_scale``;
- ``fp`` FP8_BLOCK (group_size and ``weight_block_size`` [128, 128], ``auto_round:fp8``):
  ``weight`` e4m3 [O, I], ``weight_scale_inv`` [ceil(O / 128), ceil(I / 128)] (a partial edge
  block has its own scale); AutoRound cannot load it (its config check compares the list with
  an int: "'<=' not supported between instances of 'list' and 'int'");
- ``nv_fp`` NVFP4 (``auto_round:llm_compressor``): ``weight_packed`` u8 [O, I/2], ``weight_scale``
  e4m3 [O, I/16], ``weight_global_scale`` f32 [1], ``input_global_scale`` f32 [1] (paged,
  unused); ``NVFP4QuantLinear``: ``(q * (1 / g)) * s`` in float32;
- ``mx_fp`` MXFP4 (``auto_round:llm_compressor``): ``weight_packed`` u8 [O, I/2],
  ``weight_scale`` u8 E8M0 [O, I/32]; ``MXFP4QuantLinear``: ``q * 2 ** (e - 127)`` in float32.

FP8 scales are stored in the model's dtype (bfloat16 for the act_bits 8 schemes, which AutoRound
saves in bfloat16). The FP8 formats dequantize as compressed-tensors FP8 does, in the scales'
dtype (``formats.compressed_tensors.fp8``'s packing): AutoRound's own FP8 layer multiplies in its dtype, bfloat16,
which is the scales' dtype here; the two schemes AutoRound cannot load take the same arithmetic.
NVFP4 and MXFP4 round once, from float32 to the model's dtype (AutoRound's layer casts its
float32 dequantized weight to the input's dtype), and the experts keep the model's dtype (not
compressed-tensors' bfloat16). The e2m1 codes, nibble order and E8M0 / e4m3 scales are
compressed-tensors'; NVFP4's global scale is stored as compressed-tensors stores it (the
block scales times it), but AutoRound multiplies the VALUE by its reciprocal before the block
scale, which rounds differently in float32 (``WeightPacking`` ``value_reciprocal``).

Legend: n experts dequantized together, O output features, I input features, G groups.
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
    """Refusals shared by the three exports: ``packing_format``, ``bits``, ``group_size`` and
    ``extra_config`` overrides of routed experts (one binding serves every expert).

    Raises:
        ValueError: naming the field and value."""
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
    """``ExpertFormat.linear_format`` of AutoRound's FP exports: ``fmt`` for a module its
    ``extra_config`` leaves alone, None for one it leaves unquantized (``bits`` 16).

    Raises:
        ValueError: an ``extra_config`` entry that changes the module's scheme (names it)."""
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
    """AutoRound FP8 (``data_type: fp``, 8 bits): per tensor (group_size 0), per row (-1) or per
    block (``weight_block_size``), read as compressed-tensors FP8 with AutoRound's key names:
    its ``packing`` (a per-row scale [O], one per output row; multiplied in the scales' dtype)."""

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
        """Bind the scale strategy from ``group_size`` and the scales' dtype (the model's, as
        AutoRound saves them; ``with_stored_dtypes`` rebinds it to the checkpoint's).

        Raises:
            ValueError: see ``check_autoround_fp``; a group size other than 0, -1 or two
                positive ints, an ``fmt`` other than e4m3."""
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
        """Bound to the dtype the checkpoint stores the scales in (the model's at export)."""
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
    """Shared by AutoRound's NVFP4 and MXFP4 (a mixin before the compressed-tensors class):
    matching ``data_type``, the refusals, the experts in the model's dtype (not
    compressed-tensors' bfloat16), ``extra_config`` for non-expert modules."""

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
    """AutoRound NVFP4 (``data_type: nv_fp``): compressed-tensors' NVFP4 layout, AutoRound's
    arithmetic (module docstring), experts in the model's dtype."""

    name = "auto-round-nvfp4"
    data_type = "nv_fp"

    @classmethod
    def _from_checked(cls, qc: dict) -> "AutoRoundNvfp4Format":
        """``input_global_scale`` is stored when activations are NVFP4 with a static global scale."""
        acts = str(qc.get("act_data_type") or "")
        return cls(static_input=int(qc.get("act_bits") or 16) <= 8 and "nv_fp" in acts)

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """e2m1 [N, K/2], the value times the reciprocal of the source's global scale, then
        times its e4m3 scale per 16 columns, in float32; rounded once to the dense dtype."""
        name, specs = tensor.dense.name, {p.name: p for p in tensor.packed}
        glob = specs[f"{name}_global_scale"]
        return fp4_packing(tensor, weight=specs[f"{name}_packed"], scale=specs[f"{name}_scale"], scale_codes="e4m3",
                           group_size=self.group_size, sources=glob.shape[0], global_scale=glob,
                           global_op="value_reciprocal")


class AutoRoundMxfp4Format(_AutoRoundFp4, CompressedTensorsMxfp4Format):
    """AutoRound MXFP4 (``data_type: mx_fp``): compressed-tensors' MXFP4 layout, the product in
    float32 (module docstring), experts in the model's dtype."""

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
