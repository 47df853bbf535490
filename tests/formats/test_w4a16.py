"""compressed-tensors pack-quantized int4 (W4A16) experts and the ``quantize`` writer.

References: the compressed-tensors package's own ``PackedQuantizationCompressor.decompress``
(what transformers' loader calls) and transformers' ``from_pretrained`` of the checkpoint
``quantize`` writes. transformers 5.24 cannot load ASYMMETRIC pack-quantized MoE experts (its
``CompressedTensorsDequantize`` drops ``weight_zero_point``), so asymmetric checkpoints are
compared with the package's decompression of every expert.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open

from support.tiny import tiny_model
from pagedexperts.formats import format_for_config
from pagedexperts.formats.base import TensorSpec
from pagedexperts.formats.compressed_tensors.w4a16 import CompressedTensorsW4A16Format
from pagedexperts.tools.quantize import QuantizeOptions, quantize_checkpoint
from pagedexperts.analysis.sizing import checkpoint_sizes

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

H = I_MOE = 128
E = 4


def _scheme(group_size, symmetric, num_bits=4):
    strategy = "group" if group_size else "channel"
    args = QuantizationArgs(num_bits=num_bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


def _compress(weight, scheme):
    gs = scheme.weights.group_size or weight.shape[-1]
    g = weight.unflatten(-1, (weight.shape[-1] // gs, gs))
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
    return PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zp}, scheme)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
def test_dequantize_equals_compressed_tensors(group_size, symmetric, dtype):
    """Three experts' [O=20, I=128] weights (O not a multiple of 8: padded zero-point words)."""
    torch.manual_seed(0)
    scheme = _scheme(group_size, symmetric)
    experts = [_compress(torch.randn(20, 128, dtype=dtype), scheme) for _ in range(3)]
    want = torch.stack([PackedQuantizationCompressor.decompress(e, scheme)["weight"] for e in experts])
    fmt = CompressedTensorsW4A16Format(group_size=group_size, symmetric=symmetric, scale_dtype=dtype)
    tensor = fmt.layout((TensorSpec("w", (20, 128), dtype),)).tensors[0]
    rows = {f"w_{name.removeprefix('weight_')}": torch.stack([e[name] for e in experts])
            for name in ("weight_packed", "weight_scale", "weight_zero_point") if name in experts[0]}
    got = fmt.dequantize(tensor, rows)
    assert torch.equal(got, want), f"max diff {(got.double() - want.double()).abs().max():.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("num_bits, group_size", [(4, 32), (8, 16), (8, None)])
def test_packed_zero_points_of_every_width_equal_compressed_tensors(num_bits, group_size, symmetric, dtype):
    """``formats.compressed_tensors.packed`` (W8A16, mixed-precision pack-quantized) against compressed-tensors' own
    decompression, 4- and 8-bit: the zero points are packed along the output dim with the
    weights' width (four 8-bit zero points per int32 word), so an 8-bit asymmetric checkpoint
    is where reading them as int4 shows; [O=20, I=64] (zero-point words padded)."""
    from pagedexperts.formats.compressed_tensors.packed import CompressedTensorsMixedPackedFormat, PackedArgs

    torch.manual_seed(num_bits)
    scheme = _scheme(group_size, symmetric, num_bits)
    experts = [_compress(torch.randn(20, 64, dtype=dtype), scheme) for _ in range(3)]
    want = torch.stack([PackedQuantizationCompressor.decompress(e, scheme)["weight"] for e in experts])
    fmt = CompressedTensorsMixedPackedFormat({"w": PackedArgs(num_bits, group_size, symmetric, False)}, scale_dtype=dtype)
    tensor = fmt.layout((TensorSpec("w", (20, 64), dtype),)).tensors[0]
    rows = {f"w_{name.removeprefix('weight_')}": torch.stack([e[name] for e in experts])
            for name in ("weight_packed", "weight_scale", "weight_zero_point") if name in experts[0]}
    assert symmetric or bool((rows["w_zero_point"] != 0).any())
    got = fmt.dequantize(tensor, rows)
    assert torch.equal(got, want), f"max diff {(got.double() - want.double()).abs().max():.3g}"


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    model = tiny_model(seed=3, hidden_size=H, moe_intermediate_size=I_MOE, num_experts=E, head_dim=32).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("w4a16") / "src"
    model.save_pretrained(path)
    return path


def _rows(path, layer, layout):
    """Store rows of one layer from the per-expert checkpoint keys (gate, up concatenated)."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        rows = {}
        for qt in layout.tensors:
            projs = ("gate_proj", "up_proj") if qt.dense.name == "gate_up_proj" else ("down_proj",)
            for spec in qt.packed:
                suffix = "weight" + spec.name.removeprefix(qt.dense.name)
                rows[spec.name] = torch.stack([
                    torch.cat([f.get_tensor(f"model.layers.{layer}.mlp.experts.{j}.{p}.{suffix}") for p in projs],
                              dim=spec.concat_dim)
                    for j in range(E)])
    return rows


def _layout(path, dtype):
    fmt = format_for_config(json.loads((path / "config.json").read_text()))
    dense = (TensorSpec("gate_up_proj", (2 * I_MOE, H), dtype), TensorSpec("down_proj", (H, I_MOE), dtype))
    return fmt, fmt.layout(dense, sources={"gate_up_proj": 2})


@pytest.mark.slow
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantized_checkpoint_loads_in_transformers_and_dequantizes_identically(bf16_dir, tmp_path, group_size):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "q"
    report = quantize_checkpoint(model_path=bf16_dir, output=out, options=QuantizeOptions("w4a16", group_size=group_size))
    assert report.expert_tensors == 2 * E * 3
    fmt, layout = _layout(out, torch.bfloat16)
    assert isinstance(fmt, CompressedTensorsW4A16Format) and fmt.group_size == group_size and fmt.symmetric
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    src = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16)
    for name, param in src.named_parameters():  # everything but the routed experts unchanged
        if ".experts." not in name:
            assert torch.equal(param, ref.get_parameter(name)), name
    for layer in range(2):
        got = layout.dequantize(_rows(out, layer, layout))
        experts = ref.model.layers[layer].mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(got[name], getattr(experts, name)), f"layer {layer} {name}"
            # round-to-nearest: within half a step (step = amax / 7.5; bf16 scales add ~3%)
            src_w = getattr(src.model.layers[layer].mlp.experts, name).float()
            step = src_w.abs().amax() / 7.5
            assert (got[name].float() - src_w).abs().max() <= step * 0.6


def test_asymmetric_checkpoint_dequantizes_as_compressed_tensors(bf16_dir, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(model_path=bf16_dir, output=out, options=QuantizeOptions("w4a16", group_size=64, symmetric=False))
    fmt, layout = _layout(out, torch.bfloat16)
    assert not fmt.symmetric and any(s.name == "gate_up_proj_zero_point" for s in layout.packed_specs)
    scheme = _scheme(64, False)
    got = layout.dequantize(_rows(out, 1, layout))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        def ref(j, p):
            names = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
            state = {n: f.get_tensor(f"model.layers.1.mlp.experts.{j}.{p}.{n}") for n in names}
            return PackedQuantizationCompressor.decompress(state, scheme)["weight"]

        want = torch.stack([torch.cat([ref(j, "gate_proj"), ref(j, "up_proj")]) for j in range(E)])
        assert torch.equal(got["gate_up_proj"], want)
        # the zero point matters: dropping it (the transformers bug) changes the weights
        zero_point = _rows(out, 1, layout)["gate_up_proj_zero_point"]
        no_zp = dict(_rows(out, 1, layout), gate_up_proj_zero_point=torch.full_like(zero_point, 0x88888888 - 2**32))
        assert not torch.equal(layout.dequantize(no_zp)["gate_up_proj"], want)


def _header_only_checkpoint(path, tensors):
    """A safetensors file whose header lists ``tensors`` {name: (dtype, shape)}; data sparse."""
    sizes = {"I32": 4, "BF16": 2, "I64": 8}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)


def test_preflight_reads_qwen3_30b_w4a16_expert_bytes(tmp_path):
    """Qwen3-30B-A3B (H 2048, I 768, E 128), W4A16 group 128: 2.43 MB per expert from the
    headers, and the same count from the format's layout."""
    tensors = {}
    for j in range(128):
        for proj, (o, i) in {"gate_proj": (768, 2048), "up_proj": (768, 2048), "down_proj": (2048, 768)}.items():
            key = f"model.layers.0.mlp.experts.{j}.{proj}."
            tensors[key + "weight_packed"] = ("I32", (o, i // 8))
            tensors[key + "weight_scale"] = ("BF16", (o, i // 128))
            tensors[key + "weight_shape"] = ("I64", (2,))
    _header_only_checkpoint(tmp_path / "model.safetensors", tensors)
    sizes = checkpoint_sizes(model_path=str(tmp_path), num_experts=128)
    assert round(sizes.expert_bytes / 1e6, 2) == 2.43
    fmt = CompressedTensorsW4A16Format(group_size=128, symmetric=True)
    dense = (TensorSpec("gate_up_proj", (1536, 2048), torch.bfloat16), TensorSpec("down_proj", (2048, 768), torch.bfloat16))
    layout = fmt.layout(dense, sources={"gate_up_proj": 2})
    assert layout.expert_bytes == sizes.expert_bytes
    assert 0.25 < layout.expert_bytes / layout.dense_expert_bytes < 0.27


@pytest.mark.parametrize(
    "qc, message",
    [
        ({"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 3, "strategy": "group", "group_size": 128}}}},
         "num_bits=3"),  # 8 bits is w8a16 now (test_llmc_fp8_w8a16_w4a16.py)
        ({"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "tensor"}}}},
         "strategy='tensor'"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group", "group_size": 128},
                                  "input_activations": {"num_bits": 8}}}},
         "W4A8"),
    ],
)
def test_unsupported_pack_quantized_configs_are_refused(qc, message):
    with pytest.raises(ValueError, match=message):
        format_for_config({"quantization_config": qc})


def test_quantize_refuses_bad_input_before_writing(bf16_dir, tmp_path):
    with pytest.raises(ValueError, match="in_features 128 is not a multiple of --group-size 48"):
        quantize_checkpoint(model_path=bf16_dir, output=tmp_path / "a", options=QuantizeOptions("w4a16", group_size=48))
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match="choose one of"):
        quantize_checkpoint(model_path=bf16_dir, output=tmp_path / "b", options=QuantizeOptions("nf4"))
    with pytest.raises(ValueError, match="gpt-oss"):
        quantize_checkpoint(model_path=bf16_dir, output=tmp_path / "c", options=QuantizeOptions("mxfp4"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("x")
    with pytest.raises(ValueError, match="--output .* not empty"):
        quantize_checkpoint(model_path=bf16_dir, output=tmp_path / "d", options=QuantizeOptions("w4a16"))
    quantize_checkpoint(model_path=bf16_dir, output=tmp_path / "e", options=QuantizeOptions("w4a16"))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(model_path=tmp_path / "e", output=tmp_path / "f", options=QuantizeOptions("w4a16"))


def test_scales_keep_the_checkpoint_dtype_under_another_model_dtype(bf16_dir, tmp_path):
    """A bf16 checkpoint loaded as float32: the store holds its scales in bf16 (a float32 store
    would hold widened scales and dequantize in float32, unlike transformers' bf16 arithmetic),
    and the dequantized experts stay in bf16, the dtype transformers itself keeps them in."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "q"
    quantize_checkpoint(model_path=bf16_dir, output=out, options=QuantizeOptions("w4a16", group_size=64))
    fmt, layout = _layout(out, torch.float32)
    scales = {s.name: s.dtype for s in layout.packed_specs if s.name.endswith("_scale")}
    assert scales == {"gate_up_proj_scale": torch.bfloat16, "down_proj_scale": torch.bfloat16}
    got = layout.dequantize(_rows(out, 0, layout))
    bf16 = _layout(out, torch.bfloat16)[1].dequantize(_rows(out, 0, layout))
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    experts = next(m for m in reference.modules() if type(m).__name__.endswith("Experts"))
    assert got["down_proj"].dtype == experts.down_proj.dtype == torch.bfloat16
    assert torch.equal(got["down_proj"], bf16["down_proj"]) and torch.equal(got["down_proj"], reference.model.layers[0].mlp.experts.down_proj)
