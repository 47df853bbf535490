"""``pagedexperts preflight``: what a choice of K costs, before loading anything.

Owns: the flags, their validation, the composition of ``sizing`` functions into one report,
and its JSON rendering (the text is ``preflight_text``'s). Reads config.json and safetensors headers only
(``--model-path``) or takes explicit numbers. Does not measure anything (``linkbench``) or
replay routing (``simulate``).
"""

from __future__ import annotations

import dataclasses
import json
import os

from pagedexperts.commands import COMMANDS
from pagedexperts.analysis import sizing
from pagedexperts.commands import preflight_explicit
from pagedexperts.commands.preflight_text import format_report
from pagedexperts.models import config as model_config
from pagedexperts.residency.planner import default_num_resident


def add_parser(subparsers) -> None:
    """Register the subcommand, its flags and ``func`` on the CLI's ``subparsers``."""
    p = subparsers.add_parser(
        "preflight",
        help=COMMANDS["preflight"],
        description="Arithmetic before a run: slot bytes, KV tokens per slot, single-wave batch cap (and what "
        "--beyond-k in-place changes: no batch needs waves, the link bytes per token stay), "
        "uniform miss rate, the miss rate a measured speed allows, prefill page-in time, auto K. "
        "Units: kB = 1e3 B, MB = 1e6 B, GB = 1e9 B, GB/s = 1e9 B/s. Exit status: 0, or 1 when "
        "--device-memory-gb is given and the run DOES NOT FIT in it (the report says which parts "
        "and which flag changes would fit), 2 on bad input.",
    )
    model = p.add_argument_group("model (a directory, or explicit numbers as a model card and config.json give them)")
    model.add_argument("--model-path", help="checkpoint directory: config.json + safetensors (headers only); "
                       "bundled or bundled:FORMAT as in every command (default: the bundled model, unless "
                       "the explicit numbers below are given)")
    preflight_explicit.add_arguments(model)
    run = p.add_argument_group("run")
    run.add_argument("--num-resident", type=int,
                     help="K resident experts per layer; omitted: auto K from --device-memory-gb, else the "
                     "default K of generate and serve (E/4, at least top_k)")
    run.add_argument("--link-gbps", type=float, help="host-to-device GB/s (see `pagedexperts linkbench`)")
    run.add_argument("--tok-s", type=float, help="measured decode tokens/s, to bound the miss rate")
    run.add_argument("--device-memory-gb", type=float, help="device memory budget in GB, for auto K")
    run.add_argument("--context-length", type=int, default=4096, help="tokens per request for the KV reserve (default 4096)")
    run.add_argument("--max-running-requests", type=int, default=1, help="concurrent requests for the KV reserve (default 1)")
    run.add_argument("--dtype", choices=["auto", *sorted(model_config.RUN_DTYPE_BYTES)], default="auto",
                     help="dtype the model runs in, as --dtype of generate/serve/check: weights and slots "
                     "are sized at it (fp32-kept modules stay 4 bytes); auto = config.json's dtype, "
                     "float32 if absent, as load_model (default auto)")
    run.add_argument("--kv-dtype", choices=["auto", "bf16", "fp16", "fp32", "fp8"], default="auto",
                     help="KV cache dtype; auto = the model's dtype (--dtype) (default auto)")
    run.add_argument("--slot-format", choices=["packed", "dense"], default="packed",
                     help="quantized checkpoints: slots hold packed experts (default: what --slot-format auto "
                     "picks on CUDA) or experts dequantized at page-in (dense: larger slots, fewer per GB); "
                     "page-ins copy packed bytes either way")
    run.add_argument("--experts-implementation", default="auto", choices=["auto", "grouped_mm", "packed"],
                     help="as the run's: packed (--experts-implementation packed, or the default auto on a CPU at "
                     "bfloat16 for int4 / int8 checkpoints: here, without --device-memory-gb) keeps the quantized non-expert "
                     "linears torch's CPU kernels take packed: counted at their kernel layout's bytes; grouped_mm "
                     "(auto with --device-memory-gb, a CUDA run): at their dequantized bytes")
    run.add_argument("--runtime-reserve-gb", type=float, default=1.0,
                     help="GB kept for activations, CUDA context, allocator slack (default 1.0)")
    tiers = p.add_argument_group("disk tier (three tiers: device K, host R, disk)")
    tiers.add_argument("--host-memory-gb", type=float,
                       help="host memory G for everything on the host (as `generate --host-memory-gb` on a CUDA "
                       "device: the store, its staging and the runtime allowance): R host rows per layer")
    tiers.add_argument("--disk-gbps", type=float, help="disk read GB/s (see `pagedexperts linkbench --disk`)")
    tiers.add_argument("--miss-rate", type=float,
                       help="device misses per routed expert, 0..1 (default: uniform, 1 - K/E)")
    tiers.add_argument("--host-miss-rate", type=float,
                       help="host misses per device miss, 0..1 (default: uniform, 1 - R/E; "
                       "`pagedexperts simulate --host-rows R` measures it on a trace)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_preflight)


def run_preflight(args) -> int:
    """Print the preflight report (text or --json); 0, or 1 when it does not fit
    --device-memory-gb; ValueError on bad input."""
    _check_tier_flags(args)
    report = build_report(**_model_inputs(args), **_run_inputs(args), slot_format=args.slot_format)
    if args.host_memory_gb is not None:
        report.update(tier_report(report, **_tier_inputs(args)))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if report.get("fits") is False else 0


def _quantized_sizes(model_path: str, config: dict, shape, dtype: str, keep_fp32: tuple[str, ...],
                     packed: bool | None):
    """(sizes, dense expert bytes, quantized non-expert modules) of a quantized checkpoint at
    ``dtype``: experts at their stored (packed) bytes; non-expert floating weights at the run
    dtype as a dense checkpoint's; quantized non-expert modules (attention, shared experts, dense
    MLPs) at their dequantized bytes, or with ``packed`` (None: auto on a CPU, packed at bfloat16
    for a format whose ``FormatRecord.cpu_packed``) those torch's CPU kernels take at their kernel layout's
    bytes (``loading.linears.planned_linears``), as the load keeps them;
    the dequantized experts in ``ExpertFormat.experts_dtype`` (a W4A16 checkpoint's scales' dtype)."""
    import torch

    from pagedexperts.loading.checkpoint import format_for_checkpoint
    from pagedexperts.loading.linears import planned_linears
    from pagedexperts.storage.safetensors_files import checkpoint_files

    from pagedexperts.formats import FORMATS

    files = checkpoint_files(model_path)
    fmt = format_for_checkpoint(config, files)
    packed = packed if packed is not None else FORMATS[fmt.name].cpu_packed and dtype == "bfloat16"  # the run's auto
    linears, keys = planned_linears(config, files, fmt, getattr(torch, dtype), keep_fp32, packed=packed)
    sizes = sizing.checkpoint_sizes(model_path=model_path, num_experts=shape.num_experts, keep_fp32=keep_fp32)
    run_sizes = sizing.checkpoint_sizes(model_path=model_path, num_experts=shape.num_experts, dtype=dtype,
                                        keep_fp32=keep_fp32, skip=frozenset(keys))
    sizes = dataclasses.replace(sizes, non_expert_bytes=run_sizes.non_expert_bytes + linears.host_bytes)
    experts_dtype = str(fmt.experts_dtype(getattr(torch, dtype))).removeprefix("torch.")
    return sizes, model_config.dense_expert_bytes(config, dtype=experts_dtype), linears


def _packed(args) -> bool | None:
    """Whether the run computes quantized linears packed: packed True, grouped_mm False; auto: a
    CUDA run (--device-memory-gb given) False, a CPU run None (the format decides)."""
    if args.experts_implementation != "auto":
        return args.experts_implementation == "packed"
    return False if args.device_memory_gb is not None else None


def _model_inputs(args) -> dict:
    """Model shape from --model-path or from the explicit flags; validated. Neither: the bundled
    model, as every command."""
    if not args.model_path and all(getattr(args, f) is None for f in preflight_explicit.EXPLICIT_FLAGS):
        from pagedexperts.loading.bundled import bundled_model_path

        args.model_path = str(bundled_model_path())
    if args.model_path:
        config = model_config.read_config(args.model_path)
        shape = model_config.moe_shape(config)
        dtype = model_config.run_dtype(config, dtype=args.dtype)
        keep_fp32 = fp32_kept_modules(config, dtype)
        linears = None
        if config.get("quantization_config"):
            sizes, dense_expert_bytes, linears = _quantized_sizes(args.model_path, config, shape, dtype, keep_fp32,
                                                                  _packed(args))
        else:
            sizes = sizing.checkpoint_sizes(model_path=args.model_path, num_experts=shape.num_experts, dtype=dtype,
                                            keep_fp32=keep_fp32)
            dense_expert_bytes = sizes.expert_bytes
        return dict(
            model=os.path.basename(os.path.normpath(args.model_path)),
            moe_layers=len(shape.moe_layers),
            num_experts=shape.num_experts,
            top_k=shape.top_k,
            expert_bytes=sizes.expert_bytes,
            kv_bytes_per_token=model_config.kv_bytes_per_token(config, kv_dtype=args.kv_dtype, model_dtype=dtype),
            non_expert_bytes=sizes.non_expert_bytes,
            dense_expert_bytes=dense_expert_bytes,
            dtype=dtype,
            dequantized_modules=len(linears.modules) if linears else 0,
            dequantized_bytes=linears.dense_bytes if linears else 0,
            packed_linear_modules=len(linears.packed) if linears else 0,
            packed_linear_bytes=linears.kernel_bytes if linears else 0,
        )
    if args.slot_format == "dense" and args.expert_format == preflight_explicit.DENSE:
        raise ValueError("--slot-format dense sizes a quantized checkpoint's dequantized slots; give --expert-format "
                         "(or --model-path)")
    return preflight_explicit.explicit_inputs(args)


def fp32_kept_modules(config: dict, dtype: str) -> tuple[str, ...]:
    """Module names the model class keeps in float32 under ``dtype``, as ``load_model`` does
    (``_keep_in_fp32_modules_strict`` under bf16/fp16, ``_keep_in_fp32_modules`` under fp16);
    () when transformers does not know the model type."""
    if dtype == "float32":
        return ()
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"), ""), None)
    keep = tuple(getattr(cls, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == "float16":
        keep += tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
    return keep


def _run_inputs(args) -> dict:
    for flag, value in (("--link-gbps", args.link_gbps), ("--tok-s", args.tok_s),
                        ("--device-memory-gb", args.device_memory_gb),
                        ("--context-length", args.context_length),
                        ("--max-running-requests", args.max_running_requests)):
        if value is not None:
            _positive(value, flag)
    if args.runtime_reserve_gb < 0:
        raise ValueError(f"--runtime-reserve-gb {args.runtime_reserve_gb} must be >= 0")
    return dict(
        num_resident=args.num_resident,
        link_gbps=args.link_gbps,
        tok_s=args.tok_s,
        device_memory_gb=args.device_memory_gb,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        runtime_reserve_gb=args.runtime_reserve_gb,
    )


def _check_tier_flags(args) -> None:
    """The disk tier's flags need --host-memory-gb: without it the report has no tier, and they
    were ignored without a word (``--miss-rate 2`` too, unchecked)."""
    given = [flag for flag, value in (("--disk-gbps", args.disk_gbps), ("--miss-rate", args.miss_rate),
                                      ("--host-miss-rate", args.host_miss_rate)) if value is not None]
    if given and args.host_memory_gb is None:
        raise ValueError(f"{', '.join(given)} {'sizes' if len(given) == 1 else 'size'} the disk tier, which --host-memory-gb G sets up: give it too "
                         "(without it the report has no disk tier)")


def _tier_inputs(args) -> dict:
    _positive(args.host_memory_gb, "--host-memory-gb")
    if args.disk_gbps is not None:
        _positive(args.disk_gbps, "--disk-gbps")
    for flag, value in (("--miss-rate", args.miss_rate), ("--host-miss-rate", args.host_miss_rate)):
        if value is not None and not 0 <= value <= 1:
            raise ValueError(f"{flag} {value} must be in [0, 1]")
    return dict(host_memory_gb=args.host_memory_gb, disk_gbps=args.disk_gbps,
                miss_rate=args.miss_rate, host_miss_rate=args.host_miss_rate)


def tier_report(r: dict, *, host_memory_gb: float, disk_gbps: float | None,
                miss_rate: float | None, host_miss_rate: float | None) -> dict:
    """Three tiers of ``build_report``'s model and K under G: host rows R (as the loader
    chooses them, ``storage.host_memory``), disk bytes per token at the miss rates, and the
    disk-bound tok/s. G covers everything on the host of a CUDA run (the slots, non-expert
    weights and KV live on the device): the store, its staging and the runtime allowance.
    Raises ValueError when G is below the disk tier's minimum (names it)."""
    from pagedexperts.loading.build import READ_AHEAD_EXPERTS_PER_TOP_K
    from pagedexperts.storage.host_memory import RUNTIME_ALLOWANCE_BYTES, plan_host_memory

    e, layers, eb = r["num_experts"], r["moe_layers"], r["expert_bytes"]
    plan = plan_host_memory(
        budget_bytes=round(host_memory_gb * sizing.GB), available_bytes=None, num_layers=layers, num_experts=e,
        expert_bytes=eb, slot_bytes_on_host=0,
        staging_bytes=READ_AHEAD_EXPERTS_PER_TOP_K * r["top_k"] * eb, non_expert_bytes_on_host=0, kv_bytes_on_host=0,
        runtime_bytes=RUNTIME_ALLOWANCE_BYTES["cuda"])
    rows = plan.host_rows
    device_miss = r["uniform_miss_rate"] if miss_rate is None else miss_rate
    host_miss = (0.0 if rows >= e else 1 - rows / e) if host_miss_rate is None else host_miss_rate
    disk_bpt = sizing.disk_bytes_per_token(moe_layers=layers, top_k=r["top_k"], expert_bytes=eb,
                                           device_miss_rate=device_miss, host_miss_rate=host_miss)
    out = dict(host_memory_gb=host_memory_gb, host_rows=rows, disk_tier=plan.disk_tier,
               host_tier_bytes=plan.store_bytes, staging_bytes=plan.staging_bytes, runtime_bytes=plan.runtime_bytes,
               disk_experts_per_layer=e - rows, disk_bytes=(e - rows) * layers * eb,
               device_miss_rate=device_miss, host_miss_rate=host_miss if plan.disk_tier else 0.0,
               disk_bytes_per_token=disk_bpt if plan.disk_tier else 0.0, disk_gbps=disk_gbps)
    if disk_gbps and plan.disk_tier:
        out["disk_bound_tok_s"] = sizing.disk_bound_tok_s(disk_gbps=disk_gbps, disk_bytes_per_token=disk_bpt)
    return out


def _positive(value, flag: str) -> None:
    if not value > 0:
        raise ValueError(f"{flag} {value} must be > 0")


def build_report(
    *, model, moe_layers, num_experts, top_k, expert_bytes, kv_bytes_per_token, non_expert_bytes,
    num_resident, link_gbps, tok_s, device_memory_gb, context_length, max_running_requests,
    runtime_reserve_gb, slot_format="packed", dense_expert_bytes=None, dtype=None, dequantized_modules=0,
    dequantized_bytes=0, non_expert_source=None, packed_linear_modules=0, packed_linear_bytes=0,
) -> dict:
    """Compose the sizing functions into one flat report (bytes, fractions, seconds).

    ``slot_format`` "dense": a slot holds ``dense_expert_bytes`` per layer (the expert
    dequantized); page-ins still move ``expert_bytes`` (packed). ``dequantized_modules`` /
    ``dequantized_bytes``: quantized non-expert modules the load dequantizes (their dense bytes
    are part of ``non_expert_bytes``); ``packed_linear_modules`` / ``packed_linear_bytes``: those
    it keeps packed (their kernel layout's bytes are). ``non_expert_source``: how explicit numbers got
    ``non_expert_bytes`` (given, estimated, not counted), for the report.

    Raises:
        ValueError: K outside [1, E] (names --num-resident).
    """
    slot_expert = dense_expert_bytes if slot_format == "dense" else expert_bytes
    slot = sizing.slot_bytes(expert_bytes=slot_expert, moe_layers=moe_layers)
    host = sizing.host_bytes(slot_bytes=sizing.slot_bytes(expert_bytes=expert_bytes, moe_layers=moe_layers),
                             num_experts=num_experts)
    kv_reserve = sizing.kv_reserve_bytes(context_length=context_length, max_running_requests=max_running_requests,
                                         kv_bytes_per_token=kv_bytes_per_token)
    mem = dict(non_expert_bytes=non_expert_bytes, runtime_reserve_gb=runtime_reserve_gb, slot_bytes=slot)
    k_source = "given"
    if num_resident is None and device_memory_gb:
        num_resident = sizing.auto_num_resident(device_memory_gb=device_memory_gb, kv_reserve_bytes=kv_reserve,
                                                top_k=top_k, num_experts=num_experts, **mem)
        k_source = "auto"
    elif num_resident is None:
        num_resident = default_num_resident(num_experts=num_experts, top_k=top_k)
        k_source = "default"
    if not top_k <= num_resident <= num_experts:  # the loader's range: one token's top_k must fit
        raise ValueError(f"--num-resident {num_resident} must be in [top_k={top_k}, E={num_experts}] (--num-resident)")
    all_miss = sizing.all_miss_bytes_per_token(moe_layers=moe_layers, top_k=top_k, expert_bytes=expert_bytes)
    uniform = sizing.uniform_miss_rate(num_resident=num_resident, num_experts=num_experts)
    r = dict(
        model=model, dtype=dtype, moe_layers=moe_layers, num_experts=num_experts, top_k=top_k,
        expert_bytes=expert_bytes, dense_expert_bytes=dense_expert_bytes, slot_format=slot_format, slot_bytes=slot,
        host_bytes=host,
        kv_bytes_per_token=kv_bytes_per_token,
        kv_tokens_per_slot=sizing.kv_tokens_per_slot(slot_bytes=slot, kv_bytes_per_token=kv_bytes_per_token),
        num_resident=num_resident, num_resident_source=k_source,
        device_slot_bytes=num_resident * slot,
        single_wave_batch_cap=sizing.single_wave_batch_cap(num_resident=num_resident, top_k=top_k),
        all_miss_bytes_per_token=all_miss, uniform_miss_rate=uniform,
        link_bytes_per_token_uniform=sizing.link_bytes_per_token(miss_rate=uniform, all_miss_bytes_per_token=all_miss),
        in_place_waves_per_step=1,
        prefill_page_in_bytes=sizing.prefill_page_in_bytes(
            num_experts=num_experts, num_resident=num_resident,
            slot_bytes=sizing.slot_bytes(expert_bytes=expert_bytes, moe_layers=moe_layers)),
        link_gbps=link_gbps, tok_s=tok_s, non_expert_bytes=non_expert_bytes, non_expert_source=non_expert_source,
        dequantized_modules=dequantized_modules, dequantized_bytes=dequantized_bytes,
        packed_linear_modules=packed_linear_modules, packed_linear_bytes=packed_linear_bytes,
    )
    if link_gbps:
        r["prefill_page_in_s"] = sizing.transfer_seconds(num_bytes=r["prefill_page_in_bytes"], link_gbps=link_gbps)
    if link_gbps and tok_s:
        allowed = sizing.max_miss_rate_allowed(link_gbps=link_gbps, tok_s=tok_s, all_miss_bytes_per_token=all_miss)
        r["max_miss_rate_allowed"] = allowed
        r["verdict"] = sizing.reuse_verdict(max_miss_rate=allowed, uniform_miss_rate=uniform)
    if device_memory_gb:
        needed = sizing.memory_needed_bytes(kv_reserve_bytes=kv_reserve, num_resident=num_resident, **mem)
        r.update(
            device_memory_gb=device_memory_gb, kv_reserve_bytes=kv_reserve, runtime_reserve_gb=runtime_reserve_gb,
            memory_needed_bytes=needed, fits=needed <= device_memory_gb * sizing.GB,
            kv_tokens_allowed=sizing.context_tokens_allowed(device_memory_gb=device_memory_gb,
                                                            kv_bytes_per_token=kv_bytes_per_token,
                                                            num_resident=num_resident, **mem),
            max_running_requests=max_running_requests, context_length=context_length,
            fit_changes=sizing.changes_that_fit(
                device_memory_gb=device_memory_gb, kv_reserve_bytes=kv_reserve, num_resident=num_resident,
                top_k=top_k, kv_bytes_per_token=kv_bytes_per_token, context_length=context_length,
                max_running_requests=max_running_requests, **mem),
        )
    return r
