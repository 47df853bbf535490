"""GPTQ experts, 2/4/8 bits (AutoGPTQ / GPTQModel / AutoRound ``auto_gptq``: ``quant_method: gptq``).

Layout and dequantization as GPTQModel 7.7 writes and reads them (``nn_modules/qlinear/__init__.py``
``PackableQuantLinear.pack`` / ``dequantize_weight``; v1 zeros converted per word as
``utils/model.py`` ``convert_gptq_v1_to_v2_format_module``): formats/README.md "Packings". Bound per
dense tensor to GPTQModel's ``dynamic`` overrides. Does not: read files, store, page, or quantize.

Legend: n experts, O output features, I input features, b bits, G groups.
"""

from __future__ import annotations

from typing import Mapping

import torch

from pagedexperts.formats.base import QuantizedTensor, TensorSpec
from pagedexperts.formats.gptq.dynamic import IntArgs, dynamic_override, expert_args, module_args
from pagedexperts.formats.packing import WeightPacking, int_packing
from pagedexperts.formats.unpack import PackedFormat

SCALE_DTYPE = torch.float16  # GPTQ checkpoints store float16 scales
BITS = (2, 4, 8)  # whole values per int32 word (3-bit GPTQ straddles words: refused)
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> offset added to stored zeros


def per_word(bits: int) -> int:
    return 32 // bits


class GptqFormat(PackedFormat):
    """GPTQ experts, 2/4/8 bits, any group size, desc_act or not, bound per dense tensor (``dynamic``)."""

    name = "gptq"
    serialized_names = {"weight": ("qweight", "qzeros", "scales", "g_idx")}

    def __init__(self, *, group_size: int = 128, desc_act: bool = False, zero_offset: int = 1,
                 scale_dtype: torch.dtype = SCALE_DTYPE, bits: int = 4, sym: bool = True,
                 per_tensor: Mapping[str, IntArgs] | None = None, dynamic: dict | None = None) -> None:
        self.args = IntArgs(bits, group_size, sym)  # the base config's; ``per_tensor`` overrides it per dense tensor
        self.per_tensor = dict(per_tensor or {})
        self.desc_act = desc_act  # act-order: g_idx read per column; without it groups are k // group_size
        self.zero_offset = zero_offset
        self.scale_dtype = scale_dtype  # the checkpoint's (``with_stored_dtypes``): dequantize computes in it
        self.dynamic = dynamic

    @property
    def group_size(self) -> int:
        return self.args.group_size

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        return bool(quantization_config) and quantization_config.get("quant_method") == "gptq"

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None) -> "GptqFormat":
        """Bind bits, group size, desc_act, checkpoint_format and the ``dynamic`` rules.
        Raises ValueError: bits not in ``BITS``, a group size neither positive nor -1, or a checkpoint_format
        other than gptq / gptq_v2 (e.g. marlin), naming the value."""
        qc = quantization_config or {}
        bits = qc.get("bits")
        _check_args("gptq checkpoint", bits, qc.get("group_size", 128))
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        if fmt not in CHECKPOINT_FORMATS:
            raise ValueError(f"gptq checkpoint_format={fmt!r}: only {sorted(CHECKPOINT_FORMATS)} are supported")
        return cls(group_size=qc.get("group_size", 128), bits=bits, sym=bool(qc.get("sym", True)), desc_act=bool(qc.get("desc_act", False)),
                   zero_offset=CHECKPOINT_FORMATS[fmt], dynamic=qc.get("dynamic") or None)

    @classmethod
    def from_config(cls, config, quantization_config: dict | None) -> "GptqFormat":
        """As ``from_quantization_config``, each dense tensor bound to its projections' ``dynamic`` overrides.
        Raises ValueError: see ``dynamic.expert_args`` and ``_check_args``."""
        fmt = cls.from_quantization_config(quantization_config)
        if fmt.dynamic:
            fmt.per_tensor = expert_args(fmt.args, config, lambda m: dynamic_override(fmt.dynamic, m), what="gptq dynamic")
            for args in fmt.per_tensor.values():
                _check_args("gptq dynamic override", args.bits, args.group_size)
        return fmt

    def _bound(self, **changes) -> "GptqFormat":
        fields = dict(group_size=self.args.group_size, bits=self.args.bits, sym=self.args.sym, desc_act=self.desc_act,
                      zero_offset=self.zero_offset, scale_dtype=self.scale_dtype, per_tensor=self.per_tensor,
                      dynamic=self.dynamic)
        return type(self)(**{**fields, **changes})

    def with_stored_dtypes(self, dtypes) -> "GptqFormat":
        """Bound to the dtype the checkpoint stores ``scales`` in."""
        stored = dtypes.get("scales")
        return self if stored is None or stored == self.scale_dtype else self._bound(scale_dtype=stored)

    def linear_format(self, module: str, quantization_config: dict | None) -> "GptqFormat | None":
        """Non-expert ``module``'s format: the base config with its ``dynamic`` override (None: a ``-:`` rule)."""
        args = module_args(self.args, dynamic_override(self.dynamic, module), what=f"gptq dynamic ({module})")
        if args is None:
            return None
        _check_args(f"gptq dynamic override for {module}", args.bits, args.group_size)
        return self._bound(bits=args.bits, group_size=args.group_size, per_tensor={}, dynamic=None)

    def tensor_args(self, dense_name: str) -> IntArgs:
        return self.per_tensor.get(dense_name, self.args)

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """Per source qweight [I*b/32, O], qzeros [G, O*b/32], scales [G, O] side by side on dim 1, g_idx [I]
        on dim 0. Raises ValueError: transposed experts, or I or O not a multiple of 32 / bits."""
        if transposed:
            raise ValueError(f"{self.name}: experts stored transposed ([in, out], e.g. gpt-oss) are not supported")
        args = self.tensor_args(dense.name)
        rows, in_features = dense.shape
        out_features, unit = rows // sources, per_word(args.bits)
        for what, size in (("in_features", in_features), ("out_features", out_features)):
            if size % unit:
                raise ValueError(f"gptq expert {dense.name}: {what} {size} is not a multiple of {unit} "
                                 f"({args.bits}-bit values per int32 word)")
        groups = args.groups(in_features)
        return (
            TensorSpec(f"{dense.name}_qweight", (in_features // unit, rows), torch.int32, concat_dim=1),
            TensorSpec(f"{dense.name}_qzeros", (groups, rows // unit), torch.int32, concat_dim=1),
            TensorSpec(f"{dense.name}_scales", (groups, rows), self.scale_dtype, concat_dim=1),
            TensorSpec(f"{dense.name}_g_idx", (sources * in_features,), torch.int32, concat_dim=0),
        )

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """GPTQ's packing (formats/README.md "Packings"): g_idx per column with ``desc_act``, else ``k // group_size``."""
        name, specs = tensor.dense.name, {p.name: p for p in tensor.packed}
        in_features, args = tensor.dense.shape[1], self.tensor_args(tensor.dense.name)
        return int_packing(tensor, weight=specs[f"{name}_qweight"], scale=specs[f"{name}_scales"], bits=args.bits,
                           packed_dim="in", sources=specs[f"{name}_g_idx"].shape[0] // in_features,
                           group_size=args.group_of(in_features),
                           zero=specs[f"{name}_qzeros"], g_idx=specs[f"{name}_g_idx"] if self.desc_act else None,
                           transposed=True, zero_offset=self.zero_offset)

def _check_args(what: str, bits, group_size) -> None:
    """Raises ValueError naming ``bits`` / ``group_size`` when this reader cannot read them."""
    if bits not in BITS:
        raise ValueError(f"{what} with bits={bits!r}: only {BITS} are supported (3-bit values straddle int32 words)")
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"{what} with group_size={group_size!r}: must be a positive int or -1")
