"""The unpaged reference a quantized checkpoint is checked against, when transformers' own
loading cannot be trusted: the format library's decompression, and a cross-check of the two.

Owns: ``library_decompress`` (a checkpoint directory -> a dense checkpoint directory, every
compressed module decompressed by the format's own library: compressed-tensors' per-module
``BaseCompressor.decompress``, ModelOpt's ``NVFP4QTensor`` / ``FP8QTensor.dequantize``), ``compare_experts`` (transformers' dequantized routed experts
vs the library's, on a seeded sample of (layer, expert)), and ``choose_reference``, the rule
``check`` applies:

1. the format has no library decompressor here (dense, block FP8, gpt-oss MXFP4, GPTQ, AWQ):
   transformers' loading, as before;
2. transformers cannot load the checkpoint (it raises: asymmetric MoE W4A16, W8A8 INT8 in
   transformers 5.24; not tried for per-projection config groups, ``per_projection_groups``,
   a quant_method transformers has no loader for, ``no_transformers_loader``: ModelOpt, or
   non-expert modules with quantized input activations, which transformers computes another
   way, ``quantized_activations_outside_experts``):
   the library's dense model, WARNING naming the error;
3. transformers loads it: a sample of its experts is compared with the library's; equal:
   transformers' model (INFO says how many experts were compared); different (NVFP4 in 5.24:
   the global scale is not applied): the library's dense model, WARNING with the max |diff|.

Does not: page, or run prompts (``check``). The library reference computes what the
decompressed model computes on CPU: weights decompressed, activations unquantized.
"""

from __future__ import annotations

import json
import logging
import mmap
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

# quant_method -> (the library whose decompression is the reference, the module it needs, its
# pip install)
LIBRARY_QUANT_METHODS = {"compressed-tensors": ("compressed-tensors", "compressed_tensors", "'pagedexperts[quant]'"),
                         "modelopt": ("ModelOpt", "modelopt.torch.quantization.qtensor", "'pagedexperts[modelopt]'")}
SAMPLE_EXPERTS_PER_LAYER = 4
_SIDE_SUFFIXES = ("_packed", "_scale", "_global_scale", "_zero_point", "_shape", "_g_idx")


@dataclass(frozen=True)
class ReferenceChoice:
    """Which unpaged reference ``check`` uses and why (printed, logged)."""

    source: str  # "transformers", "compressed-tensors" or "pagedexperts resident" (GPTQ/AWQ here)
    reason: str
    experts_compared: int = 0
    max_abs_diff: float = 0.0

    def line(self) -> str:
        return f"reference: {self.source} ({self.reason})"


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


def _scheme_for(prefix: str, qconf) -> object | None:
    """The config group's QuantizationScheme of module ``prefix`` (None: ignored/unquantized), as
    compressed-tensors matches it (``utils.match.is_match``): ``match_name`` (a ``re:`` regex or
    the exact module name) or the class-name target ``Linear`` (every module that stores
    compressed tensors is an nn.Linear); ``ignore`` entries the same way."""
    from compressed_tensors.utils.match import match_name

    def hit(target: str) -> bool:
        return match_name(prefix, target) or target == "Linear"

    if any(hit(e) for e in qconf.ignore or []):
        return None
    for group in qconf.config_groups.values():
        if any(hit(t) for t in group.targets):
            return group
    return None


def _modules(keys) -> dict[str, dict[str, str]]:
    """Checkpoint keys -> {module prefix: {local name: key}} of the modules with a scale."""
    by_module: dict[str, dict[str, str]] = {}
    for key in keys:
        prefix, _, local = key.rpartition(".")
        by_module.setdefault(prefix, {})[local] = key
    return {p: m for p, m in by_module.items() if "weight_scale" in m}


def _ct_decompressor(config: dict, src: Path) -> Callable:
    """compressed-tensors' per-module decompression: (module prefix, {local name: tensor}) ->
    dense weight, as ``BaseCompressor.get_value_from_registry(format).decompress(state,
    scheme)`` (the per-module call transformers' loader makes), in the dtype it returns.

    Raises (when called): ValueError, a compressed module no config group covers."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qconf = QuantizationConfig.model_validate(config["quantization_config"])

    def decompress(prefix: str, state: dict) -> torch.Tensor:
        scheme = _scheme_for(prefix, qconf)
        if scheme is None:
            raise ValueError(f"{src}: module {prefix} stores compressed tensors but no config group covers it")
        return BaseCompressor.get_value_from_registry(scheme.format or qconf.format).decompress(state, scheme)["weight"]

    return decompress


def _modelopt_decompressor(config: dict, src: Path) -> Callable:
    """ModelOpt's own dequantization of one exported module, into the checkpoint's saved dtype
    (config ``dtype``, ModelOpt's QTensor ``metadata["dtype"]``): NVFP4 (uint8 ``weight`` with
    ``weight_scale_2``) ``NVFP4QTensor(shape, dtype, weight).dequantize(scale=weight_scale,
    double_scale=weight_scale_2, block_sizes={-1: 16})``; FP8 ``FP8QTensor(...).dequantize(
    scale=weight_scale)``; ``input_scale`` dropped (activations unquantized).

    Raises (when called): ValueError, a module that is neither."""
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


def compare_experts(transformers_model, library_model, *, per_layer: int = SAMPLE_EXPERTS_PER_LAYER, seed: int = 0):
    """(experts compared, max |diff|, first differing 'param[expert]' or None) over a seeded
    sample of ``per_layer`` experts of every routed-experts parameter (torch.equal: values and
    dtype; the diff in float64)."""
    ours = expert_parameters(library_model)
    gen = torch.Generator().manual_seed(seed)
    compared, worst, first = 0, 0.0, None
    for name, theirs in expert_parameters(transformers_model).items():
        if name not in ours:
            continue
        for j in torch.randperm(theirs.shape[0], generator=gen)[:per_layer].tolist():
            a, b = theirs[j].detach(), ours[name][j].detach()
            diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("inf")
            compared += 1
            if diff > 0 or a.dtype != b.dtype or not torch.equal(a, b):
                first = first or f"{name}[{j}]"
                worst = max(worst, diff)
    return compared, worst, first


def complete(loaded, path) -> object:
    """The model of ``from_pretrained(..., output_loading_info=True)``'s (model, info).

    Raises:
        ValueError: parameters the checkpoint did not fill (transformers would leave them
            randomly initialised: a checkpoint whose names do not map onto the model).
    """
    model, info = loaded
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise ValueError(f"{path}: {len(missing)} model tensors are not in the checkpoint (e.g. {missing[:3]}); "
                         "its expert names do not map onto the model")
    return model


def cast_experts(model, dtype: torch.dtype):
    """Every routed-experts [E, ...] parameter of ``model`` in ``dtype`` (in place), as
    transformers keeps a compressed-tensors checkpoint's experts in the decompressed dtype."""
    for param in expert_parameters(model).values():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def align_like_checkpoint(model, src: Path) -> int:
    """Re-place every non-expert parameter of ``model`` (the library's dense model, loaded from
    the decompressed temporary checkpoint) at the page alignment its tensor has in ``src``'s
    shard, in place; returns how many moved.

    Why: transformers keeps non-expert weights memory-mapped, so their address is congruent to
    their file offset modulo the page size, and CPU GEMMs (oneDNN/MKL) can sum in another order
    at another alignment. Checkpoint keys are renamed as transformers does (Mixtral's
    ``block_sparse_moe.gate`` -> ``mlp.gate``: ``loading.checkpoint.KeyMap``). The decompressed checkpoint stores the same non-expert tensors at
    other offsets (its experts are larger), which made the reference's logits differ from the
    paged model's (which copies them at ``src``'s alignment, ``loading.fill.empty_like_mapped``)
    in the last bits (3.8e-6 on the bundled model's W4A16_ASYM). A parameter whose bytes differ
    from the file's (another dtype) is left where it is.
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
        if name in experts or name not in offsets or param.device.type != "cpu":
            continue
        file, start, nbytes = offsets[name]
        if nbytes != param.nbytes:
            continue
        aligned = empty_like_mapped(TensorEntry(file, param.dtype, tuple(param.shape), start, param.nbytes))
        if aligned.data_ptr() % mmap.PAGESIZE != param.data_ptr() % mmap.PAGESIZE:
            param.data = aligned.copy_(param.data)
            moved += 1
    return moved


def per_projection_groups(quantization_config: dict | None) -> str | None:
    """Why transformers cannot be the reference of a compressed-tensors checkpoint whose routed
    expert projections are in config groups with different schemes (gate/up group 32, down
    group 16), or None: transformers 5.24 applies ONE group to every expert projection
    (``get_experts_scheme``), so its loading fails (or dequantizes down_proj with the wrong
    group size), or whose one experts group is not the one transformers picks (module-name
    targets: it takes the first group with a non-``re:`` target). Read with
    ``formats.ct_schemes.dense_schemes`` (a checkpoint it refuses: None)."""
    from pagedexperts.formats.ct_schemes import dense_schemes

    if not quantization_config or quantization_config.get("quant_method") != "compressed-tensors":
        return None
    try:
        schemes = dense_schemes(quantization_config)
    except ValueError:
        return None
    if len({repr(s) for s in schemes.values()}) <= 1:
        from pagedexperts.formats.compressed_tensors import transformers_experts_args

        picked = transformers_experts_args(quantization_config) or {}
        scheme = next(iter(schemes.values()), None)
        if scheme is None or {k: v for k, v in picked.items() if k not in ("format", "input_activations")} == scheme.weights:
            return None
        return (f"transformers applies the config group with weights {picked} to every expert projection "
                f"(get_experts_scheme: the first non-re: target), but the experts' own targets give {scheme.weights}")
    groups = ", ".join(f"{d} {s.weights.get('num_bits')}-bit group_size {s.weights.get('group_size')}"
                       for d, s in schemes.items())
    return (f"the expert projections are in different config groups ({groups}) and transformers applies "
            "one group to every expert projection")


def quantized_activations_outside_experts(quantization_config: dict | None, config: dict | None = None) -> str | None:
    """Why transformers' loading is not the reference of a compressed-tensors checkpoint with
    mxfp8-quantized experts (it fails to load them), or is another computation than the paged
    model's for one whose non-expert modules (attention, shared experts, dense
    MLPs) sit in a config group with ``input_activations``, or None: transformers runs those
    through compressed-tensors' forward, which quantizes their input activations (static FP8's
    ``input_scale``, dynamic per token), while pagedexperts (and the library reference)
    dequantize their weights and run unquantized activations (``formats.ct_fp8``). ``config``:
    config.json, whose model's own module names are tried (``ignore`` lists concrete names)."""
    from pagedexperts.formats.ct_schemes import non_expert_linear_names, quantized_non_expert, scheme_of_module

    if not quantization_config or quantization_config.get("quant_method") != "compressed-tensors":
        return None
    experts = scheme_of_module(quantization_config, "model.layers.0.mlp.experts.0.down_proj")
    if experts is not None and experts.format == "mxfp8-quantized":  # its loader fails with a traceback: not tried
        return ("transformers' CompressedTensorsDequantize reads mxfp8-quantized experts' uint8 E8M0 exponents as "
                "float scales (a shape error at load)")
    module = quantized_non_expert(quantization_config, non_expert_linear_names(config) if config else None)
    scheme = scheme_of_module(quantization_config, module) if module else None
    act = scheme.input_activations if scheme else None
    if not act:
        return None
    return (f"{module} is in a config group with input_activations {act.get('type')}{act.get('num_bits')} "
            f"{'dynamic' if act.get('dynamic') else 'static'}, which transformers' compressed-tensors forward "
            "quantizes (the paged model runs its dequantized weight on unquantized activations)")


def no_transformers_loader(quantization_config: dict | None) -> str | None:
    """Why transformers cannot load a checkpoint at all (its quant_method has no quantizer in
    this transformers: ModelOpt's ``modelopt`` in 5.24), or None."""
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    method = (quantization_config or {}).get("quant_method")
    if method is None or method in AUTO_QUANTIZER_MAPPING:
        return None
    import transformers

    return f"transformers {transformers.__version__} has no loader for quant_method {method!r}"


def choose_reference(path: Path, quantization_config: dict | None, *, load: Callable, load_dense: Callable):
    """The unpaged reference model and a ``ReferenceChoice`` (module docstring's rule).

    ``load(path)``: transformers' own loading of the checkpoint (``from_pretrained`` with the
    format's ``reference_kwargs``); ``load_dense(dir)``: ``from_pretrained`` of a dense
    checkpoint at the same dtype and experts implementation. Logs a WARNING whenever the
    reference is not transformers' loading, naming why.
    """
    if not has_library_reference(quantization_config):
        cannot = no_transformers_loader(quantization_config)
        if cannot and quantization_config["quant_method"] in LIBRARY_QUANT_METHODS:
            library, module, pip = LIBRARY_QUANT_METHODS[quantization_config["quant_method"]]
            raise ImportError(f"{cannot}, and the reference, {library}'s own dequantization, needs {module} "
                              f"here: pip install {pip}")
        return load(path), ReferenceChoice("transformers", "its own loading; no format library decompression "
                                                           "for this checkpoint here")
    with tempfile.TemporaryDirectory(prefix="pagedexperts-ref-") as tmp:
        library = load_dense(library_decompress(Path(path), Path(tmp)))
    align_like_checkpoint(library, Path(path))
    library_name = LIBRARY_QUANT_METHODS[quantization_config["quant_method"]][0]
    cannot = (per_projection_groups(quantization_config) or no_transformers_loader(quantization_config)
              or quantized_activations_outside_experts(quantization_config, json.loads((Path(path) / "config.json").read_text())))
    if cannot:  # transformers' loading would fail with a long traceback: not tried
        choice = ReferenceChoice(library_name, f"transformers cannot load this checkpoint: {cannot}")
        logger.warning("unpaged reference: %s's own decompression, since %s", library_name, choice.reason)
        return library, choice
    try:
        model = load(path)
    except Exception as exc:  # transformers' loader fails in many ways (assertion, cat, key errors)
        choice = ReferenceChoice(library_name, f"transformers cannot load this checkpoint: {type(exc).__name__}: {exc}")
        logger.warning("unpaged reference: %s's own decompression, since %s", library_name, choice.reason)
        return library, choice
    compared, diff, first = compare_experts(model, library)
    if first is None:
        reason = f"cross-checked: {compared} sampled experts' dequantized weights equal {library_name}'s"
        logger.info("unpaged reference: transformers' loading (%s)", reason)
        return model, ReferenceChoice("transformers", reason, compared, 0.0)
    reason = (f"transformers' loading is WRONG: of {compared} sampled experts, e.g. {first} differs from "
              f"{library_name}'s decompression by up to {diff:.4g}")
    logger.warning("unpaged reference: %s's own decompression, since %s", library_name, reason)
    del model
    return library, ReferenceChoice(library_name, reason, compared, diff)
