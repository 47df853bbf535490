"""Per-call constants of the formats' dequantize (shift tables, FP4 lookup tables) are built once
per device and kept on the format instance (``ExpertFormat.device_constant``, issue 30 item 5):
a second dequantize creates no tensor from host data (on CUDA each was a synchronous copy per
wave), and gives the same bits. That the bits are the published ones is tested per format
against its library or oracle (test_gptq_awq, test_w4a16, test_llmc_fp4_int8,
test_modelopt, test_fp8_mxfp4).
"""

from __future__ import annotations

import pytest
import torch

from pagedexperts.formats import format_for_config
from pagedexperts.formats.base import TensorSpec

QC = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemm"},
    "w4a16": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group", "group_size": 16, "symmetric": False}}}},
    "w8a16": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "group", "group_size": 16, "symmetric": False}}}},
    "ct-pack-mixed": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "a": {"targets": ["re:.*gate_proj$", "re:.*up_proj$"], "weights": {"num_bits": 4, "strategy": "group",
                                                                         "group_size": 16, "symmetric": False}},
        "b": {"targets": ["re:.*down_proj$"], "weights": {"num_bits": 8, "strategy": "channel", "symmetric": True}}}},
    "nvfp4": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16}}}},
    "ct-mxfp4": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 32}}}},
    "modelopt-nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
    "mxfp4": {"quant_method": "mxfp4"},
    "auto-round-nvfp4": {"quant_method": "auto-round", "data_type": "nv_fp", "bits": 4, "group_size": 16,
                         "packing_format": "auto_round:llm_compressor", "act_bits": 4,
                         "act_data_type": "nv_fp4_with_static_gs"},
    "auto-round-mxfp4": {"quant_method": "auto-round", "data_type": "mx_fp", "bits": 4, "group_size": 32,
                         "packing_format": "auto_round:llm_compressor"},
}


def _random_rows(specs, n: int, gen) -> dict[str, torch.Tensor]:
    rows = {}
    for s in specs:
        if s.dtype == torch.uint8 and s.name.endswith(("_scale", "_scales")):  # E8M0 exponents near 2**0
            rows[s.name] = torch.randint(120, 135, (n, *s.shape), generator=gen).to(s.dtype)
        elif s.dtype in (torch.int32, torch.uint8, torch.int64):
            hi = 256 if s.dtype == torch.uint8 else 1 << 30
            rows[s.name] = torch.randint(0, hi, (n, *s.shape), generator=gen).to(s.dtype)
        else:
            rows[s.name] = (torch.rand((n, *s.shape), generator=gen) * 0.1 + 0.01).to(s.dtype)
    if any(s.name.endswith("_g_idx") for s in specs):  # GPTQ: groups of 16 columns
        for s in specs:
            if s.name.endswith("_g_idx"):
                rows[s.name] = (torch.arange(s.shape[0]) % 64 // 16).to(torch.int32).expand(n, -1).contiguous()
    return rows


@pytest.mark.parametrize("name", list(QC))
def test_second_dequantize_builds_no_constant_and_gives_the_same_bits(name, monkeypatch):
    config = {"model_type": "gpt_oss" if name == "mxfp4" else "qwen3_moe", "hidden_size": 64,
              "moe_intermediate_size": 64, "num_hidden_layers": 1, "quantization_config": QC[name]}
    fmt = format_for_config(config)
    assert fmt.name == name
    transposed = name == "mxfp4"
    dense = (TensorSpec("gate_up_proj", (64, 128) if transposed else (128, 64), torch.bfloat16),
             TensorSpec("down_proj", (64, 64), torch.bfloat16))
    layout = fmt.layout(dense, sources={"gate_up_proj": 1 if transposed else 2}, transposed=transposed)
    rows = _random_rows(layout.packed_specs, 3, torch.Generator().manual_seed(0))
    first = layout.dequantize(rows)
    constants = fmt.__dict__["_device_constants"]
    assert constants and {device for _, device in constants} == {torch.device("cpu")}
    made = []
    for factory in ("tensor", "arange"):
        real = getattr(torch, factory)
        monkeypatch.setattr(torch, factory, lambda *a, _real=real, **k: made.append(a) or _real(*a, **k))
    again = layout.dequantize(rows)
    assert made == [], f"{name}: {len(made)} tensors built from host data on the second dequantize"
    for key, value in first.items():
        assert torch.equal(value, again[key]), key
