"""``check``'s reference is used only once it can be trusted (``tools.reference.choose_reference``):
transformers' loading of a quantized checkpoint is refused when it leaves tensors randomly
initialised (what it does to GPTQ's fused experts with gptqmodel and optimum installed) or when a
sample of its experts differs from the format's dequantization of the checkpoint; ``check`` then
falls back, with a WARNING, to the next reference (the pagedexperts resident model).

Checkpoints: block FP8 (transformers dequantizes it itself) of a tiny Qwen3-MoE, written in
the published layout (``quantized_dirs.write_fp8_block``); the sample check's oracle is the
checkpoint read through safetensors and dequantized by the published block formula here.
"""

from __future__ import annotations

import logging

import pytest
import torch

from pagedexperts.loading.checkpoint import format_for_checkpoint
from pagedexperts.storage.safetensors_files import checkpoint_files
from pagedexperts.tools.check import load_reference_with_choice
from pagedexperts.tools.reference import RESIDENT, ReferenceLoaders, choose_reference, compare_with_format
from support.quantized_dirs import write_fp8_block
from support.families import build_model, save_char_tokenizer


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_ref")
    build_model("qwen3_moe").save_pretrained(root / "src")
    save_char_tokenizer(root / "src")
    return write_fp8_block(root / "src", root / "fp8", (16, 16))


def _transformers_model(path):
    from transformers import AutoConfig, AutoModelForCausalLM

    fmt = format_for_checkpoint(AutoConfig.from_pretrained(path), checkpoint_files(path))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="grouped_mm",
                                                **fmt.reference_kwargs()), fmt


def test_transformers_block_fp8_is_cross_checked_then_used(fp8_dir):
    _, choice = load_reference_with_choice(fp8_dir, device="cpu", dtype=None, experts_implementation="grouped_mm")
    assert choice.source == "transformers" and "nothing missing" in choice.reason and choice.experts_compared == 8, \
        choice.line()


def test_the_sample_finds_an_expert_transformers_got_wrong(fp8_dir):
    """compare_with_format against the published dequantization: equal as loaded; one element of
    one sampled expert changed in transformers' model is found and named."""
    from safetensors import safe_open

    model, fmt = _transformers_model(fp8_dir)
    files = checkpoint_files(fp8_dir)
    compared, diff, first = compare_with_format(model, files, fmt, per_layer=8)
    assert (compared, diff, first) == (2 * 8, 0.0, None)  # every expert of both MoE layers
    with safe_open(str(files[0]), framework="pt") as f:  # the published formula, by hand
        q = f.get_tensor("model.layers.1.mlp.experts.5.down_proj.weight").float()
        s = f.get_tensor("model.layers.1.mlp.experts.5.down_proj.weight_scale_inv")
    want = (q * s.repeat_interleave(16, 0).repeat_interleave(16, 1)[: q.shape[0], : q.shape[1]]).to(torch.bfloat16)
    experts = model.model.layers[1].mlp.experts
    assert torch.equal(experts.down_proj[5], want)
    with torch.no_grad():
        experts.down_proj[5, 3, 7] += 1.0
    compared, diff, first = compare_with_format(model, files, fmt, per_layer=8)
    assert first == "model.layers.1.mlp.experts.down_proj[5]" and diff == pytest.approx(1.0, abs=0.01)


def _loaders(transformers, resident="resident model"):
    return ReferenceLoaders(transformers=transformers, dense=None, resident=lambda: resident,
                            sample=lambda model: (4, 0.0, None), format_name="gptq")


def test_missing_keys_refuse_transformers_and_fall_back_with_a_warning(fp8_dir, caplog):
    """What transformers does with gptqmodel and optimum installed: the fused experts are not in
    the checkpoint as its GPTQ quantizer maps it, and stay randomly initialised."""
    model, _ = _transformers_model(fp8_dir)
    info = {"missing_keys": ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]}
    with caplog.at_level(logging.WARNING):
        got, choice = choose_reference(fp8_dir, {"quant_method": "gptq"}, _loaders(lambda p: (model, info)))
    assert got == "resident model" and choice.source == RESIDENT
    assert "leaves 2 model tensors randomly initialised" in choice.reason and "experts.down_proj" in choice.reason
    assert any("checks paging, not the dequantization" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)


def test_a_differing_sample_refuses_transformers(fp8_dir):
    model, _ = _transformers_model(fp8_dir)
    loaders = ReferenceLoaders(transformers=lambda p: (model, {}), dense=None, resident=lambda: "resident model",
                               sample=lambda m: (8, 0.5, "model.layers.1.mlp.experts.down_proj[5]"),
                               format_name="fp8-block")
    got, choice = choose_reference(fp8_dir, {"quant_method": "fp8"}, loaders)
    assert got == "resident model" and choice.source == RESIDENT
    assert "differs from pagedexperts' fp8-block dequantization" in choice.reason and "0.5" in choice.reason


def test_an_unquantized_checkpoint_with_missing_keys_is_an_error(fp8_dir):
    model, _ = _transformers_model(fp8_dir)
    with pytest.raises(ValueError, match="randomly initialised"):
        choose_reference(fp8_dir, None, _loaders(lambda p: (model, {"missing_keys": ["lm_head.weight"]})))


def test_a_refused_reference_is_one_line_not_transformers_load_report():
    """transformers cannot load GPTQModel's per-row FP8 (its block dequantization reshapes a row
    scale): its load report (a table and a traceback per conversion, 140 lines before) is held
    back, and the reference line names the report's first errors instead of pointing above."""
    import subprocess
    import sys

    from support.paths import DATA

    proc = subprocess.run([sys.executable, "-m", "pagedexperts.cli", "check", "--model-path",
                           str(DATA / "gptqmodel/qwen3_moe-fp8"), "--check-resident", "3", "--max-new-tokens", "1",
                           "--prompt", "hello", "--threads", "1"], capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "Traceback" not in text and "LOAD REPORT" not in text and len(text.splitlines()) <= 8, text
    line = next(x for x in proc.stdout.splitlines() if x.startswith("reference: "))
    assert line.startswith(f"reference: {RESIDENT}") and "Error: Fp8Dequantize on tensors destined for" in line
    assert "look at" not in line, line
