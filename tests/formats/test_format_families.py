"""The quantized formats across the tiny family configs (Qwen3-MoE, Mixtral, DeepSeek-V3,
gpt-oss), issue 20's audit: which family each format is checked on, and the layouts a format
has no packing for refused the same way by ``load_model`` and ``preflight``.

Where each quantized format's paged == unpaged exactness is tested, by family:

| format | Qwen3-MoE | Mixtral | DeepSeek-V3 | gpt-oss |
| --- | --- | --- | --- | --- |
| fp8-block | test_fp8_mxfp4 | test_fp8_mxfp4 | test_fp8_mxfp4 | refused (here) |
| int8-block | test_published_int8_gidx | - | - | refused (here) |
| mxfp4 | refused (here) | refused (here) | refused (here) | test_fp8_mxfp4 |
| ct-fp8 | test_llmc_fp8_w8a16_w4a16 | test_llmc_fp4_int8 (FP8_DYNAMIC) | test_llmc_fp8_w8a16_w4a16 (FP8_BLOCK) | refused (here) |
| w8a16 | test_llmc_fp8_w8a16_w4a16 | test_llmc_fp4_int8 | test_llmc_fp8_w8a16_w4a16 | refused (here) |
| ct-pack-mixed | test_llmc_fp8_w8a16_w4a16 | - | - | refused (here) |
| w4a16 | test_int4_paged, test_llmc_fp4_int8 | test_int4_paged, test_llmc_fp4_int8 | test_int4_paged | refused (here) |
| gptq | test_int4_paged | test_int4_paged | test_int4_paged | refused (here) |
| awq | test_int4_paged | test_int4_paged | - | refused (here) |
| nvfp4, ct-mxfp4, w8a8-int8 | test_llmc_fp4_int8 | test_llmc_fp4_int8 | test_llmc_fp4_int8 (NVFP4A16) | refused (here) |
| modelopt-nvfp4, modelopt-fp8 | test_modelopt | test_modelopt | test_modelopt | refused (here) |
| auto-round-fp8, -nvfp4, -mxfp4, gptqmodel-fp8 | test_tool_checkpoints | - | - | refused (here) |

gpt-oss's experts module stores its weights transposed ([in, out], ``is_transposed``): every
format but gpt-oss's own MXFP4 packs nn.Linear's [out, in] only, and MXFP4 has no published
layout for the others. The "-" cells are llm-compressor / ModelOpt fixtures not written yet.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedexperts import load_model
from pagedexperts.cli import main as cli_main
from pagedexperts.formats import format_for_config
from support.families import build_model
from support.paths import DATA

# format -> a quantization_config its checkpoints carry (the committed fixtures' where there is one)
CONFIGS = {
    "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "int8-block": {"quant_method": "blockwise_int8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True},
    "ct-fp8": "llmc/qwen3_moe-fp8_dynamic",
    "w8a16": "llmc/qwen3_moe-w8a16",
    "w4a16": "llmc/qwen3_moe-W4A16_ASYM-g32",
    "nvfp4": "llmc/qwen3_moe-NVFP4",
    "ct-mxfp4": "llmc/qwen3_moe-MXFP4A16",
    "w8a8-int8": "llmc/qwen3_moe-W8A8",
    "modelopt-nvfp4": "modelopt/qwen3_moe-NVFP4",
    "modelopt-fp8": "modelopt/qwen3_moe-FP8",
    "auto-round-fp8": "autoround/qwen3_moe-auto_round-FP8_STATIC-experts",
    "auto-round-nvfp4": "autoround/qwen3_moe-auto_round-NVFP4-experts",
    "auto-round-mxfp4": "autoround/qwen3_moe-auto_round-MXFP4-experts",
    "gptqmodel-fp8": "gptqmodel/qwen3_moe-fp8-experts",
}


def _quantization_config(name: str) -> dict:
    qc = CONFIGS[name]
    if isinstance(qc, dict):
        return qc
    path = DATA / qc / "config.json"
    if not path.exists():
        pytest.skip(f"{path} missing (fixture not written)")
    return json.loads(path.read_text())["quantization_config"]


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """family -> a saved tiny random model of it (unquantized weights: the refusals come first)."""
    built = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = tmp_path_factory.mktemp(family)
            build_model(family).save_pretrained(built[family])
        return built[family]

    return get


def _with_quantization(src: Path, dst: Path, qc: dict) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    (dst / "config.json").unlink()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc)))
    return dst


def _refusal(path: Path, capsys) -> str:
    """load_model's refusal, asserting preflight prints the same one (exit 2)."""
    with pytest.raises(ValueError) as error:
        load_model(path, num_resident=2)
    assert cli_main(["preflight", "--model-path", str(path), "--num-resident", "2"]) == 2
    assert str(error.value) in capsys.readouterr().err
    return str(error.value)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gpt_oss_transposed_experts_refused_alike_naming_mxfp4(name, family_dir, tmp_path, capsys):
    qc = _quantization_config(name)
    assert format_for_config(json.loads(((family_dir("qwen3_moe")) / "config.json").read_text())
                             | {"quantization_config": qc}).name == name
    message = _refusal(_with_quantization(family_dir("gpt_oss"), tmp_path / name, qc), capsys)
    assert f"{name} has no published layout for 'gpt_oss' experts stored transposed" in message
    assert "nearest supported: mxfp4" in message


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_mxfp4_on_linear_experts_refused_alike(family, family_dir, tmp_path, capsys):
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    message = _refusal(_with_quantization(family_dir(family), tmp_path / family, qc), capsys)
    assert f"mxfp4 has no published layout for '{family}' experts stored as nn.Linear's [out, in]" in message


@pytest.mark.parametrize("qc", [{"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
                                {"quant_method": "hqq", "nbits": 4, "group_size": 64}])
def test_a_format_nothing_resembles_names_no_nearest(qc):
    """bitsandbytes / hqq share nothing with any supported format: the refusal says so instead of
    naming the registry's first format (it said 'nearest supported: fp8-block')."""
    from pagedexperts.formats import nearest_format

    assert nearest_format(qc).startswith("none (")
    with pytest.raises(ValueError, match=r"nearest supported: none \(") as err:
        format_for_config({"model_type": "qwen3_moe", "quantization_config": qc})
    assert "quant_method 'bitsandbytes'" in str(err.value) or "quant_method 'hqq'" in str(err.value)
