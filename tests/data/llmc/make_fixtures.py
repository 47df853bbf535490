"""Write the llm-compressor fixtures of tests/test_ct_llmc.py (run with llm-compressor's venv).

    /work/llmc-venv/bin/python tests/data/llmc/make_fixtures.py [--out tests/data/llmc]

Tiny float32 models of two families (Qwen3-MoE, DeepSeek-V3: vocab 128, hidden 32,
16 routed experts of intermediate 16, top-2; DeepSeek-V3 with a shared expert and a dense first
layer), each saved with a character tokenizer, then quantized by ``scripts/llmc_quantize.py``
(oneshot + QuantizationModifier, routed experts only) in the schemes listed in ``FIXTURES``.
Mixtral is left out: llm-compressor 0.14 (with its transformers 5.17) saves Mixtral's linearized
experts as ``block_sparse_moe.experts.{j}.gate_proj/up_proj/down_proj``, which transformers
5.24's Mixtral conversion (``w1/w3/w2``) does not read: it leaves those experts randomly
initialised, and pagedexperts cannot map them either.
Each output dir keeps ``llmc_quantize.json`` (argv and versions).
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent))
    p.add_argument("--only", nargs="*", default=None, help="fixture names (default: all)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, (family, extra) in FIXTURES.items():
            if args.only and name not in args.only:
                continue
            src = Path(tmp) / family
            if not src.exists():
                save_source(family, src)
            out = Path(args.out) / name
            shutil.rmtree(out, ignore_errors=True)
            llmc_quantize.main(["--model-path", str(src), "--output-dir", str(out), *extra])
            (out / "recipe.yaml").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
