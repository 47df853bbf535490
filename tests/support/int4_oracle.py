"""Independent GPTQ and AWQ int4 packing and dequantization: the tests' oracle.

Written from the published reference code, as loops over words, not from the library:
- GPTQ: GPTQModel ``PackableQuantLinear.pack`` (AutoGPTQ ``QuantLinear.pack`` before it):
  ``qweight[i // 8, o] |= q[i, o] << 4 * (i % 8)``; ``qzeros[g, o // 8] |= z[g, o] << 4 * (o % 8)``,
  then for checkpoint_format "gptq" (v1) ``qzeros -= 0x11111111`` per 32-bit word, borrows included
  (GPTQModel ``utils/model.py`` ``convert_gptq_v2_to_v1_format_module``); ``W[o, i] = scales[g_idx[i], o] * (q[i, o] -
  z[g_idx[i], o])``.
- AWQ: AutoAWQ ``WQLinear_GEMM.from_linear``: ``qweight[i, c] |= q[i, 8c + order[p]] << 4p``
  with ``order = [0, 2, 4, 6, 1, 3, 5, 7]``, qzeros the same without offset; ``W[o, i] =
  (q[i, o] - z[i // g, o]) * scales[i // g, o]``.
The oracle dequantizes from the raw integers it packed (never from the packed words), in
float64 with one final rounding to float16, which equals float16's correctly rounded product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass(frozen=True)
class Int4Weight:
    """Raw quantized weight of one nn.Linear [O, I]: q [I, O] and z [G, O] in 0..15, scales
    float16 [G, O], g_idx [I] (the group of each input channel)."""

    q: torch.Tensor
    z: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The oracle's dense weight [O, I] in ``dtype``."""
        g = self.g_idx.long()
        w = self.scales.double()[g] * (self.q - self.z[g]).double()
        return w.to(torch.float16).t().to(dtype)


def group_index(in_features: int, group_size: int, *, desc_act: bool, generator) -> torch.Tensor:
    """g_idx [I] int32: input channel -> its group. Without desc_act channel k is in group
    k // group_size; with it (act-order) channel perm[k] is, perm a random permutation drawn
    from ``generator``."""
    g_idx = (torch.arange(in_features) // group_size).to(torch.int32)
    if not desc_act:
        return g_idx
    perm = torch.randperm(in_features, generator=generator)
    out = torch.empty(in_features, dtype=torch.int32)
    out[perm] = g_idx
    return out


def random_int4(out_features: int, in_features: int, group_size: int, *, desc_act: bool, generator,
                zero_min: int = 0) -> Int4Weight:
    """Random ints and scales; with desc_act, g_idx comes from a random permutation of the
    input channels (act-order: channel perm[k] falls in group k // group_size)."""
    groups = in_features // group_size
    q = torch.randint(0, 16, (in_features, out_features), generator=generator)
    z = torch.randint(zero_min, 16, (groups, out_features), generator=generator)
    scales = (torch.rand(groups, out_features, generator=generator) * 0.02 + 1e-3).to(torch.float16)
    g_idx = group_index(in_features, group_size, desc_act=desc_act, generator=generator)
    return Int4Weight(q, z, scales, g_idx)


def _to_int32(words: list[list[int]]) -> torch.Tensor:
    """uint32 words -> int32 tensor (two's complement reinterpretation)."""
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words], dtype=torch.int32)


def pack_gptq(w: Int4Weight, *, v1: bool = True) -> dict[str, torch.Tensor]:
    """GPTQ checkpoint tensors of one weight: qweight [I/8, O], qzeros [G, O/8], scales, g_idx."""
    in_features, out_features = w.q.shape
    q = w.q.tolist()
    qweight = [[0] * out_features for _ in range(in_features // 8)]
    for row in range(in_features // 8):
        for j in range(8):
            for o in range(out_features):
                qweight[row][o] |= q[row * 8 + j][o] << (4 * j)
    zeros = w.z.tolist()
    qzeros = [[0] * (out_features // 8) for _ in range(len(zeros))]
    for g, zrow in enumerate(zeros):
        for col in range(out_features // 8):
            for j in range(8):
                qzeros[g][col] |= (zrow[col * 8 + j] & 0xF) << (4 * j)
            if v1:  # GPTQModel's v2 -> v1 save: minus 1 in every nibble as ONE word subtraction (borrows included)
                qzeros[g][col] = (qzeros[g][col] - 0x11111111) & 0xFFFFFFFF
    return {"qweight": _to_int32(qweight), "qzeros": _to_int32(qzeros), "scales": w.scales.clone(),
            "g_idx": w.g_idx.clone()}


def pack_awq(w: Int4Weight) -> dict[str, torch.Tensor]:
    """AWQ GEMM checkpoint tensors of one weight: qweight [I, O/8], qzeros [G, O/8], scales."""

    def pack(values: list[list[int]]) -> torch.Tensor:
        cols = len(values[0]) // 8
        words = [[0] * cols for _ in values]
        for r, row in enumerate(values):
            for c in range(cols):
                for p in range(8):
                    words[r][c] |= row[c * 8 + AWQ_ORDER[p]] << (4 * p)
        return _to_int32(words)

    return {"qweight": pack(w.q.tolist()), "qzeros": pack(w.z.tolist()), "scales": w.scales.clone()}


def rtn_int4(weight: torch.Tensor, group_size: int, *, desc_act: bool, generator, symmetric: bool = False) -> Int4Weight:
    """Round-to-nearest int4 of an nn.Linear weight [O, I] (the oracle's own, for checkpoints
    whose model still computes something sensible). With desc_act the groups are formed over a
    random permutation of the input channels, as act-order GPTQ does; zero points are kept in
    1..15 so v1's stored ``z - 1`` stays non-negative. ``symmetric``: z = 8 everywhere and
    scale = amax / 7, as GPTQModel's ``sym=True`` stores it."""
    out_features, in_features = weight.shape
    g_idx = group_index(in_features, group_size, desc_act=desc_act, generator=generator)
    w = weight.double().t()  # [I, O]
    groups = in_features // group_size
    lo = torch.stack([w[g_idx == g].amin(0) for g in range(groups)]).clamp(max=0)  # [G, O]
    hi = torch.stack([w[g_idx == g].amax(0) for g in range(groups)]).clamp(min=0)
    if symmetric:
        scales = (torch.maximum(-lo, hi) / 7).clamp(min=1e-4).to(torch.float16)
        z = torch.full_like(lo, 8, dtype=torch.long)
    else:
        scales = ((hi - lo) / 15).clamp(min=1e-4).to(torch.float16)
        z = torch.round(-lo / scales.double()).clamp(1, 15).long()
    q = (torch.round(w / scales.double()[g_idx.long()]) + z[g_idx.long()]).clamp(0, 15).long()
    return Int4Weight(q, z, scales, g_idx)
