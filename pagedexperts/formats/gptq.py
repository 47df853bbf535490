"""GPTQ int4 experts (AutoGPTQ / GPTQModel checkpoints, ``quant_method: gptq``).

Owns: recognising the format, the packed per-expert tensor specs, and the unpack + dequantize
of some experts' packed rows. Does not: read files, store, page, or quantize (GPTQ needs
calibration; ``quantize`` writes w4a16 instead).

On-disk layout (GPTQModel ``nn_modules/qlinear/__init__.py`` ``PackableQuantLinear.pack`` and
``dequantize_weight``; AutoGPTQ's ``QuantLinear`` before it), per expert projection
``experts.{j}.{gate,up,down}_proj`` of an nn.Linear weight [O, I], group size g, G = I / g:

- ``qweight`` int32 [I / 8, O]: q[i, o] (0..15) in bits ``4 * (i % 8)`` of word [i // 8, o]
  (packed along the INPUT dim);
- ``qzeros`` int32 [G, O / 8]: zero points z[grp, o] in bits ``4 * (o % 8)`` of word
  [grp, o // 8] (packed along the OUTPUT dim). ``checkpoint_format`` "gptq" (v1) stores
  z - 1 (GPTQModel's v1 -> v2 conversion adds 1 to each nibble, mod 16); "gptq_v2" stores z;
- ``scales`` float16 [G, O];
- ``g_idx`` int32 [I]: the group of each input channel; ``i // g`` without ``desc_act``, any
  permutation-derived grouping with it (act-order), so dequantization always indexes by it.

Dequantize: ``W^T[i, o] = scales[g_idx[i], o] * (q[i, o] - z[g_idx[i], o])`` in float16
(the integer difference is exact; one rounding in the product), transposed to [O, I] and
cast to the model's dtype. Symmetric GPTQ stores z = 8 like any other zero point.

Legend: n experts dequantized together, O output features, I input features, G groups.
"""

from __future__ import annotations

from typing import Mapping

import torch

from pagedexperts.formats.base import ExpertFormat, QuantizedTensor, TensorSpec
from pagedexperts.formats.packing import WeightPacking, int_packing

PACK_FACTOR = 8  # int4 values per int32 word
SCALE_DTYPE = torch.float16  # GPTQ checkpoints store float16 scales
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> offset added to stored zeros
_SHIFTS = tuple(4 * i for i in range(PACK_FACTOR))


def nibble_shifts(device) -> torch.Tensor:
    """int32 [8]: the bit offset of each int4 value in its word, on ``device``."""
    return torch.tensor(_SHIFTS, dtype=torch.int32, device=device)


def unpack_rows(packed: torch.Tensor, shifts: torch.Tensor | None = None) -> torch.Tensor:
    """int4 packed along dim -2: int32 [..., R / 8, C] -> int32 [..., R, C] in 0..15.
    ``shifts``: ``nibble_shifts`` on packed's device (built here when None)."""
    shifts = nibble_shifts(packed.device) if shifts is None else shifts
    nibbles = (packed.unsqueeze(-2) >> shifts.view(-1, 1)) & 0xF  # [..., R/8, 8, C]
    return nibbles.flatten(-3, -2)


def unpack_cols(packed: torch.Tensor, shifts: torch.Tensor | None = None) -> torch.Tensor:
    """int4 packed along dim -1: int32 [..., R, C / 8] -> int32 [..., R, C] in 0..15."""
    shifts = nibble_shifts(packed.device) if shifts is None else shifts
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    *,
    zero_offset: int,
    dtype: torch.dtype,
    shifts: torch.Tensor | None = None,
) -> torch.Tensor:
    """One projection of n experts -> dense [n, O, I] in ``dtype``.

    qweight int32 [n, I/8, O]; qzeros int32 [n, G, O/8]; scales [n, G, O]; g_idx int [n, I];
    ``zero_offset`` 1 for v1 checkpoints (stored z - 1), 0 for v2; ``shifts``: see ``unpack_rows``.
    """
    q = unpack_rows(qweight, shifts)  # [n, I, O]
    z = (unpack_cols(qzeros, shifts) + zero_offset) & 0xF  # [n, G, O]
    index = g_idx.long().unsqueeze(-1).expand(-1, -1, q.shape[-1])  # [n, I, O]
    z_i = torch.gather(z, 1, index)
    s_i = torch.gather(scales, 1, index)
    w = (q - z_i).to(scales.dtype) * s_i  # [n, I, O]
    return w.transpose(-1, -2).to(dtype)


class GptqFormat(ExpertFormat):
    """GPTQ int4 experts, any group size (or -1: one group), with or without desc_act."""

    name = "gptq"
    serialized_names = {"weight": ("qweight", "qzeros", "scales", "g_idx")}

    def __init__(self, *, group_size: int, desc_act: bool, zero_offset: int, scale_dtype: torch.dtype = SCALE_DTYPE) -> None:
        self.group_size = group_size  # -1: one group spanning I
        self.desc_act = desc_act  # informational: g_idx is always what groups the input channels
        self.zero_offset = zero_offset
        self.scale_dtype = scale_dtype  # the checkpoint's (``with_stored_dtypes``): dequantize computes in it

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        return bool(quantization_config) and quantization_config.get("quant_method") == "gptq"

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None) -> "GptqFormat":
        """Bind bits, group size, desc_act and checkpoint_format (``sym`` needs nothing: a
        symmetric checkpoint stores its zero points, 8, like any other).

        Raises:
            ValueError: bits other than 4, a group size that is not positive or -1, or a
                checkpoint_format other than gptq / gptq_v2 (e.g. marlin), naming the value.
        """
        qc = quantization_config or {}
        if qc.get("bits") != 4:
            raise ValueError(f"gptq checkpoint with bits={qc.get('bits')!r}: only 4 is supported")
        group_size = qc.get("group_size", 128)
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise ValueError(f"gptq checkpoint with group_size={group_size!r}: must be a positive int or -1")
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        if fmt not in CHECKPOINT_FORMATS:
            raise ValueError(f"gptq checkpoint_format={fmt!r}: only {sorted(CHECKPOINT_FORMATS)} are supported")
        return cls(group_size=group_size, desc_act=bool(qc.get("desc_act", False)), zero_offset=CHECKPOINT_FORMATS[fmt])

    def with_stored_dtypes(self, dtypes) -> "GptqFormat":
        """Bound to the dtype the checkpoint stores ``scales`` in (float16 as GPTQModel writes them;
        GPTQModel's ``dequantize_weight`` computes in the scales' dtype)."""
        stored = dtypes.get("scales")
        if stored is None or stored == self.scale_dtype:
            return self
        return type(self)(group_size=self.group_size, desc_act=self.desc_act, zero_offset=self.zero_offset,
                          scale_dtype=stored)

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """Specs of one dense [sources * O, I] expert tensor: each source's [I/8, O] qweight,
        [G, O/8] qzeros and [G, O] scales side by side along dim 1, g_idx [I] one after the
        other along dim 0.

        Raises:
            ValueError: transposed experts, I not a multiple of 8 or of the group size, or O
                not a multiple of 8.
        """
        if transposed:
            raise ValueError(f"{self.name}: experts stored transposed ([in, out], e.g. gpt-oss) are not supported")
        rows, in_features = dense.shape
        out_features = rows // sources
        group_size = in_features if self.group_size == -1 else self.group_size
        for what, size, unit in (("in_features", in_features, PACK_FACTOR), ("in_features", in_features, group_size),
                                 ("out_features", out_features, PACK_FACTOR)):
            if size % unit:
                raise ValueError(f"gptq expert {dense.name}: {what} {size} is not a multiple of {unit}")
        groups = in_features // group_size
        return (
            TensorSpec(f"{dense.name}_qweight", (in_features // PACK_FACTOR, rows), torch.int32, concat_dim=1),
            TensorSpec(f"{dense.name}_qzeros", (groups, rows // PACK_FACTOR), torch.int32, concat_dim=1),
            TensorSpec(f"{dense.name}_scales", (groups, rows), self.scale_dtype, concat_dim=1),
            TensorSpec(f"{dense.name}_g_idx", (sources * in_features,), torch.int32, concat_dim=0),
        )

    def dequantize(self, tensor: QuantizedTensor, packed: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Packed rows of n experts -> [n, *dense.shape]; each source on its own, then
        concatenated along dim 1 (the dense output dim)."""
        name = tensor.dense.name
        sources = next(p for p in tensor.packed if p.name == f"{name}_g_idx").shape[0] // tensor.dense.shape[1]
        shifts = self.device_constant("shifts", packed[f"{name}_qweight"].device, nibble_shifts)
        parts = [
            dequantize_gptq(qw, qz, s, g, zero_offset=self.zero_offset, dtype=tensor.dense.dtype, shifts=shifts)
            for qw, qz, s, g in zip(
                packed[f"{name}_qweight"].chunk(sources, dim=2),
                packed[f"{name}_qzeros"].chunk(sources, dim=2),
                packed[f"{name}_scales"].chunk(sources, dim=2),
                packed[f"{name}_g_idx"].chunk(sources, dim=1),
            )
        ]
        return parts[0] if sources == 1 else torch.cat(parts, dim=1)

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """qweight [K/8, N] (input-major), qzeros [G, N/8] (+ the v1 offset), scales [G, N]
        multiplied in float16. With ``desc_act`` the kernel reads g_idx per input column;
        without it, groups are ``k // group_size`` (GPTQ writes that g_idx;
        ``packing.g_idx_is_trivial`` checks a checkpoint's rows)."""
        name, specs = tensor.dense.name, {p.name: p for p in tensor.packed}
        in_features = tensor.dense.shape[1]
        return int_packing(tensor, weight=specs[f"{name}_qweight"], scale=specs[f"{name}_scales"], bits=4,
                           packed_dim="in", sources=specs[f"{name}_g_idx"].shape[0] // in_features,
                           group_size=in_features if self.group_size == -1 else self.group_size,
                           zero=specs[f"{name}_qzeros"], g_idx=specs[f"{name}_g_idx"] if self.desc_act else None,
                           transposed=True, zero_offset=self.zero_offset)
