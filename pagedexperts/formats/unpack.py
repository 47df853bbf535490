"""The torch interpreter of a ``WeightPacking``: packed rows -> codes, values, the dense weight.

Owns the package's one unpacker. Given the ``WeightPacking`` of one dense experts tensor
(``formats.packing``: what a format's checkpoint holds and how it packs it) and n experts'
packed rows {packed name: [n, *spec.shape]}:

- ``codes``: the stored field of every element of W [n, N, K] (int fields unsigned, e2m1 4-bit
  codes, one-per-element values as stored);
- ``values``: every element's value before its scale, in float32 (int: the code minus its zero
  point; e4m3 / e2m1 decoded);
- ``dense_weight``: W in the packing's dense dtype, computed with the format's own arithmetic
  (the formula in ``formats.packing``: exact value, scale rounded to ``mul_dtype``, one rounded
  product, ``round_dtype``, the dense dtype), so bit for bit what the format's library computes;
- ``int_groups``: an integer format's codes, zero points and group scales in one canonical form
  (``IntGroups``), for CPU kernels that take int4 / int8 weights with group scales;
- ``PackedFormat``: the ``ExpertFormat`` whose ``dequantize`` is ``dense_weight`` of its
  ``packing``: the base of every quantized format, which then only says what its checkpoint
  holds (``pack``) and how it packs it (``packing``).

Constants (shift tables, e2m1 tables, index maps) come from ``constant(name, device, build)``:
``ExpertFormat.device_constant`` for a format, so each is built once per device and kept (on
CUDA each would otherwise be a synchronous host-to-device copy, every wave); ``build_each_time``
keeps nothing. The fused Triton kernels (``paging.kernels.fused_moe_kernel``) read the same
packings in registers and are tested against this interpreter. Does not: know any format class,
read files, or launch anything.

Speed: one pass per operation over [N, K] and none that is not needed (no [N, K] index or scale
tensor where groups divide K: the scales broadcast over a [N, G, g] view; input-major storage is
transposed once, in the final cast). bench/dequantize_speed.py measures it against an earlier
tree.

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
    """A ``constant`` that keeps nothing: ``build(device)`` (one-off calls; formats keep theirs)."""
    return build(torch.device(device))


def unpack_fields(words: torch.Tensor, *, bits: int, dim: int, positions: tuple[int, ...],
                  constant: Constant = build_each_time) -> torch.Tensor:
    """``bits``-wide unsigned fields of the integer ``words`` along ``dim`` (-1 or -2):
    [..., W] -> [..., W * P] (dim -1) or [..., W, C] -> [..., W * P, C] (dim -2), P =
    len(positions); field j of a word sits at bits ``bits * positions[j]``. Shifts and masks
    (the host's byte order does not matter); the result keeps ``words``' dtype."""
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
    """The stored field of every element: [n, N, K] (a view in the storage's order: input-major
    rows give a transposed view). int fields unsigned in the words' dtype, e2m1 codes uint8,
    one-per-element weights as stored (int8, float8_e4m3fn, a dense dtype)."""
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
    """``table[raw]`` for bytes ``raw`` [...]: [..., *table.shape[1:]] (one ``index_select``: on
    CPU many times faster than a float8 cast or advanced indexing)."""
    flat = raw.reshape(-1).view(torch.uint8).to(torch.int32)
    return table.index_select(0, flat).view(*raw.shape, *table.shape[1:])


def _e2m1_table(negative_zero: bool, dtype: torch.dtype, device) -> torch.Tensor:
    """[16]: the value of every e2m1 code in ``dtype`` (exact in each; code 8 -0.0, or +0.0)."""
    signed = [-m for m in E2M1_MAGNITUDES]
    signed[0] = -0.0 if negative_zero else 0.0
    return torch.tensor(list(E2M1_MAGNITUDES) + signed, dtype=torch.float32, device=device).to(dtype)


def _float_values(packing: WeightPacking, rows: Mapping[str, torch.Tensor], constant: Constant) -> torch.Tensor:
    """The e4m3 / e2m1 values in ``mul_dtype`` (exact in each), [n, N, K] (a view in the storage's
    order): looked up per stored byte (e4m3: torch's own conversion of each of the 256 codes;
    e2m1 along the input dim, every FP4 layout: the pair (low nibble's value, high nibble's))."""
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
    """The scale of every (output row, group): [n, N, G] in ``mul_dtype`` (e4m3 / E8M0 codes
    decoded, the source's global scale divided or multiplied in float32), or None (no scale)."""
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
    if packing.global_scale != "none":
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
    """The zero point of every (output row, group): int32 [n, N, G], ``zero_offset`` applied,
    or None (no zero role). Zero points are packed along the output dim, restarting per source."""
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


def _g_idx(packing: WeightPacking, rows: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """int64 [n, S, K]: the group of every input column per source, or None (no g_idx role)."""
    spec = packing.spec("g_idx")
    if spec is None:
        return None
    return rows[spec.name].long().view(-1, packing.sources, packing.in_features)


def _by_group(packing: WeightPacking, per_group: list, g_idx: torch.Tensor | None, constant: Constant):
    """Per-(row, group) tensors [n, N, G] (None kept) broadcastable against the per-element
    grid: (tensors, split) where ``split`` says the grid is to be viewed as [n, N, G, g]."""
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
    """(v, scale, split, fresh): the values (int tensors for int codes; float in ``mul_dtype``
    otherwise) and the per-element scales [n, N, G(, 1)] or [n, N, K] (None without a scale),
    ``split``: v is the grid viewed as [n, N, G, g]; ``fresh``: v is a temporary of its own (not
    the caller's rows), so later steps may write into it instead of allocating."""
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
    return v, scale, split, fresh


def values(packing: WeightPacking, rows: Mapping[str, torch.Tensor], *,
           constant: Constant = build_each_time) -> torch.Tensor:
    """float32 [n, N, K]: every element's value before its scale (int: code minus its zero point
    or value offset; e4m3 / e2m1 decoded; dense: the element)."""
    v, _, split, _ = _values(packing, rows, constant)
    return (v.flatten(-2) if split else v).to(torch.float32)


def dense_weight(packing: WeightPacking, rows: Mapping[str, torch.Tensor], *, constant: Constant = build_each_time,
                 dense_transposed: bool = False) -> torch.Tensor:
    """W of n experts, contiguous in the packing's ``dense_dtype``: [n, N, K], or [n, K, N] when
    ``dense_transposed`` (the dense module stores W^T: gpt-oss). Each element is
    ``rnd_dense(rnd_round(v * s))``, the product in ``mul_dtype`` (``formats.packing``).

    Raises:
        KeyError: a packed tensor of the packing missing from ``rows``."""
    v, scale, split, fresh = _values(packing, rows, constant)
    if scale is None:
        w = v
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
    """An integer weight of n experts in one canonical form:
    ``W[n, o, i] = (codes[n, o, i] - zeros[n, o, g]) * scales[n, o, g]``, computed in the scales'
    dtype (one rounding), then ``dense_dtype``; g = the group of input column i: ``i //
    group_size`` (the last group may be partial), or ``g_idx[n, o // source_rows, i]`` (act-order).

    ``codes``: uint8 [n, N, K] in 0 .. 2**bits - 1 (fields of packed words), or int8 [n, N, K]
    (int8 stored as is, zeros 0); ``zeros``: int32 [n, N, G] (the value offset 2**(bits-1) of a
    symmetric packing; up to 2**bits where an offset is added without wrap); ``scales``: [n, N, G]
    in the format's multiply dtype; ``group_size``: K when G is 1; ``g_idx``: int64 [n, S, K] or
    None. From here, CPU int4 / int8 kernels (torch's ``_convert_weight_to_int4pack_for_cpu``,
    ``_weight_int8pack_mm``) take their own layouts (``w = (q - 8) * s + (8 - z) * s`` ...)."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    g_idx: torch.Tensor | None
    source_rows: int
    bits: int
    dense_dtype: torch.dtype

    def dense(self) -> torch.Tensor:
        """W [n, N, K] in ``dense_dtype`` from this form (what ``dense_weight`` computes)."""
        n, out_features, in_features = self.codes.shape
        if self.g_idx is not None:
            index = self.g_idx.repeat_interleave(self.source_rows, dim=1)
        else:
            index = (torch.arange(in_features, device=self.codes.device) // self.group_size).expand(n, out_features, -1)
        v = self.codes.to(torch.int32) - torch.gather(self.zeros, -1, index)
        return (v * torch.gather(self.scales, -1, index)).to(self.dense_dtype)


def int_groups(packing: WeightPacking, rows: Mapping[str, torch.Tensor], *,
               constant: Constant = build_each_time) -> IntGroups:
    """The integer codes, zero points and group scales of n experts (``IntGroups``), from the
    packing of an int format (GPTQ, AWQ, AutoRound, compressed-tensors int4 / int8, block INT8).

    Raises:
        ValueError: the packing's codes are not int, or it has a global scale or an
            intermediate rounding (no int format has)."""
    if packing.codes != "int" or packing.global_scale != "none" or packing.round_dtype is not None:
        raise ValueError(f"int_groups reads int packings without global scale or round dtype; got codes="
                         f"{packing.codes!r} global_scale={packing.global_scale!r} round_dtype={packing.round_dtype}")
    q = codes(packing, rows, constant=constant)
    q = (q.to(torch.uint8) if packing.packed_dim != "none" else q).contiguous()
    scales = scale_rows(packing, rows, constant=constant)
    zeros = zero_rows(packing, rows, constant=constant)
    if zeros is None:
        zeros = torch.full(scales.shape, packing.value_offset, dtype=torch.int32, device=scales.device)
    return IntGroups(q, zeros, scales, packing.group_size or packing.in_features, _g_idx(packing, rows),
                     packing.source_rows, packing.bits or 8, packing.dense_dtype)


class PackedFormat(ExpertFormat):
    """A format whose packed rows its ``packing`` describes: ``dequantize`` is ``dense_weight``
    of it (the dense module's orientation: W^T where ``transposed_experts`` is True), with the
    format's constants built once per device (``device_constant``). Subclasses say what the
    checkpoint holds (``pack``) and how it packs (``packing``); nothing else of a format unpacks."""

    def packing_of(self, tensor: QuantizedTensor) -> WeightPacking:
        """``packing(tensor)`` in the dense module's orientation, built once per tensor and kept
        (formats are immutable once bound)."""
        cache = self.__dict__.setdefault("_packings", {})
        if tensor not in cache:
            cache[tensor] = self.packing(tensor, transposed=self.transposed_experts is True)
        return cache[tensor]

    def dequantize(self, tensor: QuantizedTensor, packed: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Packed rows of n experts {name: [n, *spec.shape]} -> [n, *tensor.dense.shape] in
        ``tensor.dense.dtype``: ``dense_weight`` of ``packing_of(tensor)`` (a passthrough tensor
        is returned as given)."""
        if tensor.is_passthrough:
            return packed[tensor.dense.name]
        return dense_weight(self.packing_of(tensor), packed, constant=self.device_constant,
                            dense_transposed=self.transposed_experts is True)
