"""The packed body's batched glue over any wave split: biased, gated experts driven directly.

``HostPackedStep`` over six experts' int4 weights in torch's CPU kernel layout (all resident),
routed entries of 40 tokens x top-2: one wave against the same experts in three waves (the
entries' outputs torch.equal, float32 and bfloat16), and against each entry computed alone
from the dequantized weights in float64 (bias, SiLU gate, bias), within the run dtype's rounding.
No format or checkpoint: the biased path (gpt-oss-like experts) has no int4 fixture the CPU
kernels take.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedexperts.paging.steps.contract import HostRouting
from pagedexperts.paging.steps.host_packed import HostPackedStep, PackedLayer, PackedProjection
from pagedexperts.residency.planner import Wave

E, H, I, GROUP, T, TOP_K = 6, 64, 32, 32, 40, 2


def _int4(n: int, k: int, gen: torch.Generator, dtype):
    """(packed [E, n, k/2], scales_and_zeros [E, k/GROUP, n, 2], dense float64 [E, n, k]):
    W = (q - 8) * scale + zero per (row, group), the kernel's own formula."""
    q = torch.randint(0, 16, (E, n, k), generator=gen, dtype=torch.int32)
    scale = (torch.rand((E, k // GROUP, n), generator=gen) * 0.05 + 0.01).to(dtype)
    zero = ((torch.rand((E, k // GROUP, n), generator=gen) - 0.5) * 0.02).to(dtype)
    packed = torch.stack([torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[e], 1) for e in range(E)])
    s = scale.double().repeat_interleave(GROUP, dim=1).transpose(1, 2)  # [E, n, k]
    z = zero.double().repeat_interleave(GROUP, dim=1).transpose(1, 2)
    return packed, torch.stack([scale, zero], dim=-1).contiguous(), (q.double() - 8) * s + z


def _gate(out):
    gate, up = out.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _step(dtype, gen):
    up_w, up_s, up_dense = _int4(2 * I, H, gen, dtype)
    down_w, down_s, down_dense = _int4(H, I, gen, dtype)
    up_b, down_b = (torch.randn(E, 2 * I, generator=gen) * 0.1).to(dtype), (torch.randn(E, H, generator=gen) * 0.1).to(dtype)
    plan = SimpleNamespace(kind="int4", group_size=GROUP, dtype=dtype)
    # slot e holds expert e: the rows its kernels read, as ``CpuPackedSlots.slot_rows``
    tensors = {"up": up_w, "up.scales": up_s, "up_bias": up_b, "down": down_w, "down.scales": down_s, "down_bias": down_b}
    table = SimpleNamespace(slot_rows=[{name: t[e] for name, t in tensors.items()} for e in range(E)])
    step = HostPackedStep.__new__(HostPackedStep)
    step.setup = SimpleNamespace(slots=SimpleNamespace(kernel_tensors=lambda slots: table))
    step.layer = PackedLayer(PackedProjection(plan, "up", "up.scales"), PackedProjection(plan, "down", "down.scales"),
                             "up_bias", "down_bias", _gate, None)
    dense = (up_dense, up_b.double(), down_dense, down_b.double())
    return step, dense


def _entries(step, hidden, ids: np.ndarray, waves) -> torch.Tensor:
    work = step.begin(None, hidden, torch.from_numpy(ids), HostRouting(ids, waves))
    for w in range(len(waves)):
        step.run_wave(work, w)
    return work.entry_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_wave_split_gives_the_same_entries_and_the_dequantized_math(dtype):
    gen = torch.Generator().manual_seed(3)
    step, (up_dense, up_b, down_dense, down_b) = _step(dtype, gen)
    hidden = torch.randn(T, H, generator=gen).to(dtype)
    rng = np.random.default_rng(5)
    ids = np.stack([rng.permutation(E)[:TOP_K] for _ in range(T)])
    routed = sorted(set(ids.reshape(-1).tolist()))
    assert routed == list(range(E)) and len(set(np.bincount(ids.reshape(-1)).tolist())) > 1  # uneven rows
    one = (Wave(tuple(routed), tuple(routed), ()),)
    split = tuple(Wave(tuple(routed[i::3][::-1]), tuple(routed[i::3][::-1]), ()) for i in range(3))  # unsorted inside
    want = _entries(step, hidden, ids, one)
    got = _entries(step, hidden, ids, split)
    assert torch.equal(want, got), (want.float() - got.float()).abs().max()
    # each entry alone, in float64 from the dequantized weights
    x = hidden.double()
    ref = torch.empty(T * TOP_K, H, dtype=torch.float64)
    for s, e in enumerate(ids.reshape(-1).tolist()):
        out = x[s // TOP_K] @ up_dense[e].T + up_b[e]
        ref[s] = _gate(out) @ down_dense[e].T + down_b[e]
    err = (want.double() - ref).abs().max() / ref.abs().max()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), err
