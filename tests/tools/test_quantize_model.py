"""``quantize --format w4a16 --scope model`` (``tools.quantize_model``): a whole-model int4 export.

Ours against what third-party tools write: llm-compressor's whole-model layout (tests/data/llmc_whole:
a ``Linear`` config group first, concrete router names in ``ignore``), lm_head int8 per channel in a
group of its own, routers, norms and embeddings copied byte for byte. Oracles: the source
checkpoint's bytes, and compressed-tensors' own ``decompress`` of each module transformers builds
(``from_pretrained``: the modules it quantized and the scheme it gave each), which must equal the
dense weight the package's loader dequantizes. Refusals name the module and the kernel's reason
before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("compressed_tensors")

from pagedexperts.loading.bundled import bundled_model_path  # noqa: E402
from pagedexperts.tools.quantize import QuantizeOptions, quantize_checkpoint  # noqa: E402
from support import bundled  # noqa: E402
from support.paths import DATA  # noqa: E402

GROUP = bundled.MOE_INTERMEDIATE  # the experts' down_proj input: the largest group every module takes
LAYERS, HIDDEN = bundled.LAYERS, bundled.HIDDEN
KV = bundled.CONFIG["num_key_value_heads"] * bundled.CONFIG["head_dim"]  # k and v projections' output rows


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """(source dir, our --scope model export of it)."""
    root = tmp_path_factory.mktemp("whole")
    src = bundled.untied_copy(root / "src")
    quantize_checkpoint(model_path=src, output=root / "q", options=QuantizeOptions("w4a16", group_size=GROUP,
                                                                                  scope="model"))
    return src, root / "q"


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_scope_model_writes_llm_compressors_layout(whole):
    src, out = whole
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    llmc = json.loads((DATA / "llmc_whole/qwen3_moe-W4A16-g32/config.json").read_text())["quantization_config"]
    groups = list(qc["config_groups"].values())
    assert [g["targets"] for g in groups] == [["Linear"], ["lm_head"]]
    assert list(llmc["config_groups"].values())[0]["targets"] == ["Linear"]  # what llm-compressor writes first
    int4, int8 = groups[0]["weights"], groups[1]["weights"]
    assert (int4["num_bits"], int4["strategy"], int4["group_size"], int4["symmetric"]) == (4, "group", GROUP, True)
    assert (int8["num_bits"], int8["strategy"], int8["symmetric"]) == (8, "channel", True)
    assert qc["format"] == "pack-quantized" == groups[0]["format"] == groups[1]["format"]
    assert qc["ignore"] == [f"model.layers.{i}.mlp.gate" for i in range(LAYERS)]  # routers, named as llm-compressor does
    source, written = _tensors(src), _tensors(out)
    for i in range(LAYERS):
        for proj, rows in (("q_proj", HIDDEN), ("k_proj", KV), ("v_proj", KV), ("o_proj", HIDDEN)):
            base = f"model.layers.{i}.self_attn.{proj}"
            assert f"{base}.weight" not in written
            assert written[f"{base}.weight_packed"].shape == (rows, HIDDEN // 8)  # eight int4 per int32
            assert written[f"{base}.weight_scale"].shape == (rows, HIDDEN // GROUP)
            assert written[f"{base}.weight_shape"].tolist() == [rows, HIDDEN]
    assert written["lm_head.weight_packed"].shape == (bundled.VOCAB, HIDDEN // 4)  # four int8 per int32
    assert written["lm_head.weight_scale"].shape == (bundled.VOCAB, 1)
    kept = [k for k in source if "self_attn.q_proj" not in k and "_proj.weight" not in k and k != "lm_head.weight"]
    assert any(".mlp.gate." in k for k in kept) and any("norm" in k for k in kept) and "model.embed_tokens.weight" in kept
    for key in kept:  # routers, norms, embeddings: byte for byte
        assert torch.equal(written[key], source[key]), key


def test_transformers_loads_it_as_compressed_tensors_decompresses_it(whole):
    """transformers builds every quantized module (attention int4, lm_head int8) with the scheme of
    its group; compressed-tensors' decompression of each equals the package's dequantized weight."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from transformers import AutoModelForCausalLM

    from pagedexperts import load_model

    _, out = whole
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ours, _ = load_model(out, dtype="float32", num_resident=bundled.TOP_K, experts_implementation="grouped_mm")  # grouped_mm: dequantized at load
    modules = {n: m for n, m in reference.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    assert sorted(modules) == sorted([f"model.layers.{i}.self_attn.{p}" for i in range(LAYERS)
                                      for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + ["lm_head"])
    assert modules["lm_head"].quantization_scheme.weights.num_bits == 8
    assert modules["model.layers.0.self_attn.q_proj"].quantization_scheme.weights.num_bits == 4
    assert len(ours.pagedexperts.quantized_linears.modules) == len(modules)
    for name, module in modules.items():
        state = {n: p for n, p in module.named_parameters(recurse=False)}
        want = PackedQuantizationCompressor.decompress(state, module.quantization_scheme)["weight"]
        got = ours.get_submodule(name).weight
        assert torch.equal(got, want.to(got.dtype)), name


def test_a_tied_lm_head_stays_tied_and_is_ignored(tmp_path):
    out = tmp_path / "q"
    report = quantize_checkpoint(model_path=bundled_model_path(), output=out,
                                 options=QuantizeOptions("w4a16", group_size=GROUP, scope="model"))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "lm_head" in qc["ignore"] and len(qc["config_groups"]) == 1
    assert report.linear_tensors == 4 * LAYERS and not any(k.startswith("lm_head") for k in _tensors(out))


def _small_kv_source(tmp_path: Path) -> Path:
    """A bf16 Qwen3-MoE whose k and v projections have 8 output rows (1 KV head of 8)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=1, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    return tmp_path / "src"


@pytest.mark.parametrize("case", ["rows", "group"])
def test_a_module_the_kernels_cannot_take_is_refused_naming_it(case, tmp_path):
    """Refused before the output exists: an output size the int4 kernel cannot take (k_proj's 8
    rows), a group size it lacks (16); the message names the module and the kernel's reason."""
    if case == "rows":
        src, group = _small_kv_source(tmp_path), 32
        match = r"model\.layers\.0\.self_attn\.k_proj.*8 output rows \(the int4 kernel needs a multiple of 16\)"
    else:
        src, group = bundled_model_path(), 16
        match = rf"model\.layers\.0\.self_attn\.k_proj.*group of 16 of {HIDDEN} input columns.*32 / 64 / 128 / 256"
    with pytest.raises(ValueError, match=match):
        quantize_checkpoint(model_path=src, output=tmp_path / "out",
                            options=QuantizeOptions("w4a16", group_size=group, scope="model"))
    assert not (tmp_path / "out").exists()
    quantize_checkpoint(model_path=src, output=tmp_path / "experts",  # the experts alone are fine
                        options=QuantizeOptions("w4a16", group_size=group, scope="experts"))


def test_unknown_scope_is_refused_by_argparse_and_scope_model_is_w4a16_only(capsys, tmp_path):
    from pagedexperts.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--format", "w4a16", "--scope", "layers", "--output", str(tmp_path / "x")])
    assert exc.value.code == 2 and "invalid choice: 'layers'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--scope model writes w4a16 only"):
        quantize_checkpoint(model_path=bundled_model_path(), output=tmp_path / "y",
                            options=QuantizeOptions("fp8-block", scope="model"))
