"""Write the compressed-tensors fixtures in tests/data/ct (committed beside this file), with the
compressed-tensors package's OWN quantization parameters and compressors, in the main venv::

    .venv/bin/python tests/data/ct/make_fixtures.py [--out tests/data/ct] [--only NAME ...]

Each fixture: a tiny random bfloat16 Qwen3-MoE (vocab 256, hidden 64, 2 layers, 8 routed experts
of intermediate 32, top-2, seed 0; a character tokenizer as tests/data/llmc's), every nn.Linear of the decoder that a config
group targets quantized round-to-nearest: ``calculate_qparams`` (min/max of each group, row or
tensor; MX power-of-two scales for MXFP8), then ``BaseCompressor.get_value_from_registry(format)
.compress`` per module, and ``ModelCompressor.update_config`` for config.json, as
llm-compressor saves (what it adds, calibration, does not change the layout). The router
(``mlp.gate``) and lm_head stay bfloat16.

``FIXTURES`` (name -> config groups and ignore): the layouts tools write that the llm-compressor
fixtures (tests/data/llmc) do not:

- ``named_targets``: config groups whose targets are MODULE NAMES (AutoRound's llm-compressor
  export lists the layers of each scheme so): every expert down_proj int4 group 16, every expert
  gate/up int4 group 32, every attention projection int8 per channel, all pack-quantized;
- ``named_attention_first``: a first group naming the attention projections (FP8 per channel,
  float-quantized) before a ``Linear`` group (int4 group 32, pack-quantized) that covers the
  experts: transformers 5.24 applies the FIRST group with a non-``re:`` target to the experts;
- ``naive_fp8``: FP8 per-channel weights in the ``naive-quantized`` format;
- ``fp8_static_channel``: FP8 per-channel weights with static per-tensor input activations
  (``input_scale`` = amax / 448 of the weight, standing in for calibration: unused by the
  weight-only reference);
- ``mxfp8``: ``mxfp8-quantized`` (FP8 E4M3 weights, one E8M0 uint8 scale per 32 columns);
- ``target_in_two_groups``: the experts' ``down_proj`` regex listed by two groups (int4 group 32
  with ``Linear``, then int4 group 16): compressed-tensors applies the LATER group's scheme
  (``apply_quantization_config`` fills ``target_to_scheme`` group by group, so the later group
  overwrites the target), while a first-match reading would give group 32.

Each module's group is the one compressed-tensors' own ``apply_quantization_config`` gives it
(``match_targets``, most specific target first, and ``_scheme_from_targets`` over the same
target -> scheme table), so a fixture is written as the library would quantize it.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
LAYERS, E, I_MOE, HIDDEN = 2, 8, 32, 64
ATTN = [f"model.layers.{l}.self_attn.{p}_proj" for l in range(LAYERS) for p in "qkvo"]
EXPERTS = {p: [f"model.layers.{l}.mlp.experts.{j}.{p}" for l in range(LAYERS) for j in range(E)]
           for p in ("gate_proj", "up_proj", "down_proj")}
ROUTER_AND_HEAD = ["lm_head", "re:.*mlp.gate$"]


def int_args(bits: int, group_size: int | None, symmetric: bool = True) -> dict:
    strategy = "group" if group_size else "channel"
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy, "group_size": group_size}


FP8_CHANNEL = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
FIXTURES: dict[str, tuple[dict, list[str]]] = {
    "qwen3_moe-named_targets": ({
        "group_0": {"targets": EXPERTS["down_proj"], "weights": int_args(4, 16), "format": "pack-quantized"},
        "group_1": {"targets": EXPERTS["gate_proj"] + EXPERTS["up_proj"], "weights": int_args(4, 32),
                    "format": "pack-quantized"},
        "group_2": {"targets": ATTN, "weights": int_args(8, None), "format": "pack-quantized"},
    }, []),
    "qwen3_moe-named_attention_first": ({
        "group_0": {"targets": ATTN, "weights": FP8_CHANNEL, "format": "float-quantized"},
        "group_1": {"targets": ["Linear"], "weights": int_args(4, 32), "format": "pack-quantized"},
    }, ROUTER_AND_HEAD),
    "qwen3_moe-naive_fp8": ({
        "group_0": {"targets": ["Linear"], "weights": FP8_CHANNEL, "format": "naive-quantized"},
    }, ROUTER_AND_HEAD),
    "qwen3_moe-fp8_static_channel": ({
        "group_0": {"targets": ["Linear"], "weights": FP8_CHANNEL, "format": "float-quantized",
                    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                                          "dynamic": False}},
    }, ROUTER_AND_HEAD),
    "qwen3_moe-target_in_two_groups": ({
        "group_0": {"targets": ["Linear", r"re:.*mlp\.experts\.\d+\.down_proj$"], "weights": int_args(4, 32),
                    "format": "pack-quantized"},
        "group_1": {"targets": [r"re:.*mlp\.experts\.\d+\.down_proj$"], "weights": int_args(4, 16),
                    "format": "pack-quantized"},
    }, ROUTER_AND_HEAD),
    "qwen3_moe-mxfp8": ({
        "group_0": {"targets": ["Linear"], "format": "mxfp8-quantized",
                    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                                "group_size": 32, "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"}},
    }, ROUTER_AND_HEAD),
}


def write_source(out: Path) -> None:
    """The tiny random bfloat16 Qwen3-MoE (seed 0), saved by transformers, with a character tokenizer."""
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts_per_tok=2, num_experts=E, moe_intermediate_size=I_MOE, intermediate_size=128,
        max_position_embeddings=256, initializer_range=0.05, tie_word_embeddings=False, norm_topk_prob=True,
        eos_token_id=0, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    tok = Tokenizer(models.WordLevel({chr(i): i for i in range(config.vocab_size)}, unk_token=chr(0)))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=chr(0), pad_token=chr(0)).save_pretrained(out)


def qparams(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' ``calculate_qparams`` over each group / row / the tensor of ``weight``."""
    from compressed_tensors.quantization.utils import calculate_qparams

    if args.strategy == "group":
        view = weight.unflatten(-1, (weight.shape[-1] // args.group_size, args.group_size))
        lo, hi = view.amin(-1), view.amax(-1)
    elif args.strategy == "channel":
        lo, hi = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    else:
        lo, hi = weight.amin().reshape(1), weight.amax().reshape(1)
    return calculate_qparams(lo, hi, args)


def library_scheme(qc, module: str):
    """The scheme compressed-tensors' ``apply_quantization_config`` gives the nn.Linear ``module``
    (None: ignored or no target), with the library's own matching and table."""
    from collections import OrderedDict

    from compressed_tensors.quantization.lifecycle.apply import _scheme_from_targets
    from compressed_tensors.utils.match import is_match, match_targets

    linear = torch.nn.Linear(1, 1)
    if any(is_match(module, linear, t) for t in qc.ignore or []):
        return None
    target_to_scheme = OrderedDict((t, g) for g in qc.config_groups.values() for t in g.targets)
    targets = match_targets(module, linear, target_to_scheme)
    return _scheme_from_targets(target_to_scheme, targets, module) if targets else None


def write(name: str, src: Path, out: Path) -> Path:
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    groups, ignore = FIXTURES[name]
    qc = QuantizationConfig(config_groups=groups, ignore=ignore, quantization_status=QuantizationStatus.COMPRESSED,
                            format="mixed-precision" if len({g["format"] for g in groups.values()}) > 1
                            else next(iter(groups.values()))["format"])
    dst = out / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    written = {}
    for key, tensor in tensors.items():
        module = key.removesuffix(".weight")
        scheme = None
        if key.endswith(".weight") and tensor.ndim == 2 and "embed_tokens" not in key:
            scheme = library_scheme(qc, module)
        if scheme is None:
            written[key] = tensor
            continue
        scale, zero_point = qparams(tensor, scheme.weights)
        state = {"weight": tensor, "weight_scale": scale, "weight_zero_point": zero_point}
        if scheme.input_activations is not None and not scheme.input_activations.dynamic:
            state["input_scale"] = (tensor.abs().amax().float() / 448.0).reshape(1)
        compressor = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
        for local, value in compressor.compress(state, scheme).items():
            written[f"{module}.{local}"] = value.contiguous()
    save_file(written, str(dst / "model.safetensors"), metadata={"format": "pt"})
    ModelCompressor(quantization_config=qc).update_config(str(dst))
    return dst


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE)
    p.add_argument("--only", nargs="*", default=None)
    args = p.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "source"
        write_source(src)
        for name in args.only or FIXTURES:
            print("wrote", write(name, src, args.out))


if __name__ == "__main__":
    main()
