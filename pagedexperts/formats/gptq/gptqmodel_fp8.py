"""GPTQModel's FP8 (``quant_method: fp8``, ``weight_scale_semantics: inverse``, GPTQModel 7.7 ``FP8Config``).

``weight`` e4m3 [O, I] and float32 ``weight_scale_inv`` [O] = 448 / amax per row, DIVIDING the
weight in the model's dtype (``nn_modules/qlinear/fp8.py`` ``TorchFP8Linear``, formats/README.md).
Registered before block FP8, whose ``weight_scale_inv`` multiplies. Does not: read files, store,
page, or quantize activations.

Legend: n experts, R rows (gate and up concatenated), I input features.
"""

from __future__ import annotations

import torch

from pagedexperts.formats.base import QuantizedTensor, TensorSpec
from pagedexperts.formats.gptq.dynamic import IntArgs, dynamic_override, expert_args, module_args
from pagedexperts.formats.packing import WeightPacking, dense_packing, float8_packing
from pagedexperts.formats.unpack import PackedFormat

FP8_DTYPE = torch.float8_e4m3fn
FORMATS = ("float8_e4m3fn",)
SCALE_SUFFIX = "_scale_inv"


class GptqModelFp8Format(PackedFormat):
    """GPTQModel FP8, one ``weight_scale_inv`` per output row, dividing the weight."""

    name = "gptqmodel-fp8"
    serialized_names = {"weight": ("weight", "weight_scale_inv")}

    def __init__(self, *, dynamic: dict | None = None) -> None:
        self.dynamic = dynamic

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        qc = quantization_config or {}
        return qc.get("quant_method") == "fp8" and ("weight_scale_semantics" in qc or "weight_scale_method" in qc)

    @classmethod
    def from_config(cls, config, quantization_config: dict | None) -> "GptqModelFp8Format":
        """Bind the ``dynamic`` rules.
        Raises ValueError: a semantics, scale method or format this reader does not read, or ``dynamic`` rules
        that change or skip routed experts (names the field and value)."""
        qc = quantization_config or {}
        for key, want in (("weight_scale_semantics", "inverse"), ("weight_scale_method", "row")):
            if qc.get(key, want) != want:
                raise ValueError(f"GPTQModel fp8 checkpoint with {key}={qc[key]!r}: only {key}={want!r} is supported")
        fmt = qc.get("checkpoint_format") or qc.get("format") or FORMATS[0]
        if fmt not in FORMATS or qc.get("weight_block_size") is not None:
            raise ValueError(f"GPTQModel fp8 checkpoint with format={fmt!r}, weight_block_size="
                             f"{qc.get('weight_block_size')!r}: only {FORMATS} per row is supported")
        dynamic = qc.get("dynamic") or None
        if dynamic and config is not None:
            base = IntArgs(8, -1)
            bound = expert_args(base, config, lambda m: dynamic_override(dynamic, m), what="GPTQModel fp8 dynamic")
            if any(args != base for args in bound.values()):
                raise ValueError(f"GPTQModel fp8 dynamic rules give routed experts {bound}: per-module overrides "
                                 "of FP8 experts are not supported")
        return cls(dynamic=dynamic)

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None) -> "GptqModelFp8Format":
        return cls.from_config(None, quantization_config)

    def linear_format(self, module: str, quantization_config: dict | None) -> "GptqModelFp8Format | None":
        """``self`` for a non-expert module, None where a ``-:`` rule leaves it unquantized.
        Raises ValueError: a rule that changes the module's fields (names it)."""
        args = module_args(IntArgs(8, -1), dynamic_override(self.dynamic, module), what=f"GPTQModel fp8 dynamic ({module})")
        if args is None:
            return None
        if args != IntArgs(8, -1):
            raise ValueError(f"GPTQModel fp8 dynamic rule for {module} gives {args}: only the base FP8 is supported")
        return self

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """fp8 [R, I] and ``weight_scale_inv`` float32 [R] (sources concatenated on dim 0).
        Raises ValueError: transposed experts (gpt-oss)."""
        if len(dense.shape) != 2:
            return (dense,)
        if transposed:
            raise ValueError(f"{self.name}: experts stored transposed ([in, out], e.g. gpt-oss) are not supported")
        return (TensorSpec(dense.name, dense.shape, FP8_DTYPE),
                TensorSpec(dense.name + SCALE_SUFFIX, (dense.shape[0],), torch.float32))

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """fp8 [N, K] divided by one scale per row in the dense dtype (``scale_op`` "divide")."""
        if tensor.is_passthrough:
            return dense_packing(tensor, transposed=transposed)
        return float8_packing(tensor, scale=tensor.packed[1], strategy="channel", sources=1,
                              mul_dtype=tensor.dense.dtype, scale_op="divide")
