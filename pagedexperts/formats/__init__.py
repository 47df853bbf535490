"""Expert formats: how a checkpoint stores each routed expert, and how to turn it dense.

Owns: the registry of formats (a constant table: ``FORMATS``, name -> class) and
``format_for_config``, which picks a checkpoint's format from config.json's
``quantization_config``. One module per format; the contract is in ``base`` and README.md.
Does not: read checkpoints, store or page.
"""

from __future__ import annotations

import importlib

from pagedexperts.formats.base import ExpertFormat, ExpertLayout, QuantizedTensor, TensorSpec

# name -> "module:Class". Resolved on use, so a format whose library is missing fails only
# when a checkpoint needs it. Order matters: the first class whose ``matches`` accepts a
# quantization_config wins; ``dense`` (no quantization_config) comes first.
FORMATS: dict[str, str] = {
    "dense": "pagedexperts.formats.dense:DenseFormat",
    # before fp8-block: the same quant_method and key, weight_scale_inv dividing instead of multiplying
    "gptqmodel-fp8": "pagedexperts.formats.gptqmodel_fp8:GptqModelFp8Format",
    "fp8-block": "pagedexperts.formats.fp8:Fp8BlockFormat",
    "int8-block": "pagedexperts.formats.int8_block:Int8BlockFormat",
    "mxfp4": "pagedexperts.formats.mxfp4:Mxfp4Format",
    "ct-fp8": "pagedexperts.formats.ct_fp8:CompressedTensorsFp8Format",
    "w8a16": "pagedexperts.formats.ct_packed:CompressedTensorsW8A16Format",
    "ct-pack-mixed": "pagedexperts.formats.ct_packed:CompressedTensorsMixedPackedFormat",
    "w4a16": "pagedexperts.formats.compressed_tensors:CompressedTensorsW4A16Format",
    "gptq": "pagedexperts.formats.gptq:GptqFormat",
    "awq": "pagedexperts.formats.awq:AwqFormat",
    "auto-round-fp8": "pagedexperts.formats.autoround_fp:AutoRoundFp8Format",
    "auto-round-nvfp4": "pagedexperts.formats.autoround_fp:AutoRoundNvfp4Format",
    "auto-round-mxfp4": "pagedexperts.formats.autoround_fp:AutoRoundMxfp4Format",
    "auto-round": "pagedexperts.formats.autoround:AutoRoundFormat",
    "nvfp4": "pagedexperts.formats.ct_fp4:CompressedTensorsNvfp4Format",
    "ct-mxfp4": "pagedexperts.formats.ct_fp4:CompressedTensorsMxfp4Format",
    "w8a8-int8": "pagedexperts.formats.ct_int8:CompressedTensorsInt8Format",
    "modelopt-nvfp4": "pagedexperts.formats.modelopt:ModelOptNvfp4Format",
    "modelopt-fp8": "pagedexperts.formats.modelopt:ModelOptFp8Format",
}


# name -> (what a checkpoint's config.json says for it, the (quant_method, format, weight kind)
# key that ``nearest_format`` compares). Shown in every refusal, so that a user reads the
# formats as their checkpoint spells them (not "fp8-block" for a compressed-tensors FP8_BLOCK).
SPELLED: dict[str, tuple[str, tuple[str | None, str | None, str | None]]] = {
    "dense": ("unquantized", (None, None, None)),
    "gptqmodel-fp8": ("quant_method 'fp8' with weight_scale_semantics 'inverse' per row (GPTQModel FP8Config)",
                      ("fp8", "float8_e4m3fn", "float8")),
    "fp8-block": ("quant_method 'fp8' with weight_block_size (DeepSeek-V3 / Qwen3-FP8 block FP8)", ("fp8", None, "float8")),
    "int8-block": ("quant_method 'blockwise_int8' with weight_block_size (SGLang block INT8, DeepSeek-R1-Block-INT8)",
                   ("blockwise_int8", None, "int8")),
    "mxfp4": ("quant_method 'mxfp4' (gpt-oss)", ("mxfp4", None, "float4")),
    "ct-fp8": ("compressed-tensors 'float-quantized' / 'naive-quantized' float8 tensor/channel/block/group (FP8, "
               "FP8_DYNAMIC, FP8_BLOCK), 'mxfp8-quantized' (MXFP8)",
               ("compressed-tensors", "float-quantized", "float8")),
    "w8a16": ("compressed-tensors 'pack-quantized' int8 (W8A16)", ("compressed-tensors", "pack-quantized", "int8")),
    "ct-pack-mixed": ("compressed-tensors 'pack-quantized' int4/int8 with per-projection config groups or weight_g_idx",
                      ("compressed-tensors", "pack-quantized", "int4")),
    "w4a16": ("compressed-tensors 'pack-quantized' int4 (W4A16, W4A16_ASYM)", ("compressed-tensors", "pack-quantized", "int4")),
    "gptq": ("quant_method 'gptq' int2/int4/int8, GPTQModel dynamic overrides", ("gptq", None, "int4")),
    "awq": ("quant_method 'awq' int4, zero_point true or false", ("awq", None, "int4")),
    "auto-round-fp8": ("quant_method 'auto-round' data_type 'fp' 8 bits (AutoRound's FP8_STATIC, FP8_BLOCK, FPW8A16)",
                       ("auto-round", None, "float8")),
    "auto-round-nvfp4": ("quant_method 'auto-round' data_type 'nv_fp' (AutoRound's NVFP4)", ("auto-round", None, "float4")),
    "auto-round-mxfp4": ("quant_method 'auto-round' data_type 'mx_fp' (AutoRound's MXFP4)", ("auto-round", None, "float4")),
    "auto-round": ("quant_method 'auto-round' data_type 'int' (AutoRound's own export, packing auto_round:auto_gptq "
                   "or auto_round)", ("auto-round", None, "int4")),
    "nvfp4": ("compressed-tensors 'nvfp4-pack-quantized' float4 (NVFP4A16, NVFP4)",
              ("compressed-tensors", "nvfp4-pack-quantized", "float4")),
    "ct-mxfp4": ("compressed-tensors 'mxfp4-pack-quantized' float4 (MXFP4A16)",
                 ("compressed-tensors", "mxfp4-pack-quantized", "float4")),
    "w8a8-int8": ("compressed-tensors 'int-quantized' int8 (W8A8)", ("compressed-tensors", "int-quantized", "int8")),
    "modelopt-nvfp4": ("ModelOpt quant_method 'modelopt' quant_algo 'NVFP4'", ("modelopt", None, "float4")),
    "modelopt-fp8": ("ModelOpt quant_method 'modelopt' quant_algo 'FP8' (per-tensor)", ("modelopt", None, "float8")),
}


def format_class(name: str) -> type[ExpertFormat]:
    """The format class registered under ``name``.

    Raises:
        ValueError: unknown name (lists the registered ones), or its module is not present.
    """
    if name not in FORMATS:
        raise ValueError(f"unknown expert format {name!r}; choose one of {list(FORMATS)}")
    module_name, _, cls_name = FORMATS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise ValueError(f"expert format {name!r} is registered but {module_name} is not present") from exc
        raise ValueError(f"expert format {name!r} needs the package {exc.name!r}: pip install it") from exc
    return getattr(module, cls_name)


def available_formats() -> list[str]:
    """Registered format names whose module imports."""
    names = []
    for name in FORMATS:
        try:
            format_class(name)
        except ValueError:
            continue
        names.append(name)
    return names


def quantization_config_of(config) -> dict | None:
    """config.json's ``quantization_config`` as a dict (None: unquantized), from a transformers
    config object or a config.json dict."""
    qc = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if not qc:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return qc


def checkpoint_key(qc: dict | None) -> tuple[str | None, str | None, str | None]:
    """(quant_method, format, weight kind such as 'int4' / 'float8') of a quantization_config;
    for compressed-tensors the routed experts' config group (else the first group)."""
    from pagedexperts.formats.ct_schemes import _schemes_or_first

    if not qc:
        return (None, None, None)
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        schemes = list(_schemes_or_first(qc).values())
        if not schemes:
            return (method, qc.get("format"), None)
        w = schemes[0].weights
        return (method, schemes[0].format, f"{w.get('type', 'int')}{w.get('num_bits')}")
    if method == "modelopt":
        from pagedexperts.formats.modelopt import quant_algo

        algo = str(quant_algo(qc) or "")
        return (method, None, "float4" if "FP4" in algo else "float8" if "FP8" in algo else algo.lower() or None)
    bits = qc.get("bits") or qc.get("w_bit")
    return (method, qc.get("format"), f"int{bits}" if bits else {"fp8": "float8", "mxfp4": "float4"}.get(method))


def nearest_format(qc: dict | None, among: list[str] | None = None) -> str:
    """The registered format closest to a checkpoint's (quant_method weighs most, then format,
    then weight kind; ties: registry order), as 'name (what checkpoints say)', or 'none (...)'
    when no format shares any of the three (``among`` not given); ``among``: only those names (default: every
    quantized format)."""
    key = checkpoint_key(qc)
    weights = (4, 2, 1)

    def score(name: str) -> int:
        other = SPELLED.get(name, ("", (None, None, None)))[1]
        return sum(w for w, a, b in zip(weights, key, other) if a is not None and a == b)

    best = max((n for n in (among or FORMATS) if n != "dense"), key=score)
    if among is None and score(best) == 0:  # nothing shares its quant_method, format or weight kind (bitsandbytes, hqq, ...)
        return "none (no supported format shares its quant_method, format or weight kind)"
    return f"{best} ({SPELLED.get(best, (best,))[0]})"


def refusal_message(qc: dict | None, reason: str, among: list[str] | None = None) -> str:
    """One refusal, as ``load_model``, ``preflight`` and ``check`` all raise it: the format as the
    checkpoint spells it, why, the nearest supported format (``among`` those), and every supported one."""
    from pagedexperts.formats.ct_schemes import spelling

    supported = "; ".join(f"{n} ({SPELLED.get(n, (n,))[0]})" for n in available_formats())
    return (f"quantized checkpoint ({spelling(qc)}): {reason}; nearest supported: {nearest_format(qc, among)}; "
            f"supported: {supported}")


# config.json model_type -> True where transformers' experts module stores its weights
# transposed ([in, out]: the ``is_transposed`` experts of gpt-oss); others nn.Linear's [out, in].
TRANSPOSED_EXPERTS_MODEL_TYPES = ("gpt_oss",)


def experts_layout_refusal(fmt: ExpertFormat, config) -> str | None:
    """Why ``fmt`` has no packing for the experts layout of this config's model type (gpt-oss's
    transposed experts in a compressed-tensors / ModelOpt / FP8 format), or None (also for a
    config without ``model_type``): read here so that preflight refuses what the layout
    (``pack``) would refuse at load."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    transposed = model_type in TRANSPOSED_EXPERTS_MODEL_TYPES
    if model_type is None or fmt.transposed_experts is None or fmt.transposed_experts == transposed:
        return None
    return (f"{fmt.name} has no published layout for {model_type!r} experts stored "
            + ("transposed ([in, out], gpt-oss)" if transposed else "as nn.Linear's [out, in]"))


def format_for_config(config) -> ExpertFormat:
    """The expert format of a checkpoint, from its config (object or config.json dict). The one
    function every entry point (load_model, preflight, check) resolves a format with, so they
    refuse the same checkpoints with the same message (``refusal_message``).

    Raises:
        ValueError: a quantization_config no registered format recognises, or one whose
            parameters (bits, strategy, group size against the experts' dims) the format rejects.
    """
    qc = quantization_config_of(config)
    unavailable = []
    for name in FORMATS:
        try:
            cls = format_class(name)
        except ValueError as exc:
            unavailable.append(str(exc))
            continue
        if cls.matches(qc):
            try:
                fmt = cls.from_config(config, qc)
            except ValueError as exc:
                raise ValueError(refusal_message(qc, str(exc))) from exc
            layout = experts_layout_refusal(fmt, config)
            if layout:
                fits = [n for n in available_formats() if format_class(n).transposed_experts in (None, not fmt.transposed_experts)]
                raise ValueError(refusal_message(qc, layout, fits))
            return fmt
    reason = "not a supported expert format" + (f" (unavailable here: {unavailable})" if unavailable else "")
    raise ValueError(refusal_message(qc, reason))


__all__ = [
    "FORMATS", "ExpertFormat", "ExpertLayout", "QuantizedTensor", "TensorSpec",
    "SPELLED", "TRANSPOSED_EXPERTS_MODEL_TYPES", "available_formats", "experts_layout_refusal", "checkpoint_key",
    "format_class", "format_for_config", "nearest_format",
    "quantization_config_of", "refusal_message",
]
