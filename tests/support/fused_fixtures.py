"""Every expert format at tiny shapes, with random packed rows: the fused kernels' test cases.

A case is a format instance bound as a checkpoint would bind it (group sizes, zero points,
scale dtypes, act-order, per-source scales, partial blocks), the experts' dense specs (Qwen3's
[2I, H] / [H, I], or gpt-oss's transposed [H, 2I] / [I, H] with biases) and the model dtype.
``random_store`` fills every packed tensor of the layout with valid random bytes for its role
(any int4 / int8 / e2m1 code, e4m3 values without NaN, positive scales, act-order g_idx drawn
from a permutation): the kernels must reproduce the format's own ``dequantize`` of whatever a
checkpoint holds, so the bytes need not come from a quantizer.

Legend: E experts, H hidden, I expert intermediate, R rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from support.int4_oracle import group_index
from pagedexperts.formats.gptq.autoround import AutoRoundFormat
from pagedexperts.formats.gptq.autoround_fp import AutoRoundFp8Format, AutoRoundMxfp4Format, AutoRoundNvfp4Format
from pagedexperts.formats.gptq.awq import AwqFormat
from pagedexperts.formats.base import ExpertFormat, ExpertLayout, TensorSpec
from pagedexperts.formats.compressed_tensors.w4a16 import CompressedTensorsW4A16Format
from pagedexperts.formats.compressed_tensors.fp4 import CompressedTensorsMxfp4Format, CompressedTensorsNvfp4Format
from pagedexperts.formats.compressed_tensors.fp8 import CompressedTensorsFp8Format
from pagedexperts.formats.compressed_tensors.int8 import CompressedTensorsInt8Format
from pagedexperts.formats.compressed_tensors.packed import (CompressedTensorsMixedPackedFormat, CompressedTensorsW8A16Format,
                                            PackedArgs)
from pagedexperts.formats.dense import DenseFormat
from pagedexperts.formats.fp8_fp4.fp8_block import Fp8BlockFormat
from pagedexperts.formats.gptq.gptq import GptqFormat
from pagedexperts.formats.gptq.gptqmodel_fp8 import GptqModelFp8Format
from pagedexperts.formats.fp8_fp4.int8_block import Int8BlockFormat
from pagedexperts.formats.fp8_fp4.modelopt import ModelOptFp8Format, ModelOptNvfp4Format
from pagedexperts.formats.fp8_fp4.mxfp4 import Mxfp4Format

E, TOP_K = 16, 2  # the synthetic experts layer of the fused kernels' tests
HIDDEN = 64
INTERMEDIATE = 32

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


@dataclass(frozen=True)
class FormatCase:
    """One format bound to a checkpoint's parameters, the model dtype and the experts' layout."""

    name: str
    fmt: ExpertFormat
    dtype: torch.dtype
    transposed: bool = False  # gpt-oss: dense experts [in, out] with biases
    hidden: int = HIDDEN
    intermediate: int = INTERMEDIATE

    def layout(self) -> ExpertLayout:
        h, i = self.hidden, self.intermediate
        if self.transposed:
            specs = (TensorSpec("gate_up_proj", (h, 2 * i), self.dtype), TensorSpec("gate_up_proj_bias", (2 * i,), self.dtype),
                     TensorSpec("down_proj", (i, h), self.dtype), TensorSpec("down_proj_bias", (h,), self.dtype))
            return self.fmt.layout(specs, transposed=True)
        specs = (TensorSpec("gate_up_proj", (2 * i, h), self.dtype), TensorSpec("down_proj", (h, i), self.dtype))
        return self.fmt.layout(specs, sources={"gate_up_proj": 2})


def _cases() -> dict[str, FormatCase]:
    gptq = lambda **kw: GptqFormat(**kw)  # noqa: E731
    cases = [
        FormatCase("dense-fp32", DenseFormat(), f32),
        FormatCase("dense-bf16", DenseFormat(), bf16),
        FormatCase("dense-fp16", DenseFormat(), f16),
        FormatCase("dense-gpt-oss", DenseFormat(), bf16, transposed=True),
        FormatCase("fp8-block", Fp8BlockFormat(block=(16, 32)), bf16),
        FormatCase("int8-block", Int8BlockFormat(block=(24, 32)), bf16),  # partial blocks per source
        FormatCase("ct-fp8-tensor-channel", CompressedTensorsFp8Format(
            {"gate_up_proj": ("tensor", None, f32), "down_proj": ("channel", None, bf16)}), bf16),
        FormatCase("ct-fp8-block", CompressedTensorsFp8Format(
            {"gate_up_proj": ("block", (24, 16), f32), "down_proj": ("block", (16, 16), f32)}), f16),
        FormatCase("ct-mxfp8", CompressedTensorsFp8Format(
            {"gate_up_proj": ("group", (1, 32), torch.uint8), "down_proj": ("group", (1, 32), torch.uint8)}), bf16),
        FormatCase("w8a8-int8", CompressedTensorsInt8Format(scale_dtype=bf16), f32),  # experts in the scales' dtype
        FormatCase("w4a16-sym", CompressedTensorsW4A16Format(group_size=16, symmetric=True, scale_dtype=bf16), bf16),
        FormatCase("w4a16-asym", CompressedTensorsW4A16Format(group_size=32, symmetric=False, scale_dtype=f16), f16),
        FormatCase("w8a16", CompressedTensorsW8A16Format(
            {"gate_up_proj": PackedArgs(8, None, True, False), "down_proj": PackedArgs(8, 16, False, False)},
            scale_dtype=bf16), bf16),
        FormatCase("ct-pack-mixed-g_idx", CompressedTensorsMixedPackedFormat(
            {"gate_up_proj": PackedArgs(4, 16, False, True), "down_proj": PackedArgs(4, 8, True, True)},
            scale_dtype=f16), f16),
        FormatCase("gptq-v1", gptq(group_size=16, desc_act=False, zero_offset=1), bf16),
        FormatCase("gptq-act-order", gptq(group_size=16, desc_act=True, zero_offset=1), f16),
        FormatCase("gptq-v2-channel", gptq(group_size=-1, desc_act=False, zero_offset=0), f32),
        FormatCase("gptq-2bit", gptq(group_size=32, desc_act=False, zero_offset=1, bits=2), bf16),
        FormatCase("auto-round", AutoRoundFormat(bits=4, group_size=16, zero_offset=1), f16),  # + 1 per zero, no wrap
        FormatCase("awq", AwqFormat(group_size=16), bf16),
        # AutoRound's auto_round packing: zero points stored as they are (asymmetric), no g_idx
        FormatCase("auto-round-asym", AutoRoundFormat(group_size=16, bits=4, sym=False, zero_offset=0), f16),
        FormatCase("auto-round-asym-8bit", AutoRoundFormat(group_size=-1, bits=8, sym=False, zero_offset=0), bf16),
        FormatCase("nvfp4", CompressedTensorsNvfp4Format(static_input=True), bf16),
        FormatCase("ct-mxfp4", CompressedTensorsMxfp4Format(), bf16),
        FormatCase("modelopt-nvfp4", ModelOptNvfp4Format(bf16), bf16),
        FormatCase("modelopt-fp8", ModelOptFp8Format(bf16), f32),  # multiplied in the saved bf16
        FormatCase("mxfp4-gpt-oss", Mxfp4Format(), bf16, transposed=True),
        # AutoRound's FP exports: bfloat16 scales under a float32 model (multiplied in the scales' dtype),
        # a partial block per source, NVFP4's value times the global scale's reciprocal (rounds apart in
        # float32), MXFP4 in float32 then the model's dtype
        FormatCase("auto-round-fp8-channel", AutoRoundFp8Format(
            {"gate_up_proj": ("channel", None, bf16), "down_proj": ("tensor", None, bf16)}), f32),
        FormatCase("auto-round-fp8-block", AutoRoundFp8Format(
            {"gate_up_proj": ("block", (24, 32), bf16), "down_proj": ("block", (16, 16), bf16)}, block_scales=True), bf16),
        FormatCase("auto-round-nvfp4", AutoRoundNvfp4Format(static_input=True), f32),
        FormatCase("auto-round-mxfp4", AutoRoundMxfp4Format(), f16),
        # GPTQModel FP8: the value divided by its row's weight_scale_inv, in the model's dtype
        FormatCase("gptqmodel-fp8", GptqModelFp8Format(), bf16),
        FormatCase("gptqmodel-fp8-fp32", GptqModelFp8Format(), f32),
    ]
    return {c.name: c for c in cases}


CASES = _cases()


def weight_tensors(case: FormatCase) -> dict:
    """{"gate_up_proj": QuantizedTensor, "down_proj": ...}: the two projections' weights."""
    return {t.dense.name: t for t in case.layout().tensors if t.dense.name in ("gate_up_proj", "down_proj")}


def _role_of(case: FormatCase, name: str) -> str | None:
    for tensor in weight_tensors(case).values():
        for role, spec in case.fmt.packing(tensor, transposed=case.transposed).tensors:
            if spec.name == name:
                return role
    return None


def _random(spec: TensorSpec, role: str | None, n: int, gen: torch.Generator, case: FormatCase) -> torch.Tensor:
    """[n, *spec.shape] valid random content for ``spec`` in ``role`` (module docstring)."""
    shape = (n, *spec.shape)
    if spec.dtype == torch.int32 and role in ("weight", "zero"):
        return torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int32)
    if spec.dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    if spec.dtype == torch.uint8:  # e2m1 pairs (any byte) or E8M0 scales 2**-9 .. 2**-4
        low, high = (0, 256) if role == "weight" else (118, 124)
        return torch.randint(low, high, shape, generator=gen, dtype=torch.uint8)
    if spec.dtype == torch.float8_e4m3fn:
        if role == "weight":
            return (torch.randn(shape, generator=gen) * 3).to(spec.dtype)
        return (torch.rand(shape, generator=gen) + 0.25).to(spec.dtype)  # NVFP4 group scales
    if spec.name.endswith("_g_idx"):  # stored whether or not the packing reads it (GPTQ without desc_act)
        return _g_idx(spec, n, gen, case)
    if spec.dtype == torch.int64:  # compressed-tensors weight_shape
        return torch.zeros(shape, dtype=torch.int64)
    if role == "global_scale":
        value = (16.0, 64.0) if isinstance(case.fmt, CompressedTensorsNvfp4Format) else (0.005, 0.02)
        return (torch.rand(shape, generator=gen) * (value[1] - value[0]) + value[0]).to(spec.dtype)
    if role == "scale":  # weights of about 0.01 .. 0.1 whatever the codes' range
        packing = case.fmt.packing(weight_tensors(case)["down_proj"], transposed=case.transposed)
        if packing.scale_op == "divide":  # GPTQModel's weight_scale_inv: 448 / amax of the row
            return ((torch.rand(shape, generator=gen) + 0.5) * 1000).to(spec.dtype)
        wide = dict(packing.tensors)["weight"].dtype == torch.int8 or case.fmt.name in ("w8a16",)
        return ((torch.rand(shape, generator=gen) + 0.5) * (0.001 if wide else 0.01)).to(spec.dtype)
    return (torch.randn(shape, generator=gen) * 0.1).to(spec.dtype)  # dense weights, biases, input scales


def _g_idx(spec: TensorSpec, n: int, gen: torch.Generator, case: FormatCase) -> torch.Tensor:
    """Act-order g_idx rows [n, sources * K]: per source a grouping drawn from a permutation."""
    fmt = case.fmt
    dense = next(t.dense for t in case.layout().tensors if any(p == spec for p in t.packed))
    in_features = dense.shape[1]
    group = fmt.group_size if isinstance(fmt, GptqFormat) else fmt.args[dense.name].group_size
    desc_act = not isinstance(fmt, GptqFormat) or fmt.desc_act
    sources = spec.shape[0] // in_features
    rows = [torch.cat([group_index(in_features, in_features if group == -1 else group, desc_act=desc_act,
                                   generator=gen) for _ in range(sources)]) for _ in range(n)]
    return torch.stack(rows)


def random_store(case: FormatCase, num_rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """{packed name: [num_rows, ...]} for every packed spec of the case's layout."""
    gen = torch.Generator().manual_seed(seed)
    return {spec.name: _random(spec, _role_of(case, spec.name), num_rows, gen, case)
            for spec in case.layout().packed_specs}
