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
    "fp8-block": "pagedexperts.formats.fp8:Fp8BlockFormat",
    "mxfp4": "pagedexperts.formats.mxfp4:Mxfp4Format",
    "w4a16": "pagedexperts.formats.compressed_tensors:CompressedTensorsW4A16Format",
    "gptq": "pagedexperts.formats.gptq:GptqFormat",
    "awq": "pagedexperts.formats.awq:AwqFormat",
    "nvfp4": "pagedexperts.formats.ct_fp4:CompressedTensorsNvfp4Format",
    "ct-mxfp4": "pagedexperts.formats.ct_fp4:CompressedTensorsMxfp4Format",
    "w8a8-int8": "pagedexperts.formats.ct_int8:CompressedTensorsInt8Format",
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


def format_for_config(config) -> ExpertFormat:
    """The expert format of a checkpoint, from its config (object or config.json dict).

    Raises:
        ValueError: a quantization_config no registered format recognises (names its
            quant_method and lists the formats), or one whose parameters the format rejects.
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
            return cls.from_config(config, qc)
    method = qc.get("quant_method") if qc else None
    raise ValueError(
        f"quantized checkpoint (quant_method {method!r}, format {qc.get('format') if qc else None!r}) "
        f"is not a supported expert format; supported: {available_formats()}"
        + (f"; unavailable here: {unavailable}" if unavailable else "")
    )


__all__ = [
    "FORMATS", "ExpertFormat", "ExpertLayout", "QuantizedTensor", "TensorSpec",
    "available_formats", "format_class", "format_for_config", "quantization_config_of",
]
