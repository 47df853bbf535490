"""Tiny quantized checkpoints written in the PUBLISHED on-disk layouts, for the format tests.

``write_fp8_block``: the DeepSeek-V3 / Qwen3-FP8 layout (per-expert keys; every
``*_proj.weight`` and ``w1/w2/w3.weight`` of attention, dense MLPs, shared and routed experts as
float8_e4m3fn ``weight`` + float32 ``weight_scale_inv``; router, norms, embeddings and lm_head
unquantized, and any weight with a dim above its block and not a multiple of it (transformers
could not read its grid back); ``quantization_config`` {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [bm, bn]}).
``write_mxfp4``: the gpt-oss layout (stacked ``experts.gate_up_proj_blocks`` [E, 2I, H/32, 16]
uint8, ``_scales`` [E, 2I, H/32] uint8 (E8M0, bias 127), biases in bf16; every other tensor
unquantized; ``quantization_config`` {"quant_method": "mxfp4",
"modules_to_not_convert": [...]}).
Both start from a ``save_pretrained`` directory of the unquantized model. ``fp8_block_dense`` and
``mxfp4_dense``: those layouts' rows dequantized by the formats themselves.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedexperts.formats.base import QuantizedTensor, TensorSpec
from pagedexperts.formats.fp8_fp4.fp8_block import Fp8BlockFormat, quantize_fp8_block
from pagedexperts.formats.fp8_fp4.mxfp4 import Mxfp4Format, quantize_mxfp4
from pagedexperts.tools.quantize import QuantizeOptions, quantize_checkpoint
from support.int4_oracle import pack_awq, pack_gptq, rtn_int4

_FP8_KEY = re.compile(r"\.(?:[a-z_]*proj(?:_with_mqa)?|w[123])\.weight$")


def _copy_aux(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, dst / f.name)


def write_checkpoint_dir(src: Path, dst: Path, tensors: dict, quantization_config: dict | None = None) -> Path:
    """``dst`` (new): ``src``'s files but its shards, ``tensors`` as one model.safetensors, and
    ``quantization_config`` set in config.json when given."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(dict(cfg, quantization_config=quantization_config)))
    return dst


def _tensors(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _set_quantization(dst: Path, qc: dict, dtype: str = "bfloat16") -> None:
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    cfg["dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def _fits(shape, block) -> bool:
    """Each dim a multiple of its block or below it (what transformers' dequantizer reads back)."""
    return all(size <= b or size % b == 0 for size, b in zip(shape, block))


def write_fp8_block(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Quantize ``src``'s linear weights to block FP8 into ``dst`` (see module docstring)."""
    _copy_aux(src, dst)
    out = {}
    for key, value in _tensors(src).items():
        if _FP8_KEY.search(key) and value.dim() == 2 and _fits(value.shape, block):
            q, s = quantize_fp8_block(value, block)
            out[key], out[key + "_scale_inv"] = q, s
        else:
            out[key] = value.to(torch.bfloat16) if value.is_floating_point() else value
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _set_quantization(
        dst, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    )
    return dst


def write_mxfp4(src: Path, dst: Path) -> Path:
    """Quantize ``src``'s stacked gpt-oss experts to MXFP4 into ``dst`` (see module docstring)."""
    _copy_aux(src, dst)
    out = {}
    for key, value in _tensors(src).items():
        if re.search(r"\.experts\.(gate_up_proj|down_proj)$", key):
            # the module's [E, in, out] -> the checkpoint's [E, out, in/32, 16]
            blocks, scales = quantize_mxfp4(value.transpose(1, 2).contiguous())
            out[key + "_blocks"], out[key + "_scales"] = blocks, scales
        else:
            out[key] = value.to(torch.bfloat16) if value.is_floating_point() else value
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _set_quantization(
        dst,
        {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]},
    )
    return dst


def fp8_block_dense(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Block-FP8 rows float8_e4m3fn [n, out, in] and float32 scale_inv [n, sr, sc] -> [n, out, in]
    in ``dtype`` by ``Fp8BlockFormat.dequantize`` (the block derived from the grid)."""
    shape = tuple(weight.shape[1:])
    packed = (TensorSpec("w", shape, weight.dtype), TensorSpec("w_scale_inv", tuple(scale_inv.shape[1:]), scale_inv.dtype))
    tensor = QuantizedTensor(TensorSpec("w", shape, dtype), packed)
    return Fp8BlockFormat().dequantize(tensor, {"w": weight, "w_scale_inv": scale_inv})


def mxfp4_dense(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gpt-oss MXFP4 rows: blocks uint8 [n, out, G, 16], scales uint8 [n, out, G] -> the experts
    module's [n, in, out] in ``dtype`` by ``Mxfp4Format.dequantize``."""
    out, groups = scales.shape[1:]
    layout = Mxfp4Format().layout((TensorSpec("w", (groups * 32, out), dtype),), transposed=True)
    return layout.dequantize({"w_blocks": blocks, "w_scales": scales})["w"]


def restack_fp8_experts(src: Path, dst: Path) -> Path:
    """The same block-FP8 checkpoint with stacked experts, as transformers' ``FP8Experts``
    saves them: ``experts.gate_up_proj`` float8_e4m3fn [E, 2I, H] (gate rows, then up) with
    ``experts.gate_up_proj_scale_inv`` float32 [E, 2 x ceil(I/bm), ceil(H/bn)], and
    ``experts.down_proj`` [E, H, I] with its ``_scale_inv``."""
    return restack_experts(src, dst, ("weight", "weight_scale_inv"))


def restack_experts(src: Path, dst: Path, names: tuple[str, ...]) -> Path:
    """``src`` with its per-expert ``experts.{j}.{gate,up,down}_proj.{name}`` keys (each name in
    ``names``) stacked: ``experts.gate_up_proj`` + the name's suffix (``store_name``:
    ``weight_scale`` -> ``gate_up_proj_scale``, ``input_scale`` -> ``gate_up_proj_input_scale``)
    [E, ...] with each expert's gate then up concatenated along dim 0 (a 0-d per-tensor scale
    as [1]), and ``experts.down_proj`` + suffix [E, ...]."""
    from pagedexperts.formats.base import store_name

    _copy_aux(src, dst)
    kinds = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    pattern = re.compile(rf"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.({kinds})$")
    out, per_expert = {}, {}
    for key, value in _tensors(src).items():
        m = pattern.match(key)
        if m is None:
            out[key] = value
            continue
        per_expert.setdefault((m.group(1), m.group(4)), {}).setdefault(int(m.group(2)), {})[m.group(3)] = value
    for (prefix, kind), experts in per_expert.items():
        order = sorted(experts)
        row = lambda t: t.reshape(1) if t.dim() == 0 else t  # noqa: E731
        out[f"{prefix}.{store_name('gate_up_proj', 'weight', kind)}"] = torch.stack(
            [torch.cat([row(experts[j]["gate_proj"]), row(experts[j]["up_proj"])]) for j in order])
        out[f"{prefix}.{store_name('down_proj', 'weight', kind)}"] = torch.stack([row(experts[j]["down_proj"]) for j in order])
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def prefill_decode_runs(paged, reference):
    """``tools.check.compare`` of ``paged`` vs ``reference`` on a prefill + decode of one prompt
    (batch 1) and a left-padded batch of 2 (greedy 3 steps; seeded random token ids)."""
    from pagedexperts.tools.check import compare, left_padded

    vocab = reference.config.vocab_size
    rows = [torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in (19, 6)]
    out = [compare(paged, reference, rows[0].unsqueeze(0), 3, "batch 1")]
    ids, mask = left_padded(rows)
    out.append(compare(paged, reference, ids, 3, "padded batch 2", mask))
    return out


def reference_cache(path_of):
    """name -> ``check``'s unpaged reference (``load_reference_with_choice``, CPU, grouped_mm) of
    the checkpoint at ``path_of(name)``, each built once."""
    from pagedexperts.tools.check import load_reference_with_choice

    built = {}

    def get(name):
        if name not in built:
            built[name] = load_reference_with_choice(path_of(name), device="cpu", dtype=None,
                                                     experts_implementation="grouped_mm")[0]
        return built[name]

    return get


def load_with_two_host_rows(path, top_k: int):
    """(model, bytes per expert): ``path`` loaded at K = ``top_k`` with a --host-memory-gb that
    leaves 2 host rows per layer, so most page-ins read from disk (the disk tier)."""
    from pagedexperts import load_model

    from support.tiny import host_budget_gb

    tiered, _ = load_model(path, num_resident=top_k, host_memory_gb=host_budget_gb(path, 2, num_resident=top_k))
    assert tiered.pagedexperts.host_memory.host_rows == 2
    return tiered, tiered.pagedexperts.expert_bytes


GROUP = 32


_EXPERT_WEIGHT = r".experts."


def _is_expert_weight(key: str) -> bool:
    return _EXPERT_WEIGHT in key and key.endswith(".weight") and key.split(".experts.")[1].split(".")[0].isdigit()


def _oracle_pair(src: Path, root: Path, fmt: str) -> tuple[Path, Path]:
    """(quantized GPTQ/AWQ dir, dense reference dir) from ``src``'s weights."""
    gen = torch.Generator().manual_seed(1)
    packed, dense = {}, {}
    for key, value in load_file(src / "model.safetensors").items():
        if not _is_expert_weight(key):
            packed[key] = dense[key] = value
            continue
        w = rtn_int4(value, GROUP, desc_act=fmt == "gptq", generator=gen)
        packed.update({key.removesuffix("weight") + n: t for n, t in (pack_gptq(w) if fmt == "gptq" else pack_awq(w)).items()})
        dense[key] = w.dense(value.dtype)
    qc = ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
           "checkpoint_format": "gptq"} if fmt == "gptq" else
          {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"})
    return write_checkpoint_dir(src, root / fmt, packed, qc), write_checkpoint_dir(src, root / f"{fmt}-ref", dense)


def _w4a16_pair(src: Path, root: Path, symmetric: bool) -> tuple[Path, Path]:
    """(w4a16 dir written by ``quantize``, reference dir)."""
    out = root / f"w4a16-{symmetric}"
    quantize_checkpoint(model_path=src, output=out, options=QuantizeOptions("w4a16", group_size=GROUP, symmetric=symmetric))
    if symmetric:
        return out, out
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=GROUP), format="pack-quantized")
    tensors = load_file(out / "model.safetensors")
    dense = {k: v for k, v in load_file(src / "model.safetensors").items() if not _is_expert_weight(k)}
    for key in [k for k in tensors if k.endswith(".weight_packed")]:
        base = key.removesuffix("weight_packed")
        state = {n: tensors[base + n] for n in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")}
        dense[base + "weight"] = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    return out, write_checkpoint_dir(src, root / "w4a16-asym-ref", dense)


# name -> (family, format writer, block, overrides of the family's tiny config)
QUANTIZED = {
    "qwen3_moe-fp8": ("qwen3_moe", "fp8", (128, 128), {}),
    "deepseek_v3-fp8": ("deepseek_v3", "fp8", (128, 128), {}),
    "qwen3_moe-fp8-block64-h192": ("qwen3_moe", "fp8", (64, 64), {"hidden_size": 192}),
    "mixtral-fp8": ("mixtral", "fp8", (128, 128), {}),
    "gpt_oss-mxfp4": ("gpt_oss", "mxfp4", None, {}),
    "gpt_oss-mxfp4-h96": ("gpt_oss", "mxfp4", None, {"hidden_size": 96}),
}


UNQUANTIZED = {"gpt_oss-bf16": ("gpt_oss", "dense", None, {})}
