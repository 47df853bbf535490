"""Whole-model GPTQ and AWQ checkpoints (issue 29): every nn.Linear quantized (attention, routed and
shared experts, dense MLP layers; the router and lm_head kept), as GPTQModel's and AutoRound's
default recipes write them, in float16 and bfloat16 sources. Written in the published on-disk
layouts by ``tests/support/int4_oracle.py`` (GPTQ: v1 zeros, desc_act's permuted g_idx, symmetric
z = 8; AWQ GEMM's interleaved order) until tool-written fixtures land.

Oracle: a float checkpoint of the published dequantization from the raw integers (float16
product, stored exactly in float32), loaded by transformers; paged == it with torch.equal at the
checkpoint's own dtype and at float32, a prompt alone and a left-padded batch of 2, default
threads. The reference's dequantized modules get their own allocations
(``align_like_checkpoint``), as the paged model's do. ``check`` on such a checkpoint PASSes
against the pagedexperts resident model (transformers needs GPU kernels for GPTQ/AWQ here).

Legend: E routed experts (8), k top_k (2).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.int4_oracle import pack_awq, pack_gptq, rtn_int4
from pagedexperts import load_model
from pagedexperts.tools.reference import align_like_checkpoint
from support.quantized_dirs import prefill_decode_runs, write_checkpoint_dir
from support.families import E, TOP_K, build_model, save_char_tokenizer

LINEAR = re.compile(r"\.(?:[a-z_]*proj(?:_with_mqa)?|w[123])\.weight$")  # not the router (mlp.gate), not lm_head
CASES = {  # name -> (format, family, checkpoint dtype, group size, symmetric)
    "gptq-qwen3_moe-fp16": ("gptq", "qwen3_moe", torch.float16, 16, False),  # dense MLP layers too
    "gptq-deepseek_v3-bf16": ("gptq", "deepseek_v3", torch.bfloat16, 8, True),  # MLA, shared expert, dense layer
    "awq-qwen3_moe-fp16": ("awq", "qwen3_moe", torch.float16, 16, False),
    "awq-mixtral-bf16": ("awq", "mixtral", torch.bfloat16, 16, False),
}


def _whole_model(root: Path, name: str) -> tuple[Path, Path, int]:
    """(quantized dir, reference dir, quantized non-expert modules) of case ``name``."""
    fmt, family, dtype, group, symmetric = CASES[name]
    src = root / "src"
    build_model(family).to(dtype).save_pretrained(src)
    save_char_tokenizer(src)
    gen = torch.Generator().manual_seed(1)
    packed, dense, non_expert = {}, {}, 0
    for key, value in load_file(src / "model.safetensors").items():
        if not LINEAR.search(key):
            packed[key] = dense[key] = value
            continue
        w = rtn_int4(value, group, desc_act=fmt == "gptq" and not symmetric, generator=gen, symmetric=symmetric)
        parts = pack_gptq(w) if fmt == "gptq" else pack_awq(w)
        packed.update({key.removesuffix("weight") + n: t for n, t in parts.items()})
        dense[key] = w.dense(torch.float32)  # the float16 product, exact in float32
        non_expert += ".experts." not in key
    qc = ({"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": not symmetric, "sym": symmetric,
           "checkpoint_format": "gptq"} if fmt == "gptq" else
          {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})
    return write_checkpoint_dir(src, root / "q", packed, qc), write_checkpoint_dir(src, root / "ref", dense), non_expert


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            built[name] = _whole_model(tmp_path_factory.mktemp(name), name)
        return built[name]

    return get


@pytest.mark.default_threads
@pytest.mark.parametrize("own_dtype", [True, False], ids=["own-dtype", "float32"])
@pytest.mark.parametrize("name", list(CASES))
def test_paged_whole_model_equals_published_dequantization(name, own_dtype, pairs):
    from transformers import AutoModelForCausalLM

    quantized, ref_dir, non_expert = pairs(name)
    dtype = CASES[name][2] if own_dtype else torch.float32
    run = str(dtype).removeprefix("torch.")
    paged, _ = load_model(quantized, num_resident=TOP_K, dtype=run)
    assert len(paged.pagedexperts.quantized_linears.modules) == non_expert > 0
    reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=dtype, experts_implementation="grouped_mm").eval()
    align_like_checkpoint(reference, quantized)
    with torch.no_grad():
        for result in prefill_decode_runs(paged, reference):
            assert result.exact and result.tokens_equal, f"{name} {run} {result.prompt}: {result.max_abs_diff:.3g}"


@pytest.mark.default_threads
@pytest.mark.parametrize("name", ["gptq-qwen3_moe-fp16", "awq-qwen3_moe-fp16"])
def test_check_passes_in_float16_against_the_resident_reference(name, pairs, capsys, caplog):
    """float16 is where GPTQ's down_proj and AWQ's transposed dequantized views made ``check``
    FAIL (the resident reference kept them non-contiguous; CPU GEMMs round differently there)."""
    from pagedexperts.cli import main

    quantized, _, _ = pairs(name)
    rc = main(["check", "--model-path", str(quantized), "--check-resident", f"{TOP_K},{E // 2}",
               "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("PASS (bit-identical)") == 2, out
    assert "reference: pagedexperts resident (transformers cannot load this" in out
    assert any("checks paging, not the dequantization" in r.getMessage() for r in caplog.records)


def test_a_quantized_module_missing_a_tensor_is_named(pairs, tmp_path):
    quantized, _, _ = pairs("awq-qwen3_moe-fp16")
    dst = shutil.copytree(quantized, tmp_path / "broken")
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.qzeros"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"module 'model\.layers\.0\.self_attn\.k_proj' \(awq\).*lacks \['qzeros'\]"):
        load_model(dst, num_resident=TOP_K)
