"""``quantize`` writes the published block-FP8 and MXFP4 layouts (transformers loads them and
builds exactly the formats' dequantization), keeps sharded checkpoints sharded, and leaves
every non-expert tensor byte-identical."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors import safe_open

from pagedexperts.tools.quantize import QuantizeOptions, quantize_checkpoint
from support.quantized_dirs import fp8_block_dense, mxfp4_dense
from support.families import build_model


def _non_experts_unchanged(src_model, quantized):
    for name, param in src_model.named_parameters():
        if ".experts." not in name:
            assert torch.equal(param, quantized.get_parameter(name)), name


@pytest.mark.slow
def test_fp8_block_loads_in_transformers_as_the_formats_dequantization(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    build_model("qwen3_moe").to(torch.bfloat16).save_pretrained(src)
    out = tmp_path / "fp8"
    report = quantize_checkpoint(model_path=src, output=out, options=QuantizeOptions("fp8-block", block=(32, 32)))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["weight_block_size"] == [32, 32] and "model.layers.1.self_attn.q_proj" in qc["modules_to_not_convert"]
    assert 0.49 < report.expert_bytes_out / report.expert_bytes_in < 0.52
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    _non_experts_unchanged(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16), model)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        def deq(j, p):
            key = f"model.layers.1.mlp.experts.{j}.{p}.weight"
            return fp8_block_dense(f.get_tensor(key)[None], f.get_tensor(key + "_scale_inv")[None], torch.bfloat16)[0]

        want = torch.stack([deq(j, "down_proj") for j in range(8)])
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj, want)


@pytest.mark.slow
def test_mxfp4_of_gpt_oss_loads_in_transformers_as_the_formats_dequantization(tmp_path):
    from transformers import AutoModelForCausalLM

    from pagedexperts.tools.check import transformers_model

    src = tmp_path / "src"
    build_model("gpt_oss").to(torch.bfloat16).save_pretrained(src)
    out = tmp_path / "mxfp4"
    quantize_checkpoint(model_path=src, output=out, options=QuantizeOptions("mxfp4"))
    model = transformers_model(out, dtype=torch.bfloat16)  # transformers' local path: no Hub kernel
    _non_experts_unchanged(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16), model)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        key = "model.layers.0.mlp.experts.gate_up_proj"
        want = mxfp4_dense(f.get_tensor(key + "_blocks"), f.get_tensor(key + "_scales"), torch.bfloat16)
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_bias").dtype == torch.bfloat16
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, want)


def test_sharded_source_stays_sharded(tiny_moe_sharded_dir, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(model_path=tiny_moe_sharded_dir, output=out, options=QuantizeOptions("w4a16", group_size=16))
    src_index = json.loads((tiny_moe_sharded_dir / "model.safetensors.index.json").read_text())["weight_map"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(src_index.values())
    packed = "model.layers.0.mlp.experts.3.up_proj.weight_packed"
    assert index["weight_map"][packed] == src_index["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert index["metadata"]["total_size"] < sum(
        (tiny_moe_sharded_dir / n).stat().st_size for n in set(src_index.values()))
    for name in set(index["weight_map"].values()):  # every key listed is in the shard named
        with safe_open(str(out / name), "pt") as f:
            assert {k for k, v in index["weight_map"].items() if v == name} == set(f.keys())


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], ids=["022", "002", "077"])
def test_written_shards_get_the_mode_open_gives_under_the_umask(tiny_moe_sharded_dir, tmp_path, umask):
    """safetensors writes a 0600 temporary file and renames it: the shards are chmod-ed to what
    ``open()`` creates; the copied tokenizer, config and the rest are new files too (not the source's mode)."""
    out = tmp_path / "q"
    old = os.umask(umask)
    try:
        probe = tmp_path / "probe"
        open(probe, "wb").close()
        quantize_checkpoint(model_path=tiny_moe_sharded_dir, output=out, options=QuantizeOptions("w4a16", group_size=16))
    finally:
        os.umask(old)
    want = stat.S_IMODE(probe.stat().st_mode)
    assert want == 0o666 & ~umask
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in shards} == {
        f.name: oct(want) for f in shards}
    copied = sorted(f for f in out.iterdir() if f.is_file() and f.suffix != ".safetensors")  # tokenizer, config, ...
    assert len(copied) > 2 and {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in copied} == {
        f.name: oct(want) for f in copied}
