"""The format library's own decompression of a quantized checkpoint: ``check``'s reference where
transformers' loading cannot be trusted.

Owns: ``library_decompress`` (a checkpoint directory -> a dense one, every compressed module
decompressed by the format's own library: compressed-tensors' ``BaseCompressor.decompress``,
ModelOpt's ``NVFP4QTensor`` / ``FP8QTensor.dequantize``), ``has_library_reference`` and
``align_like_checkpoint`` (the dense model laid out as the paged model holds it). Does not:
choose the reference (``tools.reference``), page or run prompts.
"""

from __future__ import annotations

import json
import mmap
import shutil
from pathlib import Path
from typing import Callable

import torch

# quant_method -> (the library whose decompression is the reference, the module it needs, its
# pip install)
LIBRARY_QUANT_METHODS = {"compressed-tensors": ("compressed-tensors", "compressed_tensors", "'pagedexperts[quant]'"),
                         "modelopt": ("ModelOpt", "modelopt.torch.quantization.qtensor", "'pagedexperts[modelopt]'")}


def has_library_reference(quantization_config: dict | None) -> bool:
    """True when the checkpoint's format library can decompress it here (compressed-tensors,
    ModelOpt: nvidia-modelopt installed)."""
    if not quantization_config or quantization_config.get("quant_method") not in LIBRARY_QUANT_METHODS:
        return False
    import importlib

    try:
        importlib.import_module(LIBRARY_QUANT_METHODS[quantization_config["quant_method"]][1])
    except ImportError:
        return False
    return True


def _modules(keys) -> dict[str, dict[str, str]]:
    """Checkpoint keys -> {module prefix: {local name: key}} of the modules with a scale."""
    by_module: dict[str, dict[str, str]] = {}
    for key in keys:
        prefix, _, local = key.rpartition(".")
        by_module.setdefault(prefix, {})[local] = key
    return {p: m for p, m in by_module.items() if "weight_scale" in m}


def _ct_decompressor(config: dict, src: Path) -> Callable:
    """compressed-tensors' per-module decompression, (module prefix, {local name: tensor}) -> dense
    weight, as transformers' loader calls it (``BaseCompressor.get_value_from_registry(format)
    .decompress``), the module's group as compressed-tensors picks it (``library_scheme``).

    Raises (when called): ValueError, a compressed module no config group covers.
    """
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qconf = QuantizationConfig.model_validate(config["quantization_config"])

    def decompress(prefix: str, state: dict) -> torch.Tensor:
        scheme = library_scheme(qconf, prefix)
        if scheme is None:
            raise ValueError(f"{src}: module {prefix} stores compressed tensors but no config group covers it")
        return BaseCompressor.get_value_from_registry(scheme.format or qconf.format).decompress(state, scheme)["weight"]

    return decompress


def library_scheme(qconf, module: str):
    """The ``QuantizationScheme`` compressed-tensors gives the nn.Linear named ``module`` (None:
    ignored, or no target matches), with the library's own matching: ``is_match`` for ``ignore``,
    ``match_targets`` (exact name, then ``re:``, then class name) over the target -> scheme table
    that ``lifecycle.apply.apply_quantization_config`` builds group by group (so a target listed
    by two groups takes the later group's scheme), and its first target's scheme
    (``_scheme_from_targets``). ``qconf``: a ``compressed_tensors.QuantizationConfig``."""
    from compressed_tensors.utils.match import is_match, match_targets

    linear = torch.nn.Linear(1, 1, device="meta")
    if any(is_match(module, linear, target) for target in qconf.ignore or []):
        return None
    table = {target: scheme for scheme in qconf.config_groups.values() for target in scheme.targets}
    targets = match_targets(module, linear, table)
    return table[targets[0]] if targets else None


def _modelopt_decompressor(config: dict, src: Path) -> Callable:
    """ModelOpt's own dequantization of one exported module into the checkpoint's saved dtype:
    NVFP4 ``NVFP4QTensor(...).dequantize(scale, double_scale, block_sizes={-1: 16})``, FP8
    ``FP8QTensor(...).dequantize(scale)``; ``input_scale`` dropped (activations unquantized).

    Raises (when called): ValueError, a module that is neither.
    """
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor

    dtype = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch."))

    def decompress(prefix: str, state: dict) -> torch.Tensor:
        weight, scale = state["weight"], state["weight_scale"]
        if weight.dtype == torch.uint8 and "weight_scale_2" in state:
            shape = (*weight.shape[:-1], 2 * weight.shape[-1])
            return NVFP4QTensor(shape, dtype, weight).dequantize(dtype=dtype, scale=scale, double_scale=state[
                "weight_scale_2"], block_sizes={-1: 16})
        if weight.dtype == torch.float8_e4m3fn:
            return FP8QTensor(weight.shape, dtype, weight).dequantize(dtype=dtype, scale=scale)
        raise ValueError(f"{src}: ModelOpt module {prefix} ({weight.dtype} weight, {sorted(state)}) is neither "
                         "NVFP4 nor FP8")

    return decompress


def library_decompress(src: Path, dst: Path) -> Path:
    """Write ``dst``: ``src`` with every compressed module (a ``weight_scale`` beside its
    ``weight``) decompressed by the checkpoint's own format library (``_ct_decompressor``,
    ``_modelopt_decompressor``); other tensors as they are; config.json without
    ``quantization_config`` (and no ``hf_quant_config.json``).

    Raises:
        ValueError: a module the library cannot decompress (see the decompressors).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pagedexperts.models.config import read_config
    from pagedexperts.storage.safetensors_files import checkpoint_files

    config = read_config(str(src))  # quantization_config from hf_quant_config.json when config.json has none
    method = config["quantization_config"].get("quant_method")
    decompress = (_modelopt_decompressor if method == "modelopt" else _ct_decompressor)(config, src)
    config.pop("quantization_config")
    dst.mkdir(parents=True, exist_ok=True)
    skip = ("config.json", "model.safetensors.index.json", "hf_quant_config.json")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in skip:
            shutil.copy(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    weight_map = {}
    for file in checkpoint_files(src):
        with safe_open(str(file), framework="pt") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        for prefix, local in _modules(tensors).items():
            state = {name: tensors.pop(key) for name, key in local.items()}
            tensors[prefix + ".weight"] = decompress(prefix, state).contiguous()
            tensors.update({f"{prefix}.{n}": v for n, v in state.items() if n == "bias"})
        save_file(tensors, str(dst / file.name), metadata={"format": "pt"})
        weight_map.update({k: file.name for k in tensors})
    if (src / "model.safetensors.index.json").exists():
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def expert_parameters(model) -> dict[str, torch.Tensor]:
    """Every routed-experts parameter with a leading E dim ({qualified name: [E, ...]})."""
    from pagedexperts.models.config import num_routed_experts

    num_experts = num_routed_experts(model.config)
    return {n: p for n, p in model.named_parameters()
            if ".experts." in n and p.dim() >= 2 and p.shape[0] == num_experts}


def align_like_checkpoint(model, src: Path) -> int:
    """Re-place every non-expert parameter of ``model`` (the library's dense model) at the page
    alignment its tensor has in ``src``'s shard (keys renamed as ``loading.checkpoint.KeyMap``
    does), in place; a parameter whose bytes differ from the file's gets a fresh allocation, as
    the paged model's dequantized weights do. Returns how many moved. Why: docs/exactness.md.
    """
    from pagedexperts.loading.checkpoint import KeyMap
    from pagedexperts.loading.fill import empty_like_mapped
    from pagedexperts.storage.safetensors_files import checkpoint_files, read_header_json
    from pagedexperts.storage.safetensors_index import TensorEntry

    rename, offsets = KeyMap(model.config.model_type, {}).rename, {}
    for file in checkpoint_files(src):
        header, data_start = read_header_json(file)
        offsets.update({rename(key): (file, data_start + h["data_offsets"][0], h["data_offsets"][1] - h["data_offsets"][0])
                        for key, h in header.items()})
    experts, moved = set(expert_parameters(model)), 0
    for name, param in model.named_parameters():
        if name in experts or param.device.type != "cpu":
            continue
        file, start, nbytes = offsets.get(name, (None, 0, -1))
        if nbytes != param.nbytes:
            param.data = param.data.clone()
            moved += 1
            continue
        aligned = empty_like_mapped(TensorEntry(file, param.dtype, tuple(param.shape), start, param.nbytes))
        if aligned.data_ptr() % mmap.PAGESIZE != param.data_ptr() % mmap.PAGESIZE:
            param.data = aligned.copy_(param.data)
            moved += 1
    return moved
