"""``formats.unpack``, the one interpreter of ``WeightPacking``: what no format's library test pins.

That ``dequantize`` (``unpack.dense_weight``) gives each format's published bits is tested per
format against its library or oracle (test_gptq_awq, test_w4a16, test_llmc_fp4_int8,
test_modelopt, test_fp8_mxfp4, test_ct_tool_layouts); the kernels against it in
test_fused_moe. Here, with values worked out by hand from the published layouts:

- ``int_groups``: codes, zero points and group scales whose ``W = (q - z[g]) * s[g]`` is the
  format's dequantize, bit for bit, for every integer fixture (act-order, per-source zero points,
  partial blocks, 2 / 4 / 8 bits);
- zero offsets: GPTQ v1 adds 1 to each 32-bit WORD (a field at 15 carries into the next),
  AutoRound's ``auto_gptq`` packing to each VALUE (15 becomes 16, no carry);
- AWQ's nibble order; e4m3 decoded as torch converts each of the 256 codes (NaN included);
  e2m1 code 8 is -0.0 for compressed-tensors and +0.0 for ModelOpt (its table);
- AutoRound NVFP4's value times the global scale's reciprocal before its block scale
  (``value_reciprocal``) and GPTQModel FP8's division by ``weight_scale_inv`` (``scale_op``).
"""

from __future__ import annotations

import pytest
import torch

from support.fused_fixtures import CASES, random_store, weight_tensors
from pagedexperts.formats.gptq.autoround import AutoRoundFormat
from pagedexperts.formats.gptq.autoround_fp import AutoRoundNvfp4Format
from pagedexperts.formats.gptq.awq import AwqFormat
from pagedexperts.formats.base import TensorSpec
from pagedexperts.formats.compressed_tensors.fp4 import CompressedTensorsNvfp4Format
from pagedexperts.formats.fp8_fp4.fp8_block import Fp8BlockFormat
from pagedexperts.formats.gptq.gptq import GptqFormat
from pagedexperts.formats.gptq.gptqmodel_fp8 import GptqModelFp8Format
from pagedexperts.formats.fp8_fp4.modelopt import ModelOptNvfp4Format
from pagedexperts.formats.unpack import codes, int_groups, values, zero_rows

INT_CASES = [name for name, case in CASES.items() if not case.transposed and all(
    case.fmt.packing(t).codes == "int" for t in weight_tensors(case).values())]


@pytest.mark.parametrize("name", INT_CASES)
def test_int_groups_is_the_formats_dequantize(name):
    case = CASES[name]
    store = random_store(case, 3)
    for proj, tensor in weight_tensors(case).items():
        packing = case.fmt.packing(tensor)
        groups = int_groups(packing, store)
        n, out_features, in_features = groups.codes.shape
        assert (n, out_features, in_features) == (3, *tensor.dense.shape), proj
        if packing.packed_dim == "none":  # int8 stored as is
            assert groups.codes.dtype == torch.int8 and not groups.zeros.any()
        else:
            assert groups.codes.dtype == torch.uint8 and int(groups.codes.max()) < 2 ** packing.bits
        assert groups.zeros.shape == groups.scales.shape and groups.zeros.shape[:2] == (3, out_features)
        assert (groups.g_idx is not None) == (packing.spec("g_idx") is not None)
        want = case.fmt.dequantize(tensor, {p.name: store[p.name] for p in tensor.packed})
        assert torch.equal(groups.dense(), want), f"{name} {proj}"


def test_int_groups_refuses_float_codes():
    case = CASES["fp8-block"]
    with pytest.raises(ValueError, match="codes='e4m3'"):
        int_groups(case.fmt.packing(weight_tensors(case)["down_proj"]), random_store(case, 1))


def _int4_tensor(fmt):
    """One [8, 8] weight of ``fmt`` (one group, one zero-point word per row of groups)."""
    return fmt.layout((TensorSpec("w", (8, 8), torch.float16),)).tensors[0]


def test_zero_offsets_gptq_v1_carries_per_word_autoround_adds_per_value():
    word = torch.tensor([[[0x0000003F]]], dtype=torch.int32)  # fields 0 = 15, 1 = 3, 2..7 = 0
    gptq = _int4_tensor(GptqFormat(group_size=8, zero_offset=1))
    rows = {"w_qzeros": word}
    # 0x3F + 0x11111111 = 0x11111150: field 0 wraps to 0 and carries, field 1 = 3 + 1 + 1
    assert zero_rows(GptqFormat(group_size=8, zero_offset=1).packing(gptq), rows)[0, :, 0].tolist() == \
        [0, 5, 1, 1, 1, 1, 1, 1]
    auto = _int4_tensor(AutoRoundFormat(bits=4, group_size=8, zero_offset=1))
    assert zero_rows(AutoRoundFormat(bits=4, group_size=8, zero_offset=1).packing(auto), rows)[0, :, 0].tolist() == \
        [16, 4, 1, 1, 1, 1, 1, 1]
    assert zero_rows(GptqFormat(group_size=8, zero_offset=0).packing(gptq), rows)[0, :, 0].tolist() == \
        [15, 3, 0, 0, 0, 0, 0, 0]


def test_awq_nibble_order():
    """AutoAWQ packs columns (0, 2, 4, 6, 1, 3, 5, 7) into nibbles 0..7 of a word: column c of
    the word whose nibble p holds value p reads ORDER.index(c)."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    word = sum(p << (4 * p) for p in range(8))  # nibble p holds p
    fmt = AwqFormat(group_size=8)
    tensor = _int4_tensor(fmt)
    rows = {"w_qweight": torch.full((1, 8, 1), word, dtype=torch.int32)}
    got = codes(fmt.packing(tensor), rows)  # [1, N, K]: column (output) n of every input row
    assert got[0, :, 0].tolist() == [order.index(c) for c in range(8)]


def test_e4m3_values_are_torchs_conversion_of_every_code():
    fmt = Fp8BlockFormat(block=(16, 16))
    tensor = fmt.layout((TensorSpec("w", (16, 16), torch.float32),)).tensors[0]
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(1, 16, 16)
    got = values(fmt.packing(tensor), {"w": every, "w_scale_inv": torch.ones(1, 1, 1)})
    want = every.to(torch.float32)
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2  # 0x7F, 0xFF
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])
    assert torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("fmt,negative", [(CompressedTensorsNvfp4Format(), True), (ModelOptNvfp4Format(torch.float32), False)])
def test_e2m1_code_8_sign_as_each_library(fmt, negative):
    """compressed-tensors' unpack multiplies magnitude 0 by -1 (-0.0); ModelOpt's table has +0."""
    tensor = fmt.layout((TensorSpec("w", (1, 16), torch.float32),)).tensors[0]
    packing = fmt.packing(tensor)
    rows = {spec.name: torch.ones((1, *spec.shape), dtype=torch.float32).to(spec.dtype) for _, spec in packing.tensors}
    rows[packing.spec("weight").name] = torch.full((1, 1, 8), 0x08, dtype=torch.uint8)  # codes 8 (low), 0 (high)
    got = values(packing, rows)[0, 0]
    assert got.tolist() == [0.0] * 16
    assert got.signbit().tolist() == [negative, False] * 8


def test_autoround_nvfp4_multiplies_the_value_by_the_reciprocal_first():
    """AutoRound's ``NVFP4QuantLinear``: ``(q * (1 / g)) * s`` in float32, 1 / g 0 where g is 0
    (``get_reciprocal``), not compressed-tensors' ``q * (s / g)``, which rounds apart here."""
    fmt = AutoRoundNvfp4Format()
    tensor = fmt.layout((TensorSpec("w", (4, 32), torch.float32),)).tensors[0]
    packing = fmt.packing(tensor)
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 4, 16), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(3, 4, 2, generator=gen) * 400 + 1).to(torch.float8_e4m3fn)
    glob = torch.tensor([[448 * 6 / 3.7], [1234.5], [0.0]])
    names = {role: spec.name for role, spec in packing.tensors}
    got = values(packing, {names["weight"]: packed, names["scale"]: scale, names["global_scale"]: glob})
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    code = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()  # low nibble first
    q = magnitudes[code & 7] * torch.where(code >= 8, -1.0, 1.0)
    reciprocal = torch.where(glob == 0, 0.0, 1.0 / glob).unsqueeze(-1)  # [3, 1, 1]
    assert torch.equal(got, q * reciprocal)
    s = scale.to(torch.float32).repeat_interleave(16, dim=-1)
    want = (q * reciprocal) * s
    assert torch.equal(fmt.dequantize(tensor, {names["weight"]: packed, names["scale"]: scale,
                                               names["global_scale"]: glob}), want)
    assert not torch.equal(want[:2], (q * (s / glob.unsqueeze(-1)))[:2])  # s / g would differ


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gptqmodel_fp8_divides_by_weight_scale_inv(dtype):
    """GPTQModel's ``TorchFP8Linear``: ``weight.to(D) / weight_scale_inv.to(D)`` per row, in the
    model's dtype D; a multiplication by the reciprocal rounds apart here."""
    fmt = GptqModelFp8Format()
    tensor = fmt.layout((TensorSpec("w", (8, 32), dtype),)).tensors[0]
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(2, 8, 32, generator=gen) * 100).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 8, generator=gen) * 1000 + 0.5
    want = weight.to(dtype) / scale_inv.to(dtype).unsqueeze(-1)
    assert torch.equal(fmt.dequantize(tensor, {"w": weight, "w_scale_inv": scale_inv}), want)
    assert not torch.equal(want, weight.to(dtype) * (1 / scale_inv.to(dtype)).unsqueeze(-1))
