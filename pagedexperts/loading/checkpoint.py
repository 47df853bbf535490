"""Checkpoint keys onto the model: the key map, non-expert tensors in place, quantized companions.

Owns: mapping checkpoint keys onto the model with transformers' own conversion table
(``KeyMap``: renamings, and the per-expert -> stacked converters), so both expert layouts are
read: stacked (``mlp.experts.gate_up_proj`` [E, ...]) and one tensor per expert
(``mlp.experts.{j}.gate_proj.weight``, what hub checkpoints and ``save_pretrained`` write).
Quantized checkpoints (``pagedexperts.formats``): expert tensors map to the store's packed
tensors under the format's names (``gate_up_proj_scale_inv``), for the converter's sources and
the format's serialized companions alike; a quantized non-expert weight (block-FP8 attention)
is dequantized by the same format once its companions are read (``PlainDequantizer``), into
the model's dtype, as transformers' loading does. Putting a non-expert tensor in place
(``load_plain_tensor``) and the final check that nothing is left on meta.
Does not: read bytes (``loading.fill``) or build the model (``loading.build``).
"""

from __future__ import annotations

import logging
import re

import torch

from pagedexperts.formats import ExpertFormat, QuantizedTensor, TensorSpec
from pagedexperts.formats.base import store_name
from pagedexperts.formats.dense import DenseFormat
from pagedexperts.models.sites import ExpertsSite

logger = logging.getLogger(__name__)


def _source_re(pattern: str) -> re.Pattern:
    """A conversion table source pattern (``mlp.experts.*.gate_proj.weight``) as a regex that
    captures the expert index and ends the key."""
    return re.compile(re.escape(pattern).replace(r"\*", r"(\d+)") + "$")


def _converters(model_type: str, renames: list | None = None) -> list[tuple[list[str], str]]:
    """The per-expert -> stacked converters of ``model_type`` as (source patterns, target),
    appending its renamings to ``renames``.

    Raises:
        ValueError: a converter other than MergeModulelist(0) [+ Concatenate(1)].
    """
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    out = []
    for t in get_checkpoint_conversion_mapping(model_type) or []:
        kind = type(t).__name__
        if kind == "WeightRenaming" and renames is not None:
            for src, dst in zip(t.source_patterns, t.target_patterns):
                renames.append((re.compile(src), dst))
        elif kind == "WeightConverter":
            ops = [(type(o).__name__, getattr(o, "dim", None)) for o in t.operations]
            if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
                raise ValueError(f"checkpoint conversion {ops} for {model_type!r} is not supported yet")
            out.append((list(t.source_patterns), t.target_patterns[0]))
    return out


def expert_sources(model_type: str) -> dict[str, int]:
    """Experts-module tensor name -> number of per-expert checkpoint tensors concatenated into
    it (Qwen3's ``gate_up_proj``: 2, gate then up); tensors not listed have one source."""
    return {target.rpartition(".")[2]: len(sources) for sources, target in _converters(model_type)}


class KeyMap:
    """Maps checkpoint keys onto the model: an expert row of a store, or a plain tensor.

    Uses transformers' checkpoint conversion table for the model type (renamings, and the
    per-expert -> stacked converters: MergeModulelist(dim=0) then Concatenate(dim=1)). A
    quantized format's serialized companions (``weight_scale_inv`` beside ``weight``) follow
    their weight's converter into ``target + suffix``, as transformers' quantizers extend the
    table (``HfQuantizer.update_weight_conversions``).
    """

    def __init__(self, model_type: str, sites: dict[str, ExpertsSite], fmt: ExpertFormat | None = None) -> None:
        self.sites = sites
        self.renames: list[tuple[re.Pattern, str]] = []
        self.converters: list[tuple[list[re.Pattern], str]] = []
        for sources, target in _converters(model_type, self.renames):
            self.converters.append(([_source_re(p) for p in sources], target))
            param = sources[0].rpartition(".")[2]
            for name in (fmt or DenseFormat()).serialized_names.get(param, ()):
                if name != param and all(p.endswith("." + param) for p in sources):
                    suffixed = [p[: -len(param)] + name for p in sources]
                    self.converters.append(([_source_re(p) for p in suffixed], store_name(target, param, name)))

    def rename(self, key: str) -> str:
        for pat, dst in self.renames:
            key = pat.sub(dst, key)
        return key

    def expert_target(self, key: str) -> tuple[ExpertsSite, str, int | None, int, int] | None:
        """(site, tensor name, expert j or None if stacked, source index, number of sources)."""
        for pats, target in self.converters:
            for i, pat in enumerate(pats):
                m = pat.search(key)
                if m is None:
                    continue
                full = key[: m.start()] + target
                site_name, _, tname = full.rpartition(".")
                site_name = site_name.lstrip(".")
                if site_name in self.sites:
                    return self.sites[site_name], tname, int(m.group(1)), i, len(pats)
        site_name, _, tname = key.rpartition(".")
        if site_name in self.sites:
            return self.sites[site_name], tname, None, 0, 1
        return None


def check_model_filled(model) -> None:
    """Tie the embeddings when the config says so, then check that no parameter is left on the
    meta device (every non-expert tensor came from the checkpoint).

    Raises:
        ValueError: model tensors the checkpoint lacks (names a few).
    """
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} model tensors, e.g. {missing[:4]}")


class PlainDequantizer:
    """Quantized non-expert weights (block-FP8 attention, shared experts, dense MLPs): collects
    a weight's serialized companions (``q_proj.weight`` + ``q_proj.weight_scale_inv``) as they
    stream by, and dequantizes them with the format into the parameter's dtype once complete.

    A weight counts as quantized when the checkpoint holds all its serialized names.
    """

    def __init__(self, fmt: ExpertFormat | None, keys: list[str]) -> None:
        self.fmt = fmt
        self.groups: dict[str, tuple[str, tuple[str, ...]]] = {}  # key -> (base "mod.weight", names)
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        present = set(keys)
        for param, names in (fmt.serialized_names.items() if fmt is not None else ()):
            for key in keys:
                if not key.endswith("." + param):
                    continue
                module = key[: -len(param) - 1]
                if len(names) > 1 and all(f"{module}.{n}" in present for n in names):
                    for n in names:
                        self.groups[f"{module}.{n}"] = (f"{module}.{param}", names)

    def takes(self, key: str) -> bool:
        return key in self.groups

    def add(self, model, key: str, value: torch.Tensor) -> tuple[str | None, torch.Tensor | None]:
        """Keep ``value``; when its group is complete return (weight key, dense weight)."""
        base, names = self.groups[key]
        module_name, _, param = base.rpartition(".")
        parts = self.pending.setdefault(base, {})
        parts[key.rpartition(".")[2]] = value
        if len(parts) < len(names):
            return None, None
        del self.pending[base]
        ref = model.get_submodule(module_name)._parameters.get(param)
        if ref is None:
            raise ValueError(f"checkpoint's quantized {base!r} has no parameter in the model")
        dense = TensorSpec(param, tuple(ref.shape), ref.dtype)
        qt = QuantizedTensor(dense, self.fmt.pack(dense, sources=1, transposed=False))
        rows = {store_name(param, param, name): parts[name].unsqueeze(0) for name in parts}
        return base, self.fmt.dequantize(qt, rows)[0]

    def check_done(self) -> None:
        if self.pending:
            base, parts = next(iter(self.pending.items()))
            raise ValueError(
                f"quantized checkpoint tensor {base!r} lacks its companions: has {sorted(parts)}, "
                f"needs {list(self.groups[base][1])}"
            )


def load_plain_tensor(model, key: str, value: torch.Tensor, device) -> bool:
    """Put a non-expert tensor in its place on the device. False if the model has no such key."""
    module_name, _, attr = key.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False
    current = module._parameters.get(attr)
    if current is None and attr not in module._buffers:
        return False
    ref = current if current is not None else module._buffers[attr]
    if tuple(ref.shape) != tuple(value.shape):
        raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(value.shape)}, the config implies {tuple(ref.shape)}")
    dtype = ref.dtype if value.is_floating_point() else value.dtype
    tensor = value.to(device=device, dtype=dtype)
    if current is not None:  # the attributes from_pretrained gives (requires_grad changes CPU matmul paths)
        module._parameters[attr] = torch.nn.Parameter(tensor.contiguous(), requires_grad=current.requires_grad)
    else:
        module._buffers[attr] = tensor
    return True
