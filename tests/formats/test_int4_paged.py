"""Paged int4 experts equal the unpaged model bit for bit (issue 12): prefill and greedy decode
(``check_model``) and a left-padded batch, at K = top_k, 2 top_k and E/2, packed and dense slots.

References (the unpaged model, plain ``from_pretrained``):
- w4a16 symmetric: transformers' own loading of the quantized checkpoint (it decompresses it
  with the compressed-tensors package);
- w4a16 asymmetric: a dense checkpoint of the compressed-tensors package's decompression of
  every expert (transformers 5.24 drops MoE zero points, see test_format_w4a16);
- GPTQ (desc_act, v1 zeros) and AWQ: a dense checkpoint of ``tests/support/int4_oracle.py``'s
  published dequantization from the raw integers (transformers needs GPU kernels for them).

Legend: E routed experts, k top_k, K resident slots.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedexperts import load_model
from pagedexperts.tools.quantize import QuantizeOptions, quantize_checkpoint
from support.families import E, TOP_K, assert_exact, build_model, save_char_tokenizer
from support.quantized_dirs import GROUP, _oracle_pair, _w4a16_pair

pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(variant, family) -> (quantized dir, reference dir), built on first use (bf16 models)."""
    built = {}

    def get(variant: str, family: str):
        if (variant, family) not in built:
            root = tmp_path_factory.mktemp(f"{variant}_{family}")
            src = root / "src"
            build_model(family).to(torch.bfloat16).save_pretrained(src)
            save_char_tokenizer(src)
            if variant.startswith("w4a16"):
                built[variant, family] = _w4a16_pair(src, root, symmetric=variant == "w4a16")
            else:
                built[variant, family] = _oracle_pair(src, root, variant)
        return built[variant, family]

    return get


def _padded_batch_exact(paged, reference) -> None:
    """Two prompts, the shorter left-padded: prefill logits at the real positions equal."""
    ids = torch.tensor([[0, 0, 0, 72, 101, 108, 108, 111], [82, 79, 77, 69, 79, 58, 10, 66]])
    mask = (ids != 0).long()
    with torch.no_grad():
        a = paged(input_ids=ids, attention_mask=mask).logits
        b = reference(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.equal(a[real], b[real]), f"padded batch: max |diff| {(a[real].float() - b[real].float()).abs().max():.3e}"


CASES = [("w4a16", "qwen3_moe"), ("w4a16", "mixtral"), ("w4a16", "deepseek_v3"), ("w4a16-asym", "qwen3_moe"),
         ("gptq", "qwen3_moe"), ("gptq", "mixtral"), ("gptq", "deepseek_v3"), ("awq", "qwen3_moe"), ("awq", "mixtral")]


@pytest.mark.slow
@pytest.mark.parametrize("variant, family", CASES)
def test_paged_int4_equals_unpaged(variant, family, pairs):
    """grouped_mm over packed and dense slots is bit-identical to transformers' (the packed CPU
    kernels' exactness: tests/paging/test_packed_cpu_exact.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized, ref_dir = pairs(variant, family)
    reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.bfloat16, experts_implementation="grouped_mm").eval()
    tokenizer = AutoTokenizer.from_pretrained(quantized)
    for k, slot_format in ((TOP_K, "packed"), (2 * TOP_K, "packed"), (E // 2, "packed"), (TOP_K, "dense")):
        paged, _ = load_model(quantized, num_resident=k, slot_format=slot_format, experts_implementation="grouped_mm")
        what = f"{variant} {family} K={k} {slot_format} slots"
        assert_exact(paged, reference, tokenizer, what)
        _padded_batch_exact(paged, reference)


@pytest.mark.slow
@pytest.mark.parametrize("variant, left_out", [("w4a16-asym", "gate_up_proj_zero_point"), ("gptq", "down_proj_g_idx"),
                                               ("awq", "down_proj_qzeros")])
def test_independence_check_catches_an_int4_tensor_left_out_of_the_page_in(variant, left_out, pairs, monkeypatch):
    """The field bug (a zero point or g_idx not paged: an expert runs with a stale one) fails
    at start-up naming the tensor."""
    from pagedexperts.loading.independence import IndependenceError
    from pagedexperts.storage.host_store import HostExpertStore

    quantized, _ = pairs(variant, "qwen3_moe")
    # the dequantizing page-in (grouped_mm: --slot-format's packed rows); passes when every tensor is paged
    load_model(quantized, num_resident=TOP_K, slot_format="packed", experts_implementation="grouped_mm")

    def copy_without(self, expert, slot, slots):
        for name, host in self.tensors.items():
            if name != left_out:
                slots[name][slot].copy_(host[expert])

    monkeypatch.setattr(HostExpertStore, "copy_to_slot", copy_without)
    with pytest.raises(IndependenceError, match=f"'{left_out}'.*left out of the page-in"):
        load_model(quantized, num_resident=TOP_K, slot_format="packed", experts_implementation="grouped_mm")


@pytest.mark.slow
def test_check_command_on_gptq_uses_the_resident_reference_and_says_so(pairs, capsys, caplog):
    """transformers needs gptqmodel for GPTQ: ``check`` compares with the resident model
    (dequantized once by the same format, tested against the published formula above) and
    logs a WARNING naming the reason."""
    from pagedexperts.cli import main

    quantized, _ = pairs("gptq", "qwen3_moe")
    rc = main(["check", "--model-path", str(quantized), "--check-resident", f"{TOP_K},{E // 2}", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("PASS (bit-identical)") == 2, out
    assert any("transformers cannot load this gptq checkpoint" in r.getMessage() for r in caplog.records)


@pytest.fixture(scope="module")
def w4a16_fp32_scales(tmp_path_factory) -> Path:
    """A w4a16 checkpoint quantized from a float32 model (``quantize``): float32 scales, as
    ``bundled:w4a16``."""
    root = tmp_path_factory.mktemp("w4a16_fp32_scales")
    src = root / "src"
    build_model("qwen3_moe").to(torch.float32).save_pretrained(src)
    save_char_tokenizer(src)
    out = root / "w4a16"
    quantize_checkpoint(model_path=src, output=out, options=QuantizeOptions("w4a16", group_size=GROUP, symmetric=True))
    return out


@pytest.mark.slow
def test_w4a16_float32_scales_at_bfloat16_equal_transformers(w4a16_fp32_scales, threads):
    """Loaded at bfloat16, transformers keeps the dequantized routed experts in the scales'
    dtype (float32) and grouped_mm computes them in float32; the paged model must dequantize
    its waves (packed slots) and slots (dense) into float32 too (was 0.09 off in bfloat16)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = AutoModelForCausalLM.from_pretrained(
        w4a16_fp32_scales, dtype=torch.bfloat16, experts_implementation="grouped_mm").eval()
    experts = next(m for m in reference.modules() if type(m).__name__.endswith("Experts"))
    assert (experts.gate_up_proj.dtype, experts.down_proj.dtype, reference.lm_head.weight.dtype) == (
        torch.float32, torch.float32, torch.bfloat16), "transformers' loading changed: revisit the w4a16 layout"
    tokenizer = AutoTokenizer.from_pretrained(w4a16_fp32_scales)
    for k, slot_format in ((TOP_K, "packed"), (E // 2, "packed"), (TOP_K, "dense")):
        paged, _ = load_model(w4a16_fp32_scales, num_resident=k, dtype="bfloat16", slot_format=slot_format,
                                  experts_implementation="grouped_mm")
        assert_exact(paged, reference, tokenizer, f"w4a16 fp32 scales at bfloat16 K={k} {slot_format} slots")
        _padded_batch_exact(paged, reference)


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_w4a16_float32_scales_at_bfloat16_refused_where_transformers_fails(w4a16_fp32_scales, implementation, capsys):
    """eager and batched_mm cannot multiply bfloat16 inputs by the float32 experts (unpaged
    transformers raises too): load_model and ``check`` refuse up front naming the configuration."""
    from pagedexperts.cli import main

    with pytest.raises(ValueError, match=f"--experts-implementation {implementation} cannot run this w4a16 "
                                         r"checkpoint at --dtype bfloat16: .*scales' dtype float32"):
        load_model(w4a16_fp32_scales, dtype="bfloat16", experts_implementation=implementation)
    rc = main(["check", "--model-path", str(w4a16_fp32_scales), "--dtype", "bfloat16",
               "--experts-implementation", implementation])
    err = capsys.readouterr().err
    assert rc != 0 and f"{implementation} cannot run this w4a16 checkpoint" in err and "Traceback" not in err, err
    load_model(w4a16_fp32_scales, num_resident=TOP_K, experts_implementation=implementation)  # float32: not refused
