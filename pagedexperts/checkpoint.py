"""Reading Hugging Face checkpoints for paging: shards, key mapping, streaming into place.

Owns: finding a directory's safetensors files (single file or shards named by an index) and
checking their headers before any allocation, mapping checkpoint keys onto the model with
transformers' own conversion table (renamings, and the per-expert -> stacked converters), and
streaming each tensor to its place: expert rows into the host stores (one expert at a time,
never the device), everything else onto the device. Both expert layouts are read: stacked
(``mlp.experts.gate_up_proj`` [E, ...]) and one tensor per expert
(``mlp.experts.{j}.gate_proj.weight``, what hub checkpoints and ``save_pretrained`` write).
Does not: build the model or attach pagers (``loader``).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from pagedexperts.models import ExpertsSite

logger = logging.getLogger(__name__)


def checkpoint_files(model_path: Path) -> list[Path]:
    """The safetensors files of a model directory (single file, or shards named by the index).

    Raises:
        FileNotFoundError: no safetensors in the directory, or a shard named by the index is
            missing.
    """
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_path / s for s in shards]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"checkpoint shards named in {index} are missing: {missing}")
        return files
    single = model_path / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(model_path.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(f"no safetensors checkpoint in {model_path} (want model.safetensors or an index)")


def check_readable(files: list[Path]) -> None:
    """Open every shard's header (reads no weights) so a truncated or corrupt shard is found
    before any allocation.

    Raises:
        ValueError: names the shard.
    """
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as exc:  # safetensors raises its own error type for truncated files
            raise ValueError(f"cannot read checkpoint shard {file}: {exc} (truncated or corrupt?)") from exc


class KeyMap:
    """Maps checkpoint keys onto the model: an expert row of a store, or a plain tensor.

    Uses transformers' checkpoint conversion table for the model type (renamings, and the
    per-expert -> stacked converters: MergeModulelist(dim=0) then Concatenate(dim=1)).
    """

    def __init__(self, model_type: str, sites: dict[str, ExpertsSite]) -> None:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        self.sites = sites
        self.renames: list[tuple[re.Pattern, str]] = []
        self.converters: list[tuple[list[re.Pattern], str]] = []
        for t in get_checkpoint_conversion_mapping(model_type) or []:
            kind = type(t).__name__
            if kind == "WeightRenaming":
                for src, dst in zip(t.source_patterns, t.target_patterns):
                    self.renames.append((re.compile(src), dst))
            elif kind == "WeightConverter":
                ops = [(type(o).__name__, getattr(o, "dim", None)) for o in t.operations]
                if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
                    raise ValueError(f"checkpoint conversion {ops} for {model_type!r} is not supported yet")
                pats = [re.compile(re.escape(p).replace(r"\*", r"(\d+)")) for p in t.source_patterns]
                self.converters.append((pats, t.target_patterns[0]))

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


def stream_checkpoint(model, sites, stores, device, *, model_type, files) -> None:
    """Copy every checkpoint tensor to its place: expert rows into stores, the rest to device."""
    from safetensors import safe_open

    keymap = KeyMap(model_type, sites)
    # site name -> {(tensor name, expert): source indices seen}; n_src per tensor name
    seen_rows: dict[str, dict] = {name: {} for name in sites}
    unexpected = []
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as exc:  # safetensors raises its own error type for truncated files
            raise ValueError(f"cannot read checkpoint shard {file}: {exc} (truncated or corrupt?)") from exc
        with handle as f:
            for raw_key in f.keys():
                key = keymap.rename(raw_key)
                target = keymap.expert_target(key)
                if target is not None:
                    _load_expert_tensor(f, raw_key, target, stores, seen_rows)
                elif not _load_plain_tensor(model, key, f.get_tensor(raw_key), device):
                    unexpected.append(raw_key)
    if unexpected:
        logger.warning("checkpoint keys not used by the model: %d (first: %s)", len(unexpected), unexpected[:3])
    for name, site in sites.items():
        lacking = [
            (spec.name, e)
            for spec in site.specs
            for e in range(site.num_experts)
            if len(seen_rows[name].get((spec.name, e), ((), 1))[0]) != seen_rows[name].get((spec.name, e), ((), 1))[1]
        ]
        if lacking:
            raise ValueError(
                f"checkpoint lacks expert tensors of {name}: {len(lacking)} (tensor, expert) rows, "
                f"e.g. {lacking[:4]}"
            )
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} model tensors, e.g. {missing[:4]}")


def _load_expert_tensor(f, raw_key, target, stores, seen_rows) -> None:
    site, tname, expert, src_index, n_src = target
    store = stores[site.name]
    if tname not in store.tensors:
        raise ValueError(f"checkpoint tensor {raw_key!r} maps to unknown expert tensor {tname!r} of {site.name}")
    if expert is None:  # stacked [E, ...]: copy one expert at a time to bound memory
        sl = f.get_slice(raw_key)
        shape = sl.get_shape()
        if shape[0] != site.num_experts:
            raise ValueError(
                f"expert tensor {raw_key!r} has {shape[0]} experts, config says E={site.num_experts}"
            )
        for e in range(site.num_experts):
            store.write_row(tname, e, sl[e])
            seen_rows[site.name][(tname, e)] = ({0}, 1)
        return
    value = f.get_tensor(raw_key)
    rows = None
    if n_src > 1:  # the sources are concatenated along the expert row's first dim
        size = store.tensors[tname].shape[1] // n_src
        if value.shape[0] != size:
            raise ValueError(
                f"checkpoint tensor {raw_key!r} (expert {expert}) has {value.shape[0]} rows, but "
                f"{tname!r} of shape {tuple(store.tensors[tname].shape[1:])} per expert needs "
                f"{size} from each of its {n_src} sources (config moe_intermediate_size?)"
            )
        rows = slice(src_index * size, (src_index + 1) * size)
    store.write_row(tname, expert, value, rows=rows)
    seen_rows[site.name].setdefault((tname, expert), (set(), n_src))[0].add(src_index)


def _load_plain_tensor(model, key: str, value: torch.Tensor, device) -> bool:
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
    if current is not None:
        module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[attr] = tensor
    return True
