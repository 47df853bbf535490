"""``pagedexperts preflight`` from explicit numbers: a model's architecture as its model card and
config.json state it, when the checkpoint is not at hand.

Owns: the explicit-mode flags and their translation into ``preflight.build_report``'s model
inputs. The architecture (MoE layers, E, top_k, hidden size, MoE intermediate size, attention
heads, KV heads, head dim) becomes a config dict that the same ``models.config`` functions read
as for ``--model-path`` (dense expert bytes, KV bytes per token); a quantized expert's packed
bytes come from its format's own layout (``formats``' ``ExpertFormat.layout``: what the store
holds and a page-in moves); the non-expert weights are estimated from the architecture
(``sizing.non_expert_bytes``) unless ``--non-expert-gb`` gives them. ``--expert-mb`` and
``--kv-bytes-per-token`` still take the byte counts themselves. Does not: read files, or print.
"""

from __future__ import annotations

from pagedexperts.analysis import sizing
from pagedexperts.formats import EXAMPLE_FORMATS
from pagedexperts.models import config as model_config

DENSE = "dense"  # sized from the config at --dtype (the other --expert-format choices: their format's layout)
EXPLICIT_DTYPE = "bfloat16"  # --dtype auto with explicit numbers: what model cards publish


def add_arguments(model) -> None:
    """The explicit-mode flags on ``model`` (the "model" argument group of preflight)."""
    model.add_argument("--layers", type=int, help="MoE layers L")
    model.add_argument("--experts", type=int, help="routed experts per layer E")
    model.add_argument("--top-k", type=int, help="experts per token k")
    model.add_argument("--hidden-size", type=int, metavar="H", help="hidden size (config.json hidden_size)")
    model.add_argument("--moe-intermediate-size", type=int, metavar="I",
                       help="one routed expert's intermediate size (moe_intermediate_size; Mixtral: intermediate_size)")
    model.add_argument("--num-attention-heads", type=int, help="query heads")
    model.add_argument("--num-key-value-heads", type=int, help="KV heads (default: --num-attention-heads)")
    model.add_argument("--head-dim", type=int, help="dimension of one head (default: H / --num-attention-heads)")
    model.add_argument("--attention-layers", type=int,
                       help="layers with a KV cache (default: --layers; more with dense layers, DeepSeek's first 3)")
    model.add_argument("--vocab-size", type=int, help="vocabulary, for the embeddings in the non-expert estimate")
    model.add_argument("--tie-word-embeddings", action="store_true", help="lm_head shares the embedding matrix")
    model.add_argument("--expert-format", choices=EXAMPLE_FORMATS, default=DENSE,
                       help="how the routed experts are stored: dense at --dtype (default), or a quantized format "
                       "(sized from the format's own layout)")
    model.add_argument("--group-size", type=int, default=128,
                       help="group size of w4a16, w8a16, gptq and awq (default 128)")
    model.add_argument("--expert-mb", type=float, help="MB of one expert in one layer (instead of H, I and the format)")
    model.add_argument("--kv-bytes-per-token", type=int,
                       help="KV bytes per token, all layers (instead of the heads; DeepSeek MLA: (kv_lora_rank + "
                       "qk_rope_head_dim) x 2 bytes x layers)")
    model.add_argument("--non-expert-gb", type=float,
                       help="GB of non-expert weights (default: estimated from the architecture: attention, routers, "
                       "norms, and embeddings with --vocab-size; shared experts and dense MLP layers need this flag)")


EXPLICIT_FLAGS = ("layers", "experts", "top_k", "hidden_size", "moe_intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "attention_layers", "vocab_size", "expert_mb", "kv_bytes_per_token",
                  "non_expert_gb")  # any of them given: explicit mode


def explicit_inputs(args) -> dict:
    """``build_report``'s model inputs from the explicit flags; each missing or bad value named.

    Raises:
        ValueError: a required flag missing (says which alternatives would do), a value <= 0,
            --group-size below 1, top_k outside [1, E], or a shape the expert format refuses (names the flags).
    """
    missing = [f for f in ("layers", "experts", "top_k") if getattr(args, f) is None]
    if args.expert_mb is None and (args.hidden_size is None or args.moe_intermediate_size is None):
        missing.append("expert-mb (or hidden-size and moe-intermediate-size)")
    if args.kv_bytes_per_token is None and args.num_attention_heads is None:
        missing.append("kv-bytes-per-token (or num-attention-heads, with hidden-size or head-dim)")
    if missing:
        raise ValueError("pass --model-path DIR, or the explicit model flags (missing: "
                         + ", ".join("--" + f.replace("_", "-") for f in missing) + ")")
    for flag in EXPLICIT_FLAGS:
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be > 0")
    if args.group_size < 1:  # the formats divide by it (a ZeroDivisionError traceback)
        raise ValueError(f"--group-size {args.group_size} must be >= 1 (input channels per scale group)")
    if not 1 <= args.top_k <= args.experts:
        raise ValueError(f"--top-k {args.top_k} must be in [1, E={args.experts}] (--top-k)")
    dtype = EXPLICIT_DTYPE if args.dtype == "auto" else args.dtype
    config = architecture_config(args, dtype)
    expert_bytes, dense_bytes = _expert_bytes(args, config, dtype)
    if args.kv_bytes_per_token is not None:  # taken as bf16 KV (2 bytes per value)
        kv = args.kv_bytes_per_token * (model_config.KV_DTYPE_BYTES[args.kv_dtype] if args.kv_dtype != "auto" else 2) // 2
    else:
        kv = model_config.kv_bytes_per_token(config, kv_dtype=args.kv_dtype, model_dtype=dtype)
    if args.non_expert_gb is not None:
        non_expert, counted = round(args.non_expert_gb * sizing.GB), "--non-expert-gb"
    elif args.hidden_size and args.num_attention_heads:
        non_expert = sizing.non_expert_bytes(
            layers=config["num_hidden_layers"], moe_layers=args.layers, hidden=args.hidden_size,
            heads=args.num_attention_heads, kv_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
            num_experts=args.experts, vocab_size=args.vocab_size or 0, tied=args.tie_word_embeddings,
            dtype_bytes=model_config.RUN_DTYPE_BYTES[dtype])
        counted = "estimated: attention, routers, norms" + (", embeddings" if args.vocab_size else
                                                           "; no embeddings (--vocab-size)")
    else:
        non_expert, counted = 0, "not counted: give --non-expert-gb, or --hidden-size and the heads"
    return dict(model="explicit", moe_layers=args.layers, num_experts=args.experts, top_k=args.top_k,
                expert_bytes=expert_bytes, dense_expert_bytes=dense_bytes, kv_bytes_per_token=kv,
                non_expert_bytes=non_expert, non_expert_source=counted, dtype=dtype)


def architecture_config(args, dtype: str) -> dict:
    """A config.json-like dict of the flags given (``models.config`` reads it as a checkpoint's)."""
    heads = args.num_attention_heads
    head_dim = args.head_dim or (args.hidden_size // heads if heads and args.hidden_size else None)
    if heads and head_dim is None and args.kv_bytes_per_token is None:
        raise ValueError("--num-attention-heads needs --head-dim or --hidden-size (head dim = H / heads)")
    return dict(num_hidden_layers=args.attention_layers or args.layers, num_experts=args.experts,
                num_experts_per_tok=args.top_k, hidden_size=args.hidden_size,
                moe_intermediate_size=args.moe_intermediate_size, num_attention_heads=heads,
                num_key_value_heads=args.num_key_value_heads or heads, head_dim=head_dim, dtype=dtype)


def _expert_bytes(args, config: dict, dtype: str) -> tuple[int, int | None]:
    """(bytes of one expert as stored, its dense bytes, or None when H and I are not given):
    dense at the dtype the format dequantizes into (``ExpertFormat.experts_dtype``), as for a
    checkpoint (``preflight._quantized_sizes``)."""
    shape = bool(args.hidden_size and args.moe_intermediate_size)
    if args.expert_mb is not None:
        if args.expert_format != DENSE:
            raise ValueError("--expert-mb is the expert's bytes already; drop --expert-format (or give --hidden-size "
                             "and --moe-intermediate-size instead of --expert-mb)")
        return round(args.expert_mb * sizing.MB), model_config.dense_expert_bytes(config, dtype=dtype) if shape else None
    if args.expert_format == DENSE:
        dense = model_config.dense_expert_bytes(config, dtype=dtype)
        return dense, dense
    packed, experts_dtype = packed_expert_bytes(args.expert_format, hidden=args.hidden_size,
                                                intermediate=args.moe_intermediate_size, group_size=args.group_size,
                                                dtype=dtype)
    return packed, model_config.dense_expert_bytes(config, dtype=experts_dtype)


def packed_expert_bytes(name: str, *, hidden: int, intermediate: int, group_size: int, dtype: str) -> tuple[int, str]:
    """(bytes of one routed expert in format ``name``, the dtype its experts dequantize into at
    run dtype ``dtype``): gate and up [2I, H] + down [H, I] in nn.Linear's layout, bytes from the
    format's own layout (weights, scales, zero points, g_idx).

    Raises:
        ValueError: the format refuses the shape, e.g. ``group_size`` does not divide a row (names
            the flags and the format's reason).
    """
    import torch

    from pagedexperts.formats import example_format
    from pagedexperts.formats.base import TensorSpec

    fmt = example_format(name, group_size=group_size)
    run = getattr(torch, dtype)
    dense = (TensorSpec("gate_up_proj", (2 * intermediate, hidden), run), TensorSpec("down_proj", (hidden, intermediate), run))
    try:
        packed = fmt.layout(dense, sources={"gate_up_proj": 2}).expert_bytes
    except ValueError as exc:  # the format's own limit, e.g. a group size that does not divide a row
        raise ValueError(f"--expert-format {name} --group-size {group_size} at --hidden-size {hidden}, "
                         f"--moe-intermediate-size {intermediate}: {exc}") from None
    return packed, str(fmt.experts_dtype(run)).removeprefix("torch.")
