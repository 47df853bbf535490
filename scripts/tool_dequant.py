"""The quantization tool's OWN dequantization of a sample of a checkpoint's modules: the oracle
tests/formats/test_tool_checkpoints.py compares pagedexperts' dequantization with (``torch.equal``).

Imported by ``tool_quantize.py tool-dequant DIR`` inside the venv of the library that reads the
format (the driver ``tool_fixtures.py`` picks it): GPTQ (``quant_method: gptq``) and AWQ
(``awq``) by GPTQModel 7.7 (``TorchQuantLinear.dequantize_weight`` after its own v1 -> v2 zero
conversion; AWQ ``quantization/awq/utils/packing_utils.dequantize_gemm`` in the scales' dtype);
GPTQModel's FP8 (``fp8``) by its ``TorchFP8Linear.dequantize_weight`` into the model's dtype (what
its forward multiplies with); AutoRound's ``auto-round``: ``data_type`` int by
``auto_round_extension.torch`` ``QuantLinear.forward`` (the packing's class) on an identity
input, which returns W^T exactly (one non-zero product per output; its forward repeats each
scale ``group_size`` times, so a group larger than the row, AutoRound's default 128 on a 32-wide
row, one group, runs with the group clamped to the row); ``nv_fp`` / ``mx_fp`` by
``auto_round.experimental.qmodules`` ``NVFP4QuantLinear`` / ``MXFP4QuantLinear``
``dequant_weight_online`` (the layers AutoRound loads them into), cast to the model's dtype as
their forward casts it; ``fp`` (FP8) by ``WeightFP8ActFP8StaticQuantLinear.dequant_weight_online``,
the layer AutoRound loads FP8_STATIC into (its ``from_original``: bfloat16), for the per-tensor
scale of FPW8A16 too; AutoRound 0.16.1 loads neither FPW8A16 nor FP8_BLOCK itself, and for
FP8_BLOCK's 2-D ``weight_scale_inv`` that layer's arithmetic (``weight.to(bfloat16) * scale``) runs
with the scale repeated over its 128 x 128 block.

Sample: layer 1's routed experts 0 and 5 (every projection) and its attention q_proj and o_proj
when quantized, and (GPTQ v1) every module whose stored zero points borrowed across values: a
zero point 0 stored as -1 takes 1 from the next value of its int32 word, which only GPTQModel's
per-word v1 -> v2 addition gives back. Writes ``DIR/tool_dequant.safetensors``: key
``{module}@{dtype}`` -> the dense weight [O, I] dequantized for a model running in float32 and
in the checkpoint's dtype.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SAMPLE = re.compile(r"^model\.layers\.1\.(?:(?:mlp|block_sparse_moe)\.experts\.[05]\.\w+|self_attn\.[qo]_proj)$")
V1_WORD_OFFSET = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}  # GPTQModel's v1 -> v2: +1 in every field


def modules(path: Path, qc: dict) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {local name: tensor}} of the sampled quantized modules (a plain float ``weight``
    is an unquantized module; FP8's float8 ``weight`` is not)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            module, _, local = key.rpartition(".")
            out.setdefault(module, {})[local] = f.get_tensor(key)
    quantized = {m: t for m, t in out.items() if set(t) - {"weight", "bias"}}
    return {m: t for m, t in quantized.items() if SAMPLE.match(m) or borrows(qc, m, t)}


def borrows(qc: dict, module: str, tensors: dict) -> bool:
    """A GPTQ v1 module whose stored zero points borrowed: adding 1 to each field alone differs
    from adding 1 to every field of the word at once (GPTQModel's conversion)."""
    if qc.get("quant_method") != "gptq" or "qzeros" not in tensors or (qc.get("checkpoint_format") or "gptq") != "gptq":
        return False
    bits = module_fields(qc, module)["bits"]
    words = tensors["qzeros"].long() & 0xFFFFFFFF
    shifts, mask = torch.arange(0, 32, bits), (1 << bits) - 1
    per_word = (((words + V1_WORD_OFFSET[bits]) & 0xFFFFFFFF).unsqueeze(-1) >> shifts) & mask
    per_field = (((words.unsqueeze(-1) >> shifts) & mask) + 1) & mask
    return bool((per_word != per_field).any())


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


def gptqmodel_fp8(qc: dict, fields: dict, t: dict, dtype: torch.dtype) -> torch.Tensor:
    from gptqmodel.nn_modules.qlinear.fp8 import TorchFP8Linear

    out_features, in_features = t["weight"].shape
    layer = TorchFP8Linear(bits=8, group_size=-1, sym=True, desc_act=False, in_features=in_features,
                           out_features=out_features, bias=False, format=qc.get("format") or "float8_e4m3fn",
                           weight_scale_method=qc.get("weight_scale_method", "row"),
                           weight_scale_semantics=qc.get("weight_scale_semantics", "inverse"))
    layer.weight = t["weight"].clone()
    layer.weight_scale_inv = t["weight_scale_inv"].clone()
    return layer.dequantize_weight(device="cpu", dtype=dtype).t().contiguous()


def autoround_fp(qc: dict, t: dict, dtype: torch.dtype) -> torch.Tensor:
    """AutoRound's own layers for its FP8 / NVFP4 / MXFP4 exports (module docstring)."""
    from auto_round.experimental.qmodules.fp8_static import WeightFP8ActFP8StaticQuantLinear
    from auto_round.experimental.qmodules.mx import MXFP4QuantLinear
    from auto_round.experimental.qmodules.nvfp4 import NVFP4QuantLinear
    from auto_round.schemes import PRESET_SCHEMES

    if qc["data_type"] == "fp":
        weight = t["weight"]
        out_features, in_features = weight.shape
        layer = WeightFP8ActFP8StaticQuantLinear.from_original(None, torch.nn.Linear(in_features, out_features, bias=False))
        if "weight_scale_inv" in t:  # FP8_BLOCK: the block's scale on each of its elements
            bm, bn = qc["weight_block_size"]
            scale = t["weight_scale_inv"].repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:out_features, :in_features]
            return (weight.to(layer.dtype) * scale.to(layer.dtype)).to(dtype)
        # FPW8A16's per-tensor [1] scale on every row: the same products as its broadcast
        state = {"weight": weight, "weight_scale": t["weight_scale"].reshape(-1).expand(out_features),
                 "input_scale": t.get("input_scale", torch.zeros(1))}
        layer.load_state_dict(state)
        with torch.no_grad():
            return layer.dequant_weight_online().to(dtype)
    cls, scheme = {"nv_fp": (NVFP4QuantLinear, "NVFP4"), "mx_fp": (MXFP4QuantLinear, "MXFP4")}[qc["data_type"]]
    out_features, in_features = t["weight_packed"].shape[0], t["weight_packed"].shape[1] * 2
    layer = cls.from_original(PRESET_SCHEMES[scheme], torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype))
    layer.load_state_dict(dict(t), strict=False)
    with torch.no_grad():
        return layer.dequant_weight_online().to(dtype)


def autoround_any(qc: dict, fields: dict, t: dict, dtype: torch.dtype) -> torch.Tensor:
    return autoround(qc, fields, t, dtype) if qc.get("data_type", "int") == "int" else autoround_fp(qc, t, dtype)


READERS = {"gptq": gptq, "awq": awq, "auto-round": autoround_any, "fp8": gptqmodel_fp8}


def write_tool_dequant(path: Path) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg["quantization_config"]
    read = READERS[qc["quant_method"]]
    saved = getattr(torch, cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    out = {}
    for module, tensors in modules(path, qc).items():
        for dtype in sorted({torch.float32, saved}, key=str):
            out[f"{module}@{str(dtype).removeprefix('torch.')}"] = read(qc, module_fields(qc, module), tensors, dtype)
    save_file(out, str(path / "tool_dequant.safetensors"))
    print(f"{path / 'tool_dequant.safetensors'}: {len(out)} dequantized weights")
    return path
