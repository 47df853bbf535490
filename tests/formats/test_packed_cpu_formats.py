"""torch's CPU int4 / int8 kernel layouts from each format's rows (``formats.cpu_pack``).

The oracle: the raw integers and scales the published packing loops wrote (``int4_oracle``:
GPTQ v1 / v2 asymmetric, AWQ), or a checkpoint's codes, zero points and scales read by the
package's unpacker, multiplied out in float64 (``(q - z) * s``, never the format's rounded
dequantization): the kernel's x @ W^T over the converted rows in float32 must match it to float32
accuracy. And every format the kernels cannot take gets its reason, naming the limit.
"""

from __future__ import annotations

import pytest
import torch

from support.int4_oracle import pack_awq, pack_gptq, random_int4
from pagedexperts.formats import format_for_config
from pagedexperts.formats.base import TensorSpec
from pagedexperts.formats.cpu_pack import CpuPackedSlots, KernelTensor, packed_matmul, plan_layout, plan_tensor

H, I_MOE = 128, 64  # hidden, expert intermediate: gate/up [I, H], down [H, I]
REL_FP32 = 1e-5  # float32 kernel vs float64 product, relative to the output's peak


def _kernel(plan: KernelTensor, rows: dict, x: torch.Tensor, expert: int) -> torch.Tensor:
    """The one kernel call (``cpu_pack.packed_matmul``) over expert ``expert`` of ``rows`` converted."""
    got = plan.convert(rows)
    return packed_matmul(plan, got[plan.weight_name][expert], got[plan.scale_name][expert], x)


def _oracle_experts(pack, group_size: int, seed: int):
    """Two experts of a Qwen3 layer packed by ``pack``, their float64 weights [n, O, I] per dense
    tensor, and the layout rows (gate and up concatenated as the store holds them)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"gate": (I_MOE, H), "up": (I_MOE, H), "down": (H, I_MOE)}
    raw = [{p: random_int4(o, i, min(group_size, i), desc_act=False, generator=gen, zero_min=1) for p, (o, i) in shapes.items()}
           for _ in range(2)]
    packed = [{p: pack(w) for p, w in e.items()} for e in raw]

    def exact(w):
        g = w.g_idx.long()
        return (w.scales.double()[g] * (w.q - w.z[g]).double()).t()

    weights = {"gate_up_proj": torch.stack([torch.cat([exact(e["gate"]), exact(e["up"])]) for e in raw]),
               "down_proj": torch.stack([exact(e["down"]) for e in raw])}
    return packed, weights


def _rows(fmt, packed):
    dense = (TensorSpec("gate_up_proj", (2 * I_MOE, H), torch.float32), TensorSpec("down_proj", (H, I_MOE), torch.float32))
    layout = fmt.layout(dense, sources={"gate_up_proj": 2})
    rows = {}
    for qt in layout.tensors:
        projs = ("gate", "up") if qt.dense.name == "gate_up_proj" else ("down",)
        for spec in qt.packed:
            ckpt = spec.name.removeprefix(qt.dense.name + "_")
            rows[spec.name] = torch.stack([torch.cat([e[p][ckpt] for p in projs], dim=spec.concat_dim) for e in packed])
    return layout, rows


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got.double() - want).abs().max().item() / want.abs().max().item()
    assert err < REL_FP32, f"{what}: max relative diff {err:.3g}"


@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("name,pack,qc", [
    ("gptq-v1-asym", pack_gptq, {"quant_method": "gptq", "bits": 4, "desc_act": False, "sym": False}),
    ("gptq-v2-asym", lambda w: pack_gptq(w, v1=False),
     {"quant_method": "gptq", "bits": 4, "desc_act": False, "sym": False, "checkpoint_format": "gptq_v2"}),
    ("awq", pack_awq, {"quant_method": "awq", "bits": 4, "zero_point": True, "version": "gemm"}),
])
def test_int4_kernel_equals_published_weights(name, pack, qc, group_size):
    """Asymmetric zero points map to the kernel's float zero: (q - 8) s + (8 - z) s = (q - z) s."""
    packed, weights = _oracle_experts(pack, group_size, seed=group_size)
    layout, rows = _rows(format_for_config({"quantization_config": dict(qc, group_size=group_size)}), packed)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    for tensor in layout.tensors:
        plan = plan_tensor(layout.format, tensor, torch.float32)
        assert isinstance(plan, KernelTensor) and plan.kind == "int4", plan
        assert plan.group_size == min(group_size, plan.in_features), plan
        for e in range(2):
            xe = x if tensor.dense.name == "gate_up_proj" else x[:, :I_MOE].contiguous()
            _assert_close(_kernel(plan, rows, xe, e), xe.double() @ weights[tensor.dense.name][e].t(),
                          f"{name} {tensor.dense.name} expert {e}")


def _gptq(group_size: int, bits: int = 4):
    return format_for_config({"quantization_config": {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                                      "desc_act": False, "sym": False}})


@pytest.mark.parametrize("group_size,in_features,kernel", [(128, 64, (64, 1)), (256, 512, (256, 1)),
                                                           (512, 1024, (256, 2)), (96, 192, (32, 3))])
def test_format_group_of_kernel_groups_repeats_its_scale(group_size, in_features, kernel):
    """A format group that is several kernel groups (or spans all K) runs at the largest kernel
    group size dividing it and K, its scale and zero repeated: checked against the codes, zero
    points and scales the unpacker reads, multiplied out in float64."""
    from pagedexperts.formats.unpack import int_groups

    fmt = _gptq(group_size)
    tensor = fmt.layout((TensorSpec("down_proj", (32, in_features), torch.float32),)).tensors[0]
    plan = plan_tensor(fmt, tensor, torch.float32)
    assert (plan.group_size, plan.repeat) == kernel
    gen = torch.Generator().manual_seed(group_size)
    rows = {s.name: torch.randint(-2**31, 2**31 - 1, (1, *s.shape), generator=gen, dtype=torch.int64).to(s.dtype)
            if s.dtype == torch.int32 else torch.rand((1, *s.shape), generator=gen).to(s.dtype) + 0.5 for s in tensor.packed}
    rows["down_proj_g_idx"] = (torch.arange(in_features) // group_size).to(torch.int32).unsqueeze(0)
    g = int_groups(fmt.packing_of(tensor), rows)
    index = torch.arange(in_features) // group_size
    w = (g.codes[0].double() - g.zeros[0][:, index].double()) * g.scales[0][:, index].double()
    x = torch.randn(3, in_features, generator=gen)
    _assert_close(_kernel(plan, rows, x, 0), x.double() @ w.t(), f"group {group_size} of {in_features}")


def test_int8_codes_and_scales():
    """Per-channel int8 (GPTQ 8-bit, group = K): codes minus the stored zero 128, one scale per row."""
    gen = torch.Generator().manual_seed(0)
    fmt = format_for_config({"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": -1,
                                                     "desc_act": False, "sym": True}})
    dense = (TensorSpec("down_proj", (H, I_MOE), torch.float32),)
    layout = fmt.layout(dense)
    tensor = layout.tensors[0]
    plan = plan_tensor(fmt, tensor, torch.float32)
    assert plan.kind == "int8"
    q = torch.randint(0, 256, (I_MOE, H), generator=gen)  # [I, O]: GPTQ input-major
    words = torch.zeros(I_MOE // 4, H, dtype=torch.int64)
    for j in range(4):
        words |= q[j::4] << (8 * j)
    rows = {"down_proj_qweight": words.to(torch.int32).unsqueeze(0)}
    zero_words = torch.full((1, H // 4), 0x7F7F7F7F, dtype=torch.int64)  # v1 stores z - 1 = 127
    rows["down_proj_qzeros"] = zero_words.to(torch.int32).unsqueeze(0)
    scales = torch.rand(1, H, generator=gen).to(torch.float16) + 0.5
    rows["down_proj_scales"] = scales.unsqueeze(0)
    rows = {s.name: rows[s.name] if s.name in rows else torch.zeros((1, *s.shape), dtype=s.dtype) for s in tensor.packed}
    x = torch.randn(3, I_MOE, generator=gen)
    want = x.double() @ ((q - 128).double().t() * scales.double().t()).t()
    _assert_close(_kernel(plan, rows, x, 0), want, "gptq int8")


@pytest.mark.parametrize("zero,low,high,fits", [
    (128, 0, 255, True),  # codes minus zero point in [-128, 127]: the int8 kernel's range
    (127, 0, 255, False),  # 255 - 127 = +128
    (127, 0, 254, True),  # +127
    (129, 0, 255, False),  # 0 - 129 = -129
    (129, 1, 255, True),  # -128
])
def test_asymmetric_int8_rows_fit_the_kernel_or_are_refused(zero, low, high, fits):
    """Per-channel asymmetric int8 (GPTQ 8-bit, sym false, one zero point per row): torch's int8
    kernel computes q * s, so q - z must be an int8; a row whose code minus zero point reaches
    +128 (or -129) is refused naming the tensor, one at the limit is computed exactly."""
    gen = torch.Generator().manual_seed(1)
    fmt = format_for_config({"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": -1,
                                                     "desc_act": False, "sym": False}})
    tensor = fmt.layout((TensorSpec("down_proj", (H, I_MOE), torch.float32),)).tensors[0]
    plan = plan_tensor(fmt, tensor, torch.float32)
    assert plan.kind == "int8"
    q = torch.randint(low, high + 1, (I_MOE, H), generator=gen)  # [I, O]: GPTQ input-major
    q[0, 0], q[1, 1] = low, high  # both ends reached
    words = torch.zeros(I_MOE // 4, H, dtype=torch.int64)
    for j in range(4):
        words |= q[j::4] << (8 * j)
    stored = (zero - 1) * 0x01010101  # v1 stores z - 1, four 8-bit zero points a word
    scales = torch.rand(1, H, generator=gen).to(torch.float16) + 0.5
    rows = {"down_proj_qweight": words.to(torch.int32).unsqueeze(0), "down_proj_scales": scales.unsqueeze(0),
            "down_proj_qzeros": torch.full((1, 1, H // 4), stored, dtype=torch.int64).to(torch.int32)}
    rows = {s.name: rows[s.name] if s.name in rows else torch.zeros((1, *s.shape), dtype=s.dtype) for s in tensor.packed}
    if not fits:
        with pytest.raises(ValueError, match=r"down_proj: int8 codes minus their zero points leave \[-128, 127\]"):
            plan.convert(rows)
        return
    x = torch.randn(3, I_MOE, generator=gen)
    want = x.double() @ ((q - zero).double().t() * scales.double().t()).t()
    _assert_close(_kernel(plan, rows, x, 0), want, f"int8 zero point {zero}")


@pytest.mark.parametrize("qc,reason", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False}, "group of 16"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}, "activation order"),
    ({"quant_method": "gptq", "bits": 2, "group_size": 32, "desc_act": False}, "2-bit"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": False}, "group-wise int8"),
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}, "e4m3"),
])
def test_formats_the_kernels_cannot_take_say_why(qc, reason):
    fmt = format_for_config({"quantization_config": qc})
    dense = (TensorSpec("gate_up_proj", (2 * I_MOE, H), torch.bfloat16), TensorSpec("down_proj", (H, I_MOE), torch.bfloat16))
    plans = plan_layout(fmt.layout(dense, sources={"gate_up_proj": 2}), torch.bfloat16)
    assert isinstance(plans, str) and reason in plans, plans


def test_dense_and_odd_rows_say_why():
    assert "dense experts" in plan_layout(None, torch.float32)
    fmt = format_for_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                     "desc_act": False}})
    odd = fmt.layout((TensorSpec("down_proj", (40, 64), torch.float32),))
    assert "multiple of 16" in plan_layout(odd, torch.float32)


def test_slot_table_converts_at_page_in():
    """write_rows converts one expert into its slot, leaving the other slots as they were."""
    packed, weights = _oracle_experts(pack_awq, 32, seed=7)
    fmt = format_for_config({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32,
                                                     "zero_point": True, "version": "gemm"}})
    layout, rows = _rows(fmt, packed)
    plans = plan_layout(layout, torch.float32)
    slots = CpuPackedSlots(layout, plans, 3, "cpu")
    before = {name: table.clone() for name, table in slots.items()}  # uninitialised: whatever they hold
    slots.write_rows({n: r[1] for n, r in rows.items()}, 2, pinned=False)
    converted = {n: t[1] for p in plans for n, t in p.convert(rows).items()}
    for name, table in slots.items():
        assert torch.equal(slots.slot_rows[2][name], converted[name]) and torch.equal(table[2], converted[name]), name
        assert torch.equal(table[:2].view(torch.uint8), before[name][:2].view(torch.uint8)), name
