"""Shared by several test modules (moved from models/test_families.py)."""

from __future__ import annotations
from dataclasses import dataclass, field
import torch
from pagedexperts.tools.check import check_model


E, TOP_K, HIDDEN, EXPERT_I, VOCAB = 8, 2, 32, 64, 128


DECODE_STEPS = 16


PROMPTS = ("ROMEO:\nBut soft, what light", "The history of the city")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=TOP_K,
    max_position_embeddings=256,
    initializer_range=0.1,  # larger than default so routing and logits are decisive
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,  # greedy decode always runs its full length
    tie_word_embeddings=False,
)


MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


@dataclass(frozen=True)
class Case:
    """A tiny model of one family: config class, fields, and what its layout must look like."""

    config_class: str
    model_class: str
    fields: dict
    moe_layers: list[int]  # by hand, from the fields: the MoE layers (others are dense)
    shared: str | None = None  # attribute of the MoE block holding the shared expert
    extra: dict = field(default_factory=dict)


CASES: dict[str, Case] = {
    "mixtral": Case("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=EXPERT_I, num_local_experts=E, head_dim=8), [0, 1, 2]),
    "qwen2_moe": Case(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        dict(intermediate_size=96, moe_intermediate_size=EXPERT_I, shared_expert_intermediate_size=48,
             num_experts=E, mlp_only_layers=[1]),
        [0, 2], shared="shared_expert",
    ),
    "qwen3_moe": Case(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=EXPERT_I, num_experts=E,
             head_dim=8, norm_topk_prob=True, decoder_sparse_step=2),
        [1, 3],
    ),
    "olmoe": Case("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=EXPERT_I, num_experts=E), [0, 1, 2]),
    "deepseek_v2": Case(
        "DeepseekV2Config", "DeepseekV2ForCausalLM",
        dict(MLA, intermediate_size=96, moe_intermediate_size=EXPERT_I, n_routed_experts=E, n_shared_experts=2,
             first_k_dense_replace=1, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
             topk_group=2, routed_scaling_factor=2.5),
        [1, 2], shared="shared_experts",
    ),
    "deepseek_v3": Case(
        "DeepseekV3Config", "DeepseekV3ForCausalLM",
        dict(MLA, intermediate_size=96, moe_intermediate_size=EXPERT_I, n_routed_experts=E, n_shared_experts=1,
             first_k_dense_replace=1, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
             routed_scaling_factor=2.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        [1, 2], shared="shared_experts",
    ),
    "gpt_oss": Case(
        "GptOssConfig", "GptOssForCausalLM",
        dict(intermediate_size=EXPERT_I, num_local_experts=E, head_dim=8, sliding_window=4),
        [0, 1, 2],
    ),
    "qwen3_next": Case(
        "Qwen3NextConfig", "Qwen3NextForCausalLM",
        dict(intermediate_size=96, moe_intermediate_size=EXPERT_I, shared_expert_intermediate_size=48,
             num_experts=E, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
             linear_num_value_heads=4, mlp_only_layers=[2],
             layer_types=["linear_attention", "full_attention", "linear_attention"]),
        [0, 1], shared="shared_expert",
    ),
}


def build_model(name: str, seed: int = 0, **overrides):
    import transformers

    case = CASES[name]
    fields = {**COMMON, **case.fields, **overrides}
    torch.manual_seed(seed)
    config = getattr(transformers, case.config_class)(**fields)
    return getattr(transformers, case.model_class)(config).eval()


def save_char_tokenizer(path) -> None:
    """A character-level tokenizer (ASCII code = token id) so ``check_model`` can run prompts."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({chr(i): i for i in range(VOCAB)}, unk_token=chr(0)))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=chr(0), pad_token=chr(0)).save_pretrained(path)


def assert_exact(paged, reference, tokenizer, what: str, steps: int = DECODE_STEPS) -> None:
    """Each prompt alone and both as a left-padded batch of 2: prefill and ``steps`` greedy steps."""
    result = check_model(paged, reference, tokenizer, PROMPTS, max_new_tokens=steps)
    bad = [p for p in result.prompts if not (p.exact and p.tokens_equal)]
    assert not bad, (
        f"{what}: paged logits differ from the unpaged model on {len(bad)} prompt(s), "
        f"max |diff| {result.max_abs_diff:.3e}"
    )
    assert result.misses > 0, f"{what}: no expert was ever paged in; the check proves nothing"
