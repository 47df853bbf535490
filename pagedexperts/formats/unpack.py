"""The package's one unpacker: the torch interpreter of a ``WeightPacking`` (``formats.packing``).

From n experts' packed rows {packed name: [n, *spec.shape]}: ``codes``, ``values``,
``dense_weight`` (W with the format's own arithmetic, bit for bit its library's), ``int_groups``
(for CPU int kernels), and ``PackedFormat``, the base of every quantized format. Constants are
built once per device (``ExpertFormat.device_constant``). Does not: know a format class, read files.

Legend: n experts, N output features, K input features, G groups, S checkpoint sources.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from pagedexperts.formats.base import ExpertFormat, QuantizedTensor
from pagedexperts.formats.packing import AWQ_POSITION, WeightPacking, scale_rows_per_source

Build = Callable[[torch.device], torch.Tensor]
Constant = Callable[[str, torch.device, Build], torch.Tensor]
# e2m1 magnitudes of codes 0-7 (bit 3 is the sign): OCP MX v1.0's FP4, as every FP4 format reads it
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_ZERO = 0x00400000  # E8M0 exponent 0 is 2**-127: a float32 subnormal, this bit pattern


def build_each_time(name: str, device, build: Build) -> torch.Tensor:
    """A ``constant`` that keeps nothing: ``build(device)``."""
    return build(torch.device(device))


def unpack_fields(words: torch.Tensor, *, bits: int, dim: int, positions: tuple[int, ...],
                  constant: Constant = build_each_time) -> torch.Tensor:
    """``bits``-wide unsigned fields of integer ``words`` along ``dim`` (-1 or -2): [..., W] ->
    [..., W * P] or [..., W, C] -> [..., W * P, C], P = len(positions); field j at bits
    ``bits * positions[j]``. Keeps ``words``' dtype."""
    key = f"shifts:{words.dtype}:{bits}:{positions}"
    shifts = constant(key, words.device,
                      lambda device: torch.tensor([bits * p for p in positions], dtype=words.dtype, device=device))
    mask = (1 << bits) - 1
    if dim == -1:
        return ((words.unsqueeze(-1) >> shifts) & mask).flatten(-2)
    return ((words.unsqueeze(-2) >> shifts.view(-1, 1)) & mask).flatten(-3, -2)


def _positions(per_word: int, interleaved: bool) -> tuple[int, ...]:
    """The field of column j of a word: j, or AWQ's interleaved order."""
    return AWQ_POSITION if interleaved else tuple(range(per_word))


def codes(packing: WeightPacking, rows: Mapping[str, torch.Tensor], *,
          constant: Constant = build_each_time) -> torch.Tensor:
    """The stored field of every element, [n, N, K] (a view in storage order): int fields unsigned,
    e2m1 codes uint8, one-per-element weights as stored."""
    raw = rows[packing.spec("weight").name]
    raw = raw.flatten(2) if raw.dim() > 3 else raw  # gpt-oss's blocks [n, N, K/32, 16]: [n, N, K/2]
    if packing.packed_dim != "none":
        along = -1 if (packing.packed_dim == "in") != packing.transposed else -2
        raw = unpack_fields(raw, bits=packing.bits, dim=along, positions=_positions(packing.per_word, packing.interleaved),
                             constant=constant)
        length = packing.in_features if packing.packed_dim == "in" else packing.out_features
        raw = raw.narrow(along, 0, length)  # compressed-tensors pads the last word
    return raw.transpose(-1, -2) if packing.transposed else raw


def _lookup(table: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """``table[raw]`` for bytes ``raw`` [...] -> [..., *table.shape[1:]] (one ``index_select``)."""
    flat = raw.reshape(-1).view(torch.uint8).to(torch.int32)
    return table.index_select(0, flat).view(*raw.shape, *table.shape[1:])


def _e2m1_table(negative_zero: bool, dtype: torch.dtype, device) -> torch.Tensor:
    """[16]: the value of every e2m1 code in ``dtype`` (exact in each; code 8 -0.0, or +0.0)."""
    signed = [-m for m in E2M1_MAGNITUDES]
    signed[0] = -0.0 if negative_zero else 0.0
    return torch.tensor(list(E2M1_MAGNITUDES) + signed, dtype=torch.float32, device=device).to(dtype)


def _float_values(packing: WeightPacking, rows: Mapping[str, torch.Tensor], constant: Constant) -> torch.Tensor:
    """The e4m3 / e2m1 values in ``mul_dtype`` (exact), [n, N, K] in storage order, by table lookup."""
    raw = rows[packing.spec("weight").name]
    dtype, neg = packing.mul_dtype, packing.negative_zero
    if packing.codes == "e4m3":
        table = constant(f"e4m3:{dtype}", raw.device, lambda device: torch.arange(
            256, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).to(dtype))
        v = _lookup(table, raw)
        return v.transpose(-1, -2) if packing.transposed else v
    table = constant(f"e2m1:{neg}:{dtype}", raw.device, lambda device: _e2m1_table(neg, dtype, device))
    if packing.packed_dim == "in" and not packing.transposed and packing.bits == 4:
        pairs = constant(f"e2m1-bytes:{neg}:{dtype}", raw.device, lambda device: torch.stack(
            [table[torch.arange(256, device=device) & 0xF], table[torch.arange(256, device=device) >> 4]], dim=-1))
        return _lookup(pairs, raw.flatten(2)).flatten(-2).narrow(-1, 0, packing.in_features)
    return _lookup(table, codes(packing, rows, constant=constant).to(torch.uint8))


def _index(constant: Constant, name: str, device, values: Callable[[torch.Tensor], torch.Tensor], size: int):
    """A cached int64 index [size] on ``device``: ``values(arange(size))``."""
    return constant(name, device, lambda d: values(torch.arange(size, device=d)))


def scale_rows(packing: WeightPacking, rows: Mapping[str, torch.Tensor], *,
               constant: Constant = build_each_time) -> torch.Tensor | None:
    """The scale of every (output row, group), [n, N, G] in ``mul_dtype`` (codes decoded, a
    divide / multiply global scale applied in float32), or None."""
    spec = packing.spec("scale")
    if spec is None:
        return None
    s = rows[spec.name]
    s = s.unsqueeze(-1) if s.dim() == 2 else (s.transpose(-1, -2) if packing.transposed else s)  # [n, R, G]
    if packing.scale_codes == "e4m3":
        s = s.to(torch.float32)
    elif packing.scale_codes == "e8m0":
        e = s.to(torch.int32)
        s = torch.where(e == 0, E8M0_ZERO, e << 23).view(torch.float32)  # 2 ** (e - 127)
    per_source = scale_rows_per_source(packing)
    if packing.global_scale in ("divide", "multiply"):
        glob = rows[packing.spec("global_scale").name].to(torch.float32)  # [n, S]
        glob = glob.repeat_interleave(per_source, dim=-1).unsqueeze(-1)  # [n, R, 1]
        s = s.to(torch.float32) / glob if packing.global_scale == "divide" else s.to(torch.float32) * glob
    s = s.to(packing.mul_dtype)
    n_rows, src, block = packing.out_features, packing.source_rows, packing.block_rows
    if block == 1 and s.shape[-2] == n_rows:
        return s
    index = _index(constant, f"scale-rows:{n_rows}:{src}:{block}", s.device,
                   lambda i: (i // src) * per_source + (i % src) // block, n_rows)
    return s.index_select(-2, index)


def zero_rows(packing: WeightPacking, rows: Mapping[str, torch.Tensor], *,
              constant: Constant = build_each_time) -> torch.Tensor | None:
    """The zero point of every (output row, group), int32 [n, N, G] with ``zero_offset`` applied, or
    None. Packed along the output dim, restarting per source."""
    spec = packing.spec("zero")
    if spec is None:
        return None
    words = rows[spec.name]
    if packing.zero_word():  # one addition per 32-bit word, carries included (GPTQModel's v1 -> v2)
        words = (words.to(torch.int64) + packing.zero_word()) & 0xFFFFFFFF
    along = -1 if packing.transposed else -2
    z = unpack_fields(words, bits=packing.bits, dim=along, positions=_positions(32 // packing.bits, packing.interleaved),
                      constant=constant)
    per_source = z.shape[along] // packing.sources
    if per_source != packing.source_rows:  # each source's last word is padded
        z = z.unflatten(along, (packing.sources, per_source)).narrow(along, 0, packing.source_rows)
        z = z.flatten(along - 1, along)
    z = (z.transpose(-1, -2) if packing.transposed else z).to(torch.int32)
    return z + packing.zero_offset if packing.zero_offset and not packing.zero_carries else z


def _global_reciprocal(packing: WeightPacking, rows: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """float32 [n, N, 1]: ``1 / g`` of each row's source global scale, 0 where g is 0 (AutoRound's
    ``get_reciprocal``)."""
    glob = rows[packing.spec("global_scale").name].to(torch.float32)  # [n, S]
    reciprocal = torch.where(glob == 0, torch.zeros_like(glob), 1.0 / glob)
    return reciprocal.repeat_interleave(packing.source_rows, dim=-1).unsqueeze(-1)


def _g_idx(packing: WeightPacking, rows: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """int64 [n, S, K]: the group of every input column per source, or None (no g_idx role)."""
    spec = packing.spec("g_idx")
    if spec is None:
        return None
    return rows[spec.name].long().view(-1, packing.sources, packing.in_features)


def _by_group(packing: WeightPacking, per_group: list, g_idx: torch.Tensor | None, constant: Constant):
    """Per-(row, group) tensors [n, N, G] (None kept) made broadcastable to the element grid:
    (tensors, split), ``split`` meaning the grid is viewed as [n, N, G, g]."""
    present = [t for t in per_group if t is not None]
    if not present or present[0].shape[-1] == 1:
        return per_group, False
    k, groups = packing.in_features, present[0].shape[-1]
    if g_idx is not None:  # act-order: each column's group, per source, gathered in the grid's memory order
        n, s, rows = g_idx.shape[0], packing.sources, packing.source_rows
        if packing.transposed:  # input-major: gather [n, K, S, rows] and view it as [n, N, K]
            index = g_idx.transpose(1, 2).unsqueeze(-1).expand(n, k, s, rows)
            return [None if t is None else torch.gather(t.reshape(n, s, rows, groups).permute(0, 3, 1, 2), 1, index)
                    .view(n, k, -1).transpose(-1, -2) for t in per_group], False
        index = g_idx.unsqueeze(2).expand(n, s, rows, k)
        return [None if t is None else torch.gather(t.reshape(n, s, rows, groups), -1, index).view(n, -1, k)
                for t in per_group], False
    size = packing.group_size
    if size and k == groups * size:
        return [None if t is None else t.unsqueeze(-1) for t in per_group], True
    index = _index(constant, f"groups:{k}:{size}", present[0].device, lambda i: i // size, k)
    return [None if t is None else t.index_select(-1, index) for t in per_group], False


def _values(packing: WeightPacking, rows: Mapping[str, torch.Tensor], constant: Constant):
    """(v, scale, split, fresh): values (int, or float in ``mul_dtype``), per-element scales or None,
    whether v is viewed [n, N, G, g], whether v is a temporary the caller may write into."""
    scale, zero = scale_rows(packing, rows, constant=constant), zero_rows(packing, rows, constant=constant)
    (scale, zero), split = _by_group(packing, [scale, zero], _g_idx(packing, rows), constant)
    if packing.codes in ("e4m3", "e2m1"):
        v = _float_values(packing, rows, constant)
    else:
        v = codes(packing, rows, constant=constant)
        v = v.to(packing.mul_dtype) if packing.codes == "dense" else v
    fresh = packing.packed_dim != "none" or packing.codes in ("e4m3", "e2m1")
    if split:
        v = v.unflatten(-1, (packing.in_features // packing.group_size, packing.group_size))
    offset = zero if zero is not None else packing.value_offset
    if zero is not None or offset:
        v, fresh = (v.sub_(offset) if fresh else v - offset), True
    if packing.global_scale == "value_reciprocal":  # float32 (``WeightPacking`` checks mul_dtype)
        reciprocal = _global_reciprocal(packing, rows)
        reciprocal = reciprocal.unsqueeze(-1) if split else reciprocal
        v, fresh = (v.mul_(reciprocal) if fresh and v.dtype == torch.float32 else v.to(torch.float32) * reciprocal), True
    return v, scale, split, fresh


def values(packing: WeightPacking, rows: Mapping[str, torch.Tensor], *,
           constant: Constant = build_each_time) -> torch.Tensor:
    """float32 [n, N, K]: every element's value before its scale (int: code minus its zero point
    or value offset; e4m3 / e2m1 decoded; dense: the element)."""
    v, _, split, _ = _values(packing, rows, constant)
    return (v.flatten(-2) if split else v).to(torch.float32)


def dense_weight(packing: WeightPacking, rows: Mapping[str, torch.Tensor], *, constant: Constant = build_each_time,
                 dense_transposed: bool = False) -> torch.Tensor:
    """W of n experts, contiguous in ``dense_dtype``: [n, N, K], or [n, K, N] when
    ``dense_transposed``. Each element ``rnd_dense(rnd_round(v * s))`` (``v / s`` for ``scale_op``
    "divide"), the product in ``mul_dtype`` (``formats.packing``).
    Raises KeyError: a packed tensor of the packing missing from ``rows``."""
    v, scale, split, fresh = _values(packing, rows, constant)
    if scale is None:
        w = v
    elif packing.scale_op == "divide":
        w = v.div_(scale) if fresh and v.dtype == scale.dtype else v / scale
    elif fresh and v.dtype == scale.dtype:
        w = v.mul_(scale)
    else:
        w = v * scale  # an int v is exact in mul_dtype: one rounding
    if packing.round_dtype is not None:
        w = w.to(packing.round_dtype)
    w = w.flatten(-2) if split else w
    w = w.transpose(-1, -2) if dense_transposed else w
    if w.dtype == packing.dense_dtype:
        return w.contiguous()
    return w.to(packing.dense_dtype, memory_format=torch.contiguous_format)  # cast and transpose in one pass


@dataclass(frozen=True)
class IntGroups:
    """An integer weight of n experts: ``W[n, o, i] = (codes - zeros[g]) * scales[g]`` in the scales'
    dtype, then ``dense_dtype``; g = ``i // group_size`` or ``g_idx[n, o // source_rows, i]``;
    codes uint8 / int8 [n, N, K], zeros int32 [n, N, G], g_idx int64 [n, S, K] or None."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    g_idx: torch.Tensor | None
    source_rows: int
    bits: int
    dense_dtype: torch.dtype

    def dense(self) -> torch.Tensor:
        """W [n, N, K] in ``dense_dtype`` (equal to ``dense_weight``)."""
        n, out_features, in_features = self.codes.shape
        if self.g_idx is not None:
            index = self.g_idx.repeat_interleave(self.source_rows, dim=1)
        else:
            index = (torch.arange(in_features, device=self.codes.device) // self.group_size).expand(n, out_features, -1)
        v = self.codes.to(torch.int32) - torch.gather(self.zeros, -1, index)
        return (v * torch.gather(self.scales, -1, index)).to(self.dense_dtype)


def int_groups(packing: WeightPacking, rows: Mapping[str, torch.Tensor], *,
               constant: Constant = build_each_time) -> IntGroups:
    """The ``IntGroups`` of an int format's packing (GPTQ, AWQ, AutoRound, compressed-tensors int4 /
    int8, block INT8).
    Raises ValueError: codes not int, or a global scale, dividing scale or intermediate rounding."""
    if (packing.codes != "int" or packing.global_scale != "none" or packing.round_dtype is not None
            or packing.scale_op != "multiply"):
        raise ValueError(f"int_groups reads int packings without global scale, dividing scale or round dtype; got "
                         f"codes={packing.codes!r} global_scale={packing.global_scale!r} scale_op={packing.scale_op!r} "
                         f"round_dtype={packing.round_dtype}")
    q = codes(packing, rows, constant=constant)
    q = (q.to(torch.uint8) if packing.packed_dim != "none" else q).contiguous()
    scales = scale_rows(packing, rows, constant=constant)
    zeros = zero_rows(packing, rows, constant=constant)
    if zeros is None:
        zeros = torch.full(scales.shape, packing.value_offset, dtype=torch.int32, device=scales.device)
    return IntGroups(q, zeros, scales, packing.group_size or packing.in_features, _g_idx(packing, rows),
                     packing.source_rows, packing.bits or 8, packing.dense_dtype)


class PackedFormat(ExpertFormat):
    """A format described by its ``packing``: ``dequantize`` is ``dense_weight`` of it (W^T where
    ``transposed_experts``); subclasses say what the checkpoint holds (``pack``) and how it packs."""

    def packing_of(self, tensor: QuantizedTensor) -> WeightPacking:
        """``packing(tensor)`` in the dense module's orientation, built once per tensor and kept."""
        cache = self.__dict__.setdefault("_packings", {})
        if tensor not in cache:
            cache[tensor] = self.packing(tensor, transposed=self.transposed_experts is True)
        return cache[tensor]

    def dequantize(self, tensor: QuantizedTensor, packed: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Packed rows {name: [n, *spec.shape]} -> [n, *tensor.dense.shape] in ``tensor.dense.dtype``
        (a passthrough tensor as given)."""
        if tensor.is_passthrough:
            return packed[tensor.dense.name]
        return dense_weight(self.packing_of(tensor), packed, constant=self.device_constant,
                            dense_transposed=self.transposed_experts is True)
