"""Write the tiny ModelOpt checkpoints of tests/formats/test_modelopt.py (committed beside this
file). Run with ModelOpt's own venv (nvidia-modelopt 0.47, transformers 5.24, CPU torch)::

    /work/modelopt-venv/bin/python tests/data/modelopt/make_fixtures.py [--out tests/data/modelopt]

Per family (tiny random Qwen3-MoE, Mixtral and DeepSeek-V3, float32, seed 0, with a character
tokenizer; DeepSeek-V3 with a shared expert and a dense first layer) and algorithm (NVFP4, FP8):
``scripts/modelopt_quantize.py`` (``mtq.quantize`` with the routed experts only, calibrated on 8
seeded random token sequences, then ``export_hf_checkpoint``) into ``OUT/{family}-{algo}``.
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
import modelopt_quantize  # noqa: E402

VOCAB, HIDDEN, EXPERT_I, E, TOP_K = 256, 64, 32, 8, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=TOP_K, max_position_embeddings=128, initializer_range=0.1, pad_token_id=0,
              bos_token_id=1, eos_token_id=None, tie_word_embeddings=False, num_hidden_layers=2)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=128, moe_intermediate_size=EXPERT_I, num_experts=E,
                                         head_dim=16, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=EXPERT_I, num_local_experts=E, head_dim=16)),
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16,
                                             qk_rope_head_dim=16, v_head_dim=16, intermediate_size=128,
                                             moe_intermediate_size=EXPERT_I, n_routed_experts=E, n_shared_experts=1,
                                             first_k_dense_replace=1, q_lora_rank=32, n_group=4, topk_group=2,
                                             norm_topk_prob=True, routed_scaling_factor=2.5,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
ALGOS = ("NVFP4", "FP8")


def save_source(family: str, path: Path) -> None:
    """The float32 source model of ``family`` (seed 0) with a character tokenizer."""
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    config_cls, fields = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**COMMON, **fields})
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(path)
    tok = Tokenizer(models.WordLevel({chr(i): i for i in range(VOCAB)}, unk_token=chr(0)))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=chr(0), pad_token=chr(0)).save_pretrained(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument("--family", nargs="+", default=list(FAMILIES))
    p.add_argument("--algo", nargs="+", default=list(ALGOS))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.family:
            src = Path(tmp) / family
            save_source(family, src)
            for algo in args.algo:
                out = args.out / f"{family}-{algo}"
                shutil.rmtree(out, ignore_errors=True)
                modelopt_quantize.main(["--model-path", str(src), "--output-dir", str(out), "--algo", algo])


if __name__ == "__main__":
    main()
