"""Checkpoint keys onto the model: the key map, non-expert tensors in place, quantized companions.

Owns: ``KeyMap`` (checkpoint keys onto model keys with transformers' own conversion table:
stacked experts [E, ...] and one tensor per expert alike; a quantized format's expert tensors
onto the store's packed tensors under the format's names), the stored dtypes of the experts'
scales (``stored_expert_dtypes``, ``format_for_checkpoint``), ``load_plain_tensor`` (refuses a
quantized weight it would cast) and the final check that nothing is left on meta.
Does not: read bytes (``loading.fill``), build (``loading.build``) or dequantize non-expert
modules (``loading.linears``).
"""

from __future__ import annotations

import contextlib
import logging
import re

import torch

from pagedexperts.formats import format_for_config
from pagedexperts.formats.base import ExpertFormat
from pagedexperts.formats.base import store_name
from pagedexperts.formats.dense import DenseFormat
from pagedexperts.models.families import experts_transposed
from pagedexperts.models.sites import ExpertsSite

logger = logging.getLogger(__name__)


def _source_re(pattern: str) -> re.Pattern:
    """A conversion table source pattern (``mlp.experts.*.gate_proj.weight``) as a regex that
    captures the expert index and ends the key."""
    return re.compile(re.escape(pattern).replace(r"\*", r"(\d+)") + "$")


@contextlib.contextmanager
def shipped_conversion_table(model_type: str):
    """While transformers itself loads a checkpoint of ``model_type`` for pagedexperts (``check``'s
    reference, ``bench``'s plain model): its conversion table as shipped
    (``shipped_conversion_mapping``), the registered one put back after.
    """
    from transformers import conversion_mapping as cm

    shipped = shipped_conversion_mapping(model_type)
    current = cm.get_checkpoint_conversion_mapping(model_type)
    if shipped is None or repr(shipped) == repr(current):
        yield
        return
    cm.register_checkpoint_conversion_mapping(model_type, shipped, overwrite=True)
    try:
        yield
    finally:
        cm.register_checkpoint_conversion_mapping(model_type, current, overwrite=True)


def shipped_conversion_mapping(model_type: str) -> list | None:
    """transformers' checkpoint conversion table of ``model_type`` as transformers ships it, not as
    another library may have replaced it process-wide (auto-round's loader drops the per-expert ->
    stacked converters); a replaced table is logged at INFO. None shipped: the registered one.
    """
    from transformers import conversion_mapping as cm

    current = cm.get_checkpoint_conversion_mapping(model_type)
    if model_type not in getattr(cm, "USER_REGISTERED_MAPPINGS", ()):
        return current
    build = getattr(cm, "_build_checkpoint_conversion_mapping", None)
    if build is None:  # a transformers without the shipped table's builder: the process's table is all there is
        logger.warning("transformers' checkpoint conversion table for %r was replaced in this process (by another "
                       "library); this transformers gives no access to the table it ships, so the replaced one is "
                       "read", model_type)
        return current
    shipped = build().get(model_type)
    if shipped is None:
        return current
    if repr(shipped) != repr(current):
        logger.info("transformers' checkpoint conversion table for %r was replaced in this process (by another "
                    "library, e.g. auto-round's loader); the paged model maps its checkpoint with the table "
                    "transformers ships", model_type)
    return shipped


def _converters(model_type: str, renames: list | None = None) -> list[tuple[list[str], str]]:
    """The per-expert -> stacked converters of ``model_type`` as (source patterns, target), its
    renamings appended to ``renames``. Raises ValueError: a converter other than MergeModulelist(0)
    [+ Concatenate(1)].
    """
    out = []
    for t in shipped_conversion_mapping(model_type) or []:
        kind = type(t).__name__
        if kind == "WeightRenaming" and renames is not None:
            for src, dst in zip(t.source_patterns, t.target_patterns):
                renames.append((re.compile(src), dst))
        elif kind == "WeightConverter":
            ops = [(type(o).__name__, getattr(o, "dim", None)) for o in t.operations]
            if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
                raise ValueError(f"checkpoint conversion {ops} for {model_type!r} is not supported yet")
            out.append((list(t.source_patterns), t.target_patterns[0]))
            aliased = [_alias(p) for p in t.source_patterns]
            if aliased != list(t.source_patterns):
                out.append((aliased, t.target_patterns[0]))
    return out


# Mixtral's w1 / w3 / w2 as the quantization tools save its linearized experts (GPTQModel 7.7,
# llm-compressor 0.14: ``experts.{j}.gate_proj / up_proj / down_proj``): read as the same rows.
EXPERT_PROJECTION_ALIASES = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def _alias(pattern: str) -> str:
    for old, new in EXPERT_PROJECTION_ALIASES.items():
        pattern = pattern.replace(old, new)
    return pattern


def expert_sources(model_type: str) -> dict[str, int]:
    """Experts-module tensor name -> number of per-expert checkpoint tensors concatenated into
    it (Qwen3's ``gate_up_proj``: 2, gate then up); tensors not listed have one source."""
    return {target.rpartition(".")[2]: len(sources) for sources, target in _converters(model_type)}


class KeyMap:
    """Maps checkpoint keys onto the model: an expert row of a store, or a plain tensor, by
    transformers' conversion table (renamings; MergeModulelist(dim=0) then Concatenate(dim=1)). A
    quantized format's companions (``weight_scale_inv``) follow their weight's converter into
    ``target + suffix``, as ``HfQuantizer.update_weight_conversions`` extends the table.
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


# A routed expert's checkpoint key: per expert (``experts.3.gate_proj.weight_scale``: the
# serialized name last) or stacked (``experts.gate_up_proj_scale``: a dense name + its suffix).
_EXPERT_KEY = re.compile(r"\.experts\.(?:\d+\.[^.]+\.)?([^.]+)$")
_STACKED_TARGETS = ("gate_up_proj", "down_proj")


def is_expert_key(key: str) -> bool:
    """Whether a checkpoint key is a routed expert's tensor (per expert or stacked), by its name."""
    return _EXPERT_KEY.search(key) is not None


def stored_expert_dtypes(files, fmt: ExpertFormat) -> dict[str, "torch.dtype"]:
    """{serialized name (``weight_scale``, ``scales``): dtype} of the routed experts' tensors as stored
    (the first expert key of each name, from the headers only). Raises ValueError: an unreadable or
    truncated shard (``storage.safetensors_index.check_readable``).
    """
    from pagedexperts.storage.safetensors_index import check_readable, read_header

    check_readable(files)  # the first header reads of a load: a truncated shard named before anything else
    names = {n for ns in fmt.serialized_names.values() for n in ns}
    out: dict[str, torch.dtype] = {}
    for file in files:
        for key, entry in read_header(file).items():
            m = _EXPERT_KEY.search(key)
            local = m.group(1) if m else None
            if local in names:
                out.setdefault(local, entry.dtype)
                continue
            for name in names:  # stacked: gate_up_proj + the name's suffix
                if local in {store_name(t, "weight", name) for t in _STACKED_TARGETS} and name != "weight":
                    out.setdefault(name, entry.dtype)
    return out


def format_for_checkpoint(config, files) -> ExpertFormat:
    """``formats.format_for_config`` for the experts as the family stores them, bound to the dtypes
    the checkpoint stores their scales and zero points in (``ExpertFormat.with_stored_dtypes``).

    Raises:
        ValueError: see ``format_for_config``; an unreadable header.
    """
    fmt = format_for_config(config, transposed_experts=experts_transposed(config))
    return fmt.with_stored_dtypes(stored_expert_dtypes(files, fmt))


def check_model_filled(model) -> None:
    """Tie the embeddings when the config says so, then check that no parameter is left on meta.
    Raises ValueError naming a few tensors the checkpoint lacks.
    """
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} model tensors, e.g. {missing[:4]}")


def load_plain_tensor(model, key: str, value: torch.Tensor, device) -> bool:
    """Put a non-expert tensor in its place on the device; False if the model has no such key.

    Raises:
        ValueError: a shape other than the config's; an integer or 8-bit float tensor for a floating
            parameter (a quantized weight whose companions the format does not read).
    """
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
    if ref.is_floating_point() and not (value.is_floating_point() and value.element_size() >= 2):
        raise ValueError(f"checkpoint tensor {key!r} is {value.dtype} for the model's {ref.dtype} parameter: a "
                         "quantized weight stored in a way this checkpoint's format does not read (its module's "
                         "serialized tensors are not the format's); not supported")
    dtype = ref.dtype if value.is_floating_point() else value.dtype
    tensor = value.to(device=device, dtype=dtype)
    if current is not None:  # the attributes from_pretrained gives (requires_grad changes CPU matmul paths)
        module._parameters[attr] = torch.nn.Parameter(tensor.contiguous(), requires_grad=current.requires_grad)
    else:
        module._buffers[attr] = tensor
    return True
