"""compressed-tensors NVFP4A16, NVFP4, W8A8 INT8, MXFP4A16 and W4A16_ASYM experts, on the tiny
checkpoints llm-compressor 0.14 writes (tests/data/llmc, ``make_fixtures.py`` beside them):
Qwen3-MoE (E = 8, k = 2, H = 64, I = 32, 2 layers; every scheme) and Mixtral (same sizes; no
NVFP4 W4A4: llm-compressor's calibration wants a tokenizer the tiny model has not).

References, independent of pagedexperts' formats: compressed-tensors' own per-module
``decompress`` (every expert projection), and ``check``'s unpaged reference
(``tools.reference.choose_reference``: transformers where it is right, else the dense model
built from compressed-tensors' decompression). transformers 5.24 cannot load the W8A8 and
asymmetric W4A16 experts and loads NVFP4 without its global scale; the tests assert that the
reference says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagedexperts import load_model
from pagedexperts.tools.check import load_reference_with_choice
from pagedexperts.formats import format_for_config
from pagedexperts.formats.base import TensorSpec
from pagedexperts.tools.reference import compare_experts
from support.quantized_dirs import load_with_two_host_rows, prefill_decode_runs, reference_cache

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from support import paths  # noqa: E402

DATA = paths.DATA / "llmc"
SCHEMES = {  # fixture -> (format name, reference source, why transformers is not it)
    "qwen3_moe-NVFP4A16": ("nvfp4", "compressed-tensors", "WRONG"),
    "qwen3_moe-NVFP4": ("nvfp4", "compressed-tensors", "WRONG"),
    "qwen3_moe-W8A8": ("w8a8-int8", "compressed-tensors", "cannot load"),
    "qwen3_moe-MXFP4A16": ("ct-mxfp4", "transformers", "cross-checked"),
    "qwen3_moe-W4A16_ASYM-g32": ("w4a16", "compressed-tensors", "cannot load"),
    "mixtral-NVFP4A16": ("nvfp4", "compressed-tensors", "WRONG"),
    "mixtral-W8A8": ("w8a8-int8", "compressed-tensors", "cannot load"),
    "mixtral-MXFP4A16": ("ct-mxfp4", "transformers", "cross-checked"),
    # Exact only with the library reference's non-expert weights at the original checkpoint's
    # page alignment (tools.reference.align_like_checkpoint): without it 8.9e-7 off.
    "mixtral-W4A16_ASYM-g32": ("w4a16", "compressed-tensors", "cannot load"),
    "deepseek_v3-NVFP4A16": ("nvfp4", "compressed-tensors", "WRONG"),
    "deepseek_v3-W8A8": ("w8a8-int8", "compressed-tensors", "cannot load"),
    "deepseek_v3-MXFP4A16": ("ct-mxfp4", "transformers", "cross-checked"),
    "mixtral-W8A16-g16": ("w8a16", "transformers", "cross-checked"),
    "mixtral-FP8_DYNAMIC": ("ct-fp8", "transformers", "cross-checked"),
}
E, TOP_K = paths.FIXTURE_E, paths.FIXTURE_TOP_K


def _fixture(name: str) -> Path:
    path = DATA / name
    if not (path / "config.json").exists():
        pytest.skip(f"{path} missing: run tests/data/llmc/make_fixtures.py with llm-compressor's venv")
    return path


def _projections(path: Path):
    """(scheme, compressor, {prefix: {local name: tensor}}) of every routed-expert projection."""
    qconf = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    scheme = next(iter(qconf.config_groups.values()))
    compressor = BaseCompressor.get_value_from_registry(scheme.format or qconf.format)
    modules: dict[str, dict] = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            prefix, _, local = key.rpartition(".")
            if ".experts." in prefix:
                modules.setdefault(prefix, {})[local] = f.get_tensor(key)
    return scheme, compressor, modules


@pytest.mark.parametrize("name", ["qwen3_moe-NVFP4A16", "qwen3_moe-NVFP4", "qwen3_moe-MXFP4A16"])
def test_fp4_dequantize_equals_compressed_tensors_on_every_expert(name):
    path = _fixture(name)
    scheme, compressor, modules = _projections(path)
    fmt = format_for_config(json.loads((path / "config.json").read_text()))
    assert len(modules) == 2 * E * 3
    for prefix, state in modules.items():
        want = compressor.decompress(dict(state), scheme)["weight"]
        got = fmt.dequantize_linear(fmt.linear_tensor(tuple(want.shape), want.dtype), state)
        assert torch.equal(got, want), f"{prefix}: max diff {(got.double() - want.double()).abs().max():.3g}"


def test_int8_dequantize_equals_compressed_tensors_on_every_expert():
    path = _fixture("qwen3_moe-W8A8")
    scheme, compressor, modules = _projections(path)
    fmt = format_for_config(json.loads((path / "config.json").read_text()))
    for prefix, state in modules.items():
        want = compressor.decompress(dict(state), scheme)["weight"]
        rows, cols = state["weight"].shape
        layout = fmt.layout((TensorSpec("w", (rows, cols), want.dtype),))
        got = layout.dequantize({"w": state["weight"][None], "w_scale": state["weight_scale"][None]})["w"][0]
        assert torch.equal(got, want), prefix


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_format_and_reference_named(name):
    """The checkpoint's format is recognised, and check's reference says which one and why."""
    path = _fixture(name)
    fmt_name, source, why = SCHEMES[name]
    assert format_for_config(json.loads((path / "config.json").read_text())).name == fmt_name
    _, choice = load_reference_with_choice(path, device="cpu", dtype=None, experts_implementation="grouped_mm")
    assert choice.source == source and why in choice.reason, choice.line()


def test_transformers_nvfp4_is_off_by_the_global_scale():
    """What the cross-check catches, computed independently: transformers' NVFP4 experts are
    compressed-tensors' times the projection's global scale (bf16 rounding aside)."""
    from transformers import AutoModelForCausalLM

    path = _fixture("qwen3_moe-NVFP4A16")
    _, compressor, modules = _projections(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    scheme = _projections(path)[0]
    state = modules["model.layers.1.mlp.experts.3.down_proj"]
    want = compressor.decompress(dict(state), scheme)["weight"].float()
    got = hf.model.layers[1].mlp.experts.down_proj[3].float()
    ratio = state["weight_global_scale"].item()
    assert ratio > 100  # a real global scale (448 x 6 / amax)
    assert torch.allclose(got, want * ratio, rtol=2e-2, atol=1e-3)
    ref, _ = load_reference_with_choice(path, device="cpu", dtype=None, experts_implementation="grouped_mm")
    compared, diff, first = compare_experts(hf, ref)
    assert compared > 0 and first is not None and diff > 1.0


@pytest.fixture(scope="module")
def references():
    return reference_cache(_fixture)


@pytest.mark.default_threads
@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("num_resident, slot_format", [(TOP_K, "packed"), (2 * TOP_K, "dense"),
                                                        pytest.param(E // 2, "packed", marks=pytest.mark.slow)])
def test_paged_equals_reference(name, num_resident, slot_format, references):
    reference = references(name)
    paged, _ = load_model(_fixture(name), num_resident=num_resident, slot_format=slot_format,
                          experts_implementation="grouped_mm")  # the library's dequantized experts, bit for bit
    with torch.no_grad():
        for run in prefill_decode_runs(paged, reference):
            assert run.exact and run.tokens_equal, f"{name} K={num_resident} {slot_format} {run.prompt}: {run.max_abs_diff:.3g}"


@pytest.mark.default_threads
@pytest.mark.parametrize("name", ["qwen3_moe-NVFP4", "qwen3_moe-W8A8"])
def test_paged_from_the_disk_tier_equals_reference(name, references):
    tiered, _ = load_with_two_host_rows(_fixture(name), TOP_K)
    reference = references(name)
    with torch.no_grad():
        for run in prefill_decode_runs(tiered, reference):
            assert run.exact and run.tokens_equal, f"{name} disk tier {run.prompt}: {run.max_abs_diff:.3g}"


def test_library_reference_keeps_the_checkpoint_alignment(references):
    """The library reference's non-expert weights sit at the page alignment the paged model
    copies them at (their offset in the original shard), Mixtral's renamed router included:
    CPU GEMMs round by alignment, which made W4A16_ASYM's logits differ by up to 9e-7."""
    import mmap

    name = "mixtral-W4A16_ASYM-g32"
    reference = references(name)
    paged, _ = load_model(_fixture(name), num_resident=TOP_K)
    ref = dict(reference.named_parameters())
    compared = 0
    for key, param in paged.named_parameters():
        if ".experts." in key or key not in ref:
            continue
        assert ref[key].data_ptr() % mmap.PAGESIZE == param.data_ptr() % mmap.PAGESIZE, key
        compared += 1
    assert compared >= 8 and "model.layers.1.mlp.gate.weight" in ref


@pytest.mark.default_threads
@pytest.mark.parametrize("name", ["qwen3_moe-w4a16_mixed"])
def test_check_per_projection_groups_uses_the_library_reference(name, capsys, caplog):
    """gate/up group 32, down group 16: transformers 5.24 applies one group to every expert
    projection, so ``check`` does not try it (no traceback), WARNs why, and PASSes against
    compressed-tensors' decompression."""
    import logging

    from pagedexperts.cli import main

    with caplog.at_level(logging.WARNING):
        rc = main(["check", "--model-path", str(_fixture(name)), "--check-resident", f"{TOP_K},{E // 2}",
                   "--max-new-tokens", "3", "--experts-implementation", "grouped_mm"])
    out = capsys.readouterr()
    assert rc == 0 and "verdict: PASS" in out.out, out.out
    assert "reference: compressed-tensors" in out.out and "different config groups" in out.out
    assert "group_size 32" in out.out and "group_size 16" in out.out
    assert any("different config groups" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "Traceback" not in out.out + out.err and "CONVERSION" not in out.out + out.err
    assert "verdict: PASS: paging is exact on this checkpoint (against compressed-tensors)" in out.out
