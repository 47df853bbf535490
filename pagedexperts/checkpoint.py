"""Reading Hugging Face checkpoints for paging: shards, key mapping, streaming into place.

Owns: finding a directory's safetensors files (single file or shards named by an index) and
checking their headers before any allocation, mapping checkpoint keys onto the model with
transformers' own conversion table (renamings, and the per-expert -> stacked converters), and
streaming each tensor to its place (``storage.reader``): expert rows into the host stores
(never the device), everything else onto the device. Both expert layouts are read: stacked
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
    """Copy every checkpoint tensor to its place: expert rows into stores (or, for a disk-tier
    store, their byte ranges), the rest to device. See ``storage.reader.fill_from_checkpoint``."""
    from pagedexperts.storage.reader import fill_from_checkpoint

    fill_from_checkpoint(model, sites, stores, device, model_type=model_type, files=files)


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
    if current is not None:
        module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[attr] = tensor
    return True
