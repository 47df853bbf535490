"""Baseline modes (resident, offload, cpu-experts) and the benchmark tools.

On CPU every mode computes exactly what the unpaged model computes (same kernel, same rows),
so tokens and logits are compared with torch.equal. The offload byte count is checked against
a hand count: E x expert bytes per MoE layer per step.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from support.tiny import E, HIDDEN, MOE_INTERMEDIATE, TOP_K, assert_same, greedy_logits
from pagedexperts.loading.loader import load_model
from pagedexperts.loading.runners import repage
from support.paths import ROOT

EXPERT_BYTES_F32 = 3 * MOE_INTERMEDIATE * HIDDEN * 4  # gate, up [I, H] and down [H, I], float32


@pytest.fixture(scope="module")
def reference(reference_model):
    return reference_model()


@pytest.mark.parametrize("mode,extra", [("resident", {}), ("offload", {}), ("cpu-experts", {"cpu_expert_layers": 1}),
                                        ("paged", {"num_resident": TOP_K})])
def test_every_mode_equals_the_unpaged_model(tiny_moe_dir, reference, mode, extra):
    model, _ = load_model(tiny_moe_dir, mode=mode, **extra)
    ids = torch.tensor([[5, 9, 17, 33, 2, 77, 41]])
    assert_same(greedy_logits(model, ids), greedy_logits(reference, ids), f"{mode} greedy logits")  # so tokens too


def test_offload_copies_every_expert_every_step(tiny_moe_dir):
    model, _ = load_model(tiny_moe_dir, mode="offload")
    ids = torch.tensor([[5, 9, 17]])
    with torch.no_grad():
        model(ids)
        model(ids[:, :1])
    for stats in model.pagedexperts.stats().layers.values():
        assert stats.steps == 2
        assert stats.bytes_paged == 2 * E * EXPERT_BYTES_F32
        assert stats.hits == 0 and stats.misses == stats.union_sum


def test_cpu_experts_runs_the_first_n_layers_on_the_cpu(tiny_moe_dir):
    from pagedexperts.paging.baselines import CpuExpertsRunner, ResidentRunner

    model, _ = load_model(tiny_moe_dir, mode="cpu-experts", cpu_expert_layers=1)
    kinds = [type(p) for _, p in sorted(model.pagedexperts.runners.items())]
    assert kinds == [CpuExpertsRunner, ResidentRunner]
    with pytest.raises(ValueError, match="--cpu-expert-layers 5 outside"):
        load_model(tiny_moe_dir, mode="cpu-experts", cpu_expert_layers=5)
    with pytest.raises(ValueError, match="unknown mode 'gpu'"):
        load_model(tiny_moe_dir, mode="gpu")


def test_repage_switches_mode_and_k_over_the_same_stores(tiny_moe_dir, reference):
    model, _ = load_model(tiny_moe_dir, num_resident=E)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        want = reference(ids).logits
        for mode, k in (("paged", TOP_K), ("offload", None), ("paged", E // 2)):
            repage(model, mode=mode, num_resident=k)
            assert torch.equal(model(ids).logits, want), mode
            assert model.pagedexperts.num_resident == (k or E)
    with pytest.raises(ValueError, match="--num-resident"):
        repage(model, mode="paged", num_resident=1)


def test_gpu_bench_dry_run(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_bench

    trace = ROOT / "tests" / "data" / "synthetic_trace.npz"
    assert gpu_bench.main(["--dry-run", "--out", str(tmp_path), "--traces", str(trace)]) == 0
    result = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert [m["mode"] for m in result["modes"]] == ["resident", "offload", "paged", "paged"]
    assert [c["misses"] for c in result["miss_costs"]] == [0, 1, 2, 4]
    layers, e = result["layers"], gpu_bench.TINY["num_experts"]
    # offload: every step copies E experts per layer; the run is 1 prefill (prompt 8) + 3 decode steps
    offload = result["modes"][1]
    assert offload["bytes_per_token"] == pytest.approx(layers * 4 * e * result["expert_bytes"] / (8 + 3))
    assert result["modes"][0]["hit_rate"] is None  # resident counts nothing: n/a, not a measured 100%
    assert len(result["modelled"]) == 2 and all(r["modelled_tok_s_48_layers"] > 0 for r in result["modelled"])
    assert "| mode | K |" in (tmp_path / "summary.md").read_text()
    assert result["phases_done"] == ["build", "link", "modes", "decode_host", "miss_costs", "layer_scaling", "modelled"]
    rows = result["decode_host"]
    assert [(r["mode"], r["batch"]) for r in rows] == [(m, b) for m in ("resident", "paged", "paged") for b in (1, 4)]
    assert [r["K"] for r in rows] == [e, e, 6, 6, 10, 10]
    assert all(r["host_syncs_per_decode_step"] is None for r in rows)  # CPU: n/a
    # dry run: the static decode step run eagerly (no capture on CPU), timed beside eager generate
    assert all(r["graphs_tok_s"] > 0 and r["eager_router_tok_s"] > 0 for r in rows)
    # warm-up 3 tokens (2 decode steps: the capture, 1 replay), then 4 tokens (3 replays), one capture
    assert all((r["graphs"]["backend"], r["graphs"]["captures"], r["graphs"]["replays"]) == ("eager", 1, 4)
               for r in rows)
    assert all(0 < r["host_s_per_layer_step_p50"] and r["eager_tok_s"] > 0 for r in rows)
    assert set(result["layer_scaling"]) == {"resident", "paged"}


def test_gpu_bench_timing_model_on_synthetic_costs():
    """Token time = fixed + L x per-layer: the split recovers both from two layer counts, and
    the 48-layer model pays the fixed part once (not 48 / L times) plus paging's per-layer
    cost at 0 misses and the interpolated extra cost of its misses."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_bench

    fixed, per_layer = 0.010, 0.0005  # 10 ms per token (lm_head, loop), 0.5 ms per layer
    token_s = {8: fixed + 8 * per_layer, 4: fixed + 4 * per_layer}
    got_fixed, got_layer = gpu_bench.split_token_time(token_s)
    assert got_fixed == pytest.approx(fixed) and got_layer == pytest.approx(per_layer)
    assert gpu_bench.split_token_time({8: 0.008, 4: 0.003}) == (0.0, pytest.approx(0.001))  # noise
    assert gpu_bench.split_token_time({8: 0.008, 4: 0.009}) == (0.008, 0.0)
    costs = [dict(misses=0, layer_step_s=0.001), dict(misses=2, layer_step_s=0.003), dict(misses=4, layer_step_s=0.004)]
    assert gpu_bench.miss_extra_s(costs, 3) == pytest.approx(0.0025)
    assert gpu_bench.miss_extra_s([dict(misses=0, layer_step_s=0.002), dict(misses=1, layer_step_s=0.001)], 1) == 0.0
    got = gpu_bench.modelled_token_s(fixed_s=got_fixed, per_layer_s=got_layer, extra_miss_s=0.0025, layers=48)
    assert got == pytest.approx(0.010 + 48 * (0.0005 + 0.0025))
    # the old model spread the fixed cost over 8 layers and multiplied it by 48: 6x the fixed cost
    assert got < 48 * (token_s[8] / 8 + 0.0025)


def test_read_prompts_formats(tmp_path):
    from pagedexperts.tools.prompts import read_prompts

    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a"}\n{"turns": ["b", "c"]}\n{"question": "d"}\n')
    assert read_prompts(jl) == ["a", "b", "d"]
    sg = tmp_path / "s.json"
    sg.write_text('[{"conversations": [{"from": "human", "value": "e"}, {"from": "gpt", "value": "f"}]}]')
    assert read_prompts(sg) == ["e"]
    empty = tmp_path / "e.jsonl"
    empty.write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="no prompts found"):
        read_prompts(empty)
    # each was a traceback (AttributeError, IsADirectoryError) or a JSON message naming no file
    (tmp_path / "s.jsonl").write_text('"a string"\n')
    (tmp_path / "b.jsonl").write_text('{"prompt": "a"}\n{"prompt\n')
    (tmp_path / "i.json").write_text("[1]")
    for name, message in [("s.jsonl", "s.jsonl:1: a JSON str, not an object"), ("b.jsonl", "b.jsonl:2: not valid JSON"),
                          ("i.json", "i.json: item 1: a JSON int, not an object"), ("none", "none: no such file"),
                          (".", "is a directory; give a file")]:
        with pytest.raises(ValueError, match=message):
            read_prompts(tmp_path / name)


@pytest.mark.slow
def test_bench_command_on_the_bundled_model(tmp_path, capsys):
    from pagedexperts.cli import main

    rc = main(["bench", "--mode", "plain,resident,paged", "--num-resident", "8", "--num-prompts", "1",
               "--output-tokens", "3", "--long-prompt-tokens", "16", "--concurrency", "1,2", "--rounds", "2",
               "--threads", "1", "--results-dir", str(tmp_path)])
    assert rc == 0
    shown = capsys.readouterr().out.splitlines()  # the compact view; the full table is bench.md's
    assert shown[0].split()[:3] == ["mode", "decode", "tok/s"] and max(len(line) for line in shown) < 100
    data = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["mode"]: r for r in data["results"]}
    assert data["order"] == [["plain", "resident", "paged K=8"], ["resident", "paged K=8", "plain"]]
    assert rows["plain"]["ratio_cpu_vs_plain"] == {"median": 1.0, "low": 1.0, "high": 1.0}
    assert len(rows["paged"]["samples"]) == 2 and rows["paged"]["ratio_wall_vs_plain"]["low"] > 0
    assert rows["paged"]["num_resident"] == 8 and 0 < rows["paged"]["hit_rate"] < 1
    assert rows["resident"]["hit_rate"] is None and rows["plain"]["bytes_per_token"] is None  # n/a
    assert set(rows["paged"]["total_tok_s"]) == {"1", "2"}
    table = (tmp_path / "bench.md").read_text()
    assert "| resident | 64 |" in table and "n/a" in table and "CPU time/token vs plain" in table
    names = ["bench.md", "command.txt"] + (["bench.png"] if importlib.util.find_spec("matplotlib") else [])
    for name in names:
        assert (tmp_path / name).exists(), name


@pytest.mark.parametrize(
    "argv,needle",
    [(["--num-resident", "8,100"], "--num-resident K=100 exceeds the E=64"),
     (["--num-resident", "2"], "--num-resident K=2 is below top_k=4"),
     (["--num-resident", "8,x"], "--num-resident '8,x': want comma-separated integers"),
     (["--concurrency", "1,0"], "--concurrency 0 must be >= 1"),
     (["--num-prompts", "0"], "--num-prompts 0 must be >= 1"),
     (["--num-prompts", "4"], "--num-prompts 4 exceeds the 3 prompts of the built-in prompts"),
     (["--long-prompt-tokens", "0"], "--long-prompt-tokens 0 must be >= 1"),
     (["--cpu-expert-layers", "7"], "--cpu-expert-layers 7 outside [1, 6]"),
     (["--cpu-expert-layers", "-1"], "--cpu-expert-layers -1 outside [1, 6]"),
     (["--cpu-expert-layers", "0"], "--cpu-expert-layers 0 outside [1, 6]"),
     (["--mode", "plain,paged,plain"], "--mode names ['plain'] more than once"),
     (["--rounds", "0"], "--rounds 0 must be >= 1"),
     (["--threads", "-1"], "--threads -1 must be >= 1 (or 0: torch's default, or auto)"),
     (["--mode", "plain,gpu"], "unknown --mode ['gpu']; choose from ['plain', 'paged'"),
     # an empty --mode raised ZeroDivisionError in round_order; "plain," and "8," dropped the empty item
     (["--mode", ""], "--mode '' is empty: want comma-separated values from ['plain', 'paged'"),
     (["--mode", "plain,"], "--mode 'plain,' has an empty item: want comma-separated values from ['plain', 'paged'"),
     (["--num-resident", "8,"], "--num-resident '8,' has an empty item"),
     (["--num-resident", ""], "--num-resident '' is empty"),
     (["--concurrency", "1,"], "--concurrency '1,' has an empty item"),
     (["--concurrency", "1,1"], "--concurrency names [1] more than once"),
     (["--num-resident", "8,08"], "--num-resident names [8] more than once"),
     # a file: FileExistsError (traceback) when the results were written, after the whole benchmark
     (["--results-dir", __file__], f"--results-dir {__file__} is a file; give a directory"),
     (["--prompts", "/nonexistent.jsonl"], "--prompts /nonexistent.jsonl: no such file")],
)
def test_bench_bad_input_is_refused_before_any_work(argv, needle, capsys, monkeypatch):
    import pagedexperts.tools.bench
    from pagedexperts.cli import main

    def fail(*args, **kwargs):
        raise AssertionError("the bench ran before its flags were validated")

    monkeypatch.setattr(pagedexperts.tools.bench, "run_bench", fail)
    assert main(["bench", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_bench_loads_once_and_repages_per_mode_and_k(tiny_moe_dir, monkeypatch):
    """One load of the paged model and one of the plain model; each round re-attaches every
    paged-model mode (repage) and warms it up before its measured run."""
    from pagedexperts.loading import loader, runners
    from pagedexperts.tools import bench

    loads, plain_loads, events = [], [], []
    real_load, real_repage, real_plain = loader.load_model, runners.repage, bench.load_plain
    monkeypatch.setattr(loader, "load_model", lambda *a, **kw: loads.append(kw) or real_load(*a, **kw))
    monkeypatch.setattr(runners, "repage", lambda m, **kw: events.append(("repage", kw["mode"], kw["num_resident"]))
                        or real_repage(m, **kw))
    monkeypatch.setattr(bench, "load_plain", lambda cfg: plain_loads.append(cfg) or real_plain(cfg))
    monkeypatch.setattr(bench, "long_prompts", lambda *a: ["a long prompt"])  # the tiny model has no tokenizer
    monkeypatch.setattr(bench, "timed_generate", lambda model, tok, prompts, n, **kw: events.append(("warm-up", n)))
    sample = bench.RoundSample(0.1, 0.2, 0.01, 0.01, {1: 1.0})
    monkeypatch.setattr(bench, "measure_round", lambda model, *a: events.append(("measure",)) or sample)
    cfg = bench.BenchConfig(model_path=str(tiny_moe_dir), modes=("paged", "resident", "plain"),
                            num_resident=(TOP_K, E // 2), long_prompt_tokens=4, rounds=2)
    run = bench.run_bench(cfg, ["hello"], progress=False)
    assert [(r.mode, r.num_resident) for r in run.results] == [("paged", TOP_K), ("paged", E // 2), ("resident", E),
                                                               ("plain", E)]
    assert len(loads) == 1 and loads[0]["mode"] == "paged" and loads[0]["num_resident"] == TOP_K
    assert len(plain_loads) == 1
    warm, measure = ("warm-up", bench.WARM_UP_TOKENS), ("measure",)
    round0 = [("repage", "paged", TOP_K), warm, measure, ("repage", "paged", E // 2), warm, measure,
              ("repage", "resident", None), warm, measure, warm, measure]
    round1 = round0[3:] + [("repage", "paged", TOP_K), warm, measure]
    assert events == round0 + round1
    a, b = f"paged K={TOP_K}", f"paged K={E // 2}"
    assert run.order == [[a, b, "resident", "plain"], [b, "resident", "plain", a]]


@pytest.mark.parametrize("unwritable", ["under a file", "not writable"])
def test_bench_refuses_a_results_dir_it_cannot_write_before_any_work(tmp_path, unwritable, capsys, monkeypatch):
    """A results dir that cannot be made or written raised an OSError traceback when the results
    were written, after the whole benchmark; now a one-line error first (as root, chmod stops
    nothing: a path under a regular file, or os.access saying no, as on a read-only mount)."""
    import os

    import pagedexperts.tools.bench
    from pagedexperts.cli import main

    def fail(*args, **kwargs):
        raise AssertionError("the bench ran before --results-dir was checked")

    monkeypatch.setattr(pagedexperts.tools.bench, "run_bench", fail)
    (tmp_path / "f").write_text("a regular file")
    out = tmp_path / "f" / "x" if unwritable == "under a file" else tmp_path / "ro"
    if unwritable == "not writable":
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != out and access(path, mode, **kw))
    assert main(["bench", "--mode", "plain", "--results-dir", str(out)]) == 2
    err = capsys.readouterr().err
    why = "cannot make the directory (Not a directory)" if unwritable == "under a file" else "not writable"
    assert f"pagedexperts bench: error: --results-dir {out}: {why}" in err and "Traceback" not in err
