"""Layouts no CPU tool writes today, written by hand in their published form: block INT8
(SGLang's ``blockwise_int8``: int8 ``weight`` + float32 ``weight_scale_inv`` per block, partial
edge blocks) and compressed-tensors ``pack-quantized`` int4 with ``weight_g_idx`` (activation
order, as compressed-tensors <= 0.12 wrote it; 0.13+ and llm-compressor 0.14 no longer do).

Oracle: the published dequantization implemented here independently (block: ``q * s[r // bm,
c // bn]`` with explicit row/column indices; g_idx: compressed-tensors' own group dequantize of
the columns permuted by ``argsort(g_idx)``, permuted back, as compressed-tensors <= 0.12 did),
written as a float checkpoint that transformers loads: paged logits of the quantized
checkpoint == transformers' logits of the dequantized one, torch.equal, K = top_k and E/2,
batch 1 and a padded batch, packed and dense slots.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.tiny import E, TOP_K, VOCAB, tiny_model
from pagedexperts import load_model

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

BLOCK = (12, 12)  # H = 32, I = 16: partial edge blocks in both dims, gate and up each their own
GROUP = 8
EXPERT_KEY = ".mlp.experts."


def _split(src: Path):
    tensors = load_file(src / "model.safetensors")
    return tensors, [k for k in tensors if EXPERT_KEY in k and k.endswith("_proj.weight")]


def _write(dst: Path, src: Path, tensors: dict, qc: dict | None) -> Path:
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    if qc is not None:
        cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def block_int8(w: torch.Tensor, block=BLOCK):
    """(int8 q, float32 scale_inv [ceil(O/bm), ceil(I/bn)]), symmetric round-to-nearest."""
    bm, bn = block
    rows, cols = torch.arange(w.shape[0]) // bm, torch.arange(w.shape[1]) // bn
    amax = torch.zeros(rows.max() + 1, cols.max() + 1)
    for r in range(amax.shape[0]):
        for c in range(amax.shape[1]):
            amax[r, c] = w[rows == r][:, cols == c].abs().max()
    scale = amax / 127
    q = torch.round(w / scale[rows][:, cols]).clamp(-127, 127).to(torch.int8)
    return q, scale


def published_block_dequant(q, scale, block=BLOCK):
    rows, cols = torch.arange(q.shape[0]) // block[0], torch.arange(q.shape[1]) // block[1]
    return q.to(torch.float32) * scale[rows[:, None], cols[None, :]]


def gidx_int4(w: torch.Tensor, seed: int, symmetric: bool = True):
    """Activation-order int4: columns assigned to groups in a random order (``g_idx``), scales
    (and zero points when not ``symmetric``) per (row, group) from compressed-tensors' qparams.
    Returns (q int8 [O, I], scale [O, G], zero point int8 [O, G] or None, g_idx, args)."""
    cols = w.shape[1]
    perm = torch.randperm(cols, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(cols, dtype=torch.int32)
    g_idx[perm] = torch.arange(cols, dtype=torch.int32) // GROUP
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=GROUP)
    grouped = w[:, perm].unflatten(-1, (cols // GROUP, GROUP))
    scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    q_perm = quantize(w[:, perm], scale, zp, args, dtype=torch.int8)
    q = torch.empty_like(q_perm)
    q[:, perm] = q_perm
    return q, scale, None if symmetric else zp, g_idx, args


def published_gidx_dequant(q, scale, zp, g_idx, args):
    perm = torch.argsort(g_idx)
    w = dequantize(q[:, perm], scale, zp, args)
    out = torch.empty_like(w)
    out[:, perm] = w
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """name -> (quantized checkpoint, float checkpoint of its published dequantization)."""
    root = tmp_path_factory.mktemp("published")
    src = root / "src"
    tiny_model(seed=5).save_pretrained(src)
    tensors, keys = _split(src)
    out = {}
    q_t, d_t = dict(tensors), dict(tensors)
    for k in keys:
        q, s = block_int8(tensors[k])
        q_t[k], q_t[k + "_scale_inv"] = q, s
        d_t[k] = published_block_dequant(q, s)
    qc = {"quant_method": "blockwise_int8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    out["int8-block"] = (_write(root / "int8", src, q_t, qc), _write(root / "int8-ref", src, d_t, None))
    out["int8-block-bf16"] = _whole_model_bf16(root, qc)
    for name, symmetric in (("ct-pack-mixed", True), ("ct-pack-mixed-asym", False)):
        q_t, d_t = dict(tensors), dict(tensors)
        for i, k in enumerate(keys):
            q, s, zp, g, args = gidx_int4(tensors[k], seed=i, symmetric=symmetric)
            base = k.removesuffix(".weight")
            del q_t[k]
            q_t |= {f"{base}.weight_packed": pack_to_int32(q, 4), f"{base}.weight_scale": s,
                    f"{base}.weight_shape": torch.tensor(tensors[k].shape), f"{base}.weight_g_idx": g}
            if zp is not None:  # packed along the rows, as compressed-tensors' pack-quantized compressor
                q_t[f"{base}.weight_zero_point"] = pack_to_int32(zp, 4, packed_dim=0)
            d_t[k] = published_gidx_dequant(q, s, zp, g, args)
        weights = dict(args.model_dump(), actorder="group")
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": [r"re:.*mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"],
                                            "weights": weights, "format": "pack-quantized"}}}
        out[name] = (_write(root / name, src, q_t, qc), _write(root / f"{name}-ref", src, d_t, None))
    return out


def _whole_model_bf16(root: Path, qc: dict):
    """Block INT8 of every projection (attention too: the published checkpoints quantize every
    Linear but the router and lm_head) of a bfloat16 model; the reference stores the published
    dequantization in float32 (exact), so that it reads the same at bfloat16 and float32."""
    src = root / "src-bf16"
    tiny_model(seed=6).to(torch.bfloat16).save_pretrained(src)
    tensors = load_file(src / "model.safetensors")
    q_t, d_t = dict(tensors), dict(tensors)
    for k in [k for k in tensors if k.endswith("_proj.weight")]:
        q, s = block_int8(tensors[k].float())
        q_t[k], q_t[k + "_scale_inv"] = q, s
        d_t[k] = published_block_dequant(q, s)
    return _write(root / "int8-bf16", src, q_t, qc), _write(root / "int8-bf16-ref", src, d_t, None)


@torch.no_grad()
def _logits(model, batch: int) -> torch.Tensor:
    ids = torch.randint(2, VOCAB, (batch, 9), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[0, :3], mask[0, :3] = 0, 0
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=4, min_new_tokens=4,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return torch.stack(out.logits)


def _own_allocations(model):
    """Every parameter in memory of its own (64-byte aligned by the CPU allocator). Both models'
    non-expert weights alias their safetensors file at its offsets, and CPU matmul kernels on one
    row (decode, ``logits_to_keep=1``) give other bits at another alignment: the two checkpoints
    here are different files, so without this the comparison would test file offsets."""
    for p in model.parameters():
        p.data = p.data.clone()
    return model


@pytest.mark.parametrize("slot_format", ["packed", "dense"])
@pytest.mark.parametrize("k", [TOP_K, E // 2])
@pytest.mark.parametrize("name", ["int8-block", "ct-pack-mixed", "ct-pack-mixed-asym"])
def test_paged_equals_the_published_dequantization(pairs, name, k, slot_format):
    """ct-pack-mixed-asym: activation order with zero points (subtracted per column's group)."""
    from transformers import AutoModelForCausalLM

    quantized, dequantized = pairs[name]
    paged, _ = load_model(quantized, num_resident=k, slot_format=slot_format)
    assert paged.pagedexperts.expert_format == name.removesuffix("-asym")
    assert paged.pagedexperts.expert_bytes < paged.pagedexperts.dense_expert_bytes
    ref = AutoModelForCausalLM.from_pretrained(dequantized, experts_implementation="grouped_mm").eval()
    _own_allocations(paged), _own_allocations(ref)
    for batch in (1, 3):
        got, want = _logits(paged, batch), _logits(ref, batch)
        assert torch.equal(got, want), f"{name} K={k} batch {batch}: max |diff| {(got - want).abs().max():.3e}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_block_int8_whole_model_in_its_own_dtype_and_float32(pairs, dtype):
    """A bfloat16 block-INT8 checkpoint with attention quantized, run at bfloat16 (its own dtype)
    and float32: weight x scale in float32 as SGLang does, then the run dtype (a multiply in the
    run dtype rounds the float32 scale to bfloat16 first)."""
    from transformers import AutoModelForCausalLM

    quantized, dequantized = pairs["int8-block-bf16"]
    paged, _ = load_model(quantized, num_resident=TOP_K, dtype=dtype)
    assert len(paged.pagedexperts.quantized_linears.modules) == 8  # q, k, v, o of 2 layers
    ref = AutoModelForCausalLM.from_pretrained(dequantized, dtype=getattr(torch, dtype),
                                               experts_implementation="grouped_mm").eval()
    _own_allocations(paged), _own_allocations(ref)
    for batch in (1, 3):
        got, want = _logits(paged, batch), _logits(ref, batch)
        assert torch.equal(got, want), f"{dtype} batch {batch}: max |diff| {(got - want).abs().max():.3e}"


def test_g_idx_matters(pairs):
    """The fixture's groups are really permuted: reading it as column-order groups differs."""
    quantized, _ = pairs["ct-pack-mixed"]
    g = load_file(quantized / "model.safetensors")["model.layers.0.mlp.experts.0.gate_proj.weight_g_idx"]
    assert not torch.equal(g, torch.arange(g.numel(), dtype=torch.int32) // GROUP)


def test_block_int8_refuses_static_activations(pairs, tmp_path):
    quantized, _ = pairs["int8-block"]
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"]["activation_scheme"] = "static"
    from pagedexperts.formats import format_for_config

    with pytest.raises(ValueError, match=r"quant_method 'blockwise_int8'.*activation_scheme='static'.*nearest supported"):
        format_for_config(cfg)
