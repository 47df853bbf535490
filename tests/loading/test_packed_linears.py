"""A quantized non-expert nn.Linear kept packed on a CPU (``loading.packed_linears``).

Oracle: the raw integers and scales the published GPTQ / AWQ packing loops wrote
(``int4_oracle``), multiplied out in float64 (``(q - z) * s``, never the format's rounded
dequantization). The module's forward must match x @ W^T to float32 accuracy in float32, equal
torch's kernel on the same converted data (torch.equal, any leading shape), and stay within the
kernel's rounding of the format's own dequantized module in bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from support.int4_oracle import pack_awq, pack_gptq, random_int4
from pagedexperts.formats import format_for_config
from pagedexperts.loading.packed_linears import PackedLinear, packed_linear

O, I = 64, 256  # a projection [out, in]
REL_FP32 = 1e-5


def _checkpoint(method: str, group_size: int, *, desc_act: bool = False, seed: int = 0):
    """(module format, serialized tensors of one Linear, its float64 weight [O, I])."""
    gen = torch.Generator().manual_seed(seed)
    w = random_int4(O, I, group_size, desc_act=desc_act, generator=gen, zero_min=1)
    qc = {"quant_method": method, "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": False}
    if method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    fmt = format_for_config({"quantization_config": qc})
    serialized = pack_awq(w) if method == "awq" else pack_gptq(w)
    g = w.g_idx.long()
    exact = (w.scales.double()[g] * (w.q - w.z[g]).double()).t()
    return fmt.linear_format("model.layers.0.self_attn.q_proj", qc), serialized, exact


@pytest.mark.parametrize("method,group_size", [("gptq", 128), ("gptq", 64), ("awq", 128), ("gptq", 256)])
def test_packed_linear_equals_the_exact_product(method, group_size):
    fmt, serialized, exact = _checkpoint(method, group_size)
    bias = torch.randn(O, generator=torch.Generator().manual_seed(1))
    module = packed_linear(fmt, (O, I), torch.float32, serialized, bias)
    assert isinstance(module, PackedLinear), module
    x = torch.randn(2, 3, I, generator=torch.Generator().manual_seed(2))
    got = module(x)
    want = x.double() @ exact.t() + bias.double()
    assert got.shape == (2, 3, O) and got.dtype == torch.float32
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < REL_FP32, f"{method} group {group_size}: relative error {err:.3g}"
    # the module is the kernel on the same packed data, whatever the leading shape
    flat = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, I), module.weight_packed, module.group_size,
                                                      module.scales)
    assert torch.equal(got, (flat + bias).reshape(2, 3, O))


def test_packed_linear_bfloat16_within_the_kernels_rounding_of_the_dequantized_module():
    """bfloat16: close to the format's own dequantized Linear (the reference rounds each weight
    to bfloat16, the kernel does not): within a few bfloat16 ulps of the output's scale."""
    fmt, serialized, exact = _checkpoint("gptq", 128, seed=3)
    module = packed_linear(fmt, (O, I), torch.bfloat16, serialized)
    dense = fmt.dequantize_linear(fmt.linear_tensor((O, I), torch.bfloat16), serialized)
    x = torch.randn(4, I, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got, ref = module(x), torch.nn.functional.linear(x, dense)
    assert got.dtype == torch.bfloat16
    scale = ref.float().abs().max()
    assert (got.float() - ref.float()).abs().max() <= 0.02 * scale
    assert (got.double() - x.double() @ exact.t()).abs().max() <= 0.02 * scale


def test_act_order_is_refused_with_its_reason():
    fmt, serialized, _ = _checkpoint("gptq", 64, desc_act=True)
    reason = packed_linear(fmt, (O, I), torch.float32, serialized)
    assert isinstance(reason, str) and "g_idx" in reason


def test_missing_tensor_names_it():
    fmt, serialized, _ = _checkpoint("gptq", 128)
    del serialized["scales"]
    with pytest.raises(ValueError, match="scales"):
        packed_linear(fmt, (O, I), torch.float32, serialized)


@pytest.mark.parametrize("plan_dtype,x_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                (torch.float32, torch.float16)])
def test_an_input_in_another_dtype_comes_back_in_its_dtype(plan_dtype, x_dtype):
    """The model may feed a float32-kept module's input in the run dtype, or the reverse: the
    module computes in its plan's dtype and returns the input's."""
    fmt, serialized, _ = _checkpoint("gptq", 128, seed=5)
    module = packed_linear(fmt, (O, I), plan_dtype, serialized)
    x = torch.randn(2, 5, I, generator=torch.Generator().manual_seed(6)).to(x_dtype)
    got = module(x)
    assert got.dtype == x_dtype and got.shape == (2, 5, O)
    assert torch.equal(got, module(x.to(plan_dtype)).to(x_dtype))  # computed in the plan's dtype


@pytest.mark.parametrize("scales_dtype", [torch.bfloat16, torch.float32])
def test_scales_stored_in_bfloat16_or_float32(scales_dtype):
    """A checkpoint's scales stored in bfloat16 or float32 (GPTQ's are float16): the module equals
    the exact product with those scales, and holds them in the run dtype."""
    gen = torch.Generator().manual_seed(7)
    w = random_int4(O, I, 128, desc_act=False, generator=gen, zero_min=1)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False}
    fmt = format_for_config({"quantization_config": qc}).linear_format("model.layers.0.self_attn.q_proj", qc)
    serialized = pack_gptq(w)
    noise = 1 + 1e-3 * torch.rand(serialized["scales"].shape, generator=gen)  # off float16's grid
    serialized["scales"] = (serialized["scales"].float() * noise).to(scales_dtype)
    g = w.g_idx.long()
    exact = (serialized["scales"].double()[g] * (w.q - w.z[g]).double()).t()
    module = packed_linear(fmt, (O, I), torch.float32, serialized)
    assert isinstance(module, PackedLinear), module
    assert module.scales.dtype == torch.float32
    x = torch.randn(3, I, generator=torch.Generator().manual_seed(8))
    want = x.double() @ exact.t()
    err = (module(x).double() - want).abs().max() / want.abs().max()
    assert err < REL_FP32, f"scales in {scales_dtype}: relative error {err:.3g}"
