"""GPTQ and AWQ int4 experts: the library's dequantize equals the published dequantization.

transformers cannot load GPTQ/AWQ on this CPU machine (it needs GPTQModel kernels), so the
oracle is ``tests/support/int4_oracle.py``: the published packing loops and the dequantization from
the raw integers. Covered: desc_act's permuted g_idx, v1 zeros (stored z - 1) and v2, AWQ's
interleaved order, a Qwen3-style gate+up merge (two sources), rows independent, bad configs.
"""

from __future__ import annotations

import pytest
import torch

from support.int4_oracle import pack_awq, pack_gptq, random_int4
from pagedexperts.formats import format_for_config
from pagedexperts.formats.base import TensorSpec
from pagedexperts.formats.gptq.awq import AwqFormat
from pagedexperts.formats.gptq.gptq import GptqFormat

H, I_MOE = 64, 32  # hidden, expert intermediate: gate/up [I, H], down [H, I]


def _experts(pack, n, group_size, desc_act, seed, **kw):
    """n experts of a Qwen3 layer: raw ints per (expert, projection), and their packed rows."""
    gen = torch.Generator().manual_seed(seed)
    raw = [{p: random_int4(o, i, group_size, desc_act=desc_act, generator=gen, **kw)
            for p, (o, i) in {"gate": (I_MOE, H), "up": (I_MOE, H), "down": (H, I_MOE)}.items()} for _ in range(n)]
    packed = [{p: pack(w) for p, w in e.items()} for e in raw]
    return raw, packed


def _rows(fmt, packed, dtype):
    """Store rows of the layout: gate and up concatenated along each spec's concat_dim."""
    dense = (TensorSpec("gate_up_proj", (2 * I_MOE, H), dtype), TensorSpec("down_proj", (H, I_MOE), dtype))
    layout = fmt.layout(dense, sources={"gate_up_proj": 2})
    rows = {}
    for qt in layout.tensors:
        projs = ("gate", "up") if qt.dense.name == "gate_up_proj" else ("down",)
        for spec in qt.packed:
            ckpt = spec.name.removeprefix(qt.dense.name + "_")
            per_expert = [torch.cat([e[p][ckpt] for p in projs], dim=spec.concat_dim) for e in packed]
            rows[spec.name] = torch.stack(per_expert)
            assert rows[spec.name].shape[1:] == spec.shape and rows[spec.name].dtype == spec.dtype, spec
    return layout, rows


def _expected(raw, dtype):
    gate_up = torch.stack([torch.cat([e["gate"].dense(dtype), e["up"].dense(dtype)]) for e in raw])
    return {"gate_up_proj": gate_up, "down_proj": torch.stack([e["down"].dense(dtype) for e in raw])}


def _assert_equal(got, want):
    for name, w in want.items():
        diff = (got[name].double() - w.double()).abs()
        assert torch.equal(got[name], w), f"{name}: max diff {diff.max():.3g}, mean {diff.mean():.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("group_size", [16, 32])
def test_gptq_dequantize_equals_published(group_size, desc_act, dtype):
    raw, packed = _experts(pack_gptq, 3, group_size, desc_act, seed=group_size + desc_act, zero_min=1)
    fmt = format_for_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                                     "desc_act": desc_act, "sym": False}})
    assert isinstance(fmt, GptqFormat)
    layout, rows = _rows(fmt, packed, dtype)
    _assert_equal(layout.dequantize(rows), _expected(raw, dtype))
    # rows are independent: expert 2 alone equals expert 2 of the three
    alone = layout.dequantize({k: v[2:3] for k, v in rows.items()})
    assert torch.equal(alone["gate_up_proj"][0], layout.dequantize(rows)["gate_up_proj"][2])


def test_gptq_v2_zeros_stored_without_offset():
    raw, packed = _experts(lambda w: pack_gptq(w, v1=False), 2, 32, True, seed=7)
    fmt = format_for_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                     "desc_act": True, "checkpoint_format": "gptq_v2"}})
    layout, rows = _rows(fmt, packed, torch.bfloat16)
    _assert_equal(layout.dequantize(rows), _expected(raw, torch.bfloat16))


@pytest.mark.parametrize("version", ["gptq", "gptq_v2"])
def test_gptq_every_zero_point_nibble(version):
    """Zero points 0..15 in every weight, so every stored nibble 0..15 occurs: v1 stores z - 1
    as GPTQModel's save subtracts 0x11111111 from each word, so z = 0 borrows from the next
    nibble and only GPTQModel's per-word +0x11111111 (carries included) gives every z back;
    v2 stores z itself."""
    v1 = version == "gptq"
    gen = torch.Generator().manual_seed(5)
    raw = [{p: random_int4(o, i, 16, desc_act=False, generator=gen)
            for p, (o, i) in {"gate": (I_MOE, H), "up": (I_MOE, H), "down": (H, I_MOE)}.items()} for _ in range(2)]
    for e in raw:
        for w in e.values():
            w.z.copy_((torch.arange(w.z.numel()) % 16).view_as(w.z))
    packed = [{p: pack_gptq(w, v1=v1) for p, w in e.items()} for e in raw]
    qz = packed[0]["down"]["qzeros"]
    stored = ((qz.unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF).unique()
    if v1:  # z = 0 borrowed: the stored nibbles are not (z - 1) mod 16 one by one
        nibble_by_nibble = ((qz.unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=torch.int32)) + 1) & 0xF
        assert not torch.equal(nibble_by_nibble.flatten(-2), raw[0]["down"].z.to(torch.int32))
    else:
        assert stored.tolist() == list(range(16))
    fmt = format_for_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 16,
                                                     "desc_act": False, "sym": False, "checkpoint_format": version}})
    layout, rows = _rows(fmt, packed, torch.float32)
    _assert_equal(layout.dequantize(rows), _expected(raw, torch.float32))


def test_gptq_desc_act_g_idx_is_used():
    """A desc_act checkpoint dequantized as if g_idx were i // g must differ (guards indexing by g_idx)."""
    raw, packed = _experts(pack_gptq, 1, 16, True, seed=3, zero_min=1)
    layout, rows = _rows(GptqFormat(group_size=16, desc_act=True, zero_offset=1), packed, torch.float32)
    rows["gate_up_proj_g_idx"] = (torch.arange(2 * H) % H // 16).to(torch.int32).unsqueeze(0)
    assert not torch.equal(layout.dequantize(rows)["gate_up_proj"], _expected(raw, torch.float32)["gate_up_proj"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [16, 32])
def test_awq_dequantize_equals_published(group_size, dtype):
    raw, packed = _experts(pack_awq, 3, group_size, False, seed=group_size)
    fmt = format_for_config({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                                     "zero_point": True, "version": "gemm"}})
    assert isinstance(fmt, AwqFormat)
    layout, rows = _rows(fmt, packed, dtype)
    _assert_equal(layout.dequantize(rows), _expected(raw, dtype))


def test_expert_bytes_int4_vs_bf16():
    """Qwen3-30B-A3B expert (H 2048, I 768), group 128: int4 formats move ~0.26x of bf16."""
    dense = (TensorSpec("gate_up_proj", (2 * 768, 2048), torch.bfloat16), TensorSpec("down_proj", (2048, 768), torch.bfloat16))
    bf16 = 3 * 2048 * 768 * 2
    gptq = GptqFormat(group_size=128, desc_act=False, zero_offset=1).layout(dense, sources={"gate_up_proj": 2})
    awq = AwqFormat(group_size=128).layout(dense, sources={"gate_up_proj": 2})
    # hand count: int4 weights + fp16 scales [G, O] + int4 zeros [G, O/8] (+ int32 g_idx [I])
    weights, scales = 3 * 2048 * 768 // 2, 2 * (2 * 768 * 16 + 2048 * 6)
    zeros = 4 * (2 * 16 * 96 + 6 * 256)
    assert awq.expert_bytes == weights + scales + zeros
    assert gptq.expert_bytes == weights + scales + zeros + 4 * (2 * 2048 + 768)
    assert 0.25 < awq.expert_bytes / bf16 < 0.27 and 0.25 < gptq.expert_bytes / bf16 < 0.27


@pytest.mark.parametrize(
    "qc, message",
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size=0"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "awq", "w_bit": 3}, "bits=3"),
    ],
)
def test_unsupported_configs_are_refused(qc, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        format_for_config({"quantization_config": qc})


def test_shapes_that_do_not_pack_are_refused():
    spec = TensorSpec("down_proj", (H, 36), torch.bfloat16)
    with pytest.raises(ValueError, match="in_features 36 is not a multiple of 8"):
        GptqFormat(group_size=-1, desc_act=False, zero_offset=1).pack(spec, sources=1, transposed=False)
    with pytest.raises(ValueError, match="in_features 36 is not a multiple of group_size 32"):
        AwqFormat(group_size=32).pack(spec, sources=1, transposed=False)
