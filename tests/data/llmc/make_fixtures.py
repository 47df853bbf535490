"""Write every llm-compressor fixture in tests/data/llmc (committed beside this file). Run with
llm-compressor 0.14's own venv (it pins an older transformers)::

    /work/llmc-venv/bin/python tests/data/llmc/make_fixtures.py [--out tests/data/llmc] [--only NAME ...]

Two sets, each a table of fixture name -> (family, how it is quantized), both from seeded tiny
float32 models:

- ``FIXTURES`` (tests/formats/test_llmc_fp8_w8a16_w4a16.py): Qwen3-MoE and DeepSeek-V3 (vocab 128, hidden 32,
  16 routed experts of intermediate 16, top-2; DeepSeek-V3 with a shared expert and a dense
  first layer), saved with a character tokenizer, quantized by ``scripts/llmc_quantize.py``
  (oneshot + QuantizationModifier, routed experts only); each dir keeps ``llmc_quantize.json``.
  Mixtral is not in this set: llm-compressor 0.14 (with its transformers 5.17) saves Mixtral's
  linearized experts as ``block_sparse_moe.experts.{j}.gate_proj/up_proj/down_proj``, which
  transformers 5.24's Mixtral conversion (``w1/w3/w2``) does not read.
- ``FP4_INT8_FIXTURES`` (tests/formats/test_llmc_fp4_int8.py): Qwen3-MoE and Mixtral (vocab 256,
  hidden 64, 8 routed experts, top-2, 2 layers), llm-compressor's preset schemes through
  ``oneshot`` with ``QuantizationModifier(targets="Linear", ignore=IGNORE)`` (attention,
  router, shared experts and lm_head ignored), ``save_pretrained(save_compressed=True)``;
  Mixtral's linearized expert names renamed to w1/w3/w2 after saving. NVFP4 (static input
  global scale) is calibrated on 8 seeded random token sequences; ``W4A16_ASYM:g32`` is the
  preset with group size 32 (its 128 exceeds I). No tokenizer, no source dir.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
import llmc_quantize  # noqa: E402

VOCAB, HIDDEN, EXPERT_I, E, TOP_K = 128, 32, 16, 16, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=TOP_K, max_position_embeddings=256, initializer_range=0.1, pad_token_id=0,
              bos_token_id=1, eos_token_id=None, tie_word_embeddings=False)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=EXPERT_I, num_experts=E,
                       head_dim=8, norm_topk_prob=True)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                         qk_rope_head_dim=8, v_head_dim=8, intermediate_size=64, moe_intermediate_size=EXPERT_I,
                         n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24, n_group=4,
                         topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
# name -> (family, llmc_quantize arguments)
FIXTURES = {
    "qwen3_moe-fp8": ("qwen3_moe", ["--scheme", "FP8", "--num-samples", "4", "--seq-len", "32"]),
    "qwen3_moe-fp8_dynamic": ("qwen3_moe", ["--scheme", "FP8_DYNAMIC"]),
    "qwen3_moe-fp8_block": ("qwen3_moe", ["--scheme", "FP8_BLOCK"]),
    "qwen3_moe-w8a16": ("qwen3_moe", ["--scheme", "W8A16", "--group-size", "16"]),
    "qwen3_moe-w4a16_mixed": ("qwen3_moe", ["--scheme", "W4A16", "--group-size", "32",
                                            "--group-size-override", "down_proj=16"]),
    "deepseek_v3-fp8_block": ("deepseek_v3", ["--scheme", "FP8_BLOCK"]),
    "deepseek_v3-w8a16": ("deepseek_v3", ["--scheme", "W8A16", "--group-size", "16"]),
}


def save_source(family: str, path: Path) -> None:
    """The float32 source model of ``family`` (seed 0) with a character tokenizer."""
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    config_cls, model_cls, fields = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**COMMON, **fields})).eval()
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({chr(i): i for i in range(VOCAB)}, unk_token=chr(0)))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=chr(0), pad_token=chr(0)).save_pretrained(path)


FP4_INT8_SCHEMES = ("NVFP4A16", "NVFP4", "W8A8", "MXFP4A16", "W4A16_ASYM:g32")
# name -> (family, scheme): every family with every scheme but Mixtral NVFP4 (W4A4): its
# calibration wants a tokenizer the tiny model has not
FP4_INT8_FIXTURES = {f"{family}-{scheme.replace(':', '-')}": (family, scheme)
                     for family in ("qwen3_moe", "mixtral") for scheme in FP4_INT8_SCHEMES
                     if (family, scheme) != ("mixtral", "NVFP4")}
# The families' remaining cells of tests/formats/test_format_families.py's table, through the same path.
FP4_INT8_FIXTURES.update({f"{family}-{scheme.replace(':', '-')}": (family, scheme) for family, scheme in (
    ("deepseek_v3", "NVFP4A16"), ("deepseek_v3", "W8A8"), ("deepseek_v3", "MXFP4A16"),
    ("mixtral", "FP8_DYNAMIC"), ("mixtral", "W8A16:g16"))})
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$", "re:.*shared_expert.*"]
FP4_DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
            max_position_embeddings=128, initializer_range=0.1, tie_word_embeddings=False)


def fp4_family_config(family: str):
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    if family == "deepseek_v3":  # a shared expert and a dense first layer, as FAMILIES' DeepSeek-V3
        dims = {k: v for k, v in FP4_DIMS.items() if k != "head_dim"} | {"num_key_value_heads": 4}  # MLA: one per head
        return DeepseekV3Config(**dims, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                                first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16,
                                qk_rope_head_dim=16, v_head_dim=16, n_group=4, topk_group=2, norm_topk_prob=True,
                                routed_scaling_factor=2.5)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**FP4_DIMS, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True)
    if family == "mixtral":
        dims = dict(FP4_DIMS, intermediate_size=32)
        return MixtralConfig(**dims, num_local_experts=8)
    raise ValueError(f"unknown family {family!r}")


def fp4_recipe(scheme: str, ignore: list[str] = IGNORE):
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if ":g" in scheme:
        name, group = scheme.split(":g")
        qs = preset_name_to_scheme(name, ["Linear"])
        qs.weights.group_size = int(group)
        return QuantizationModifier(config_groups={"group_0": qs}, ignore=ignore)
    return QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)


def write_fp4_int8(family: str, scheme: str, out: Path) -> Path:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dst = out / f"{family}-{scheme.replace(':', '-')}"
    with tempfile.TemporaryDirectory() as tmp:  # oneshot reads the source's config back
        AutoModelForCausalLM.from_config(fp4_family_config(family)).save_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        linearize_moe(model)
        kwargs = {}
        if scheme == "NVFP4":
            ids = torch.randint(2, 256, (8, 32), generator=torch.Generator().manual_seed(1))
            kwargs = dict(dataset=Dataset.from_dict({"input_ids": ids.tolist()}), num_calibration_samples=8,
                          max_seq_length=32)
        # DeepSeek-V3's dense first layer stays unquantized: pagedexperts quantizes routed experts only
        ignore = IGNORE + (["re:.*layers\\.0\\.mlp\\..*"] if family == "deepseek_v3" else [])
        oneshot(model=model, recipe=fp4_recipe(scheme, ignore), **kwargs)
        shutil.rmtree(dst, ignore_errors=True)
        model.save_pretrained(dst, save_compressed=True)
    if family == "mixtral":
        mixtral_names(dst)
    return dst


MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def mixtral_names(dst: Path) -> None:
    """Rename the linearized experts' ``gate_proj/up_proj/down_proj`` to Mixtral's checkpoint
    names ``w1/w3/w2`` in place: llm-compressor's ``load_quantizable_moe`` registers this save
    mapping (``modeling/moe/conversion_mappings.py``), but it needs torchvision to run, so the
    fixtures use ``linearize_moe`` after loading, which saves the linearized names."""
    from safetensors.torch import load_file, save_file

    file = dst / "model.safetensors"
    pattern = re.compile(r"(\.experts\.\d+\.)(gate_proj|up_proj|down_proj)\.")
    tensors = {pattern.sub(lambda m: m.group(1) + MIXTRAL_NAMES[m.group(2)] + ".", k): v for k, v in load_file(file).items()}
    save_file(tensors, str(file), metadata={"format": "pt"})


def write_llmc_quantize(name: str, out: Path, sources: Path) -> Path:
    """One ``FIXTURES`` entry: its family's source (saved once into ``sources``), then
    ``llmc_quantize.main`` into ``out / name`` (``recipe.yaml`` dropped)."""
    family, extra = FIXTURES[name]
    src = sources / family
    if not src.exists():
        save_source(family, src)
    dst = out / name
    shutil.rmtree(dst, ignore_errors=True)
    llmc_quantize.main(["--model-path", str(src), "--output-dir", str(dst), *extra])
    (dst / "recipe.yaml").unlink(missing_ok=True)
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument("--only", nargs="*", default=None, help="fixture names (default: all of both sets)")
    args = p.parse_args()
    names = args.only or [*FIXTURES, *FP4_INT8_FIXTURES]
    unknown = [n for n in names if n not in FIXTURES and n not in FP4_INT8_FIXTURES]
    if unknown:
        sys.exit(f"--only {unknown}: not a fixture; choose from {[*FIXTURES, *FP4_INT8_FIXTURES]}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if name in FIXTURES:
                print("wrote", write_llmc_quantize(name, args.out, Path(tmp)))
            else:
                print("wrote", write_fp4_int8(*FP4_INT8_FIXTURES[name], args.out))


if __name__ == "__main__":
    main()
