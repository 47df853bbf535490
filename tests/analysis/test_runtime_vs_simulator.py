"""Runtime counters equal the simulator's for the same recorded routing, for every policy.

A tiny paged model (conftest: E=16, top_k=2, 2 MoE layers) generates with a ``TraceRecorder``
attached: two single prompts one after another, then a batch of two left-padded prompts. The
trace is replayed through ``simulate.replay`` with the same policy and K; per layer the hits,
misses, bytes paged, waves, union sizes, steps and tokens must be equal (issue 4's "LRU hit rate
from the simulator equals the runtime's own counters", and issue 8's for each policy).
"""

from __future__ import annotations

import pytest
import torch

from support.tiny import E, TOP_K, prompt
from pagedexperts.analysis import simulate as sim
from pagedexperts.loading.loader import load_model
from pagedexperts.analysis.recording import TraceRecorder
from pagedexperts.residency.policies import POLICIES
from pagedexperts.analysis.trace import load_trace
from support.recorded import FIELDS, generate, run_recorded



def assert_layers_equal(runtime, simulated) -> None:
    assert sorted(runtime) == sorted(simulated)
    for layer, rs in runtime.items():
        got = {f: getattr(simulated[layer], f) for f in FIELDS}
        want = {f: getattr(rs, f) for f in FIELDS}
        assert got == want, f"layer {layer}: simulator {got} != runtime {want}"


@pytest.mark.parametrize("num_resident", [TOP_K, 2 * TOP_K, E // 2])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_runtime_counters_equal_simulator(tiny_moe_dir, tmp_path, policy, num_resident):
    model = run_recorded(tiny_moe_dir, tmp_path / "t.npz", policy=policy, num_resident=num_resident)
    rt = model.pagedexperts
    trace = load_trace(tmp_path / "t.npz", num_experts=rt.num_experts, top_k=rt.top_k)
    everything, _ = sim.replay(sim.recorded_steps(trace), num_experts=rt.num_experts, num_resident=num_resident,
                               policy=policy, expert_bytes=rt.expert_bytes)
    runtime = rt.stats().layers
    assert sum(s.misses for s in runtime.values()) > 0
    assert_layers_equal(runtime, everything.layers)


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_runtime_prefetch_counters_equal_simulator(tiny_moe_dir, tmp_path, policy):
    """With --prefetch the recorded predictions, replayed, give the same hits, misses and the
    same prefetches issued / used / wasted per layer."""
    from pagedexperts.analysis.recording import record_predictions

    model, _ = load_model(tiny_moe_dir, num_resident=2 * TOP_K, policy=policy, prefetch=True)
    rec = TraceRecorder.attach(model)
    record_predictions(model, rec)
    for n, seed in enumerate((5, 6)):
        rec.request_ids = [n]
        ids = prompt(6 + 3 * n, seed).unsqueeze(0)
        generate(model, ids, torch.ones_like(ids), new_tokens=16)
    rec.save(tmp_path / "p.npz")
    rt = model.pagedexperts
    trace = load_trace(tmp_path / "p.npz")
    assert "prefetch" in trace.meta.extras
    rep = sim.replay_prefetch(sim.recorded_steps(trace), num_experts=rt.num_experts, num_resident=2 * TOP_K,
                              policy=policy, budget=TOP_K, expert_bytes=rt.expert_bytes, link_gbps=1.0,
                              compute_ms_per_layer=1.0)
    assert_layers_equal(rt.stats().layers, rep.stats.layers)
    for layer, pager in rt.runners.items():
        assert rep.prefetch[layer].as_dict() | dict(predict_s=0, issue_s=0) == \
            pager.prefetch_stats.as_dict() | dict(predict_s=0, issue_s=0), f"layer {layer}"
    assert sum(p.prefetch_stats.issued for p in rt.runners.values()) > 0
