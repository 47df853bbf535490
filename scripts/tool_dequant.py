"""The quantization tool's OWN dequantization of a sample of a checkpoint's modules: the oracle
tests/test_formats_tools.py compares pagedexperts' dequantization with (``torch.equal``).

Imported by ``tool_quantize.py tool-dequant DIR`` inside the venv of the library that reads the
format (the driver ``tool_fixtures.py`` picks it): GPTQ (``quant_method: gptq``) and AWQ
(``awq``) by GPTQModel 7.7 (``TorchQuantLinear.dequantize_weight`` after its own v1 -> v2 zero
conversion; AWQ ``quantization/awq/utils/packing_utils.dequantize_gemm`` in the scales' dtype);
AutoRound's ``auto-round`` by ``auto_round_extension.torch`` ``QuantLinear.forward`` (the packing's
class) on an identity input, which returns W^T exactly (one non-zero product per output); its
forward repeats each scale ``group_size`` times, so a group larger than the row (AutoRound's
default 128 on a 32-wide row: one group) runs with the group clamped to the row.

Sample: layer 1's routed experts 0 and 5 (every projection) and its attention q_proj and o_proj
when quantized. Writes ``DIR/tool_dequant.safetensors``: key ``{module}@{dtype}`` -> the dense
weight [O, I] dequantized for a model running in float32 and in the checkpoint's dtype.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SAMPLE = re.compile(r"^model\.layers\.1\.(?:(?:mlp|block_sparse_moe)\.experts\.[05]\.\w+|self_attn\.[qo]_proj)$")


def modules(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {local name: tensor}} of the sampled quantized modules."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            module, _, local = key.rpartition(".")
            if SAMPLE.match(module):
                out.setdefault(module, {})[local] = f.get_tensor(key)
    return {m: t for m, t in out.items() if "weight" not in t}


def module_fields(qc: dict, module: str) -> dict:
    """bits / group_size / sym of ``module``: the base config with GPTQModel's ``dynamic`` rule or
    AutoRound's ``extra_config`` entry (the tools' own lookups)."""
    fields = {k: qc.get(k) for k in ("bits", "group_size", "sym")}
    if qc.get("dynamic"):
        from gptqmodel.quantization.config import dynamic_get

        fields.update({k: v for k, v in (dynamic_get(qc["dynamic"], module) or {}).items() if k in fields})
    for key, extra in (qc.get("extra_config") or {}).items():
        if key == module or re.fullmatch(key, module):
            fields.update({k: v for k, v in extra.items() if k in fields})
            break
    return fields


def gptq(qc: dict, fields: dict, t: dict, dtype: torch.dtype) -> torch.Tensor:
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module

    in_features, out_features = t["g_idx"].numel(), t["scales"].shape[1]
    layer = TorchLinear(bits=fields["bits"], group_size=fields["group_size"], sym=fields["sym"],
                             desc_act=bool(qc.get("desc_act")), in_features=in_features, out_features=out_features,
                             bias=False, register_buffers=True)
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        setattr(layer, name, t[name].clone())
    if (qc.get("checkpoint_format") or qc.get("format") or "gptq") == "gptq":
        convert_gptq_v1_to_v2_format_module(layer, bits=fields["bits"], pack_dtype=torch.int32)
    layer.eval()
    return layer.dequantize_weight().to(dtype).t().contiguous()


def awq(qc: dict, fields: dict, t: dict, dtype: torch.dtype) -> torch.Tensor:
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    in_features = t["qweight"].shape[0]
    group = fields["group_size"] if fields["group_size"] and fields["group_size"] > 0 else in_features
    w = dequantize_gemm(t["qweight"], t["qzeros"], t["scales"], fields["bits"], group)
    return w.to(dtype).t().contiguous()


def autoround(qc: dict, fields: dict, t: dict, dtype: torch.dtype) -> torch.Tensor:
    if qc.get("packing_format", "auto_round:auto_gptq") == "auto_round:auto_gptq":
        from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
    else:
        from auto_round_extension.torch.qlinear_torch import QuantLinear
    bits = fields["bits"]
    in_features, out_features = t["qweight"].shape[0] * 32 // bits, t["scales"].shape[1]
    # its forward repeats each scale group_size times: a group larger than the row (one group, as
    # AutoRound packs it) only runs with group_size clamped to in_features
    group = fields["group_size"] if 0 < fields["group_size"] < in_features else in_features
    layer = QuantLinear(bits, group, in_features, out_features, bias=False)
    for name in ("qweight", "qzeros", "scales"):
        setattr(layer, name, t[name].clone())
    with torch.no_grad():
        return layer(torch.eye(in_features, dtype=dtype)).t().contiguous()


READERS = {"gptq": gptq, "awq": awq, "auto-round": autoround}


def write_tool_dequant(path: Path) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg["quantization_config"]
    read = READERS[qc["quant_method"]]
    saved = getattr(torch, cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    out = {}
    for module, tensors in modules(path).items():
        for dtype in sorted({torch.float32, saved}, key=str):
            out[f"{module}@{str(dtype).removeprefix('torch.')}"] = read(qc, module_fields(qc, module), tensors, dtype)
    save_file(out, str(path / "tool_dequant.safetensors"))
    print(f"{path / 'tool_dequant.safetensors'}: {len(out)} dequantized weights")
    return path
