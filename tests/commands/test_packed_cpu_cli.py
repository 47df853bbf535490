"""``--experts-implementation packed`` from the command line: check's two verdicts, the start-up
line, and the options it cannot serve refused before loading, each naming its flag."""

from __future__ import annotations


import pytest

from pagedexperts.cli import main
from pagedexperts.loading.config import PagingConfig, option_problems
from pagedexperts.paging.steps.table import inner_problem
from support.paths import DATA

INT4 = DATA / "autoround/qwen3_moe-auto_round-experts"


def test_check_gives_both_verdicts(capsys):
    rc = main(["check", "--model-path", str(INT4), "--experts-implementation", "packed", "--check-resident", "3",
               "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "references: the same packed kernel with all E=8 experts resident (exact)" in out
    assert "[vs packed, all E=8 resident]" in out and "logits torch.equal: yes" in out
    assert "max |logit diff|" in out and "PASS (within tolerance)" in out
    assert "verdict: PASS (paged packed == packed all resident; within tolerance of" in out


def test_generate_states_which_layers_run_packed(capsys):
    rc = main(["generate", "--model-path", str(INT4), "--experts-implementation", "packed", "--num-resident", "4",
               "--prompt", "hello", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "experts: packed (torch's CPU int4 / int8 kernels) on 2 of 2 MoE layers" in err


def test_generate_states_the_fallback(capsys):
    rc = main(["generate", "--model-path", str(DATA / "llmc/qwen3_moe-fp8_block"), "--experts-implementation",
               "packed", "--num-resident", "4", "--prompt", "hello", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "on 0 of 2 MoE layers; grouped_mm on layers [0, 1] (ct-fp8 gate_up_proj: e4m3 codes" in err


@pytest.mark.parametrize("options,flag", [
    (dict(device="cuda"), "--device cpu"),
    (dict(mode="resident"), "--mode paged"),
    (dict(mode="offload"), "--mode paged"),
])
def test_options_packed_cannot_serve_are_refused(options, flag, monkeypatch):
    monkeypatch.setattr("pagedexperts.loading.config.device_problem", lambda device: None)  # as if CUDA were here
    problems = option_problems(PagingConfig(experts_implementation="packed", **options))
    assert any("--experts-implementation packed" in p and flag in p for p in problems), problems


def test_packed_has_no_device_planned_body():
    problem = inner_problem("packed", decide="device")
    assert problem is not None and "--decide host" in problem and "packed" in problem
    assert inner_problem("packed", decide="host") is None


@pytest.mark.parametrize("fmt_name,options,want", [
    ("gptq", {}, "packed"), ("awq", {}, "packed"), ("w4a16", {}, "packed"), ("w8a16", {}, "packed"),
    ("auto-round", {}, "packed"), ("ct-pack-mixed", {}, "packed"),
    ("dense", {}, "grouped_mm"), ("fp8-block", {}, "grouped_mm"), ("nvfp4", {}, "grouped_mm"),
    ("gptq", {"mode": "resident"}, "grouped_mm"), ("gptq", {"device": "cuda"}, "grouped_mm"),
])
def test_auto_is_packed_on_a_cpu_for_the_int_formats(fmt_name, options, want, monkeypatch):
    from types import SimpleNamespace

    from pagedexperts.loading.config import resolve_experts_implementation

    monkeypatch.setattr("pagedexperts.loading.config.device_problem", lambda device: None)
    cfg = PagingConfig(experts_implementation="auto", **options)
    assert resolve_experts_implementation(cfg, SimpleNamespace(name=fmt_name)) == want
    explicit = PagingConfig(experts_implementation="grouped_mm", **options)
    assert resolve_experts_implementation(explicit, SimpleNamespace(name=fmt_name)) == "grouped_mm"


def test_auto_runs_int4_packed_and_says_it_chose(capsys):
    rc = main(["generate", "--model-path", str(INT4), "--num-resident", "4", "--prompt", "hello",
               "--max-new-tokens", "2", "--experts-implementation", "auto"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "experts: packed (torch's CPU int4 / int8 kernels) on 2 of 2 MoE layers (auto's choice for auto-round on a CPU" in err
