"""``--experts-implementation packed`` from the command line: check's two verdicts, the start-up
line, and the options it cannot serve refused before loading, each naming its flag."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pagedexperts.cli import main
from pagedexperts.loading.config import PagingConfig, option_problems
from pagedexperts.paging.steps.table import inner_problem
from support.paths import DATA

INT4 = DATA / "autoround/qwen3_moe-auto_round-experts"


def test_check_gives_both_verdicts(capsys):
    rc = main(["check", "--model-path", str(INT4), "--experts-implementation", "packed", "--check-resident", "3",
               "--max-new-tokens", "3"])
    out, err = capsys.readouterr()
    assert rc == 0, out
    # the paged load's start-up lines, as generate prints them: what host memory holds, and the stored layout
    assert "host memory: " in err and re.search(r"host store: (stored kernel layout \S+|converts)", err), err
    assert "ran: packed on 2 of 2 MoE layers" in out and "ran nowhere" not in out
    assert "references: the same kernels (packed) with all E=8 experts resident (exact); the checkpoint's weights " \
           "dequantized in float32 (each packed matmul, within its bound)" in out
    assert "[vs packed, all E=8 resident]" in out and "logits torch.equal: yes" in out
    assert "2 of 2 experts layers, 0 non-expert linears, M = 1 and 16 rows" in out and "PASS (within the bound)" in out
    assert re.search(r"K=3 top-1 agreement with float32 \(.+, teacher-forced\): \d+/\d+ \(\d+\.\d%\)", out), out
    assert "verdict: PASS (paged packed == packed all resident; packed matmuls within their bound of float32)" in out


def test_check_says_packed_ran_nowhere_on_a_dense_checkpoint(capsys, caplog):
    """Every layer of the bundled (float32) model falls back to grouped_mm: no verdict, reference
    or top-1 label claims packed, and the fallback is one WARNING though check loads the
    checkpoint three times (the reference, all E resident, the K)."""
    rc = main(["check", "--experts-implementation", "packed", "--check-resident", "8", "--max-new-tokens", "2",
               "--prompt", "ROMEO:"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "ran: packed on 0 of 6 MoE layers, grouped_mm on layers [0, 1, 2, 3, 4, 5] (dense experts" in out
    assert "--experts-implementation packed ran nowhere: this checks grouped_mm" in out
    assert "PASS (bit-identical) [vs grouped_mm, all E=64 resident]" in out and "[vs packed" not in out
    assert "packed matmuls: none to bound (nothing runs packed)" in out and "dequantized" not in out
    assert "K=8 top-1 agreement with float32 (transformers, teacher-forced): 4/4 (100.0%)" in out  # float32 model
    assert "verdict: PASS (paged grouped_mm == grouped_mm all resident); packed ran nowhere" in out
    fallbacks = [r for r in caplog.records if "run grouped_mm instead" in r.getMessage()]
    assert len(fallbacks) == 1 and "MoE layers [0, 1, 2, 3, 4, 5]" in fallbacks[0].getMessage(), fallbacks


def test_check_labels_name_the_reference_that_ran(capsys):
    """A GPTQ export whose reference is whichever ``choose_reference`` picks here (transformers needs
    optimum for GPTQ; else the pagedexperts resident model): the references line and the top-1
    line name that source (in float32), never "transformers" for another."""
    rc = main(["check", "--model-path", str(DATA / "gptqmodel/qwen3_moe-gptq"), "--experts-implementation", "packed",
               "--check-resident", "3", "--max-new-tokens", "2", "--prompt", "hello"])
    out = capsys.readouterr().out
    assert rc == 0, out
    source = next(line for line in out.splitlines() if line.startswith("reference: ")).split()[1]
    source = "pagedexperts resident" if source == "pagedexperts" else source
    assert f"(each packed matmul, within its bound); {source} in float32 (top-1 agreement)" in out
    assert f"K=3 top-1 agreement with float32 ({source}, teacher-forced): " in out


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """The bundled model, lm_head untied, quantize --format w4a16 --scope model (attention int4, lm_head int8)."""
    from pagedexperts.tools.quantize import QuantizeOptions, quantize_checkpoint
    from support import bundled

    root = tmp_path_factory.mktemp("ours")
    quantize_checkpoint(model_path=bundled.untied_copy(root / "src"), output=root / "q",
                        options=QuantizeOptions("w4a16", group_size=bundled.MOE_INTERMEDIATE, scope="model"))
    return root / "q"


def _with_tokenizer(path: Path, tmp_path: Path) -> Path:
    """``path``'s files linked beside a tokenizer of its vocabulary (llm-compressor's whole-model
    fixtures ship none; check tokenizes its prompts)."""
    dst = tmp_path / path.name
    dst.mkdir()
    for f in [*path.iterdir(), *(DATA / "llmc/qwen3_moe-w4a16_mixed").glob("tokenizer*")]:
        if not (dst / f.name).exists():
            (dst / f.name).symlink_to(f)
    return dst


def _check(path, *extra) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["check", "--model-path", str(path), "--max-new-tokens", "3", *extra])  # the default: auto, packed
    return rc, out.getvalue()


@pytest.mark.parametrize("name,dtype", [("ours", "bfloat16"), pytest.param("ours", "float32", marks=pytest.mark.slow),
                                        ("gptqmodel/qwen3_moe-gptq", None),
                                        pytest.param("autoround/qwen3_moe-llm_compressor", None, marks=pytest.mark.slow)])
def test_check_passes_on_whole_model_exports(name, dtype, ours):
    """Attention (and our lm_head) computed packed too: both verdicts pass, every packed linear bounded
    (the default at bfloat16; at float32 auto runs grouped_mm, so packed is asked)."""
    packed = ["--experts-implementation", "packed"] if dtype == "float32" else []
    rc, out = _check(ours if name == "ours" else DATA / name, *(["--dtype", dtype] if dtype else []), *packed)
    assert rc == 0 and out.count("PASS (bit-identical)") == 2 and out.count("PASS (within the bound)") == 1, out
    assert re.search(r"experts layers, [1-9]\d* non-expert linears", out), out


def test_transformers_loads_ours_without_a_spurious_lm_head_warning(ours, caplog):
    """Where the commands load ours through transformers (bench's plain model, check's candidates):
    no "Could not match `lm_head`" (compressed-tensors' matcher stops at lm_head's first target,
    Linear, and reports the lm_head target unmatched), and lm_head does get its int8 scheme; a
    target naming no module of the checkpoint still warns."""
    import logging

    from transformers import AutoModelForCausalLM

    from pagedexperts.tools.check import _CheckpointModuleTargets, fused_expert_targets_quiet

    with fused_expert_targets_quiet(ours):
        model = AutoModelForCausalLM.from_pretrained(ours)
    assert model.lm_head.quantization_scheme.weights.num_bits == 8
    assert not [r for r in caplog.records if "Could not match" in r.getMessage()], caplog.text
    quiet = _CheckpointModuleTargets([], ["lm_head", "model.layers.0.self_attn.q_proj"], {"lm_head"})
    for target, kept in (("lm_head", False), ("re:.*vision.*", True), ("re:.*q_proj$", True)):
        record = logging.LogRecord("compressed_tensors.utils.match", logging.WARNING, "", 0,
                                   f"Could not match `{target}` in instance of Qwen3MoeForCausalLM", None, None)
        assert quiet.filter(record) == kept, target


@pytest.mark.parametrize("name", ["autoround/qwen3_moe-auto_round", *(pytest.param(n, marks=pytest.mark.slow) for n in (
    "autoround/qwen3_moe-auto_gptq", "gptqmodel/mixtral-gptq", "llmc_whole/qwen3_moe-W4A16-g32"))])
def test_check_passes_on_the_other_whole_model_exports(name, tmp_path):
    """Both verdicts on the other tool-written whole-model exports: paged == packed all resident
    (torch.equal) at every K, and every packed matmul within its bound of the checkpoint's
    weights dequantized in float32 (the logit tolerance against transformers' model this replaced
    failed on these: a last-bit difference flips an expert choice in these tiny random models)."""
    path = DATA / name
    packed = ["--experts-implementation", "packed"] if name.endswith("auto_gptq") else []  # float16: auto is grouped_mm
    rc, out = _check(_with_tokenizer(path, tmp_path) if name.startswith("llmc") else path, *packed)
    assert rc == 0 and out.count("PASS (bit-identical) [vs packed, all E=8 resident]") == 2, out
    assert out.count("PASS (within the bound)") == 1 and "top-1 agreement with float32" in out, out


def test_generate_states_which_layers_run_packed(capsys):
    rc = main(["generate", "--model-path", str(INT4), "--experts-implementation", "packed", "--num-resident", "4",
               "--prompt", "hello", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "experts: packed (torch's CPU int4 / int8 kernels) on 2 of 2 MoE layers" in err


def test_generate_states_the_packed_non_expert_linears(capsys, tmp_path):
    path = _with_tokenizer(DATA / "llmc_whole/qwen3_moe-W8A16-g16", tmp_path)
    rc = main(["generate", "--model-path", str(path), "--experts-implementation",
               "packed", "--num-resident", "4", "--prompt", "hello", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "quantized non-expert linears: 0 packed, 8 dequantized (w8a16 weight: group-wise int8" in err
    assert "WARNING fallbacks:" in err and "packed -> dequantized at load (w8a16 weight: group-wise int8" in err


def test_generate_states_the_fallback(capsys):
    rc = main(["generate", "--model-path", str(DATA / "llmc/qwen3_moe-fp8_block"), "--experts-implementation",
               "packed", "--num-resident", "4", "--prompt", "hello", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "on 0 of 2 MoE layers (--experts-implementation); grouped_mm on layers [0, 1] (ct-fp8 gate_up_proj: e4m3" in err


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
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16, torch.float32])
def test_auto_is_packed_on_a_cpu_for_the_int_formats(fmt_name, options, want, dtype, monkeypatch):
    """auto: packed on a CPU in mode paged for the int formats at run dtype bfloat16 (the int4
    kernel's vectorised dtype; None: not known, as bfloat16), grouped_mm otherwise."""
    from types import SimpleNamespace

    from pagedexperts.loading.config import resolve_experts_implementation

    monkeypatch.setattr("pagedexperts.loading.config.device_problem", lambda device: None)
    cfg = PagingConfig(experts_implementation="auto", **options)
    fast = dtype in (None, torch.bfloat16)
    assert resolve_experts_implementation(cfg, SimpleNamespace(name=fmt_name), dtype) == (want if fast else "grouped_mm")
    explicit = PagingConfig(experts_implementation="grouped_mm", **options)
    assert resolve_experts_implementation(explicit, SimpleNamespace(name=fmt_name)) == "grouped_mm"


def test_auto_runs_int4_packed_and_says_it_chose(capsys):
    rc = main(["generate", "--model-path", str(INT4), "--num-resident", "4", "--prompt", "hello",
               "--max-new-tokens", "2", "--experts-implementation", "auto"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert ("experts: packed (torch's CPU int4 / int8 kernels) on 2 of 2 MoE layers (auto's choice for auto-round: "
            "int4 / int8 on a CPU: torch's packed kernels") in err


def test_stats_json_says_what_auto_chose_and_why(tmp_path):
    """The default on an int4 checkpoint on a CPU: packed, and the stats say it was auto's choice and why."""
    import json

    out = tmp_path / "stats.json"
    assert main(["generate", "--model-path", str(INT4), "--num-resident", "4", "--prompt", "hello", "--max-new-tokens",
                 "1", "--stats-json", str(out), "--quiet"]) == 0
    report = json.loads(out.read_text())
    assert report["experts_implementation"] == "packed"
    assert report["experts_implementation_why"].startswith("the default, auto's choice for auto-round: int4 / int8 on "
                                                           "a CPU: torch's packed kernels"), report


@pytest.mark.parametrize("argv,want,unwanted", [
    (["--experts-implementation", "auto"], "experts: grouped_mm (auto's choice for dense: grouped_mm: torch's packed "
     "CPU kernels take int4 / int8, not dense", "the default,"),
    (["--experts-implementation", "grouped_mm"], "experts: grouped_mm (--experts-implementation);", "the default,"),
    ([], "experts: grouped_mm (the default, auto's choice for dense: grouped_mm: torch's packed CPU kernels take "
     "int4 / int8, not dense", "--experts-implementation)"),
    (["--model-path", str(INT4)], "experts: packed (torch's CPU int4 / int8 kernels) on 2 of 2 MoE layers (the "
     "default, auto's choice for auto-round: int4 / int8 on a CPU", "--experts-implementation)"),
    (["--model-path", str(INT4), "--experts-implementation", "auto"],
     "experts: packed (torch's CPU int4 / int8 kernels) on 2 of 2 MoE layers (auto's choice for auto-round", "the default,"),
])
def test_one_experts_line_saying_why(argv, want, unwanted, capsys):
    """One "experts:" start-up line saying what ran and why: auto's choice and its reason (the
    default: packed for an int checkpoint on a CPU, grouped_mm for a dense one), "the default" only
    when the flag was left out."""
    rc = main(["generate", "--num-resident", "4", "--prompt", "hello", "--max-new-tokens", "1", *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("experts:")]
    assert rc == 0 and len(lines) == 1, err
    assert want in lines[0] and unwanted not in lines[0], lines[0]
