"""Write the tiny llm-compressor checkpoints of tests/test_formats_llmc.py (committed beside
this file). Run with llm-compressor 0.14's own venv (it pins an older transformers):

    /work/llmc-venv/bin/python tests/data/llmc/make_fp4_int8_fixtures.py --out tests/data/llmc

Per family (tiny random Qwen3-MoE and Mixtral, float32, seeded) and scheme: llm-compressor's
``oneshot`` with ``QuantizationModifier`` (round-to-nearest; routed experts only: attention,
router, shared experts and lm_head ignored), ``save_pretrained(save_compressed=True)``, into
``OUT/{family}-{scheme}``; the float32 source into ``OUT/{family}-source`` is NOT written
(the tests do not need it). NVFP4 (static input global scale) is calibrated on 8 seeded random
token sequences. ``W4A16_ASYM:g32``: the preset with group size 32 (its 128 exceeds I).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

SCHEMES = ("NVFP4A16", "NVFP4", "W8A8", "MXFP4A16", "W4A16_ASYM:g32")
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$", "re:.*shared_expert.*"]
DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
            max_position_embeddings=128, initializer_range=0.1, tie_word_embeddings=False)


def family_config(family: str):
    from transformers import MixtralConfig, Qwen3MoeConfig

    if family == "qwen3_moe":
        return Qwen3MoeConfig(**DIMS, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True)
    if family == "mixtral":
        dims = dict(DIMS, intermediate_size=32)
        return MixtralConfig(**dims, num_local_experts=8)
    raise ValueError(f"unknown family {family!r}")


def recipe(scheme: str):
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if ":g" in scheme:
        name, group = scheme.split(":g")
        qs = preset_name_to_scheme(name, ["Linear"])
        qs.weights.group_size = int(group)
        return QuantizationModifier(config_groups={"group_0": qs}, ignore=IGNORE)
    return QuantizationModifier(targets="Linear", scheme=scheme, ignore=IGNORE)


def write(family: str, scheme: str, out: Path) -> Path:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dst = out / f"{family}-{scheme.replace(':', '-')}"
    with tempfile.TemporaryDirectory() as tmp:  # oneshot reads the source's config back
        AutoModelForCausalLM.from_config(family_config(family)).save_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        linearize_moe(model)
        kwargs = {}
        if scheme == "NVFP4":
            ids = torch.randint(2, 256, (8, 32), generator=torch.Generator().manual_seed(1))
            kwargs = dict(dataset=Dataset.from_dict({"input_ids": ids.tolist()}), num_calibration_samples=8,
                          max_seq_length=32)
        oneshot(model=model, recipe=recipe(scheme), **kwargs)
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
    import re

    from safetensors.torch import load_file, save_file

    file = dst / "model.safetensors"
    pattern = re.compile(r"(\.experts\.\d+\.)(gate_proj|up_proj|down_proj)\.")
    tensors = {pattern.sub(lambda m: m.group(1) + MIXTRAL_NAMES[m.group(2)] + ".", k): v for k, v in load_file(file).items()}
    save_file(tensors, str(file), metadata={"format": "pt"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent)
    p.add_argument("--family", nargs="+", default=["qwen3_moe", "mixtral"])
    p.add_argument("--scheme", nargs="+", default=list(SCHEMES))
    a = p.parse_args()
    for family in a.family:
        for scheme in a.scheme:
            print("wrote", write(family, scheme, a.out))


if __name__ == "__main__":
    main()
