"""``bench/cpu_kernels.py`` measures what it says: each candidate CPU kernel route computes x @ W^T
of the weight it was given (checked against an independent float64 computation of the route's
own arithmetic), its row-independence check tells a per-tensor activation scale from a per-row
one, and the per-token estimate adds the model's matmuls as stated (4 layers of q, k, v, o and 8
x (gate_up + down), plus lm_head)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import cpu_kernels as ck  # noqa: E402

N, K = 64, 256


def _weight(group_size: int = 128) -> tuple[torch.Tensor, ck.IntWeight]:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.02
    return w, ck.quantize_int4(w, group_size)


def _route(name: str) -> ck.Route:
    return next(r for r in ck.ROUTES if r.name == name)


def _bf16_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """y (bf16) is ref (float64) rounded once to bf16, up to one bf16 step of fp32 rounding slack."""
    step = ref.abs().clamp_min(1e-30) * 2.0 ** -7
    diff = (y.double() - ref).abs()
    assert bool((diff <= step).all()), f"max diff {float(diff.max()):.3g}, mean {float(diff.mean()):.3g}"


def test_int4_quantization_round_trips_its_codes():
    w, w4 = _weight(32)
    assert w4.codes.dtype == torch.uint8 and int(w4.codes.max()) <= 15 and w4.scales.shape == (N, K // 32)
    # symmetric int4: |w - dequantized| <= half a step of its group
    step = w4.scales.repeat_interleave(32, 1)
    assert bool(((w - w4.dequantize()).abs() <= step / 2 + 1e-7).all())


def test_int_mm_rows_is_per_row_int8_times_per_channel_int8():
    _, w4 = _weight()
    x = ck.inputs(5, K, 1)
    p = ck.prep_int8(w4)
    xf = x.double()
    sx = xf.abs().amax(1, keepdim=True) / 127
    xq = torch.round(xf / sx)
    ref = (xq @ p["w"].double().t()) * sx * p["s"].double()
    _bf16_close(ck.mm_int_rows(x, p), ref)
    _bf16_close(ck.mm_onednn_rows(x, ck.prep_onednn(w4)), ref)


def test_groups_routes_are_int4_codes_times_per_group_int8():
    _, w4 = _weight()
    x = ck.inputs(3, K, 1, outliers=True)
    xf = x.double().view(3, K // 128, 128)
    sx = xf.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(xf / sx)  # [M, G, 128]
    codes = (w4.codes.double() - 8).view(N, K // 128, 128)  # [N, G, 128]
    ref = torch.einsum("mgk,ngk->mgn", xq, codes)
    ref = (ref * sx * w4.scales.double().t()).sum(1)
    _bf16_close(ck.mm_int_groups(x, ck.prep_int8_groups(w4)), ref)
    _bf16_close(ck.mm_onednn_groups(x, ck.prep_onednn(w4, groups=True)), ref)


@pytest.mark.parametrize("name", [r.name for r in ck.ROUTES if r.shapes is None or "gate_up" in r.shapes])
def test_every_route_computes_x_times_w_transposed(name):
    route = _route(name)
    _, w4 = _weight(route.group_size)
    x = ck.inputs(1, K, 2)
    ref = x.double() @ w4.dequantize().double().t()
    err = float((route.run(x, route.prep(w4)).double() - ref).norm() / ref.norm())
    assert err < 0.05, f"{name}: relative error {err:.3g}"


def test_row_independence_check_tells_per_tensor_from_per_row():
    _, w4 = _weight()
    per_tensor, per_row = ck.Result(), ck.Result()
    ck.check_route(_route("fbgemm dynamic (per-tensor x)"), w4, None, per_tensor)
    ck.check_route(_route("_int_mm rows"), w4, None, per_row)
    assert per_tensor.rows_independent.startswith("no") and per_row.rows_independent == "yes"
    assert per_row.thread_invariant == "yes" and per_row.err4[1] > per_row.err4[0]  # outliers cost accuracy


def test_estimate_adds_the_models_matmuls():
    cost_us = {"q": 400.0, "kv": 50.0, "o": 300.0, "gate_up": 30.0, "down": 20.0}
    results, med = {}, {}
    for shape, us in cost_us.items():
        for route, factor in (("bf16 linear", 2.0), ("int4pack g128", 1.0)):
            results[(shape, route, 1)] = ck.Result(cold={1: [us * factor, us * factor + 7, us * factor + 1]})
            med[(shape, route)] = us * factor + 1  # the median of the three samples
    line = next(s for s in ck.estimates(results) if s.startswith("- today"))
    bf16 = {s: med[(s, "bf16 linear")] for s in cost_us}
    int4 = {s: med[(s, "int4pack g128")] for s in cost_us}
    layer_us = bf16["q"] + 2 * bf16["kv"] + bf16["o"] + 8 * (int4["gate_up"] + int4["down"])
    total_ms = (4 * layer_us + bf16["q"]) / 1e3
    assert line.startswith(f"- today: bf16 attention + lm_head, int4pack experts: {total_ms:.2f} ms")
