"""How a format's packed rows encode one expert weight: the one description unpack and the fused kernels read.

Owns ``WeightPacking`` (which packed tensor holds each role: ``weight``, ``scale``, ``zero``,
``g_idx``, ``global_scale``; how values, scales and zero points are stored; the dtypes of the
format's arithmetic) and the encodings' names (the kernels' constexprs). ``formats.unpack``
interprets it in torch, ``paging.kernels.fused_moe_kernel`` in registers. Does not: unpack.

W is nn.Linear's [N, K] whatever the module's orientation. Element ``W[n, k]``:

- value ``v``: ``dense`` the element; ``int`` the unsigned ``bits``-wide field minus the zero point
  (``((z_word + zero_word()) >> shift) & mask``; without ``zero_carries`` ``zero_offset`` is added
  per field) or minus ``value_offset``; ``e4m3`` / ``e2m1`` the code's value (e2m1 code 8: -0.0,
  +0.0 without ``negative_zero``);
- scale ``s``: the ``scale`` row at group ``k // group_size`` (``g_idx`` if present; one group if
  ``group_size`` is 0) and row ``(n // source_rows) * ceil(source_rows / block_rows) + (n %
  source_rows) // block_rows``, codes decoded, divided by or multiplied with the source's
  ``global_scale`` in float32, or (``value_reciprocal``) ``v = rnd_f32(v * rnd_f32(1 / g))``;
- ``W[n, k] = rnd_dense(rnd_round(rnd_mul(v * rnd_mul(s))))``; ``scale_op`` "divide": ``v / s``.

Rows are [N, K / per_word], input-major when ``transposed``; ``zero`` is packed along N, 32 //
bits per int32 word, restarting per source; ``interleaved``: AWQ's nibble order.

Legend: N output features, K input features, R rows of one expert's tensor, G groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedexperts.formats.base import TensorSpec, ceil_div

if TYPE_CHECKING:
    from pagedexperts.formats.base import QuantizedTensor

ROLES = ("weight", "scale", "zero", "g_idx", "global_scale")
CODES = ("dense", "int", "e4m3", "e2m1")
PACKED_DIMS = ("none", "in", "out")
SCALES = ("none", "tensor", "channel", "group", "block")
SCALE_CODES = ("float", "e4m3", "e8m0")
GLOBAL_SCALES = ("none", "divide", "multiply", "value_reciprocal")
SCALE_OPS = ("multiply", "divide")
# AWQ: column j (0..7) of an 8-column word sits in nibble AWQ_POSITION[j] (``formats.gptq.awq``)
AWQ_POSITION = (0, 4, 1, 5, 2, 6, 3, 7)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class WeightPacking:
    """The packed encoding of one expert projection ``W [N, K]`` (module docstring)."""

    out_features: int
    in_features: int
    dense_dtype: torch.dtype  # what the format's dequantize returns
    tensors: tuple[tuple[str, TensorSpec], ...]  # (role, packed spec of one expert's row)
    codes: str = "dense"
    bits: int = 0  # bits of one packed field; 0: one value per stored element
    packed_dim: str = "none"
    transposed: bool = False
    interleaved: bool = False
    value_offset: int = 0
    scale: str = "none"
    scale_codes: str = "float"
    group_size: int = 0  # input columns per scale; 0: one group spanning K
    block_rows: int = 1  # output rows per scale, inside one source
    source_rows: int = 0  # output rows per checkpoint source (gate, up); 0: N
    zero_offset: int = 0  # added to each stored zero point (GPTQ v1 stores z - 1), per word: ``zero_word``
    zero_carries: bool = True  # zero_offset added to the whole word (carries); False: to each field, no wrap
    negative_zero: bool = True  # e2m1 code 8 decodes to -0.0; False: +0.0 (ModelOpt's e2m1 table)
    global_scale: str = "none"
    scale_op: str = "multiply"  # how the value meets its scale (``divide``: GPTQModel FP8)
    mul_dtype: torch.dtype = torch.float32
    round_dtype: torch.dtype | None = None
    roles: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        for what, value, choices in (("codes", self.codes, CODES), ("packed_dim", self.packed_dim, PACKED_DIMS),
                                     ("scale", self.scale, SCALES), ("scale_codes", self.scale_codes, SCALE_CODES),
                                     ("global_scale", self.global_scale, GLOBAL_SCALES),
                                     ("scale_op", self.scale_op, SCALE_OPS)):
            if value not in choices:
                raise ValueError(f"WeightPacking {what}={value!r}: choose one of {list(choices)}")
        roles = dict(self.tensors)
        unknown = set(roles) - set(ROLES)
        if unknown or "weight" not in roles:
            raise ValueError(f"WeightPacking roles {sorted(roles)}: need 'weight', each one of {list(ROLES)}")
        if (self.scale == "none") != ("scale" not in roles) or (self.global_scale == "none") != ("global_scale" not in roles):
            raise ValueError(f"WeightPacking scale={self.scale!r} global_scale={self.global_scale!r} disagree "
                             f"with the roles {sorted(roles)}")
        if self.packed_dim != "none" and self.bits not in (2, 4, 8):
            raise ValueError(f"WeightPacking packed along {self.packed_dim!r} with bits={self.bits}: only 2, 4 and 8")
        if self.global_scale == "value_reciprocal" and self.mul_dtype != torch.float32:
            raise ValueError(f"WeightPacking global_scale='value_reciprocal' computes in float32: mul_dtype={self.mul_dtype}")
        for dtype in (self.dense_dtype, self.mul_dtype) + ((self.round_dtype,) if self.round_dtype else ()):
            if dtype not in FLOAT_DTYPES:
                raise ValueError(f"WeightPacking dtype {dtype}: choose one of {list(FLOAT_DTYPES)}")
        object.__setattr__(self, "roles", roles)
        if not self.source_rows:
            object.__setattr__(self, "source_rows", self.out_features)

    def spec(self, role: str) -> TensorSpec | None:
        """The packed spec of ``role`` (None: this packing has no such tensor)."""
        return self.roles.get(role)

    @property
    def per_word(self) -> int:
        """Values per stored element of the weight row (8 int4 per int32, 2 e2m1 per byte)."""
        if self.packed_dim == "none":
            return 1
        return torch.empty((), dtype=self.roles["weight"].dtype).element_size() * 8 // self.bits

    @property
    def sources(self) -> int:
        return self.out_features // self.source_rows

    def zero_word(self) -> int:
        """``zero_offset`` in every ``bits``-wide field of a 32-bit zero-point word (GPTQ v1, 4 bits:
        0x11111111), added as one integer so GPTQModel's v2 -> v1 borrow carries back; 0 without an
        offset or without ``zero_carries``."""
        if not self.zero_offset or not self.zero_carries:
            return 0
        return self.zero_offset * sum(1 << (self.bits * i) for i in range(32 // self.bits))

    @property
    def expert_bytes(self) -> int:
        """Packed bytes of one expert's row of every role: what a kernel reads per routed expert."""
        return sum(spec.row_bytes for spec in self.roles.values())

    def row_strides(self, role: str) -> tuple[int, int]:
        """(elements per output index, elements per input index) of ``role``'s row: [N, K/pw] or
        transposed, scale / zero [n, g] or [g, n], a 1-D row (1, 0)."""
        shape = self.roles[role].shape
        if len(shape) == 1:
            return (1, 0)
        inner = shape[-1] if len(shape) == 2 else shape[-2] * shape[-1]  # gpt-oss blocks [N, K/32, 16]
        return (1, inner) if self.transposed else (inner, 1)


def dense_packing(tensor: "QuantizedTensor", *, transposed: bool) -> WeightPacking:
    """An unquantized weight: the dense spec itself, [N, K] (or [K, N] when ``transposed``)."""
    rows, cols = tensor.dense.shape
    n, k = (cols, rows) if transposed else (rows, cols)
    return WeightPacking(n, k, tensor.dense.dtype, (("weight", tensor.packed[0]),), transposed=transposed,
                         mul_dtype=tensor.dense.dtype)


def float8_packing(tensor: "QuantizedTensor", *, scale: TensorSpec, strategy: str, sources: int,
                   block: tuple[int, int] | None = None, codes: str = "e4m3", mul_dtype=torch.float32,
                   scale_codes: str = "float", scale_op: str = "multiply") -> WeightPacking:
    """An 8-bit weight [N, K] (e4m3 or int8) with a per-``strategy`` scale (tensor: one per source;
    channel: [N, 1] or [N]; block: [sources * ceil(O / bm), ceil(K / bn)]; group: [N, K / g]),
    multiplying the value (or dividing it: ``scale_op``)."""
    n, k = tensor.dense.shape
    weight = next(p for p in tensor.packed if p.name == tensor.dense.name)
    source_rows = n // sources
    block_rows = {"tensor": source_rows, "channel": 1, "block": block[0] if block else 1, "group": 1}[strategy]
    return WeightPacking(n, k, tensor.dense.dtype, (("weight", weight), ("scale", scale)), codes=codes,
                         bits=0, scale=strategy, scale_codes=scale_codes,
                         group_size=block[1] if strategy in ("block", "group") else 0,
                         block_rows=block_rows, source_rows=source_rows, mul_dtype=mul_dtype, scale_op=scale_op)


def int_packing(tensor: "QuantizedTensor", *, weight: TensorSpec, scale: TensorSpec, bits: int, packed_dim: str,
                sources: int, group_size: int, zero: TensorSpec | None = None, g_idx: TensorSpec | None = None,
                transposed: bool = False, interleaved: bool = False, zero_offset: int = 0,
                zero_carries: bool = True, mul_dtype: torch.dtype | None = None) -> WeightPacking:
    """An int weight packed in int32 words: symmetric (value offset 2**(bits-1)) without ``zero``,
    zero points otherwise."""
    n, k = tensor.dense.shape
    roles = [("weight", weight), ("scale", scale)]
    roles += [("zero", zero)] if zero is not None else []
    roles += [("g_idx", g_idx)] if g_idx is not None else []
    return WeightPacking(n, k, tensor.dense.dtype, tuple(roles), codes="int", bits=bits, packed_dim=packed_dim,
                         transposed=transposed, interleaved=interleaved,
                         value_offset=0 if zero is not None else 1 << (bits - 1), scale="group",
                         group_size=0 if group_size >= k else group_size, source_rows=n // sources,
                         zero_offset=zero_offset, zero_carries=zero_carries, mul_dtype=mul_dtype or scale.dtype)


def fp4_packing(tensor: "QuantizedTensor", *, weight: TensorSpec, scale: TensorSpec, scale_codes: str, group_size: int,
                sources: int, global_scale: TensorSpec | None = None, global_op: str = "none",
                round_dtype: torch.dtype | None = None, mul_dtype=torch.float32, n: int | None = None,
                k: int | None = None, negative_zero: bool = True) -> WeightPacking:
    """e2m1 codes, two per byte, low nibble first, along K ([N, K/2]), a group scale (e4m3 per 16 or
    E8M0 per 32), optionally a per-source global scale."""
    n, k = (n, k) if n is not None else tensor.dense.shape
    roles = [("weight", weight), ("scale", scale)] + ([("global_scale", global_scale)] if global_scale else [])
    return WeightPacking(n, k, tensor.dense.dtype, tuple(roles), codes="e2m1", bits=4, packed_dim="in",
                         scale="group", scale_codes=scale_codes, group_size=group_size, source_rows=n // sources,
                         global_scale=global_op, mul_dtype=mul_dtype, round_dtype=round_dtype,
                         negative_zero=negative_zero)


def derived_block(weight_shape: tuple[int, int], scale_shape: tuple[int, int]) -> tuple[int, int]:
    """The block (bm, bn) a scale grid implies (``rows // scale_rows``, as transformers derives it).
    Raises ValueError: the weight shape is not a multiple of the grid."""
    (rows, cols), (sr, sc) = weight_shape, scale_shape
    if rows % sr or cols % sc:
        raise ValueError(f"Weight shape ({rows}, {cols}) not divisible by scale grid ({sr}, {sc}).")
    return rows // sr, cols // sc


def g_idx_is_trivial(g_idx: torch.Tensor, *, in_features: int, group_size: int) -> bool:
    """True when every source's g_idx rows [n, sources * K] are ``k // group_size`` (what a packing
    without ``g_idx`` assumes); call where rows enter the store, not per step."""
    want = (torch.arange(in_features, device=g_idx.device) // group_size).to(g_idx.dtype)
    return bool((g_idx.reshape(-1, in_features) == want).all())


def scale_rows_per_source(packing: WeightPacking) -> int:
    """Scale rows of one source: ceil(source_rows / block_rows)."""
    return ceil_div(packing.source_rows, packing.block_rows)
