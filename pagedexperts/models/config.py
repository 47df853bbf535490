"""What a model's config says about paging: E, top_k, the MoE layers, KV and expert bytes, dtypes.

The one reading of a Hugging Face config (object or config.json dict; multimodal by its
``text_config``). Standard library only. Does not: know module layouts or checkpoints.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
_CONFIG_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
RUN_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the --dtype choices, bytes per value
_LINEAR_ATTENTION_TYPES = {"linear_attention", "mamba", "gated_delta_net"}
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``key`` of a config object or a config.json dict (None counts as missing)."""
    value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return default if value is None else value


def text_config(config: Any) -> Any:
    """The language-model part of a config (a dict's ``text_config``); a config object as it is."""
    return (config.get("text_config") or config) if isinstance(config, dict) else config


def num_routed_experts(config: Any) -> int:
    """E: config.json spells it num_experts, num_local_experts or n_routed_experts (0: none)."""
    for key in EXPERT_COUNT_KEYS:
        if config_value(config, key) is not None:
            return int(config_value(config, key))
    return 0


def top_k(config: Any) -> int:
    """k: ``num_experts_per_tok`` (``moe_top_k`` in some configs); 0 when neither is set."""
    return int(config_value(config, "num_experts_per_tok") or config_value(config, "moe_top_k") or 0)


def routing_problem(config: Any) -> str | None:
    """Why top_k > E in config.json (names both keys and values), or None."""
    cfg = text_config(config)
    num_experts, k = num_routed_experts(cfg), top_k(cfg)
    if not num_experts or k <= num_experts:
        return None
    k_key = "num_experts_per_tok" if config_value(cfg, "num_experts_per_tok") else "moe_top_k"
    e_key = next(key for key in EXPERT_COUNT_KEYS if config_value(cfg, key) is not None)
    return (f"config.json has {k_key} = {k} but {e_key} = {num_experts}: a token cannot route to more "
            f"experts than a layer has; the checkpoint's config.json is inconsistent (--model-path)")


def is_moe_layer(config: Any, layer: int) -> bool:
    """Whether decoder layer ``layer`` holds routed experts, as the families' constructors decide:
    ``mlp_layer_types`` or ``moe_layers`` when present; else every layer but ``mlp_only_layers``,
    those before ``first_k_dense_replace``, and those off ``decoder_sparse_step`` ((i + 1) % step
    == 0), ``moe_layer_freq`` (i % freq == 0) or ``interleave_moe_layer_step`` ((i + 1) % step == 0)."""
    if num_routed_experts(config) <= 0:
        return False
    types = config_value(config, "mlp_layer_types")
    if types:
        return types[layer] in ("sparse", "moe")
    if config_value(config, "moe_layers") is not None:
        return layer in config_value(config, "moe_layers")
    if layer in (config_value(config, "mlp_only_layers") or []):
        return False
    if layer < int(config_value(config, "first_k_dense_replace", 0)):
        return False
    step = int(config_value(config, "decoder_sparse_step", 1))
    freq = int(config_value(config, "moe_layer_freq", 1))
    interleave = int(config_value(config, "interleave_moe_layer_step", 1))
    return (layer + 1) % step == 0 and layer % freq == 0 and (layer + 1) % interleave == 0


def moe_layer_indices(config: Any) -> list[int]:
    """Decoder layers of ``config`` that hold routed experts (``is_moe_layer``)."""
    cfg = text_config(config)
    return [i for i in range(int(config_value(cfg, "num_hidden_layers"))) if is_moe_layer(cfg, i)]


@dataclass(frozen=True)
class MoEShape:
    """The routed-expert shape of a model: E, k, decoder layers and the MoE layer indices."""

    num_experts: int
    top_k: int
    num_layers: int
    moe_layers: tuple[int, ...]


def moe_shape(config: dict) -> MoEShape:
    """E, k and the MoE layer indices (``is_moe_layer``) of a config dict.
    Raises ValueError: not a MoE config (no expert count, top_k or MoE layer), or top_k above E."""
    cfg = text_config(config)
    e, k = num_routed_experts(cfg), top_k(cfg)
    if not e or not k:
        raise ValueError(
            "config is not a Mixture-of-Experts config: it needs num_experts / num_local_experts / "
            f"n_routed_experts and num_experts_per_tok (model_type={cfg.get('model_type')!r})"
        )
    if routing_problem(cfg):
        raise ValueError(routing_problem(cfg))
    n = int(cfg["num_hidden_layers"])
    layers = moe_layer_indices(cfg)
    if not layers:
        raise ValueError(f"config has {e} experts but no MoE layer (check mlp_only_layers etc.)")
    return MoEShape(num_experts=int(e), top_k=int(k), num_layers=n, moe_layers=tuple(layers))


def dense_expert_bytes(config: dict, *, dtype: str | None = None) -> int:
    """Bytes of one routed expert dequantized to ``dtype`` (None: the config's, else bfloat16):
    (3 x H x I + gpt-oss's biases 2 x I + H) x dtype bytes, I = ``moe_intermediate_size`` else
    ``intermediate_size``.
    Raises ValueError: an unknown dtype (lists the choices)."""
    cfg = text_config(config)
    name = str(dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").replace("torch.", "")
    if name not in RUN_DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(RUN_DTYPE_BYTES)} (--dtype)")
    h = int(cfg["hidden_size"])
    i = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    biases = 2 * i + h if cfg.get("model_type") == "gpt_oss" else 0
    return (3 * h * i + biases) * RUN_DTYPE_BYTES[name]


def _kv_layers(cfg: dict) -> int:
    n = int(cfg["num_hidden_layers"])
    if cfg.get("layer_types"):
        return sum(t not in _LINEAR_ATTENTION_TYPES for t in cfg["layer_types"][:n])
    interval = cfg.get("full_attention_interval")
    if interval:
        return sum((i + 1) % int(interval) == 0 for i in range(n))
    return n


def _kv_dtype_bytes(cfg: dict, kv_dtype: str) -> int:
    if kv_dtype == "auto":
        name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
        return _CONFIG_DTYPE_BYTES.get(name, 2)
    try:
        return KV_DTYPE_BYTES[kv_dtype]
    except KeyError:
        raise ValueError(
            f"unknown KV dtype {kv_dtype!r}; choose one of {['auto', *KV_DTYPE_BYTES]} (--kv-dtype)"
        ) from None


def kv_bytes_per_token(config: dict, *, kv_dtype: str = "auto", model_dtype: str | None = None) -> int:
    """KV-cache bytes one token keeps across all layers: ``KV layers x 2 x kv heads x head dim x
    dtype bytes``; DeepSeek MLA ``(kv_lora_rank + qk_rope_head_dim) x dtype bytes`` per layer;
    linear-attention layers none. ``kv_dtype``: "auto" (``model_dtype``, else the config's, else
    bf16), "bf16", "fp16", "fp32" or "fp8". Qwen3-30B-A3B: 48 x 2 x 4 x 128 x 2 = 98,304.
    Raises ValueError: unknown ``kv_dtype`` (lists the choices; ``--kv-dtype``)."""
    cfg = text_config(config)
    dtype_bytes = _kv_dtype_bytes({**cfg, "dtype": model_dtype} if model_dtype else cfg, kv_dtype)
    layers = _kv_layers(cfg)
    if cfg.get("kv_lora_rank"):
        return layers * (int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 0))) * dtype_bytes
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def run_dtype(config: dict, *, dtype: str | None = None) -> str:
    """The dtype name a run uses: ``dtype`` (``--dtype``), else the config's, else float32.
    Raises ValueError: an unknown dtype (lists the --dtype choices)."""
    cfg = text_config(config)
    saved = config_value(cfg, "dtype") or (cfg.get("torch_dtype") if isinstance(cfg, dict) else None)
    name = dtype if dtype not in (None, "auto") else str(saved or "float32").replace("torch.", "")
    if name not in RUN_DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(RUN_DTYPE_BYTES)} (--dtype)")
    return name


def read_config(model_path: str) -> dict:
    """The parsed ``config.json`` of a model directory, ``quantization_config`` filled from a ModelOpt
    ``hf_quant_config.json`` when absent. Raises FileNotFoundError: no config.json (``--model-path``);
    ValueError: config.json is not valid JSON (names the file, line and column)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {model_path!r} (--model-path)")
    with open(path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} "
                             "(--model-path)") from None
    if not config.get("quantization_config"):
        quantization = modelopt_quantization_config(model_path)
        if quantization is not None:
            config["quantization_config"] = quantization
    return config


def modelopt_quantization_config(model_path) -> dict | None:
    """``{"quant_method": "modelopt", **quantization}`` from a ModelOpt export's
    ``hf_quant_config.json`` (read when config.json has no ``quantization_config``); None without it.
    Raises ValueError: the file is not JSON, or has no ``quantization`` object (names the file)."""
    path = os.path.join(model_path, "hf_quant_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    quantization = data.get("quantization") if isinstance(data, dict) else None
    if not isinstance(quantization, dict):
        raise ValueError(f"{path} has no 'quantization' object; ModelOpt's export writes "
                         "{\"producer\": ..., \"quantization\": {\"quant_algo\": ...}}")
    return {"quant_method": "modelopt", **quantization}


def with_modelopt_quantization(config, model_path):
    """``config`` with ``quantization_config`` filled from hf_quant_config.json when it has none."""
    if not getattr(config, "quantization_config", None):
        quantization = modelopt_quantization_config(model_path)
        if quantization is not None:
            config.quantization_config = quantization
    return config
