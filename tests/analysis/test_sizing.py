"""sizing: the published Qwen3-30B-A3B analysis to the printed digit, configs, headers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from pagedexperts.analysis import sizing
from pagedexperts.models import config as model_config
from pagedexperts.storage.safetensors_files import read_header_json

QWEN3_30B = dict(num_hidden_layers=48, num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, hidden_size=2048, decoder_sparse_step=1,
                 mlp_only_layers=[], torch_dtype="bfloat16", model_type="qwen3_moe")

# (expert MB, K, link GB/s, tok/s) -> (slot MB, KV tokens, cap, uniform %, allowed %, verdict)
PUBLISHED = [
    ((2.43, 92, 50, 205.6), (117, 1187, 11, 28, 26, "inconclusive")),
    ((4.72, 40, 50, 87.7), (227, 2305, 5, 69, 31, "reuse implied")),
    ((2.43, 26, 15.75, 32.6), (117, 1187, 3, 80, 52, "reuse implied")),
]


@pytest.mark.parametrize("inputs,expected", PUBLISHED)
def test_published_qwen3_30b_analysis(inputs, expected):
    expert_mb, k, link, tok_s = inputs
    expert = round(expert_mb * sizing.MB)
    kv = model_config.kv_bytes_per_token(config=QWEN3_30B)
    assert kv == 98_304
    slot = sizing.slot_bytes(expert_bytes=expert, moe_layers=48)
    uniform = sizing.uniform_miss_rate(num_resident=k, num_experts=128)
    allowed = sizing.max_miss_rate_allowed(
        link_gbps=link, tok_s=tok_s,
        all_miss_bytes_per_token=sizing.all_miss_bytes_per_token(moe_layers=48, top_k=8, expert_bytes=expert))
    got = (
        round(slot / sizing.MB),
        round(sizing.kv_tokens_per_slot(slot_bytes=slot, kv_bytes_per_token=kv)),
        sizing.single_wave_batch_cap(num_resident=k, top_k=8),
        round(100 * uniform),
        round(100 * allowed),
        sizing.reuse_verdict(max_miss_rate=allowed, uniform_miss_rate=uniform),
    )
    assert got == expected


def test_kv_bytes_fp8_halves_bf16():
    assert model_config.kv_bytes_per_token(config=QWEN3_30B, kv_dtype="fp8") == 98_304 // 2
    with pytest.raises(ValueError, match="--kv-dtype"):
        model_config.kv_bytes_per_token(config=QWEN3_30B, kv_dtype="int3")


def test_kv_bytes_deepseek_mla_has_no_factor_two():
    cfg = dict(num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=128,
               hidden_size=7168, torch_dtype="bfloat16")
    assert model_config.kv_bytes_per_token(config=cfg) == 61 * (512 + 64) * 2


def test_kv_bytes_qwen3_next_counts_full_attention_layers_only():
    base = dict(num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                hidden_size=2048, torch_dtype="bfloat16")
    by_interval = model_config.kv_bytes_per_token(config={**base, "full_attention_interval": 4})
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12
    by_types = model_config.kv_bytes_per_token(config={**base, "layer_types": types})
    assert by_interval == by_types == 12 * 2 * 2 * 256 * 2


def test_moe_shape_layer_patterns():
    assert model_config.moe_shape(config=QWEN3_30B).moe_layers == tuple(range(48))
    qwen2 = dict(num_hidden_layers=6, num_experts=60, num_experts_per_tok=4, decoder_sparse_step=2,
                 mlp_only_layers=[3])
    assert model_config.moe_shape(config=qwen2).moe_layers == (1, 5)
    ds = dict(num_hidden_layers=5, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=2)
    shape = model_config.moe_shape(config=ds)
    assert (shape.num_experts, shape.top_k, shape.moe_layers) == (64, 6, (2, 3, 4))
    mixtral = dict(num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2)
    assert model_config.moe_shape(config=mixtral).num_experts == 8
    with pytest.raises(ValueError, match="not a Mixture-of-Experts"):
        model_config.moe_shape(config=dict(num_hidden_layers=4, model_type="llama"))


def test_auto_k_and_context_inverse():
    slot = 100 * 10**6
    kw = dict(device_memory_gb=10, non_expert_bytes=2 * 10**9, runtime_reserve_gb=1.0, slot_bytes=slot)
    kv = sizing.kv_reserve_bytes(context_length=1000, max_running_requests=2, kv_bytes_per_token=500_000)
    assert kv == 10**9
    assert sizing.auto_num_resident(kv_reserve_bytes=kv, top_k=4, num_experts=128, **kw) == 60
    assert sizing.auto_num_resident(kv_reserve_bytes=kv, top_k=4, num_experts=32, **kw) == 32
    assert sizing.auto_num_resident(kv_reserve_bytes=9 * 10**9, top_k=4, num_experts=128, **kw) == 4
    # inverse: at K=60 the KV budget is exactly the reserve asked for
    assert sizing.context_tokens_allowed(num_resident=60, kv_bytes_per_token=500_000, **kw) == 2000
    assert sizing.context_tokens_allowed(num_resident=128, kv_bytes_per_token=500_000, **kw) == 0


def test_prefill_page_in():
    b = sizing.prefill_page_in_bytes(num_experts=128, num_resident=92, slot_bytes=116_640_000)
    assert b == 36 * 116_640_000
    assert sizing.transfer_seconds(num_bytes=b, link_gbps=50) == pytest.approx(b / 50e9)


# ---- model directories: config.json + safetensors headers ---------------------------------

E, H, I = 4, 8, 6  # experts, hidden, intermediate of the synthetic checkpoint


def _write_config(path, **extra):
    cfg = dict(num_hidden_layers=2, num_experts=E, num_experts_per_tok=2, num_attention_heads=2,
               num_key_value_heads=1, hidden_size=H, torch_dtype="bfloat16", **extra)
    (path / "config.json").write_text(json.dumps(cfg))


def _per_expert_tensors():
    t = {"model.embed_tokens.weight": np.zeros((10, H), np.float16)}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp"
        t[f"{p}.gate.weight"] = np.zeros((E, H), np.float32)
        t[f"{p}.shared_experts.up_proj.weight"] = np.zeros((I, H), np.float16)
        for j in range(E):
            t[f"{p}.experts.{j}.gate_proj.weight"] = np.zeros((I, H), np.float16)
            t[f"{p}.experts.{j}.up_proj.weight"] = np.zeros((I, H), np.float16)
            t[f"{p}.experts.{j}.down_proj.weight"] = np.zeros((H, I), np.float16)
            t[f"{p}.experts.{j}.down_proj.bias"] = np.zeros((H,), np.float32)
    return t


def test_expert_bytes_per_expert_keys_hand_count(tmp_path):
    _write_config(tmp_path)
    save_file(_per_expert_tensors(), str(tmp_path / "model.safetensors"))
    sizes = sizing.checkpoint_sizes(model_path=str(tmp_path), num_experts=E)
    one_expert = 3 * I * H * 2 + H * 4  # three fp16 matrices + an fp32 bias = 320 bytes
    assert sizes.expert_bytes == one_expert == 320
    assert sizes.expert_tensor_bytes == 2 * E * one_expert
    assert sizes.non_expert_bytes == 10 * H * 2 + 2 * (E * H * 4 + I * H * 2)
    assert sizes.expert_layers == (0, 1)


def test_expert_bytes_stacked_sharded(tmp_path):
    _write_config(tmp_path)
    shards = {}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        shards[f"model-0000{layer + 1}-of-00002.safetensors"] = {
            f"{p}.gate_up_proj": np.zeros((E, 2 * I, H), np.float16),
            f"{p}.gate_up_proj_scales": np.zeros((E, 2 * I), np.float32),
            f"{p}.down_proj": np.zeros((E, H, I), np.float16),
            f"model.layers.{layer}.self_attn.q_proj.weight": np.zeros((H, H), np.float16),
        }
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(tmp_path / name))
        weight_map.update({k: name for k in tensors})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sizes = sizing.checkpoint_sizes(model_path=str(tmp_path), num_experts=E)
    assert sizes.expert_bytes == 2 * I * H * 2 + 2 * I * 4 + H * I * 2
    assert sizes.non_expert_bytes == 2 * H * H * 2


def test_model_directory_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_config.read_config(str(tmp_path))
    _write_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="no safetensors checkpoint .*\\*.safetensors"):
        sizing.checkpoint_sizes(model_path=str(tmp_path), num_experts=E)
    save_file({"model.embed_tokens.weight": np.zeros((2, 2), np.float16)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no routed-expert tensor"):
        sizing.checkpoint_sizes(model_path=str(tmp_path), num_experts=E)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_header_json(tmp_path / "model.safetensors")
