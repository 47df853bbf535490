"""The unpaged reference ``check`` compares a paged model with, chosen per checkpoint so that it
can be trusted, each fallback with a WARNING naming why (``choose_reference``):

1. where a format library decompresses the checkpoint here (compressed-tensors, ModelOpt): its
   dense model, unless transformers loads it with nothing missing and a sample of its experts
   equals the library's (``compare_experts``; not tried for per-projection config groups, no
   transformers loader, or quantized non-expert modules);
2. otherwise transformers' loading, for a quantized checkpoint only when nothing is missing
   (``complete``) and a sample of its experts equals pagedexperts' dequantization
   (``compare_with_format``); else the pagedexperts resident model, which checks paging, not
   the dequantization.

Every reference computes weights dequantized and activations unquantized. Does not: decompress
(``tools.library_reference``), page, or run prompts (``tools.check``).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pagedexperts.tools.library_reference import (LIBRARY_QUANT_METHODS, align_like_checkpoint,  # noqa: F401
                                                  expert_parameters, has_library_reference, library_decompress)

logger = logging.getLogger(__name__)

SAMPLE_EXPERTS_PER_LAYER = 4
RESIDENT = "pagedexperts resident"


@dataclass(frozen=True)
class ReferenceChoice:
    """Which unpaged reference ``check`` uses and why (printed, logged)."""

    source: str  # "transformers", "compressed-tensors", "ModelOpt" or RESIDENT
    reason: str
    experts_compared: int = 0
    max_abs_diff: float = 0.0

    def line(self) -> str:
        return f"reference: {self.source} ({self.reason})"


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
        ValueError: parameters the checkpoint did not fill (transformers leaves them randomly
            initialised: names that do not map onto the model, or modules its quantizer
            replaced, as GPTQModel's leaves the fused experts).
    """
    model, info = loaded
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise ValueError(f"{path}: transformers' loading leaves {len(missing)} model tensors randomly initialised "
                         f"(not filled from the checkpoint, e.g. {missing[:3]})")
    return model


def with_experts_in(model, dtype: torch.dtype, load_at: Callable):
    """``model`` (the library's dense model at the run dtype) with its routed experts in ``dtype``,
    as transformers keeps a compressed-tensors checkpoint's experts in the decompressed dtype:
    taken from ``load_at(dtype)``, a second load of the same dense checkpoint at that dtype, when
    it differs (casting ``model``'s experts would round twice: the file's float16 -> the run's
    bfloat16 -> float16)."""
    ours = expert_parameters(model)
    if all(not p.is_floating_point() or p.dtype == dtype for p in ours.values()):
        return model
    theirs = expert_parameters(load_at(dtype))
    for name, param in ours.items():
        param.data = theirs[name].data
    return model


def per_projection_groups(quantization_config: dict | None) -> str | None:
    """Why transformers cannot be the reference of a compressed-tensors checkpoint whose routed
    expert projections are in config groups with different schemes (gate/up group 32, down
    group 16), or None: transformers 5.24 applies ONE group to every expert projection
    (``get_experts_scheme``), so its loading fails (or dequantizes down_proj with the wrong
    group size). Read with ``formats.compressed_tensors.schemes.dense_schemes`` (a checkpoint it refuses: None)."""
    from pagedexperts.formats.compressed_tensors.schemes import dense_schemes

    if not quantization_config or quantization_config.get("quant_method") != "compressed-tensors":
        return None
    try:
        schemes = dense_schemes(quantization_config)
    except ValueError:
        return None
    if len({repr(s) for s in schemes.values()}) <= 1:
        return None
    groups = ", ".join(f"{d} {s.weights.get('num_bits')}-bit group_size {s.weights.get('group_size')}"
                       for d, s in schemes.items())
    return (f"the expert projections are in different config groups ({groups}) and transformers applies "
            "one group to every expert projection")


def no_transformers_loader(quantization_config: dict | None) -> str | None:
    """Why transformers cannot load a checkpoint at all (its quant_method has no quantizer in
    this transformers: ModelOpt's ``modelopt`` in 5.24), or None."""
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    method = (quantization_config or {}).get("quant_method")
    if method is None or method in AUTO_QUANTIZER_MAPPING:
        return None
    import transformers

    return f"transformers {transformers.__version__} has no loader for quant_method {method!r}"


def compare_with_format(model, files, fmt, *, per_layer: int = SAMPLE_EXPERTS_PER_LAYER, seed: int = 0):
    """(experts compared, max |diff|, first differing 'param[expert]' or None): a seeded sample of
    ``per_layer`` experts of every experts module of ``model`` (transformers' loading) against
    pagedexperts' dequantization (``fmt``'s layout) of the same experts read from the
    checkpoint ``files`` through safetensors' own reader (``loading.independence.reference_rows``).
    A model without experts modules compares nothing and differs ('no experts module')."""
    from types import SimpleNamespace

    from pagedexperts.loading.checkpoint import KeyMap, expert_sources
    from pagedexperts.loading.independence import reference_rows
    from pagedexperts.models.sites import find_experts_sites

    try:
        sites = {s.name: s for s in find_experts_sites(model)}
    except ValueError as exc:
        return 0, float("inf"), f"no experts module pagedexperts reads ({exc})"
    sources = expert_sources(model.config.model_type)
    layouts = {n: fmt.layout(s.specs, sources=sources, transposed=bool(getattr(s.module, "is_transposed", False)))
               for n, s in sites.items()}
    gen = torch.Generator().manual_seed(seed)
    wanted = {n: torch.randperm(s.num_experts, generator=gen)[:per_layer].tolist() for n, s in sites.items()}
    stores = {n: SimpleNamespace(specs=layout.packed_specs) for n, layout in layouts.items()}
    rows = reference_rows(files, KeyMap(model.config.model_type, sites, fmt), {n: st.specs for n, st in stores.items()}, wanted)
    compared, worst, first = 0, 0.0, None
    for name, experts in wanted.items():
        for j in experts:
            ours = layouts[name].dequantize({k: v.unsqueeze(0) for k, v in rows[name][j].items()})
            for tensor, dense in ours.items():
                theirs = getattr(sites[name].module, tensor)[j].detach()
                equal = theirs.dtype == dense.dtype and torch.equal(theirs, dense[0])
                if not equal:
                    first = first or f"{name}.{tensor}[{j}]"
                    worst = max(worst, (theirs.double() - dense[0].double()).abs().max().item())
            compared += 1
    return compared, worst, first


@dataclass(frozen=True)
class ReferenceLoaders:
    """How ``choose_reference`` builds each candidate, all at the run's dtype and experts
    implementation: ``transformers(path)`` -> ``from_pretrained(..., output_loading_info=True)``'s
    (model, info) with the format's ``reference_kwargs``; ``dense(dir)`` -> the model of a dense
    checkpoint; ``resident()`` -> the pagedexperts resident model; ``sample(model)`` ->
    ``compare_with_format`` of transformers' model; ``format_name``: the checkpoint's format."""

    transformers: Callable
    dense: Callable
    resident: Callable
    sample: Callable
    format_name: str


def choose_reference(path: Path, quantization_config: dict | None, loaders: ReferenceLoaders,
                     quantized_linears: list[str] = ()):
    """The unpaged reference model and a ``ReferenceChoice`` (the module docstring's rule).
    ``quantized_linears``: the non-expert modules the checkpoint stores quantized. Logs a
    WARNING whenever the reference is not transformers' loading, naming why.

    Raises:
        ImportError: a ModelOpt checkpoint without nvidia-modelopt (names the pip install).
        ValueError: an unquantized checkpoint transformers loads with tensors missing.
    """
    if has_library_reference(quantization_config):
        return _library_or_transformers(Path(path), quantization_config, loaders, quantized_linears)
    cannot = no_transformers_loader(quantization_config)
    if cannot and quantization_config["quant_method"] in LIBRARY_QUANT_METHODS:
        library, module, pip = LIBRARY_QUANT_METHODS[quantization_config["quant_method"]]
        raise ImportError(f"{cannot}, and the reference, {library}'s own dequantization, needs {module} "
                          f"here: pip install {pip}")
    try:
        model = complete(loaders.transformers(path), path)
    except Exception as exc:  # transformers' loaders fail in many ways (missing kernels, keys, shapes)
        if not quantization_config:
            raise
        return _resident(loaders, f"transformers cannot load this {loaders.format_name} checkpoint here "
                                  f"({type(exc).__name__}: {exc})")
    if not quantization_config:
        return model, ReferenceChoice("transformers", "its own loading of an unquantized checkpoint")
    compared, diff, first = loaders.sample(model)
    if first is not None:
        del model
        return _resident(loaders, f"transformers' loading differs from pagedexperts' {loaders.format_name} "
                                  f"dequantization of the checkpoint: of {compared} sampled experts, e.g. {first} "
                                  f"by up to {diff:.4g}")
    reason = (f"cross-checked: nothing missing, {compared} sampled experts equal pagedexperts' "
              f"{loaders.format_name} dequantization of the checkpoint")
    logger.info("unpaged reference: transformers' loading (%s)", reason)
    return model, ReferenceChoice("transformers", reason, compared)


def _resident(loaders: ReferenceLoaders, reason: str):
    """The pagedexperts resident reference, with the WARNING naming why transformers is not it."""
    logger.warning("unpaged reference: the pagedexperts resident model (every expert dequantized by pagedexperts' "
                   "%s format: this checks paging, not the dequantization), since %s", loaders.format_name, reason)
    return loaders.resident(), ReferenceChoice(RESIDENT, reason)


def _library_or_transformers(path: Path, qc: dict, loaders: ReferenceLoaders, quantized_linears):
    """Rule 1 of the module docstring."""
    with tempfile.TemporaryDirectory(prefix="pagedexperts-ref-") as tmp:
        library = loaders.dense(library_decompress(path, Path(tmp)))
    align_like_checkpoint(library, path)
    library_name = LIBRARY_QUANT_METHODS[qc["quant_method"]][0]
    cannot = per_projection_groups(qc) or no_transformers_loader(qc)
    if cannot:  # transformers' loading would fail with a long traceback: not tried
        return _library(library, library_name, f"transformers cannot load this checkpoint: {cannot}")
    if quantized_linears:  # transformers computes another thing there: not tried
        return _library(library, library_name, (
            f"transformers is not the reference: the checkpoint stores {len(quantized_linears)} non-expert modules "
            f"quantized (e.g. {quantized_linears[0]}), which transformers runs through compressed-tensors' forward "
            "(scales cast to the run dtype), not as the weights the library decompresses"))
    try:
        model = complete(loaders.transformers(path), path)
    except Exception as exc:  # transformers' loader fails in many ways (assertion, cat, key errors)
        return _library(library, library_name, f"transformers cannot load this checkpoint: {type(exc).__name__}: {exc}")
    compared, diff, first = compare_experts(model, library)
    if first is None:
        reason = f"cross-checked: {compared} sampled experts' dequantized weights equal {library_name}'s"
        logger.info("unpaged reference: transformers' loading (%s)", reason)
        return model, ReferenceChoice("transformers", reason, compared, 0.0)
    del model
    reason = (f"transformers' loading is WRONG: of {compared} sampled experts, e.g. {first} differs from "
              f"{library_name}'s decompression by up to {diff:.4g}")
    return _library(library, library_name, reason, compared, diff)


def _library(model, library_name: str, reason: str, compared: int = 0, diff: float = 0.0):
    logger.warning("unpaged reference: %s's own decompression, since %s", library_name, reason)
    return model, ReferenceChoice(library_name, reason, compared, diff)
