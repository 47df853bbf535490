"""AutoRound's native integer format (``quant_method: auto-round``, ``data_type: int``).

Layout (AutoRound 0.16.1 ``export/export_to_autoround/export.py`` ``pack_layer``, the QuantLinear of
``auto_round_extension/torch``): GPTQ's without ``g_idx``; ``packing_format`` ``auto_round:auto_gptq``
stores zero points minus one (+ 1 per value on reading, no wrap), ``auto_round`` as they are
(formats/README.md "Packings"). ``extra_config`` binds each dense tensor (``dynamic``). The FP data types
are ``formats.gptq.autoround_fp``'s. Does not: read files, store, page.
"""

from __future__ import annotations

from pagedexperts.formats.base import QuantizedTensor, TensorSpec
from pagedexperts.formats.compressed_tensors.schemes import dense_source_count
from pagedexperts.formats.gptq.gptq import GptqFormat, _check_args
from pagedexperts.formats.gptq.dynamic import expert_args, extra_config_override, module_args
from pagedexperts.formats.packing import WeightPacking, int_packing

PACKING_ZERO_OFFSET = {"auto_round:auto_gptq": 1, "auto_round": 0}  # packing_format -> added to each stored zero
INT_DATA_TYPES = ("int",)


class AutoRoundFormat(GptqFormat):
    """AutoRound's own integer export (2/4/8 bits, GPTQ-style packing without g_idx)."""

    name = "auto-round"
    serialized_names = {"weight": ("qweight", "qzeros", "scales")}

    def __init__(self, *, extra_config: dict | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.extra_config = extra_config

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        return bool(quantization_config) and quantization_config.get("quant_method") in ("auto-round", "auto_round")

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None) -> "AutoRoundFormat":
        """Bind bits, group size, packing and ``extra_config``.
        Raises ValueError: a ``data_type`` other than int, ``act_bits`` below 16, a ``packing_format`` not in
        ``PACKING_ZERO_OFFSET``, or bits / group size ``gptq`` cannot read (names it)."""
        qc = quantization_config or {}
        data_type = str(qc.get("data_type", "int"))
        if data_type not in INT_DATA_TYPES:
            raise ValueError(f"auto-round checkpoint with data_type={data_type!r}: only {INT_DATA_TYPES} is supported "
                             "here (and 'fp', 'nv_fp', 'mx_fp': the auto-round-fp8 / -nvfp4 / -mxfp4 formats)")
        act_bits = qc.get("act_bits", 16)
        if act_bits is not None and int(act_bits) < 16:
            raise ValueError(f"auto-round checkpoint with act_bits={act_bits!r}: only weight-only (act_bits 16) is supported")
        packing = qc.get("packing_format", "auto_round:auto_gptq")
        if packing not in PACKING_ZERO_OFFSET:
            raise ValueError(f"auto-round checkpoint with packing_format={packing!r}: only {sorted(PACKING_ZERO_OFFSET)} "
                             "are supported")
        bits, group_size = qc.get("bits"), qc.get("group_size", 128)
        _check_args("auto-round checkpoint", bits, group_size)
        return cls(bits=bits, group_size=group_size, sym=bool(qc.get("sym", True)), zero_offset=PACKING_ZERO_OFFSET[packing],
                   extra_config=qc.get("extra_config") or None)

    @classmethod
    def from_config(cls, config, quantization_config: dict | None) -> "AutoRoundFormat":
        """As ``from_quantization_config``, each dense tensor bound to its ``extra_config`` overrides.
        Raises ValueError: see ``dynamic.expert_args``."""
        fmt = cls.from_quantization_config(quantization_config)
        if fmt.extra_config:
            fmt.per_tensor = expert_args(fmt.args, config, lambda m: extra_config_override(fmt.extra_config, m),
                                         what="auto-round extra_config")
            for args in fmt.per_tensor.values():
                _check_args("auto-round extra_config override", args.bits, args.group_size)
        return fmt

    def _bound(self, **changes) -> "AutoRoundFormat":
        fields = dict(group_size=self.args.group_size, bits=self.args.bits, sym=self.args.sym, zero_offset=self.zero_offset,
                      scale_dtype=self.scale_dtype, per_tensor=self.per_tensor, extra_config=self.extra_config)
        return type(self)(**{**fields, **changes})

    def linear_format(self, module: str, quantization_config: dict | None) -> "AutoRoundFormat | None":
        """Non-expert ``module``'s format with its ``extra_config`` entry (None: ``bits`` 16)."""
        args = module_args(self.args, extra_config_override(self.extra_config, module),
                           what=f"auto-round extra_config ({module})")
        if args is None:
            return None
        _check_args(f"auto-round extra_config for {module}", args.bits, args.group_size)
        return self._bound(bits=args.bits, group_size=args.group_size, per_tensor={}, extra_config=None)

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """GPTQ's specs (``GptqFormat.pack``) without ``g_idx``."""
        return super().pack(dense, sources=sources, transposed=transposed)[:3]

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """GPTQ's packing without g_idx, ``auto_round:auto_gptq``'s + 1 per zero point (``zero_carries`` False)."""
        name, specs = tensor.dense.name, {p.name: p for p in tensor.packed}
        in_features, args = tensor.dense.shape[1], self.tensor_args(tensor.dense.name)
        return int_packing(tensor, weight=specs[f"{name}_qweight"], scale=specs[f"{name}_scales"], bits=args.bits,
                           packed_dim="in", sources=dense_source_count(name), group_size=args.group_of(in_features),
                           zero=specs[f"{name}_qzeros"], transposed=True, zero_offset=self.zero_offset,
                           zero_carries=False)
