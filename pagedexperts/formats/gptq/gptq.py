"""GPTQ experts, 2/4/8 bits (AutoGPTQ / GPTQModel / AutoRound ``auto_gptq`` checkpoints, ``quant_method: gptq``).

Owns: recognising the format, the packed per-expert tensor specs and their ``WeightPacking``,
GPTQModel's per-module ``dynamic`` overrides (``formats.gptq.dynamic``). Does not: unpack
(``formats.unpack`` interprets the packing), read files, store, page, or quantize (GPTQ needs
calibration; ``quantize`` writes w4a16 instead).

On-disk layout (GPTQModel 7.7 ``nn_modules/qlinear/__init__.py`` ``PackableQuantLinear.pack`` and
``dequantize_weight``; AutoGPTQ's ``QuantLinear`` before it), per expert projection
``experts.{j}.{gate,up,down}_proj`` of an nn.Linear weight [O, I], b bits (2, 4, 8: 32 / b
values per int32 word, none straddling a word), group size g, G = ceil(I / g) (one group when
g > I or g = -1: GPTQModel writes ``g_idx`` = i // g, all 0):

- ``qweight`` int32 [I * b / 32, O]: q[i, o] in bits ``b * (i % (32/b))`` of word
  [i // (32/b), o] (packed along the INPUT dim);
- ``qzeros`` int32 [G, O * b / 32]: zero points packed the same way along the OUTPUT dim.
  ``checkpoint_format`` "gptq" (v1) stores z - 1: GPTQModel's v1 -> v2 conversion
  (``utils/model.py`` ``convert_gptq_v1_to_v2_format_module``) adds 0x11111111 (b = 4;
  0x01010101 for 8, 0x55555555 for 2) to each WORD, so a borrow its v2 -> v1 save made
  (z = 0) carries back into the next value; "gptq_v2" stores z;
- ``scales`` [G, O] float16 (GPTQModel and AutoRound write float16; bound to what the
  checkpoint stores, ``with_stored_dtypes``);
- ``g_idx`` int32 [I]: the group of each input channel; ``i // g`` without ``desc_act`` (what
  GPTQModel writes, and what the packing then reads: ``packing.g_idx_is_trivial`` checks rows),
  any permutation-derived grouping with it (act-order), read per column.

Dequantize (``dequantize_weight``): ``W^T[i, o] = scales[g_idx[i], o] * (q[i, o] -
z[g_idx[i], o])`` in the scales' dtype (the integer difference is exact; one rounding in the
product), transposed to [O, I] and cast to the model's dtype (GPTQModel's torch kernel casts
the dequantized weight to the input's dtype). Symmetric GPTQ stores z = 2**(b-1) like any
other zero point.

Legend: n experts dequantized together, O output features, I input features, G groups.
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
    """GPTQ experts, 2/4/8 bits, any group size (one group when it exceeds a row), with or
    without desc_act, bound per dense experts tensor (GPTQModel's ``dynamic`` overrides)."""

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
        """Bind bits, group size, desc_act, checkpoint_format and the ``dynamic`` rules (``sym``
        needs nothing: a symmetric checkpoint stores its zero points, 2**(bits-1), like any other).

        Raises:
            ValueError: bits not in ``BITS``, a group size that is not positive or -1, or a
                checkpoint_format other than gptq / gptq_v2 (e.g. marlin), naming the value.
        """
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
        """As ``from_quantization_config``, each dense experts tensor bound to its projections'
        ``dynamic`` overrides (down_proj group 32 beside gate/up group 128).

        Raises:
            ValueError: see ``dynamic.expert_args`` and ``_check_args``."""
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
        """Bound to the dtype the checkpoint stores ``scales`` in (float16 as GPTQModel writes them;
        GPTQModel's ``dequantize_weight`` computes in the scales' dtype)."""
        stored = dtypes.get("scales")
        return self if stored is None or stored == self.scale_dtype else self._bound(scale_dtype=stored)

    def linear_format(self, module: str, quantization_config: dict | None) -> "GptqFormat | None":
        """The format of non-expert ``module``: the base config with its ``dynamic`` override (None:
        a ``-:`` rule leaves it unquantized)."""
        args = module_args(self.args, dynamic_override(self.dynamic, module), what=f"gptq dynamic ({module})")
        if args is None:
            return None
        _check_args(f"gptq dynamic override for {module}", args.bits, args.group_size)
        return self._bound(bits=args.bits, group_size=args.group_size, per_tensor={}, dynamic=None)

    def tensor_args(self, dense_name: str) -> IntArgs:
        return self.per_tensor.get(dense_name, self.args)

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """Specs of one dense [sources * O, I] expert tensor: each source's [I*b/32, O] qweight,
        [G, O*b/32] qzeros and [G, O] scales side by side along dim 1, g_idx [I] one after the
        other along dim 0 (G = ceil(I / g): one group when g exceeds I).

        Raises:
            ValueError: transposed experts, or I or O not a multiple of 32 / bits.
        """
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
        """qweight [K/8, N] (input-major), qzeros [G, N/8] (+ the v1 offset), scales [G, N]
        multiplied in float16. With ``desc_act`` the kernel reads g_idx per input column;
        without it, groups are ``k // group_size`` (GPTQ writes that g_idx;
        ``packing.g_idx_is_trivial`` checks a checkpoint's rows)."""
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
