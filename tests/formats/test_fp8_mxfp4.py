"""Quantized experts paged packed (issue 12): block FP8 and MXFP4 against transformers' loading.

The oracle is transformers' own loading of the same quantized directory (``from_pretrained``
on CPU dequantizes block FP8 and MXFP4 into the model's dtype). Checkpoints are tiny family
models written in the published on-disk layouts (``tests/support/quantized_dirs.py``): Qwen3-MoE and
DeepSeek-V3 in block FP8 (per-expert keys, attention and shared experts quantized too), gpt-oss
in MXFP4 (stacked ``*_blocks`` / ``*_scales`` and bf16 biases). One config per format has
sizes that are multiples of the format's block but not of 128 (gpt-oss hidden 2880 = 90 x 32
is the real case): gpt-oss hidden 96, FP8 blocks of 64 on hidden 192.

Legend: E routed experts, k top_k, K resident slots, H hidden.
"""

from __future__ import annotations

import pytest
import torch

from support.tiny import assert_same
from pagedexperts import load_model
from pagedexperts.tools.check import check_model
from pagedexperts.formats import format_for_config
from pagedexperts.formats.fp8_fp4.fp8_block import quantize_fp8_block
from pagedexperts.formats.fp8_fp4.mxfp4 import quantize_mxfp4
from pagedexperts.loading.independence import IndependenceError
from support.quantized_dirs import fp8_block_dense, mxfp4_dense, restack_fp8_experts
from support.families import DECODE_STEPS, E, PROMPTS, TOP_K
from support.quantized_dirs import QUANTIZED



@pytest.fixture(scope="session")
def quantized_reference():
    """(path, dtype) -> transformers' own loading of the quantized directory (dequantized, on its
    local path: ``tools.check.transformers_model``)."""
    from pagedexperts.tools.check import transformers_model

    cache = {}

    def get(path, dtype=torch.bfloat16):
        if (str(path), dtype) not in cache:
            cache[(str(path), dtype)] = transformers_model(path, dtype=dtype, experts_implementation="grouped_mm").eval()
        return cache[(str(path), dtype)]

    return get


# --- the formats' arithmetic against transformers' own functions -----------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((64, 256), (128, 128)), ((192, 128), (64, 64))])
def test_fp8_dequantize_equals_transformers(shape, block, dtype):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    w = torch.randn(3, *shape) * 0.05
    pairs = [quantize_fp8_block(w[i], block) for i in range(3)]
    q, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    ref = torch.stack([Fp8Dequantize(None)._dequantize_one(q[i], s[i], output_dtype=dtype) for i in range(3)])
    assert_same(fp8_block_dense(q, s, dtype), ref, "block FP8 dequantize")
    # round to nearest: within half an e4m3 step (2**-3 relative) of each block's amax
    err = (fp8_block_dense(q, s, torch.float32) - w).abs().max().item()
    assert err <= w.abs().max().item() * 2**-4, err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_dequantize_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    w = torch.randn(4, 96, 160) * 0.05  # [E, out, in], in = 5 blocks of 32
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (4, 96, 5, 16) and scales.shape == (4, 96, 5)
    assert_same(mxfp4_dense(blocks, scales, dtype), convert_moe_packed_tensors(blocks, scales, dtype=dtype), "MXFP4")
    # e2m1 values at the block's power-of-two scale: each value within half a step of 6 * 2**exp
    back = mxfp4_dense(blocks, scales, torch.float32).transpose(1, 2)
    assert (back - w).abs().max().item() <= w.abs().max().item() * 0.25


def test_a_format_whose_package_is_missing_is_named_not_fatal(monkeypatch):
    from pagedexperts import formats

    monkeypatch.setitem(formats.FORMATS, "fake", formats.FormatRecord(
        "fake", "pagedexperts.formats.fake_missing_module:Fake", "a fake", (None, None, None)))
    assert "fake" not in formats.available_formats()
    assert format_for_config({"quantization_config": {"quant_method": "mxfp4"}}).name == "mxfp4"
    with pytest.raises(ValueError, match="unavailable here: .*'fake' is registered but"):
        format_for_config({"quantization_config": {"quant_method": "bitsandbytes"}})


def test_fp8_quantizer_refuses_grids_transformers_reads_differently():
    with pytest.raises(ValueError, match="192 cols is neither a multiple of the block 128"):
        quantize_fp8_block(torch.ones(64, 192), (128, 128))


def test_dequantize_rows_are_independent():
    """Dequantizing experts together equals dequantizing each alone (per-wave batching)."""
    torch.manual_seed(1)
    q, s = zip(*(quantize_fp8_block(torch.randn(128, 64), (64, 64)) for _ in range(5)))
    q, s = torch.stack(q), torch.stack(s)
    together = fp8_block_dense(q[[4, 1, 3]], s[[4, 1, 3]], torch.bfloat16)
    for i, e in enumerate([4, 1, 3]):
        assert_same(together[i], fp8_block_dense(q[e : e + 1], s[e : e + 1], torch.bfloat16)[0], f"expert {e}")


def test_format_recognition():
    assert format_for_config({}).name == "dense"
    assert format_for_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}).block == (128, 128)
    assert format_for_config({"quantization_config": {"quant_method": "mxfp4"}}).name == "mxfp4"
    with pytest.raises(ValueError, match="per-tensor FP8"):
        format_for_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": None}})
    with pytest.raises(ValueError, match="activation_scheme='static'"):
        format_for_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                   "activation_scheme": "static"}})
    with pytest.raises(ValueError, match="'bitsandbytes'.*supported: dense \\(unquantized\\)"):
        format_for_config({"quantization_config": {"quant_method": "bitsandbytes"}})
    # a compressed-tensors FP8_BLOCK user reads the list as their checkpoint spells it
    with pytest.raises(ValueError, match=r"format 'float-quantized'.*num_bits=4.*nearest supported: ct-fp8 "
                       r"\(compressed-tensors 'float-quantized'.*FP8_BLOCK\).*fp8-block \(quant_method 'fp8' with"):
        format_for_config({"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                           "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float"}}}}})


# --- paged vs transformers' loading -----------------------------------------------------------


@pytest.mark.parametrize("slot_format", ["packed", "dense"])
@pytest.mark.parametrize("name", [n if n in ("qwen3_moe-fp8", "gpt_oss-mxfp4") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in QUANTIZED])  # one per format quick, the variants slow
def test_paged_quantized_equals_transformers(name, slot_format, quantized_dirs, quantized_reference):
    path = quantized_dirs(name)
    reference = quantized_reference(path)
    for k in (TOP_K, 2 * TOP_K, E // 2):
        paged, tok = load_model(path, num_resident=k, slot_format=slot_format)
        rt = paged.pagedexperts
        assert rt.expert_format == QUANTIZED[name][1].replace("fp8", "fp8-block")
        result = check_model(paged, reference, tok, PROMPTS, max_new_tokens=DECODE_STEPS)
        assert result.passed, f"{name} {slot_format} K={k}: max |diff| {result.max_abs_diff:.3e}"
        stats = rt.stats().total()
        assert stats.misses > 0
        # every page-in moved one expert's packed bytes, fewer than its dense bytes
        assert stats.bytes_paged == stats.misses * rt.expert_bytes
        assert rt.expert_bytes < rt.dense_expert_bytes


@pytest.mark.parametrize("slot_format", ["packed", "dense"])
def test_stacked_fp8_layout_equals_transformers_per_expert_loading(slot_format, quantized_dirs, quantized_reference, tmp_path):
    """Block FP8 with stacked experts (transformers' FP8Experts save layout) pages the same
    bytes and computes the same logits as the per-expert checkpoint loaded by transformers."""
    per_expert = quantized_dirs("qwen3_moe-fp8")
    stacked = restack_fp8_experts(per_expert, tmp_path / "stacked")
    for k in (TOP_K, E // 2):
        paged, tok = load_model(stacked, num_resident=k, slot_format=slot_format)
        result = check_model(paged, quantized_reference(per_expert), tok, PROMPTS, max_new_tokens=DECODE_STEPS)
        assert result.passed, f"stacked FP8 {slot_format} K={k}: max |diff| {result.max_abs_diff:.3e}"


def _padded_batch(tok, prompts):
    rows = [tok(p, return_tensors="pt")["input_ids"][0] for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):  # left padding, as generate() batches
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


@pytest.mark.parametrize("slot_format", ["packed", "dense"])
@pytest.mark.parametrize("threads", [None, 1])
@pytest.mark.parametrize("name", ["deepseek_v3-fp8", "gpt_oss-mxfp4-h96"])
def test_padded_batch_prefill_and_decode(name, threads, slot_format, quantized_dirs, quantized_reference):
    path = quantized_dirs(name)
    reference = quantized_reference(path)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        paged, tok = load_model(path, num_resident=TOP_K, slot_format=slot_format)
        ids, mask = _padded_batch(tok, ["Hi", *PROMPTS])
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            got, want = paged.generate(ids, **kw), reference.generate(ids, **kw)
    finally:
        torch.set_num_threads(before)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert_same(a, b, f"{name} batch of 3 (left-padded), step {step}, threads {threads or before}")
    assert paged.pagedexperts.stats().total().misses > 0


def test_auto_slot_format_is_dense_on_cpu(quantized_dirs):
    paged, _ = load_model(quantized_dirs("qwen3_moe-fp8"), num_resident=TOP_K)
    assert paged.pagedexperts.resolved.slot_format == "dense" and paged.pagedexperts.config.slot_format == "auto"
    pager = next(iter(paged.pagedexperts.runners.values()))
    assert set(pager.slots) == {"gate_up_proj", "down_proj"} and pager.slots["down_proj"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown slot format 'sparse'.*--slot-format"):
        load_model(quantized_dirs("qwen3_moe-fp8"), slot_format="sparse")


def test_bf16_and_fp32_model_dtype(quantized_dirs, quantized_reference):
    """The dequantized dtype follows --dtype, as transformers' loader follows dtype=."""
    path = quantized_dirs("qwen3_moe-fp8")
    paged, tok = load_model(path, num_resident=TOP_K, dtype="float32")
    result = check_model(paged, quantized_reference(path, torch.float32), tok, PROMPTS[:1], max_new_tokens=4)
    assert result.passed, result.max_abs_diff


# --- the start-up independence check ----------------------------------------------------------


def test_independence_check_catches_a_tensor_left_out_of_the_page_in(quantized_dirs, monkeypatch):
    from pagedexperts.storage.host_store import HostExpertStore

    path = quantized_dirs("qwen3_moe-fp8")

    def copy_without_scales(self, expert, slot, slots):  # the field bug: one tensor not paged
        for name, host in self.tensors.items():
            if name != "down_proj_scale_inv":
                slots[name][slot].copy_(host[expert])

    monkeypatch.setattr(HostExpertStore, "copy_to_slot", copy_without_scales)
    with pytest.raises(IndependenceError, match="'down_proj'.*'down_proj_scale_inv'.*left out of the page-in"):
        load_model(path, num_resident=TOP_K, slot_format="packed")


def test_independence_check_catches_a_per_expert_tensor_left_on_the_module(quantized_dirs, quantized_reference):
    """The field bug: a bias left out of the store and the slots stays an [E, ...] tensor on the
    experts module, which the kernel indexes with slot ids: wrong logits, and caught by name.
    (In packed slots of a quantized layer the same omission fails loudly at dequantization.)"""
    from pagedexperts.storage.safetensors_files import checkpoint_files
    from pagedexperts.loading.independence import check_model_independence

    path = quantized_dirs("gpt_oss-bf16")
    paged, tok = load_model(path, num_resident=TOP_K, dtype="bfloat16", check_independence=False)
    rt = paged.pagedexperts
    for site in rt.sites:
        bias = rt.stores[site.name].tensors.pop("down_proj_bias")
        rt.runners[site.layer].slots.pop("down_proj_bias")
        site.module.register_parameter("down_proj_bias", torch.nn.Parameter(bias, requires_grad=False))
    result = check_model(paged, quantized_reference(path), tok, PROMPTS[:1], max_new_tokens=4)
    assert not result.passed  # the bug is real: the paged model computes something else
    with pytest.raises(IndependenceError, match="layer 0: per-expert tensor 'down_proj_bias'.*not paged"):
        check_model_independence(paged, checkpoint_files(path), format_for_config(paged.config))


def test_independence_check_catches_a_per_expert_buffer_left_on_the_module(quantized_dirs):
    """A buffer counts as a parameter does: an [E, ...] buffer registered on an experts module
    and never paged would be indexed with slot ids too (the check once looked at parameters only)."""
    from pagedexperts.storage.safetensors_files import checkpoint_files
    from pagedexperts.loading.independence import check_model_independence

    path = quantized_dirs("gpt_oss-bf16")
    paged, _ = load_model(path, num_resident=TOP_K, dtype="bfloat16", check_independence=False)
    check_model_independence(paged, checkpoint_files(path), format_for_config(paged.config))  # clean: passes
    for site in paged.pagedexperts.sites:
        site.module.register_buffer("stray_scale", torch.ones(site.num_experts, 4))
    with pytest.raises(IndependenceError, match="layer 0: per-expert tensor 'stray_scale'.*not paged"):
        check_model_independence(paged, checkpoint_files(path), format_for_config(paged.config))


def test_independence_check_catches_a_scale_left_out_of_the_store(quantized_dirs):
    from pagedexperts.storage.safetensors_files import checkpoint_files
    from pagedexperts.loading.independence import check_model_independence

    path = quantized_dirs("qwen3_moe-fp8")
    paged, _ = load_model(path, num_resident=TOP_K, check_independence=False, slot_format="packed")
    rt = paged.pagedexperts
    for site in rt.sites:
        rt.stores[site.name].tensors.pop("gate_up_proj_scale_inv")
        rt.runners[site.layer].slots.pop("gate_up_proj_scale_inv")
    with pytest.raises(IndependenceError, match="layer 1 .*packed tensor 'gate_up_proj_scale_inv' is not in the slots"):
        check_model_independence(paged, checkpoint_files(path), format_for_config(paged.config))


@pytest.mark.parametrize("slot_format", ["packed", "dense"])
def test_independence_check_passes_and_counts(slot_format, quantized_dirs):
    from pagedexperts.storage.safetensors_files import checkpoint_files
    from pagedexperts.loading.independence import check_model_independence

    path = quantized_dirs("gpt_oss-mxfp4")
    paged, _ = load_model(path, num_resident=TOP_K, check_independence=False, slot_format=slot_format)
    fmt = format_for_config(paged.config)
    n = check_model_independence(paged, checkpoint_files(path), fmt, experts_per_layer=3)
    assert n == 3 * len(paged.pagedexperts.runners)
    for pager in paged.pagedexperts.runners.values():  # the check leaves the slots empty
        assert all(not t.view(torch.uint8).any() for t in pager.slots.values())


# --- the commands on a quantized directory ----------------------------------------------------


@pytest.mark.parametrize("slot_format", ["packed", "dense"])
def test_check_command_on_quantized_dir(slot_format, quantized_dirs, capsys):
    from pagedexperts.cli import main

    path = quantized_dirs("deepseek_v3-fp8")
    rc = main(["check", "--model-path", str(path), "--max-new-tokens", "4", "--prompt", "The city",
               "--check-resident", f"{TOP_K},{E // 2}", "--slot-format", slot_format])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("PASS (bit-identical)") == 2, out


def _write_header_only(path, entries: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file whose header names ``entries`` (name -> (dtype, shape)); the data
    region is a sparse hole of the right length (preflight reads headers only)."""
    import json
    import math
    import struct

    size = {"F8_E4M3": 1, "F32": 4, "BF16": 2, "U8": 1}
    header, offset = {}, 0
    for name, (dtype, shape) in entries.items():
        n = math.prod(shape) * size[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


@pytest.mark.slow
def test_preflight_reads_block_fp8_expert_bytes_of_a_qwen3_30b_a3b_header(tmp_path, capsys):
    """Qwen3-30B-A3B-FP8's shape: H=2048, I=768, E=128, k=8, 48 layers, blocks of 128: an expert
    is 3 x 2048 x 768 fp8 bytes + 3 x (6 x 16) float32 scales = 4,719,744 B = 4.72 MB."""
    import json

    from pagedexperts.cli import main

    h, i, e, layers = 2048, 768, 128, 48
    config = {"model_type": "qwen3_moe", "hidden_size": h, "moe_intermediate_size": i, "num_experts": e,
              "num_experts_per_tok": 8, "num_hidden_layers": layers, "num_attention_heads": 32,
              "num_key_value_heads": 4, "head_dim": 128, "dtype": "bfloat16",
              "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    entries = {}
    for layer in range(layers):
        for j in range(e):
            for proj, shape in (("gate_proj", [i, h]), ("up_proj", [i, h]), ("down_proj", [h, i])):
                key = f"model.layers.{layer}.mlp.experts.{j}.{proj}"
                entries[key + ".weight"] = ("F8_E4M3", shape)
                entries[key + ".weight_scale_inv"] = ("F32", [shape[0] // 128, shape[1] // 128])
    entries["model.embed_tokens.weight"] = ("BF16", [151936, h])
    _write_header_only(tmp_path / "model.safetensors", entries)
    for slot_format, slot_mb in (("packed", "227 MB"), ("dense", "453 MB dense")):
        rc = main(["preflight", "--model-path", str(tmp_path), "--num-resident", "64", "--json",
                   "--slot-format", slot_format])
        report = json.loads(capsys.readouterr().out)
        assert rc == 0
        assert report["expert_bytes"] == 3 * h * i + 3 * 6 * 16 * 4 == 4_719_744
        assert report["dense_expert_bytes"] == 3 * h * i * 2
        assert report["slot_bytes"] == layers * (report["expert_bytes"] if slot_format == "packed" else 3 * h * i * 2)
        assert report["all_miss_bytes_per_token"] == layers * 8 * 4_719_744  # page-ins stay packed
        main(["preflight", "--model-path", str(tmp_path), "--num-resident", "64", "--slot-format", slot_format])
        out = capsys.readouterr().out
        assert "expert                4.72 MB (packed; 9.44 MB dequantized)" in out, out
        assert f"slot (expert x L)     {slot_mb}" in out, out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
class TestQuantizedOnCuda:
    """Packed page-ins on the copy stream, per-wave dequantization on the compute stream, and
    dense slots dequantized on the copy stream, against transformers' dequantized loading on
    the same GPU (``dequantize=True``: without it transformers would run its FP8/MXFP4 kernels,
    another computation)."""

    @pytest.mark.parametrize("slot_format", ["packed", "dense"])
    @pytest.mark.parametrize("name", ["deepseek_v3-fp8", "gpt_oss-mxfp4-h96"])
    def test_paged_equals_dequantized_reference(self, name, slot_format, quantized_dirs):
        from pagedexperts.tools.check import load_reference

        path = quantized_dirs(name)
        reference = load_reference(path, device="cuda", dtype="bfloat16", experts_implementation="grouped_mm")
        for k in (TOP_K, E // 2):
            paged, tok = load_model(path, num_resident=k, device="cuda", slot_format=slot_format)
            result = check_model(paged, reference, tok, PROMPTS, max_new_tokens=DECODE_STEPS)
            assert result.passed, f"{name} {slot_format} K={k} on CUDA: max |diff| {result.max_abs_diff:.3e}"
