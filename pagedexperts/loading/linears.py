"""Quantized non-expert nn.Linear modules of a checkpoint, dequantized once at load.

Owns: recognising which non-expert modules (attention projections, shared experts, dense MLP
layers, lm_head, a router) a checkpoint stores quantized, in any format (``module_group``:
grouped by the module's format's serialized names, ``qweight`` + ``qzeros`` + ``scales`` +
``g_idx``, ``weight_packed`` + ``weight_scale`` + ..., ``weight`` + ``weight_scale_inv``),
collecting their tensors as the fill streams them (``PlainDequantizer``), dequantizing each
into its parameter's dtype (``dequantize_module``: ``ExpertFormat.dequantize_linear``, the
experts' own dequantization with one row of one source, so a new format gets it for free), and
counting what that costs (``DequantizedLinears``; ``planned_linears`` from the headers alone,
for ``preflight``). Does not: read bytes (``loading.fill``) or map expert keys
(``loading.checkpoint``).

Why dequantize at load: on CPU (and as the CUDA fallback, with a WARNING naming the memory) the
model's nn.Linear runs on the dense weight the format's library produces (compressed-tensors'
``decompress``, GPTQModel's ``dequantize_weight``, transformers' FP8 dequantization), bit for bit,
and activations stay unquantized, as in the library's dense reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedexperts.formats.base import ExpertFormat


@dataclass(frozen=True)
class DequantizedLinears:
    """The non-expert modules a checkpoint stores quantized, dequantized once at load: their
    weight keys, the bytes the checkpoint stores for them and the bytes of their dense weights
    on the device (run dtype)."""

    modules: tuple[str, ...] = ()
    packed_bytes: int = 0
    dense_bytes: int = 0

    def describe(self, fmt_name: str) -> str:
        """One line for the start-up report (empty when nothing was dequantized)."""
        if not self.modules:
            return ""
        return (f"{len(self.modules)} quantized non-expert modules ({fmt_name}) dequantized at load: "
                f"{self.dense_bytes / 1e6:,.3f} MB dense (stored packed: {self.packed_bytes / 1e6:,.3f} MB)")


def module_group(fmt: ExpertFormat | None, raw_module: str, local_names, quantization_config: dict | None):
    """(the module's format, its serialized names) when the checkpoint stores non-expert module
    ``raw_module`` (its checkpoint name) quantized, else None (stored as a plain ``weight``).

    Quantized: ``fmt.linear_format`` gives the module a format and ``local_names`` (the keys under
    the module) hold one of its serialized names other than ``weight`` itself (GPTQ's
    ``qweight``, compressed-tensors' ``weight_packed`` / ``weight_scale``, block FP8's
    ``weight_scale_inv``).

    Raises:
        ValueError: a quantized module missing some of its serialized tensors (names them), or
            a module scheme no format supports (``ExpertFormat.linear_format``).
    """
    local = set(local_names)
    if fmt is None or local <= {"weight", "bias"}:
        return None
    module_fmt = fmt.linear_format(raw_module, quantization_config)
    names = tuple(module_fmt.serialized_names.get("weight", ())) if module_fmt is not None else ()
    if not set(names) & (local - {"weight"}):
        return None
    missing = [n for n in names if n not in local]
    if missing:
        raise ValueError(f"quantized checkpoint module {raw_module!r} ({module_fmt.name}): has {sorted(local)}, "
                         f"lacks {missing}")
    return module_fmt, names


class PlainDequantizer:
    """Quantized non-expert nn.Linear weights (attention projections, shared experts, dense MLP
    layers, lm_head, a router) dequantized once at load, generic over ``ExpertFormat``.

    Groups each module's serialized tensors by its format's names (``module_group``:
    ``q_proj.qweight`` + ``qzeros`` + ``scales`` + ``g_idx``; ``q_proj.weight_packed`` +
    ``weight_scale`` + ...; ``q_proj.weight`` + ``weight_scale_inv``), keeps them as they stream
    by, and once a module's are all read dequantizes them (``ExpertFormat.dequantize_linear``:
    the experts' ``dequantize`` with one row of one source, in the dtypes the tensors are stored
    in) into its parameter's dtype: the run dtype, float32 for the modules the model keeps in
    float32. ``dequantized`` counts what was done (``DequantizedLinears``).
    """

    def __init__(self, fmt: ExpertFormat | None, plain: list[tuple[str, str]], quantization_config: dict | None) -> None:
        """``plain``: (model key, checkpoint key) of every non-expert tensor; a module's config
        group is matched on its checkpoint name (Mixtral's ``block_sparse_moe`` before renaming)."""
        by_module: dict[str, dict[str, str]] = {}
        for key, raw_key in plain:
            raw_module, _, local = raw_key.rpartition(".")
            by_module.setdefault(raw_module, {})[local] = key
        self.groups: dict[str, tuple[str, ExpertFormat, tuple[str, ...]]] = {}  # key -> (weight key, format, names)
        for raw_module, keys in by_module.items():
            group = module_group(fmt, raw_module, keys, quantization_config)
            if group is None:
                continue
            weight_key = next(iter(keys.values())).rpartition(".")[0] + ".weight"
            for name in group[1]:
                self.groups[keys[name]] = (weight_key, *group)
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.done: list[tuple[str, int, int]] = []  # (weight key, packed bytes, dense bytes)

    def takes(self, key: str) -> bool:
        return key in self.groups

    def add(self, model, key: str, value: torch.Tensor) -> tuple[str | None, torch.Tensor | None]:
        """Keep ``value``; when its module is complete return (weight key, dense weight)."""
        weight_key, module_fmt, names = self.groups[key]
        parts = self.pending.setdefault(weight_key, {})
        parts[key.rpartition(".")[2]] = value
        if len(parts) < len(names):
            return None, None
        del self.pending[weight_key]
        dense = dequantize_module(model, weight_key, module_fmt, parts)
        self.done.append((weight_key, sum(v.nbytes for v in parts.values()), dense.nbytes))
        return weight_key, dense

    @property
    def dequantized(self) -> DequantizedLinears:
        return DequantizedLinears(tuple(k for k, _, _ in self.done), sum(p for _, p, _ in self.done),
                                  sum(d for _, _, d in self.done))

    def check_done(self) -> None:
        if self.pending:
            base, parts = next(iter(self.pending.items()))
            names = next(g[2] for g in self.groups.values() if g[0] == base)
            raise ValueError(
                f"quantized checkpoint tensor {base!r} lacks its companions: has {sorted(parts)}, needs {list(names)}"
            )


def dequantize_module(model, weight_key: str, module_fmt: ExpertFormat, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The dense weight of quantized module ``weight_key``'s parameter (its shape and dtype in
    ``model``) from its serialized tensors ``parts`` ({name: tensor as stored}).

    Raises:
        ValueError: the model has no 2-D weight there (an embedding, a missing module), lm_head
            tied to the embeddings, or what the format refuses (names module and format).
    """
    module_name, _, param = weight_key.rpartition(".")
    what = f"checkpoint's quantized module {module_name!r} ({module_fmt.name}: {sorted(parts)})"
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise ValueError(f"{what} is not a module of the model") from None
    ref = module._parameters.get(param)
    if ref is None or ref.dim() != 2 or isinstance(module, torch.nn.Embedding):
        raise ValueError(f"{what}: the model has no nn.Linear weight there; only Linear weights are dequantized")
    if module is model.get_output_embeddings() and getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(f"{what}: the config ties lm_head to the input embeddings (tie_word_embeddings), which "
                         "are not quantized; a quantized tied lm_head is not supported")
    try:
        tensor = module_fmt.linear_tensor(tuple(ref.shape), ref.dtype)
        if tensor.is_passthrough:
            raise ValueError("the format has no packing for a plain weight")
        return module_fmt.dequantize_linear(tensor, parts)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"{what}: {exc}") from exc


def quantized_modules(files, fmt: ExpertFormat, quantization_config: dict | None) -> dict[str, list[str]]:
    """{checkpoint module name: its serialized keys} of every non-expert module the checkpoint
    stores quantized (``module_group``), from the shards' headers only.

    Raises:
        ValueError: see ``module_group``; an unreadable header.
    """
    from pagedexperts.loading.checkpoint import is_expert_key
    from pagedexperts.storage.safetensors_index import read_header

    by_module: dict[str, dict[str, str]] = {}
    for f in files:
        for key in read_header(f):
            if not is_expert_key(key):
                module, _, local = key.rpartition(".")
                by_module.setdefault(module, {})[local] = key
    out = {}
    for module, keys in by_module.items():
        group = module_group(fmt, module, keys, quantization_config)
        if group is not None:
            out[module] = [keys[n] for n in group[1]]
    return out


def planned_linears(config: dict, files, fmt: ExpertFormat, dtype: torch.dtype, keep_fp32: tuple[str, ...] = ()):
    """(``DequantizedLinears`` the load will produce at ``dtype``, the checkpoint keys of those
    modules), from the shards' headers and the model's skeleton on the meta device (no weight is
    read): ``preflight``'s count of the dequantized non-expert memory. ``keep_fp32``: module
    names the model keeps in float32 (dequantized into float32 there).

    Raises:
        ValueError: see ``module_group``; a config transformers cannot build.
    """
    from pagedexperts.formats import quantization_config_of
    from pagedexperts.loading.checkpoint import KeyMap
    from pagedexperts.storage.safetensors_index import read_header

    nbytes = {key: entry.nbytes for f in files for key, entry in read_header(f).items()}
    rename, shapes = KeyMap(config["model_type"], {}).rename, _meta_weight_shapes(config)
    done, keys = [], []
    for module, group_keys in quantized_modules(files, fmt, quantization_config_of(config)).items():
        weight_key = rename(module + ".weight")
        if weight_key not in shapes:
            continue
        itemsize = 4 if any(k in weight_key for k in keep_fp32) else torch.empty((), dtype=dtype).element_size()
        keys += group_keys
        done.append((weight_key, sum(nbytes[k] for k in group_keys), math.prod(shapes[weight_key]) * itemsize))
    linears = DequantizedLinears(tuple(k for k, _, _ in done), sum(p for _, p, _ in done), sum(d for _, _, d in done))
    return linears, keys


def _meta_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """{parameter name: shape} of the model ``config`` (config.json's dict) describes, built on
    the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}
