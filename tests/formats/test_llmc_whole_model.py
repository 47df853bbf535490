"""Whole-model compressed-tensors checkpoints (issue 29): llm-compressor's default recipe quantizes
attention, shared experts and dense MLP layers too, and users run such checkpoints in their own
dtype. Fixtures: tests/data/llmc_whole (``make_fixtures.py`` beside them, bfloat16 sources:
Qwen3-MoE in every format, Mixtral with regex targets and FP8_DYNAMIC, DeepSeek-V3 with MLA, a
shared expert and a dense first layer quantized; one with float16 scales under a bfloat16
config, as AutoRound writes).

Oracles, independent of pagedexperts' formats: compressed-tensors' own per-module
``decompress`` (each non-expert module's dense weight), and ``check``'s reference (the dense
model built from compressed-tensors' decompression of every module). Paged == reference with
torch.equal at the checkpoint's own dtype and at float32, a prompt alone and a left-padded
batch of 2, default thread count.

Legend: E routed experts (8), k top_k (2), K resident slots.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagedexperts import load_model
from pagedexperts.tools.check import load_reference_with_choice
from support.quantized_dirs import prefill_decode_runs

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from support import paths  # noqa: E402

DATA = paths.DATA / "llmc_whole"
E, TOP_K = paths.FIXTURE_E, paths.FIXTURE_TOP_K
FIXTURES = {  # name -> (format, its dtype as run by default: config.json's)
    "qwen3_moe-W4A16-g32": "w4a16", "qwen3_moe-W4A16_ASYM-g32": "w4a16",
    "qwen3_moe-W4A16_ASYM-g32-fp16scales": "w4a16", "qwen3_moe-W8A16-g16": "w8a16",
    "qwen3_moe-W8A16_ASYM-g16": "w8a16", "qwen3_moe-W4A16_ASYM-mixed": "ct-pack-mixed",
    "qwen3_moe-W8A8": "w8a8-int8", "qwen3_moe-FP8": "ct-fp8", "qwen3_moe-FP8_DYNAMIC": "ct-fp8",
    "qwen3_moe-FP8_BLOCK": "ct-fp8", "qwen3_moe-NVFP4A16": "nvfp4", "qwen3_moe-NVFP4": "nvfp4",
    "qwen3_moe-MXFP4A16": "ct-mxfp4", "mixtral-W4A16_ASYM-regex": "ct-pack-mixed", "mixtral-FP8_DYNAMIC": "ct-fp8",
    "deepseek_v3-W4A16-g16": "w4a16", "deepseek_v3-FP8_BLOCK": "ct-fp8",
}


def _fixture(name: str) -> Path:
    path = DATA / name
    if not (path / "config.json").exists():
        pytest.skip(f"{path} missing: run tests/data/llmc_whole/make_fixtures.py with llm-compressor's venv")
    return path


def _non_expert_modules(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {local name: tensor}} of every quantized non-expert module of the checkpoint."""
    modules: dict[str, dict] = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            prefix, _, local = key.rpartition(".")
            if ".experts." not in prefix:
                modules.setdefault(prefix, {})[local] = f.get_tensor(key)
    return {p: m for p, m in modules.items() if "weight_scale" in m}


@pytest.mark.parametrize("name", ["qwen3_moe-W4A16_ASYM-g32-fp16scales", "qwen3_moe-W8A16_ASYM-g16",
                                  "qwen3_moe-FP8", "qwen3_moe-NVFP4", "deepseek_v3-W4A16-g16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_non_expert_weights_equal_compressed_tensors_decompression(name, dtype):
    """Every quantized attention / shared-expert / dense-MLP weight the paged model holds is
    compressed-tensors' own decompression of the module (in the scales' dtype), cast to the run
    dtype, bit for bit; routers, norms and embeddings stay as stored."""
    path = _fixture(name)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    qconf = QuantizationConfig.model_validate(qc)
    paged, _ = load_model(path, num_resident=TOP_K, experts_implementation="grouped_mm", dtype=str(dtype).removeprefix("torch."))
    params = dict(paged.named_parameters())
    modules = _non_expert_modules(path)
    assert len(modules) >= 8 and sorted(paged.pagedexperts.quantized_linears.modules) == sorted(
        m + ".weight" for m in modules)
    for module, state in modules.items():
        scheme = next(g for g in qconf.config_groups.values() if "Linear" in g.targets)
        state = {k: v for k, v in state.items() if k != "input_scale"}
        want = BaseCompressor.get_value_from_registry(scheme.format or qconf.format).decompress(state, scheme)["weight"]
        got = params[module + ".weight"]
        assert got.dtype == dtype and torch.equal(got, want.to(dtype)), module


@pytest.fixture(scope="module")
def references():
    built = {}

    def get(name, dtype):
        if (name, dtype) not in built:
            built[name, dtype] = load_reference_with_choice(_fixture(name), device="cpu", dtype=dtype,
                                                            experts_implementation="grouped_mm")
        return built[name, dtype]

    return get


@pytest.mark.default_threads
@pytest.mark.parametrize("dtype", [None, pytest.param("float32", marks=pytest.mark.slow)])  # None: the checkpoint's dtype
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_paged_equals_library_reference(name, dtype, references):
    """K = top_k, packed slots: every format, at the checkpoint's own dtype (None: bfloat16) and
    at float32; the reference is compressed-tensors' decompression, and says why."""
    path = _fixture(name)
    reference, choice = references(name, dtype)
    why = ("non-expert modules quantized", "different config groups")  # the latter: per-projection groups
    assert choice.source == "compressed-tensors" and any(w in choice.reason for w in why), choice.line()
    paged, _ = load_model(path, num_resident=TOP_K, experts_implementation="grouped_mm", dtype=dtype)
    assert paged.pagedexperts.expert_format == FIXTURES[name]
    with torch.no_grad():
        for run in prefill_decode_runs(paged, reference):
            assert run.exact and run.tokens_equal, f"{name} {dtype} {run.prompt}: {run.max_abs_diff:.3g}"


@pytest.mark.default_threads
@pytest.mark.parametrize("name", ["qwen3_moe-W4A16_ASYM-mixed", "mixtral-W4A16_ASYM-regex"])
def test_dense_slots_and_half_the_experts(name, references):
    reference, _ = references(name, None)
    paged, _ = load_model(_fixture(name), num_resident=E // 2, experts_implementation="grouped_mm", slot_format="dense")
    with torch.no_grad():
        for run in prefill_decode_runs(paged, reference):
            assert run.exact and run.tokens_equal, f"{name} {run.prompt}: {run.max_abs_diff:.3g}"


def test_scale_dtype_is_the_checkpoints_not_the_configs():
    """AutoRound's exports: float16 scales under config dtype bfloat16. The experts dequantize
    in float16 (the scales' dtype, as compressed-tensors does and transformers stacks them), the
    store holds the scales as float16 (no lossy cast to bfloat16)."""
    path = _fixture("qwen3_moe-W4A16_ASYM-g32-fp16scales")
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    paged, _ = load_model(path, num_resident=TOP_K, experts_implementation="grouped_mm")
    rt = paged.pagedexperts
    layout = next(iter(rt.layouts.values()))
    assert {s.dtype for s in layout.dense_specs} == {torch.float16}
    scales = [s for s in layout.packed_specs if s.name.endswith("_scale")]
    assert scales and all(s.dtype == torch.float16 for s in scales)
    assert paged.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_regex_targets_bind_each_projection_to_its_group():
    """Mixtral recipes' ``re:.*w[13]$`` (group 32) and ``re:.*w2$`` (group 16) beside a
    ``Linear`` group (attention, group 32): compressed-tensors gives the regex targets
    precedence, whatever the order of the groups in config.json (llm-compressor writes
    ``Linear`` first)."""
    from pagedexperts.formats import format_for_config

    config = json.loads((_fixture("mixtral-W4A16_ASYM-regex") / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    assert list(groups.values())[0]["targets"] == ["Linear"]
    fmt = format_for_config(config)
    assert fmt.name == "ct-pack-mixed"
    assert (fmt.args["gate_up_proj"].group_size, fmt.args["down_proj"].group_size) == (32, 16)
    assert not fmt.args["down_proj"].symmetric


def test_preflight_counts_the_dequantized_non_expert_memory(capsys):
    """preflight's non-expert bytes: the quantized attention projections at their dequantized size
    in the run dtype (hand count from the config: q and o [64, 64], k and v [32, 64] per layer, 2
    layers), plus the unquantized tensors at the run dtype."""
    from pagedexperts.cli import main

    path = _fixture("qwen3_moe-W4A16-g32")
    attention = 2 * (64 * 64 * 2 + 32 * 64 * 2)
    unquantized = 2 * 256 * 64 + 2 * (8 * 64 + 2 * 64 + 2 * 16) + 64  # embed + lm_head, router + norms, final norm
    for dtype, size in (("bfloat16", 2), ("float32", 4)):
        assert main(["preflight", "--model-path", str(path), "--num-resident", str(TOP_K), "--dtype", dtype,
                     "--experts-implementation", "grouped_mm", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["dequantized_modules"] == 8 and report["dequantized_bytes"] == attention * size
        assert report["non_expert_bytes"] == (attention + unquantized) * size
        paged, _ = load_model(path, num_resident=TOP_K, experts_implementation="grouped_mm", dtype=dtype)
        assert paged.pagedexperts.quantized_linears.dense_bytes == attention * size


def test_load_reports_the_dequantized_modules(caplog):
    with caplog.at_level(logging.INFO, logger="pagedexperts.loading.fill"):
        load_model(_fixture("qwen3_moe-W8A8"), num_resident=TOP_K)
    assert any("8 quantized non-expert modules (w8a8-int8) dequantized at load" in r.getMessage()
               for r in caplog.records)


def _with_tokenizer(name: str, tmp_path: Path) -> Path:
    """The fixture's files linked into ``tmp_path`` beside a 128-token tokenizer (the fixtures'
    vocab is 256; ``check`` tokenizes its prompts)."""
    dst = tmp_path / name
    dst.mkdir()
    for f in _fixture(name).iterdir():
        (dst / f.name).symlink_to(f)
    for f in (DATA.parent / "llmc" / "qwen3_moe-w4a16_mixed").glob("tokenizer*"):
        (dst / f.name).symlink_to(f)
    return dst


@pytest.mark.default_threads
@pytest.mark.parametrize("name, dtype", [(n, None) for n in sorted(FIXTURES)] + [
    ("qwen3_moe-W4A16_ASYM-g32-fp16scales", "float16")])
def test_check_passes_at_the_checkpoints_dtype(name, dtype, tmp_path, capsys, monkeypatch):
    """``check`` at the dtype the tool wrote (config.json's bfloat16; float16 for the float16
    scales AutoRound writes): PASS against compressed-tensors' decompression, in that dtype."""
    import pagedexperts.tools.check as tools_check
    from pagedexperts.cli import main

    built = []
    real = tools_check.load_reference_with_choice
    monkeypatch.setattr(tools_check, "load_reference_with_choice",
                        lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    argv = ["check", "--model-path", str(_with_tokenizer(name, tmp_path)), "--check-resident", str(TOP_K),
            "--max-new-tokens", "2", "--prompt", "The city", "--experts-implementation", "grouped_mm"] + (
            ["--dtype", dtype] if dtype else [])  # grouped_mm against the library reference at the run dtype
    rc = main(argv)
    out = capsys.readouterr().out
    assert rc == 0 and "verdict: PASS" in out and "reference: compressed-tensors" in out, out
    assert [model.dtype for model, _ in built] == [getattr(torch, dtype or "bfloat16")]
