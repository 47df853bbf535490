"""Expert formats: how a checkpoint stores each routed expert, and how to turn it dense.

Owns the registry ``FORMATS`` (one ``FormatRecord`` per format; every other view is derived
from it) and ``format_for_config``. The contract is in ``base`` and formats/README.md. Standard library
only at import, so the light commands read the table without torch. Does not: read checkpoints,
store, page, or know model families.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pagedexperts.formats.base import ExpertFormat

CheckpointKey = tuple[str | None, str | None, str | None]  # (quant_method, format, weight kind)


@dataclass(frozen=True)
class FormatRecord:
    """One format's facts, each written only here (formats/README.md: who reads each field). ``where``:
    "module:Class", imported on use; ``spelled``: what config.json says; ``key``: (quant_method,
    format, weight kind) for ``nearest_format``; ``cpu_packed``: torch's CPU kernels compute it
    packed; ``example``: preflight's ``(class, group size) -> format``; ``quantize``: written by quantize."""

    name: str
    where: str
    spelled: str
    key: CheckpointKey
    cpu_packed: bool = False
    example: Callable[[type[ExpertFormat], int], ExpertFormat] | None = None
    quantize: bool = False

    def load(self) -> type[ExpertFormat]:
        """The format class (its module imported now).
        Raises ValueError: its module is not present, or needs a package that is not installed (names it)."""
        module_name, _, cls_name = self.where.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                raise ValueError(f"expert format {self.name!r} is registered but {module_name} is not present") from exc
            raise ValueError(f"expert format {self.name!r} needs the package {exc.name!r}: pip install it") from exc
        return getattr(module, cls_name)


def _w8a16_example(cls, group_size: int) -> ExpertFormat:
    from pagedexperts.formats.compressed_tensors.packed import PackedArgs

    eight = PackedArgs(8, group_size, True, False)
    return cls({"gate_up_proj": eight, "down_proj": eight})


# Order matters: the first class whose ``matches`` accepts a quantization_config wins; ``dense``
# (no quantization_config) comes first.
FORMATS: dict[str, FormatRecord] = {r.name: r for r in (
    FormatRecord("dense", "pagedexperts.formats.dense:DenseFormat", "unquantized", (None, None, None),
                 example=lambda cls, group: cls()),
    # before fp8-block: the same quant_method and key, weight_scale_inv dividing instead of multiplying
    FormatRecord("gptqmodel-fp8", "pagedexperts.formats.gptq.gptqmodel_fp8:GptqModelFp8Format",
                 "quant_method 'fp8' with weight_scale_semantics 'inverse' per row (GPTQModel FP8Config)",
                 ("fp8", "float8_e4m3fn", "float8")),
    FormatRecord("fp8-block", "pagedexperts.formats.fp8_fp4.fp8_block:Fp8BlockFormat",
                 "quant_method 'fp8' with weight_block_size (DeepSeek-V3 / Qwen3-FP8 block FP8)", ("fp8", None, "float8"),
                 example=lambda cls, group: cls(block=(128, 128)), quantize=True),
    FormatRecord("int8-block", "pagedexperts.formats.fp8_fp4.int8_block:Int8BlockFormat",
                 "quant_method 'blockwise_int8' with weight_block_size (SGLang block INT8, DeepSeek-R1-Block-INT8)",
                 ("blockwise_int8", None, "int8"), example=lambda cls, group: cls(block=(128, 128))),
    FormatRecord("mxfp4", "pagedexperts.formats.fp8_fp4.mxfp4:Mxfp4Format", "quant_method 'mxfp4' (gpt-oss)",
                 ("mxfp4", None, "float4"), quantize=True),
    FormatRecord("ct-fp8", "pagedexperts.formats.compressed_tensors.fp8:CompressedTensorsFp8Format",
                 "compressed-tensors 'float-quantized' / 'naive-quantized' float8 tensor/channel/block/group (FP8, "
                 "FP8_DYNAMIC, FP8_BLOCK), 'mxfp8-quantized' (MXFP8)",
                 ("compressed-tensors", "float-quantized", "float8")),
    FormatRecord("w8a16", "pagedexperts.formats.compressed_tensors.packed:CompressedTensorsW8A16Format",
                 "compressed-tensors 'pack-quantized' int8 (W8A16)", ("compressed-tensors", "pack-quantized", "int8"),
                 cpu_packed=True, example=_w8a16_example),
    FormatRecord("ct-pack-mixed", "pagedexperts.formats.compressed_tensors.packed:CompressedTensorsMixedPackedFormat",
                 "compressed-tensors 'pack-quantized' int4/int8 with per-projection config groups or weight_g_idx",
                 ("compressed-tensors", "pack-quantized", "int4"), cpu_packed=True),
    FormatRecord("w4a16", "pagedexperts.formats.compressed_tensors.w4a16:CompressedTensorsW4A16Format",
                 "compressed-tensors 'pack-quantized' int4 (W4A16, W4A16_ASYM)",
                 ("compressed-tensors", "pack-quantized", "int4"), cpu_packed=True,
                 example=lambda cls, group: cls(group_size=group, symmetric=True), quantize=True),
    FormatRecord("gptq", "pagedexperts.formats.gptq.gptq:GptqFormat",
                 "quant_method 'gptq' int2/int4/int8, GPTQModel dynamic overrides", ("gptq", None, "int4"),
                 cpu_packed=True, example=lambda cls, group: cls(group_size=group)),
    FormatRecord("awq", "pagedexperts.formats.gptq.awq:AwqFormat", "quant_method 'awq' int4, zero_point true or false",
                 ("awq", None, "int4"), cpu_packed=True, example=lambda cls, group: cls(group_size=group)),
    FormatRecord("auto-round-fp8", "pagedexperts.formats.gptq.autoround_fp:AutoRoundFp8Format",
                 "quant_method 'auto-round' data_type 'fp' 8 bits (AutoRound's FP8_STATIC, FP8_BLOCK, FPW8A16)",
                 ("auto-round", None, "float8")),
    FormatRecord("auto-round-nvfp4", "pagedexperts.formats.gptq.autoround_fp:AutoRoundNvfp4Format",
                 "quant_method 'auto-round' data_type 'nv_fp' (AutoRound's NVFP4)", ("auto-round", None, "float4")),
    FormatRecord("auto-round-mxfp4", "pagedexperts.formats.gptq.autoround_fp:AutoRoundMxfp4Format",
                 "quant_method 'auto-round' data_type 'mx_fp' (AutoRound's MXFP4)", ("auto-round", None, "float4")),
    FormatRecord("auto-round", "pagedexperts.formats.gptq.autoround:AutoRoundFormat",
                 "quant_method 'auto-round' data_type 'int' (AutoRound's own export, packing auto_round:auto_gptq "
                 "or auto_round)", ("auto-round", None, "int4"), cpu_packed=True),
    FormatRecord("nvfp4", "pagedexperts.formats.compressed_tensors.fp4:CompressedTensorsNvfp4Format",
                 "compressed-tensors 'nvfp4-pack-quantized' float4 (NVFP4A16, NVFP4)",
                 ("compressed-tensors", "nvfp4-pack-quantized", "float4"), example=lambda cls, group: cls()),
    FormatRecord("ct-mxfp4", "pagedexperts.formats.compressed_tensors.fp4:CompressedTensorsMxfp4Format",
                 "compressed-tensors 'mxfp4-pack-quantized' float4 (MXFP4A16)",
                 ("compressed-tensors", "mxfp4-pack-quantized", "float4")),
    FormatRecord("w8a8-int8", "pagedexperts.formats.compressed_tensors.int8:CompressedTensorsInt8Format",
                 "compressed-tensors 'int-quantized' int8 (W8A8)", ("compressed-tensors", "int-quantized", "int8")),
    FormatRecord("modelopt-nvfp4", "pagedexperts.formats.fp8_fp4.modelopt:ModelOptNvfp4Format",
                 "ModelOpt quant_method 'modelopt' quant_algo 'NVFP4'", ("modelopt", None, "float4")),
    FormatRecord("modelopt-fp8", "pagedexperts.formats.fp8_fp4.modelopt:ModelOptFp8Format",
                 "ModelOpt quant_method 'modelopt' quant_algo 'FP8' (per-tensor)", ("modelopt", None, "float8")),
)}

# Views of FORMATS (derived, never written by hand): preflight's --expert-format choices, and
# what ``pagedexperts quantize --format`` writes.
EXAMPLE_FORMATS = tuple(name for name, r in FORMATS.items() if r.example is not None)
QUANTIZE_FORMATS = tuple(name for name, r in FORMATS.items() if r.quantize)


def format_class(name: str) -> type[ExpertFormat]:
    """The format class registered under ``name``.
    Raises ValueError: unknown name (lists the registered ones), or its module is not present."""
    if name not in FORMATS:
        raise ValueError(f"unknown expert format {name!r}; choose one of {list(FORMATS)}")
    return FORMATS[name].load()


def example_format(name: str, *, group_size: int) -> ExpertFormat:
    """Preflight's instance of format ``name`` at ``group_size``.
    Raises ValueError: a name outside ``EXAMPLE_FORMATS`` (lists them)."""
    record = FORMATS.get(name)
    if record is None or record.example is None:
        raise ValueError(f"no example of expert format {name!r}; choose one of {list(EXAMPLE_FORMATS)}")
    return record.example(record.load(), group_size)


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
    """config.json's ``quantization_config`` as a dict (None: unquantized), from a config object or dict."""
    qc = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if not qc:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return qc


def checkpoint_key(qc: dict | None) -> CheckpointKey:
    """(quant_method, format, weight kind such as 'int4') of a quantization_config; compressed-tensors:
    the routed experts' config group (else the first)."""
    from pagedexperts.formats.compressed_tensors.schemes import _schemes_or_first

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
        from pagedexperts.formats.fp8_fp4.modelopt import quant_algo

        algo = str(quant_algo(qc) or "")
        return (method, None, "float4" if "FP4" in algo else "float8" if "FP8" in algo else algo.lower() or None)
    bits = qc.get("bits") or qc.get("w_bit")
    return (method, qc.get("format"), f"int{bits}" if bits else {"fp8": "float8", "mxfp4": "float4"}.get(method))


def nearest_format(qc: dict | None, among: list[str] | None = None) -> str:
    """The registered format closest to a checkpoint's key (quant_method weighs most, then format,
    then weight kind; ties: registry order) as 'name (spelled)', among ``among`` (default: every
    quantized format), or 'none (...)' when none shares any part."""
    key = checkpoint_key(qc)
    weights = (4, 2, 1)

    def score(name: str) -> int:
        return sum(w for w, a, b in zip(weights, key, FORMATS[name].key) if a is not None and a == b)

    best = max((n for n in (among or FORMATS) if n != "dense"), key=score)
    if among is None and score(best) == 0:  # nothing shares its quant_method, format or weight kind (bitsandbytes, hqq, ...)
        return "none (no supported format shares its quant_method, format or weight kind)"
    return f"{best} ({FORMATS[best].spelled})"


def refusal_message(qc: dict | None, reason: str, among: list[str] | None = None) -> str:
    """One refusal as every entry point raises it: the checkpoint's spelling, the reason, the nearest
    supported format (``among`` those) and every supported one."""
    from pagedexperts.formats.compressed_tensors.schemes import spelling

    supported = "; ".join(f"{n} ({FORMATS[n].spelled})" for n in available_formats())
    return (f"quantized checkpoint ({spelling(qc)}): {reason}; nearest supported: {nearest_format(qc, among)}; "
            f"supported: {supported}")


def experts_layout_refusal(fmt: ExpertFormat, config, transposed: bool | None) -> str | None:
    """Why ``fmt`` has no packing for the experts as the family stores them (``transposed``: [in, out];
    None: not checked), or None."""
    if transposed is None or fmt.transposed_experts is None or fmt.transposed_experts == transposed:
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return (f"{fmt.name} has no published layout for {model_type!r} experts stored "
            + ("transposed ([in, out], gpt-oss)" if transposed else "as nn.Linear's [out, in]"))


def format_for_config(config, *, transposed_experts: bool | None = None) -> ExpertFormat:
    """The expert format of a checkpoint from its config (object or dict): the one function load_model,
    preflight and check resolve a format with. ``transposed_experts``: the family's
    (``models.families.experts_transposed``).
    Raises ValueError: no registered format recognises the quantization_config, or the format rejects its
    parameters or the experts' layout (``refusal_message``)."""
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
            layout = experts_layout_refusal(fmt, config, transposed_experts)
            if layout:
                fits = [n for n in available_formats() if format_class(n).transposed_experts in (None, not fmt.transposed_experts)]
                raise ValueError(refusal_message(qc, layout, fits))
            return fmt
    reason = "not a supported expert format" + (f" (unavailable here: {unavailable})" if unavailable else "")
    raise ValueError(refusal_message(qc, reason))


__all__ = [
    "EXAMPLE_FORMATS", "FORMATS", "QUANTIZE_FORMATS", "CheckpointKey", "FormatRecord", "available_formats",
    "checkpoint_key", "example_format", "experts_layout_refusal", "format_class", "format_for_config", "nearest_format",
    "quantization_config_of", "refusal_message",
]
