"""ModelOpt NVFP4 and FP8 experts (``quant_method: modelopt``), on the tiny checkpoints NVIDIA
ModelOpt 0.47 itself writes on CPU (tests/data/modelopt, ``make_fixtures.py`` beside them:
``mtq.quantize`` of the routed experts, then ``export_hf_checkpoint``): Qwen3-MoE, Mixtral and
DeepSeek-V3 (E = 8, k = 2, H = 64, I = 32, 2 layers; DeepSeek-V3 with a shared expert and a
dense first layer).

Oracles, independent of pagedexperts' format module: ModelOpt's own ``NVFP4QTensor`` /
``FP8QTensor.dequantize`` of every expert projection, and ``check``'s unpaged reference (the
dense model built from ModelOpt's dequantization: transformers 5.24 has no ModelOpt loader).
Paged vs unpaged: torch.equal of the logits of every prefill and decode step, batch 1 and a
left-padded batch of 2, K = top_k, 2 top_k, E/2, packed and dense slots, stacked keys, and the
disk tier.

Legend: E routed experts (8), k top_k (2), K resident slots.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagedexperts import load_model
from pagedexperts.cli import main as cli_main
from pagedexperts.formats import format_for_config
from pagedexperts.formats.base import TensorSpec
from pagedexperts.tools.check import load_reference_with_choice
from support.quantized_dirs import load_with_two_host_rows, prefill_decode_runs, reference_cache
from support import paths

qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")

DATA = paths.DATA / "modelopt"
E, TOP_K = paths.FIXTURE_E, paths.FIXTURE_TOP_K
FIXTURES = {f"{family}-{algo}": f"modelopt-{algo.lower()}"
            for family in ("qwen3_moe", "mixtral", "deepseek_v3") for algo in ("NVFP4", "FP8")}


def _fixture(name: str) -> Path:
    path = DATA / name
    if not (path / "config.json").exists():
        pytest.skip(f"{path} missing: run tests/data/modelopt/make_fixtures.py with ModelOpt's venv")
    return path


def _expert_modules(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{module prefix: {local name: tensor}} of every routed-expert projection."""
    modules: dict[str, dict] = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            prefix, _, local = key.rpartition(".")
            if ".experts." in prefix and "shared" not in prefix:
                modules.setdefault(prefix, {})[local] = f.get_tensor(key)
    return modules


def _modelopt_dequantize(state: dict, dtype: torch.dtype) -> torch.Tensor:
    weight, scale = state["weight"], state["weight_scale"]
    if weight.dtype == torch.uint8:
        shape = (weight.shape[0], 2 * weight.shape[1])
        return qtensor.NVFP4QTensor(shape, dtype, weight).dequantize(
            dtype=dtype, scale=scale, double_scale=state["weight_scale_2"], block_sizes={-1: 16})
    return qtensor.FP8QTensor(weight.shape, dtype, weight).dequantize(dtype=dtype, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_dequantize_equals_modelopt_on_every_expert(name, dtype):
    """Every expert projection, dequantized by the format (one source of a [1, O, I] row),
    equals ModelOpt's own dequantization into the checkpoint's saved dtype (float32 here; and
    a bfloat16-saved checkpoint: FP8 multiplies in bfloat16)."""
    path = _fixture(name)
    cfg = json.loads((path / "config.json").read_text())
    fmt = format_for_config(dict(cfg, dtype=str(dtype).removeprefix("torch.")))
    modules = _expert_modules(path)
    assert len(modules) == 2 * E * 3 if not name.startswith("deepseek") else E * 3
    for prefix, state in modules.items():
        want = _modelopt_dequantize(dict(state), dtype)
        layout = fmt.layout((TensorSpec("w", tuple(want.shape), dtype),))
        rows = {"w": state["weight"][None], "w_scale": state["weight_scale"].reshape(1, -1) if state[
            "weight_scale"].dim() == 0 else state["weight_scale"][None], "w_input_scale": state["input_scale"].reshape(1, 1)}
        if "weight_scale_2" in state:
            rows["w_scale_2"] = state["weight_scale_2"].reshape(1, 1)
        got = layout.dequantize(rows)["w"][0]
        assert got.dtype == want.dtype and torch.equal(got, want), f"{prefix}: {(got.double() - want.double()).abs().max():.3g}"


def test_gate_and_up_share_their_per_tensor_scales_and_input_scale_is_per_layer():
    """The layout facts the README states, read off ModelOpt's own export: gate and up of one
    expert share weight_scale_2 (NVFP4) / weight_scale (FP8); input_scale is one value per
    layer and projection kind, repeated in every expert; the per-tensor scales are 0-d."""
    for name, shared in (("qwen3_moe-NVFP4", "weight_scale_2"), ("qwen3_moe-FP8", "weight_scale")):
        modules = _expert_modules(_fixture(name))
        for j in range(E):
            gate, up = modules[f"model.layers.1.mlp.experts.{j}.gate_proj"], modules[f"model.layers.1.mlp.experts.{j}.up_proj"]
            assert gate[shared].dim() == 0 and torch.equal(gate[shared], up[shared])
        inputs = {modules[f"model.layers.1.mlp.experts.{j}.down_proj"]["input_scale"].item() for j in range(E)}
        assert len(inputs) == 1
        scales = {modules[f"model.layers.1.mlp.experts.{j}.down_proj"][shared].item() for j in range(E)}
        assert len(scales) > 1  # per expert, unlike input_scale


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_format_and_reference_named(name):
    path = _fixture(name)
    assert format_for_config(json.loads((path / "config.json").read_text())).name == FIXTURES[name]
    _, choice = load_reference_with_choice(path, device="cpu", dtype=None, experts_implementation="grouped_mm")
    assert choice.source == "ModelOpt" and "no loader for quant_method 'modelopt'" in choice.reason, choice.line()


@pytest.fixture(scope="module")
def references():
    return reference_cache(_fixture)


def _assert_exact(paged, reference, what: str) -> None:
    with torch.no_grad():
        for run in prefill_decode_runs(paged, reference):
            assert run.exact and run.tokens_equal, f"{what} {run.prompt}: {run.max_abs_diff:.3g}"
    assert paged.pagedexperts.stats().total().misses > 0


@pytest.mark.default_threads
@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize("num_resident, slot_format", [(TOP_K, "packed"), (2 * TOP_K, "dense"), (E // 2, "packed")])
def test_paged_equals_reference(name, num_resident, slot_format, references):
    paged, _ = load_model(_fixture(name), num_resident=num_resident, slot_format=slot_format)
    assert paged.pagedexperts.expert_format == FIXTURES[name]
    _assert_exact(paged, references(name), f"{name} K={num_resident} {slot_format}")


@pytest.mark.default_threads
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["qwen3_moe-NVFP4", "qwen3_moe-FP8", "deepseek_v3-FP8"])
def test_paged_equals_reference_at_half_precision(name, dtype):
    """The float32 fixtures (float32 scales) run at bfloat16 / float16, as ModelOpt exports are
    run: the reference is ModelOpt's dequantization built at that dtype."""
    reference, choice = load_reference_with_choice(_fixture(name), device="cpu", dtype=dtype,
                                                   experts_implementation="grouped_mm")
    assert reference.dtype == getattr(torch, dtype) and choice.source == "ModelOpt", choice.line()
    paged, _ = load_model(_fixture(name), num_resident=TOP_K, dtype=dtype)
    _assert_exact(paged, reference, f"{name} {dtype}")


@pytest.mark.parametrize("name", ["qwen3_moe-NVFP4", "qwen3_moe-FP8"])
def test_one_thread_and_dense_slots(name, threads, references):
    paged, _ = load_model(_fixture(name), num_resident=TOP_K, slot_format="dense")
    _assert_exact(paged, references(name), f"{name} dense slots {threads} threads")


@pytest.mark.default_threads
@pytest.mark.parametrize("name", ["qwen3_moe-NVFP4", "mixtral-FP8"])
def test_paged_from_the_disk_tier_equals_reference(name, references):
    tiered, expert_bytes = load_with_two_host_rows(_fixture(name), TOP_K)
    _assert_exact(tiered, references(name), f"{name} disk tier")
    totals = tiered.pagedexperts.stats().as_dict()
    assert totals["disk_reads"] > 0 and totals["disk_bytes_read"] == totals["disk_reads"] * expert_bytes


@pytest.mark.default_threads
@pytest.mark.parametrize("name", ["qwen3_moe-NVFP4", "qwen3_moe-FP8"])
def test_stacked_keys_equal_per_expert_keys(name, tmp_path):
    """The same checkpoint with stacked [E, ...] expert keys (``experts.gate_up_proj``,
    ``_scale``, ``_scale_2``, ``_input_scale``: gate rows then up) pages to the logits of the
    per-expert checkpoint's reference, its non-expert weights re-placed at the stacked file's
    page alignment (CPU GEMMs round by alignment: 8e-7 off without it)."""
    from support.quantized_dirs import restack_experts

    from pagedexperts.tools.reference import align_like_checkpoint

    stacked = restack_experts(_fixture(name), tmp_path / "stacked", ("weight", "weight_scale", "weight_scale_2",
                                                                     "input_scale"))
    with safe_open(str(stacked / "model.safetensors"), framework="pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj_input_scale" in f.keys()
        assert not any(".experts.0." in k for k in f.keys())
    reference, _ = load_reference_with_choice(_fixture(name), device="cpu", dtype=None,
                                              experts_implementation="grouped_mm")
    align_like_checkpoint(reference, stacked)
    paged, _ = load_model(stacked, num_resident=TOP_K)
    _assert_exact(paged, reference, f"{name} stacked")


def _edited(tmp_path: Path, name: str, edit) -> Path:
    dst = shutil.copytree(_fixture(name), tmp_path / name)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("edit, reason", [
    (lambda qc: qc.update(group_size=32), "group_size=32: only 16"),
    (lambda qc: qc["ignore"].append("model.layers.1.mlp.experts*"), "routed experts in exclude_modules"),
])
def test_preflight_refuses_what_load_refuses_with_the_same_message(tmp_path, capsys, edit, reason):
    path = _edited(tmp_path, "qwen3_moe-NVFP4", edit)
    with pytest.raises(ValueError) as load_error:
        load_model(path, num_resident=TOP_K)
    message = str(load_error.value)
    assert reason in message and "quant_method 'modelopt', quant_algo 'NVFP4'" in message
    assert "nearest supported: modelopt-nvfp4" in message
    assert cli_main(["preflight", "--model-path", str(path), "--num-resident", str(TOP_K)]) == 2
    assert message in capsys.readouterr().err


def test_unsupported_quant_algo_is_refused_naming_the_nearest(tmp_path):
    path = _edited(tmp_path, "qwen3_moe-FP8", lambda qc: qc.update(quant_algo="FP8_PB_WO"))
    with pytest.raises(ValueError, match=r"quant_algo 'FP8_PB_WO'.*not a supported.*nearest supported: modelopt-fp8"):
        load_model(path, num_resident=TOP_K)


def test_check_cli_passes_naming_modelopt(capsys):
    rc = cli_main(["check", "--model-path", str(_fixture("mixtral-NVFP4")), "--check-resident", f"{TOP_K},{E // 2}",
                   "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and "verdict: PASS: paging is exact on this checkpoint (against ModelOpt)" in out, out
    assert "reference: ModelOpt (transformers cannot load this checkpoint" in out


def test_without_modelopt_the_reference_says_what_to_install(monkeypatch):
    """No nvidia-modelopt here: no traceback from transformers' loading (which cannot read the
    checkpoint), but an ImportError naming the package to install."""
    import pagedexperts.tools.reference as reference

    monkeypatch.setattr(reference, "has_library_reference", lambda qc: False)
    with pytest.raises(ImportError, match=r"no loader for quant_method 'modelopt'.*pip install 'pagedexperts\[modelopt\]'"):
        load_reference_with_choice(_fixture("qwen3_moe-FP8"), device="cpu", dtype=None, experts_implementation="grouped_mm")


@pytest.mark.default_threads
@pytest.mark.parametrize("name", ["qwen3_moe-NVFP4", "mixtral-FP8"])
def test_a_checkpoint_with_only_hf_quant_config_json_pages_as_the_full_one(name, tmp_path, references, capsys):
    """Older ModelOpt exports (and many Hub checkpoints) have no quantization_config in
    config.json, only hf_quant_config.json: read it as vLLM / SGLang do. Same format, same
    exact logits against the full checkpoint's reference, preflight and check agree."""
    dst = shutil.copytree(_fixture(name), tmp_path / name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    paged, _ = load_model(dst, num_resident=TOP_K)
    assert paged.pagedexperts.expert_format == FIXTURES[name]
    _assert_exact(paged, references(name), f"{name} hf_quant_config.json only")
    assert cli_main(["preflight", "--model-path", str(dst), "--num-resident", str(TOP_K)]) == 0
    rc = cli_main(["check", "--model-path", str(dst), "--check-resident", str(TOP_K), "--max-new-tokens", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "(against ModelOpt)" in out, out
