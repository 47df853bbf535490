"""``--beyond-k in-place`` through the runtime: flags, the model, its decode steps' waves, the lines.

On the tiny random Qwen3-MoE (support.tiny: E = 16, top_k = 2) at K = 2, the fused kernels under
``TRITON_INTERPRET=1``, the decide / page-in / remap as torch references: a batch of 4 prompts
(unions above K) generates the same tokens and ``torch.equal`` logits, prefill and decode, with
in-place reads, in waves and with all E resident; its decode steps are one wave at every serve
bucket up to the running cap (in waves: more than one above K // top_k); the static decode step
that a CUDA graph captures (run by the eager backend on a CPU) is built once per batch, without
fallback, at a batch beyond K // top_k. The flags' refusals name the flags; the start-up lines
say which experts implementation runs and why and how a union beyond K is computed; the stats
and /metrics carry the rows read in place and their bytes.

Legend: E experts, k top_k, K slots, B batch.
"""

from __future__ import annotations

import pytest
import torch

from pagedexperts.loading.config import ConfigError, PagingConfig, check_config
from pagedexperts.paging.kernels import HAVE_TRITON
from support.tiny import E, TOP_K

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (pip install 'pagedexperts[gpu]')")
K = 2  # slots: a batch of 4 routes a union beyond K


def test_in_place_needs_fused_on_the_device_planned_step():
    with pytest.raises(ConfigError, match="--beyond-k in-place.*--experts-implementation fused") as err:
        check_config(PagingConfig(beyond_k="in-place", experts_implementation="grouped_mm", decide="device"))
    assert "--experts-implementation grouped_mm" in str(err.value)
    with pytest.raises(ConfigError, match="--decide host"):
        check_config(PagingConfig(beyond_k="in-place", experts_implementation="fused", decide="host"))
    with pytest.raises(ConfigError, match="mode resident"):
        check_config(PagingConfig(beyond_k="in-place", experts_implementation="fused", mode="resident"))
    with pytest.raises(ConfigError, match="unknown --beyond-k 'sideways'"):
        check_config(PagingConfig(beyond_k="sideways"))


@needs_triton  # fused needs triton: without it the check refuses fused itself
def test_in_place_with_fused_and_decide_auto_is_accepted():
    check_config(PagingConfig(beyond_k="in-place", experts_implementation="fused"))  # auto: device for fused


def test_admit_per_step_needs_in_place_and_a_count():
    with pytest.raises(ConfigError, match="--admit-per-step 3 limits the page-ins of --beyond-k in-place"):
        check_config(PagingConfig(admit_per_step=3))
    with pytest.raises(ConfigError, match="--admit-per-step -1 must be an integer >= 0"):
        check_config(PagingConfig(beyond_k="in-place", experts_implementation="fused", admit_per_step=-1))


def test_the_commands_take_the_flags():
    from pagedexperts.cli import build_parser
    from pagedexperts.commands.common import paging_options

    for command in ("generate", "serve", "check", "bench"):
        argv = [command, "--beyond-k", "in-place", "--admit-per-step", "4", "--experts-implementation", "fused"]
        args = build_parser(argv).parse_args(argv)
        assert (args.beyond_k, args.admit_per_step) == ("in-place", 4), command
        if command != "bench":  # bench builds its options itself (BenchConfig)
            assert paging_options(args)["beyond_k"] == "in-place", command
        assert build_parser([command]).parse_args([command]).beyond_k == "waves", command  # the default
    with pytest.raises(SystemExit):
        build_parser(["generate"]).parse_args(["generate", "--beyond-k", "sideways"])


class _Stop(Exception):
    """Raised by the spy once check has built the model it pages (check itself is not run)."""


@needs_triton  # --beyond-k in-place runs fused on the device-planned step
def test_check_builds_the_paged_model_with_the_beyond_k_flags(monkeypatch):
    """check builds its own options (not through ``commands.common.paging_options``): the paged
    model it checks carries --beyond-k in-place and --admit-per-step as given, and its all-resident
    oracle the same options at K = E."""
    import pagedexperts.loading.loader as loader
    from pagedexperts.cli import main

    built, real = [], loader.load_model

    def spy(path, **options):
        model, tokenizer = real(path, **options)
        built.append(model.pagedexperts.config)
        if options["num_resident"] < model.pagedexperts.num_experts:
            raise _Stop
        return model, tokenizer

    monkeypatch.setattr(loader, "load_model", spy)
    with pytest.raises(_Stop):
        main(["check", "--experts-implementation", "fused", "--beyond-k", "in-place", "--admit-per-step", "2",
              "--check-resident", "4", "--max-new-tokens", "1", "--prompt", "hi"])
    oracle, paged = built
    assert (paged.num_resident, paged.beyond_k, paged.admit_per_step, paged.experts_implementation) == (
        4, "in-place", 2, "fused")
    assert (oracle.num_resident, oracle.beyond_k, oracle.admit_per_step) == (64, "in-place", 2)


def greedy(model, ids, mask):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, out.logits


@pytest.fixture(scope="module")
def models(tiny_moe_dir):
    from pagedexperts.loading.loader import load_model

    common = dict(experts_implementation="fused", device_kernels="torch", check_independence=False,
                  cuda_graphs="eager", cuda_graph_max_batch=8)
    return {name: load_model(tiny_moe_dir, num_resident=k, beyond_k=beyond, **common)[0]
            for name, k, beyond in [("in-place", K, "in-place"), ("waves", K, "waves"), ("resident", E, "waves")]}


@needs_triton
@pytest.mark.default_threads
def test_batch_beyond_k_equals_waves_and_all_resident(models):
    ids = torch.randint(1, 100, (4, 3), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, 0] = mask[1, 0] = 0  # a left-padded row
    with torch.no_grad():
        runs = {name: greedy(m, ids, mask) for name, m in models.items()}
    for name in ("in-place", "waves"):
        seq, logits = runs[name]
        assert torch.equal(seq, runs["resident"][0]), name
        assert all(torch.equal(a, b) for a, b in zip(logits, runs["resident"][1])), name
    stats = models["in-place"].pagedexperts.stats().as_dict(times=False)
    assert stats["multi_wave_steps"] == 0 and stats["in_place_rows"] > 0
    assert stats["in_place_bytes"] == stats["in_place_rows"] * models["in-place"].pagedexperts.stores[
        next(iter(models["in-place"].pagedexperts.stores))].expert_bytes
    assert stats["page_ins"] + stats["in_place_rows"] == stats["misses"]
    assert models["waves"].pagedexperts.stats().as_dict(times=False)["multi_wave_steps"] > 0


@needs_triton
def test_every_serve_bucket_is_one_wave(models):
    """Serve's decode buckets up to a running cap of 64 (8 x K // top_k): one wave each with
    in-place reads; in waves, every bucket above K // top_k has more than one."""
    from pagedexperts.engine.row_forwards import bucket_sizes
    from pagedexperts.generation.capture_checks import decode_waves

    buckets = bucket_sizes(64)
    assert buckets[-1] == 64
    assert {b: decode_waves(models["in-place"], b) for b in buckets} == {b: 1 for b in buckets}
    cap = K // TOP_K
    assert all(decode_waves(models["waves"], b) > 1 for b in buckets if b > cap)
    assert decode_waves(models["waves"], 64) == E // K


@needs_triton
@pytest.mark.default_threads
def test_static_decode_beyond_k_builds_once_and_equals_all_resident(models):
    """The static-buffer decode step (what a CUDA graph captures; the eager backend on a CPU) at
    batch 4 > K // top_k: built once, no fallback, logits equal to all E resident."""
    from pagedexperts.generation.capture_checks import capture_problem_of
    from pagedexperts.generation.graphs import DecodeGraphs

    ids = torch.randint(1, 100, (4, 2), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    tokens = torch.randint(1, 100, (4, 2), generator=torch.Generator().manual_seed(2))
    logits = {}
    for name in ("in-place", "resident"):
        model = models[name]
        assert capture_problem_of(model) is None
        graphs = DecodeGraphs(model, backend="eager", max_batch=4)
        st = graphs.step_for(4, 2 + 3)
        with torch.no_grad():
            logits[name] = [st.prefill(ids, mask)] + [graphs.decode(st, tokens[:, i], 2 + i) for i in range(2)]
        assert graphs.summary()["captures"] == 1 and graphs.summary()["fallbacks"] == [], name
    assert all(torch.equal(a, b) for a, b in zip(logits["in-place"], logits["resident"]))


@needs_triton
def test_start_up_lines_say_what_runs_and_why(models):
    from pagedexperts.commands.common import experts_note
    from pagedexperts.serving.api_server import single_wave_note

    note = experts_note(models["in-place"].pagedexperts)
    assert note.startswith("experts: fused (--experts-implementation)")
    assert "device (--decide auto)-planned" in note and "--beyond-k in-place" in note and "<= K" in note
    assert "in waves (--beyond-k waves" in experts_note(models["waves"].pagedexperts)
    assert "every decode step is one wave" in single_wave_note(models["in-place"].pagedexperts, 64)
    assert "single-wave cap K // top_k = 2 // 2 = 1" in single_wave_note(models["waves"].pagedexperts, 64)


@pytest.mark.parametrize("device,mode,fmt,want", [
    ("cuda:0", "paged", "gptq", "experts: grouped_mm (the default, auto's choice for gptq: grouped_mm on CUDA (fused "
     "becomes the default on CUDA once"),
    ("cpu", "resident", "gptq", "experts: grouped_mm (the default, auto's choice for gptq: grouped_mm in --mode "
     "resident (packed computes the paged slots)"),
    ("cpu", "paged", "fp8-block", "experts: grouped_mm (the default, auto's choice for fp8-block: grouped_mm: torch's packed "
     "CPU kernels take int4 / int8, not fp8-block"),
])
def test_grouped_mm_default_line_says_auto_chose_it_and_why(device, mode, fmt, want):
    from types import SimpleNamespace

    from pagedexperts.commands.common import experts_note

    cfg = PagingConfig(device=device, mode=mode)  # the default, auto
    resolved = SimpleNamespace(experts_implementation="grouped_mm", decide="host", beyond_k="waves", admit_per_step=None,
                               num_resident=4, reasons={"experts_implementation": "auto: grouped_mm"})  # as auto resolved it
    rt = SimpleNamespace(config=cfg, resolved=resolved, expert_format=fmt)
    assert experts_note(rt).startswith(want), experts_note(rt)


def test_metrics_export_rows_read_in_place():
    """/metrics exports every numeric LayerStats field as pagedexperts_paging_<field>."""
    from pagedexperts.serving.metrics import _numeric_fields
    from pagedexperts.stats.accounting import LayerStats, ModelStats

    stats = LayerStats(in_place_rows=3, in_place_bytes=300, tokens=2, steps=1)
    assert {"in_place_rows", "in_place_bytes", "page_ins"} <= set(_numeric_fields(stats))
    totals = ModelStats.collect([(0, stats), (1, stats)]).as_dict(times=False)
    assert totals["in_place_rows"] == 6 and totals["in_place_bytes_per_token"] == 300.0


def test_preflight_says_what_k_costs_with_in_place_reads(capsys):
    """Link bytes per token at the uniform miss rate: (1 - K/E) x L x top_k x expert bytes,
    the same figure paged in or read in place; in-place needs one wave at every batch."""
    import json

    from pagedexperts.cli import main

    argv = ["preflight", "--num-resident", "8", "--link-gbps", "25", "--json"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    want = (1 - 8 / r["num_experts"]) * r["moe_layers"] * r["top_k"] * r["expert_bytes"]
    assert r["link_bytes_per_token_uniform"] == pytest.approx(want, rel=1e-12)
    assert r["in_place_waves_per_step"] == 1
    assert main(argv[:-1]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("beyond K in place"))
    assert "every batch one wave" in line and f"{want / 25e9 * 1e3:.2f} ms at 25 GB/s" in line


def test_gpu_check_has_the_beyond_k_phase_within_its_budget(tmp_path):
    import re
    import subprocess

    from support.paths import ROOT as root
    out = subprocess.run(["bash", str(root / "bench" / "gpu_check.sh"), "--dry-run"], capture_output=True, text=True,
                         timeout=120, env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}, cwd=root)
    phases = dict(re.findall(r"^== (\w+) \(limit (\d+) s\)", out.stdout, re.M))
    assert "beyond_k" in phases and sum(map(int, phases.values())) <= 360, phases
    assert "bench/gpu_beyond_k.py" in out.stdout


@pytest.mark.slow
@needs_triton
def test_gpu_beyond_k_dry_run(tmp_path):
    """The phase's code on CPU at tiny sizes: a row per (mode, batch); in-place one wave a step."""
    import json
    import sys

    from support.paths import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_beyond_k

    assert gpu_beyond_k.main(["--dry-run", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_beyond_k.json").read_text())["rows"]
    assert [(r["beyond_k"], r["batch"]) for r in rows] == [("waves", 1), ("waves", 4), ("in-place", 1), ("in-place", 4)]
    assert all(r["waves_per_step"] == 1 and r["multi_wave_steps"] == 0 for r in rows if r["beyond_k"] == "in-place")
    assert any(r["waves_per_step"] > 1 for r in rows if r["beyond_k"] == "waves")
    assert all(r["decide"] == "device" and r["graphs_tok_s"] > 0 for r in rows)


def test_an_implementation_given_by_name_is_said_to_be_the_flag():
    """A runtime whose config names its implementation (load_model(experts_implementation=...),
    the notes called without ``asked``) says the flag, never "the default, auto's choice"."""
    from types import SimpleNamespace

    from pagedexperts.commands.common import experts_note

    resolved = SimpleNamespace(experts_implementation="grouped_mm", decide="host", beyond_k="waves", admit_per_step=None,
                               num_resident=4, reasons={"experts_implementation": "--experts-implementation grouped_mm"})
    rt = SimpleNamespace(config=PagingConfig(experts_implementation="grouped_mm"), resolved=resolved, expert_format="gptq")
    assert experts_note(rt).startswith("experts: grouped_mm (--experts-implementation)"), experts_note(rt)
