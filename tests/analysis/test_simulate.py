"""simulate: Belady is optimal and never below LRU, batching, uniform reference, CLI, errors."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from pagedexperts.residency import planner
from pagedexperts.residency.eviction import EvictionPolicy, LRUPolicy
from pagedexperts.analysis import simulate as sim
from pagedexperts.cli import main
from pagedexperts.stats.accounting import LayerStats
from pagedexperts.analysis.trace import load_trace
from support.trace_fixtures import TRACES, needs_real_traces
from support import paths

ROOT = str(paths.ROOT)
SYNTHETIC = os.path.join(ROOT, "tests", "data", "synthetic_trace.npz")
REAL = ["qwen15moe_a27b_layer0_gsm8k.jsonl", "olmoe_1b7b_layer0_gsm8k.jsonl"]


def _steps(unions_per_step, layer=0):
    """SimSteps from per-step lists of routed ids (top_k 1: one row per id)."""
    return [sim.SimStep(phase="decode", tokens=len(u), ids={layer: np.asarray(u, dtype=np.int64).reshape(-1, 1)})
            for u in unions_per_step]


def _misses(steps, *, num_experts, num_resident, policy):
    stats, _ = sim.replay(steps, num_experts=num_experts, num_resident=num_resident, policy=policy)
    return stats.total().misses


# ---- Belady -------------------------------------------------------------------------------


def test_belady_evicts_furthest_next_use():
    # K=2: C(2) evicts B(1, next used at step 4) rather than A (0, used at step 3); LRU evicts A.
    steps = _steps([[0], [1], [2], [0], [1]])
    assert _misses(steps, num_experts=3, num_resident=2, policy="belady") == 4
    assert _misses(steps, num_experts=3, num_resident=2, policy="lru") == 5


class _NeedChoice(Exception):
    def __init__(self, n):
        self.n = n


class _ScriptedPolicy(EvictionPolicy):
    """Evicts candidates[choices[i]] at the i-th eviction; raises past the script."""

    def __init__(self, num_slots, choices):
        super().__init__(num_slots)
        self.choices, self.i = choices, 0

    def victim(self, candidates, expert_of_slot):
        if self.i == len(self.choices):
            raise _NeedChoice(len(candidates))
        self.i += 1
        return candidates[self.choices[self.i - 1]]


def _brute_force_min_misses(unions, *, num_experts, num_resident):
    """Fewest misses over every sequence of victim choices the planner allows."""
    best, stack = None, [[]]
    while stack:
        choices = stack.pop()
        res = planner.Residency(num_experts, num_resident, _ScriptedPolicy(num_resident, choices))
        try:
            misses = sum(res.plan(u).misses for u in unions)
        except _NeedChoice as need:
            stack += [choices + [i] for i in range(need.n)]
            continue
        best = misses if best is None else min(best, misses)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_belady_equals_brute_force_optimum_on_tiny_traces(seed):
    rng = random.Random(seed)
    e, k = rng.choice([(4, 2), (5, 2), (5, 3), (6, 3)])
    unions = [sorted(rng.sample(range(e), rng.randint(1, min(e, k + 1)))) for _ in range(rng.randint(4, 8))]
    best = _brute_force_min_misses(unions, num_experts=e, num_resident=k)
    assert _misses(_steps(unions), num_experts=e, num_resident=k, policy="belady") == best
    assert _misses(_steps(unions), num_experts=e, num_resident=k, policy="lru") >= best


def _assert_belady_at_least_lru(steps, num_experts, ks):
    for k in ks:
        lru, _ = sim.replay(steps, num_experts=num_experts, num_resident=k, policy="lru")
        bel, _ = sim.replay(steps, num_experts=num_experts, num_resident=k, policy="belady")
        for layer, s in lru.layers.items():
            assert bel.layers[layer].hits >= s.hits, f"K={k} layer {layer}: belady {bel.layers[layer].hits} < lru {s.hits}"


def test_belady_at_least_lru_on_synthetic_trace():
    tr = load_trace(SYNTHETIC)
    e = tr.meta.num_experts
    streams = sim.request_streams(tr)
    for steps in [sim.recorded_steps(tr)] + [sim.batched_steps(streams, batch_size=b) for b in (1, 2, 6)]:
        _assert_belady_at_least_lru(steps, e, range(tr.meta.top_k, e + 1))


@needs_real_traces
@pytest.mark.parametrize("name", REAL)
def test_belady_at_least_lru_on_real_traces(name):
    tr = load_trace(os.path.join(TRACES, name))
    e, k = tr.meta.num_experts, tr.meta.top_k
    ks = sim.default_num_resident(num_experts=e, top_k=k)
    recorded = sim.recorded_steps(tr)
    _assert_belady_at_least_lru(recorded, e, ks)
    if any(s.tokens > 1 for s in recorded):  # else B=1 replays the same single-token steps
        _assert_belady_at_least_lru(sim.batched_steps(sim.request_streams(tr), batch_size=1), e, ks)


# ---- replay, batching, uniform ------------------------------------------------------------


def test_replay_counts_like_a_direct_residency_loop():
    tr = load_trace(SYNTHETIC)
    steps = sim.recorded_steps(tr)
    stats, decode = sim.replay(steps, num_experts=16, num_resident=4, policy="lru", expert_bytes=10)
    for layer in tr.meta.layers:
        res, ref = planner.Residency(16, 4, LRUPolicy(4)), LayerStats()
        for s in tr:
            plan = res.plan(s.topk_ids[layer].ravel().tolist())
            ref.record_step(hits=plan.hits, misses=plan.misses, waves=len(plan.waves), tokens=s.num_tokens,
                            expert_bytes=10)
        assert stats.layers[layer] == ref
    assert decode.tokens == stats.tokens - 12  # the 12-row prefill step is not decode


def test_batched_steps_interleave_streams():
    a = {0: np.array([[1], [2], [3]])}
    b = {0: np.array([[4], [5]])}
    c = {0: np.array([[6]])}
    steps = sim.batched_steps([a, b, c], batch_size=2)  # c cannot fill a second group: left out
    assert [s.ids[0].ravel().tolist() for s in steps] == [[1, 4], [2, 5], [3]]
    assert [s.ids[0].ravel().tolist() for s in sim.batched_steps([a, b, c], batch_size=1)] == [[1], [2], [3], [4], [5], [6]]
    with pytest.raises(ValueError, match="--batch-sizes"):
        sim.batched_steps([a], batch_size=0)


def test_single_stream_is_cut_into_pseudo_requests():
    s = {0: np.arange(10).reshape(10, 1)}
    parts = sim.request_streams(_FakeTrace({7: s}), min_streams=4)
    assert len(parts) == 4 and np.concatenate([p[0] for p in parts]).ravel().tolist() == list(range(10))


class _FakeTrace:
    def __init__(self, streams):
        self._streams = streams

    def streams(self):
        return self._streams


def test_uniform_steps_keep_shape_and_draw_distinct_experts():
    steps = sim.recorded_steps(load_trace(SYNTHETIC))
    uni = sim.uniform_steps(steps, num_experts=16, top_k=2, seed=3)
    assert [(u.tokens, u.padding, u.phase) for u in uni] == [(s.tokens, s.padding, s.phase) for s in steps]
    for u in uni:
        for ids in u.ids.values():
            assert ids.shape[1] == 2 and all(len(set(r)) == 2 for r in ids.tolist())
            assert ids.min() >= 0 and ids.max() < 16


def test_modelled_decode_tok_s():
    steps = _steps([[0], [1], [0], [1]])
    _, decode = sim.replay(steps, num_experts=2, num_resident=1, policy="lru", expert_bytes=10**9)
    # 4 steps x 1 layer x 10 ms compute + 4 misses x 1 GB / 10 GB/s = 0.04 + 0.4 s for 4 tokens
    assert sim.modelled_decode_tok_s(decode, link_gbps=10, compute_ms_per_layer=10) == pytest.approx(4 / 0.44)
    assert sim.modelled_decode_tok_s(decode, link_gbps=10, compute_ms_per_layer=10, model_layers=2) == pytest.approx(2 / 0.44)


def test_bad_inputs():
    steps = sim.recorded_steps(load_trace(SYNTHETIC))  # top_k 2
    for k, limit in ((0, "is below top_k=2"), (1, "is below top_k=2: one token routes to 2 experts"),
                     (17, "exceeds the E=16")):
        with pytest.raises(ValueError, match=f"--num-resident K={k} {limit}"):
            sim.replay(steps, num_experts=16, num_resident=k, policy="lru")
    with pytest.raises(ValueError, match="--num-resident K=1 is below top_k=2"):  # the runtime's refusal, verbatim
        sim.run_grid(steps, num_experts=16, top_k=2, num_resident=[4, 1], policies=["lru"])
    from pagedexperts.residency.planner import num_resident_problem

    assert num_resident_problem(1, num_experts=16, min_slots=2) in str(pytest.raises(
        ValueError, sim.replay_prefetch, steps, num_experts=16, num_resident=1, policy="lru", budget=1,
        expert_bytes=1, link_gbps=1.0, compute_ms_per_layer=1.0).value)
    assert sim.default_num_resident(num_experts=4, top_k=3) == [3, 4]  # E/2 = 2 < top_k is lifted to top_k
    with pytest.raises(ValueError, match="choose from .*belady.*--policy"):
        sim.run_grid(steps, num_experts=16, top_k=2, num_resident=[4], policies=["fifo"])
    with pytest.raises(ValueError, match="nothing to replay"):
        sim.run_grid([], num_experts=16, top_k=2, num_resident=[4], policies=["lru"])


# ---- CLI ----------------------------------------------------------------------------------


def _run(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_table_json_and_plots(tmp_path, capsys):
    rc, out, _ = _run(capsys, ["simulate", "--trace", SYNTHETIC, "--num-resident", "4,8"])
    assert rc == 0 and "belady" in out and "uniform" in out
    rc, out, err = _run(capsys, ["simulate", "--trace", SYNTHETIC, "--num-resident", "4,8", "--batch-sizes", "1,3",
                               "--policy", "lru", "--json", "--link-gbps", "10", "--compute-ms-per-layer", "1",
                               "--expert-mb", "1", "--plot-dir", str(tmp_path)])
    r = json.loads(out)
    assert rc == 0 and r["meta"]["num_experts"] == 16
    keys = {(x["batch_size"], x["routing"], x["num_resident"]) for x in r["results"]}
    assert keys == {(b, g, k) for b in (1, 3) for g in ("trace", "uniform") for k in (4, 8)}
    assert all(x["modelled_decode_tok_s"] > 0 for x in r["results"])
    assert sorted(os.listdir(tmp_path)) == ["hit_rate_vs_k.png", "union_vs_batch.png"]
    # where they went is said (nothing was)
    assert f"plots written: {tmp_path / 'hit_rate_vs_k.png'}, {tmp_path / 'union_vs_batch.png'}" in err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--experts", "64", "--top-k", "8"], "E=16, top_k=2; the model has E=64, top_k=8"),
        (["--num-resident", "0"], "--num-resident K=0 is below top_k=2"),
        (["--num-resident", "4,1"], "--num-resident K=1 is below top_k=2: one token routes to 2 experts, so at least 2 "
                                    "slots are needed; raise --num-resident"),
        (["--num-resident", "17"], "--num-resident K=17 exceeds the E=16"),
        (["--policy", "mru"], "unknown --policy ['mru']; choose from ["),
        # an empty item was skipped silently (bench's and check's lists refuse it: commands.flag_lists)
        (["--num-resident", "4,,8"], "--num-resident '4,,8' has an empty item: want comma-separated integers"),
        (["--policy", "lru,"], "--policy 'lru,' has an empty item: want comma-separated values from ["),
        (["--batch-sizes", "1,,3"], "--batch-sizes '1,,3' has an empty item: want comma-separated integers"),
        (["--num-resident", ""], "--num-resident '' is empty"),
        (["--batch-sizes", "1,x"], "--batch-sizes '1,x': want comma-separated integers"),
        (["--expert-mb", "-1"], "--expert-mb -1.0 must be >= 0"),
        (["--link-gbps", "10", "--compute-ms-per-layer", "1"], "--link-gbps needs --expert-mb"),
        (["--link-gbps", "-1", "--compute-ms-per-layer", "1"], "--link-gbps -1.0 must be > 0"),
        (["--expert-mb", "1", "--link-gbps", "10", "--compute-ms-per-layer", "-5"], "--compute-ms-per-layer -5.0 must be >= 0"),
        (["--expert-mb", "1", "--link-gbps", "10", "--compute-ms-per-layer", "1", "--model-layers", "0"], "--model-layers 0 must be >= 1"),
        (["--expert-mb", "1", "--link-gbps", "10"], "--link-gbps needs --compute-ms-per-layer"),
        (["--compute-ms-per-layer", "1"], "--compute-ms-per-layer needs --link-gbps"),
        (["--model-layers", "48"], "--model-layers needs --link-gbps and --compute-ms-per-layer"),
    ],
)
def test_cli_bad_inputs(capsys, extra, message):
    rc, _, err = _run(capsys, ["simulate", "--trace", SYNTHETIC] + extra)
    assert rc == 2 and message in err


def test_cli_trace_that_is_no_file(tmp_path, capsys):
    """A missing path named the flag nowhere; a directory raised IsADirectoryError (traceback).
    A directory is a set of traces now (tests/analysis/test_trace_sets.py): one without any is refused."""
    rc, _, err = _run(capsys, ["simulate", "--trace", str(tmp_path / "none.npz")])
    assert rc == 2 and f"--trace {tmp_path / 'none.npz'}: no such file or directory" in err
    rc, _, err = _run(capsys, ["simulate", "--trace", str(tmp_path)])
    assert rc == 2 and f"{tmp_path}: a directory with no trace files (*.npz, *.jsonl)" in err


def test_cli_empty_and_truncated_trace(tmp_path, capsys):
    (tmp_path / "empty.npz").write_bytes(b"")
    rc, _, err = _run(capsys, ["simulate", "--trace", str(tmp_path / "empty.npz")])
    assert rc == 2 and "empty trace file" in err
    data = open(SYNTHETIC, "rb").read()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) - 100])
    rc, _, err = _run(capsys, ["simulate", "--trace", str(tmp_path / "cut.npz")])
    assert rc == 2 and "truncated or corrupt" in err


def test_cli_plot_dir_that_is_a_file_is_refused_before_the_replay(tmp_path, capsys, monkeypatch):
    """--plot-dir naming a file raised FileExistsError (traceback) after the whole replay."""
    pytest.importorskip("matplotlib")
    (tmp_path / "taken").write_text("")

    def replay(*args, **kwargs):
        raise AssertionError("the trace was replayed before --plot-dir was checked")

    monkeypatch.setattr(sim, "run_grid", replay)
    rc, _, err = _run(capsys, ["simulate", "--trace", SYNTHETIC, "--plot-dir", str(tmp_path / "taken")])
    assert rc == 2 and err == (f"pagedexperts simulate: error: --plot-dir {tmp_path / 'taken'} is a file; give a "
                               "directory (made if missing)\n")
