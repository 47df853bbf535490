"""Quantized non-expert nn.Linear modules of a checkpoint: dequantized once at load, or kept packed.

Owns: which non-expert modules a checkpoint stores quantized, in any format (``module_group``),
collecting their tensors as the fill streams them (``PlainLinears``), and for each complete
module either a ``loading.packed_linears.PackedLinear`` in place of the nn.Linear (on a CPU
whenever the experts run packed) or its dense weight (``dequantize_module``: the format's
``ExpertFormat.dequantize_linear``); what that costs (``QuantizedLinears``; ``planned_linears``
from the headers alone, for preflight and the host-memory plan). When and why:
docs/formats.md, "Computed packed on a CPU". Does not: read bytes (``loading.fill``), map
expert keys (``loading.checkpoint``) or choose a kernel (``loading.packed_linears``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedexperts.formats.base import ExpertFormat
from pagedexperts.loading.packed_linears import PackedLinear, kernel_bytes, packed_linear, plan_packed_linear

NOT_LINEAR = "not an nn.Linear (a router or another module whose own forward reads the weight)"


@dataclass(frozen=True)
class QuantizedLinears:
    """The non-expert modules a checkpoint stores quantized, as the load keeps them: ``modules``
    dequantized at load (``packed_bytes`` as stored, ``dense_bytes`` dense in the run dtype),
    ``packed`` computed packed (``kernel_bytes`` in the kernel's layout), and ``fallbacks`` (weight
    key, why it was dequantized though the load keeps modules packed).
    """

    modules: tuple[str, ...] = ()
    packed_bytes: int = 0
    dense_bytes: int = 0
    packed: tuple[str, ...] = ()
    kernel_bytes: int = 0
    fallbacks: tuple[tuple[str, str], ...] = ()

    @property
    def host_bytes(self) -> int:
        """Bytes the quantized modules' weights hold after the load (dense and kernel layout)."""
        return self.dense_bytes + self.kernel_bytes

    def describe(self, fmt_name: str) -> str:
        """One line for the start-up report (empty when nothing is quantized)."""
        parts = []
        if self.packed:
            parts.append(f"{len(self.packed)} quantized non-expert modules ({fmt_name}) computed packed "
                         f"(torch's CPU int4 / int8 kernels): {self.kernel_bytes / 1e6:,.3f} MB")
        if self.modules:
            parts.append(f"{len(self.modules)} quantized non-expert modules ({fmt_name}) dequantized at load: "
                         f"{self.dense_bytes / 1e6:,.3f} MB dense (stored packed: {self.packed_bytes / 1e6:,.3f} MB)")
        return "; ".join(parts)

    def fallback_lines(self) -> list[str]:
        """One line per distinct reason a module was dequantized instead of packed, naming the modules."""
        by_reason: dict[str, list[str]] = {}
        for key, why in self.fallbacks:
            by_reason.setdefault(why, []).append(key.removesuffix(".weight"))
        return [f"packed -> dequantized at load ({why}): {len(names)} modules, {', '.join(names)}"
                for why, names in by_reason.items()]


def module_group(fmt: ExpertFormat | None, raw_module: str, local_names, quantization_config: dict | None):
    """(the module's format, its serialized names) when the checkpoint stores non-expert module
    ``raw_module`` (its checkpoint name) quantized (a serialized name other than ``weight`` under
    it: ``qweight``, ``weight_packed``, ``weight_scale_inv``, ...), else None.

    Raises:
        ValueError: a quantized module missing some of its serialized tensors (names them), or a
            module scheme no format supports (``ExpertFormat.linear_format``).
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


class PlainLinears:
    """Quantized non-expert nn.Linear weights as the fill streams them, generic over ``ExpertFormat``:
    each module's serialized tensors grouped by ``module_group`` and, once all are read, kept packed
    (``packed`` True, where torch's CPU kernels take it; ``install``) or dequantized into its
    parameter's dtype (the run dtype; float32 for modules the model keeps in float32). ``result``:
    the ``QuantizedLinears``.
    """

    def __init__(self, fmt: ExpertFormat | None, plain: list[tuple[str, str]], quantization_config: dict | None,
                 *, packed: bool = False) -> None:
        """``plain``: (model key, checkpoint key) of every non-expert tensor; a module's config
        group is matched on its checkpoint name (Mixtral's ``block_sparse_moe`` before renaming)."""
        by_module: dict[str, dict[str, str]] = {}
        for key, raw_key in plain:
            raw_module, _, local = raw_key.rpartition(".")
            by_module.setdefault(raw_module, {})[local] = key
        self.packed = packed
        self.groups: dict[str, tuple[str, ExpertFormat, tuple[str, ...]]] = {}  # key -> (weight key, format, names)
        for raw_module, keys in by_module.items():
            group = module_group(fmt, raw_module, keys, quantization_config)
            if group is None:
                continue
            weight_key = next(iter(keys.values())).rpartition(".")[0] + ".weight"
            names = group[1] + (("bias",) if packed and "bias" in keys else ())
            for name in names:
                self.groups[keys[name]] = (weight_key, group[0], names)
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.done: list[tuple[str, int, int]] = []  # (weight key, packed bytes, dense bytes)
        self.kept: dict[str, tuple[PackedLinear, int]] = {}  # weight key -> (module, its kernel bytes)
        self.fallbacks: list[tuple[str, str]] = []

    def takes(self, key: str) -> bool:
        return key in self.groups

    def add(self, model, key: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Keep ``value``; when its module is complete, the (model key, tensor) pairs left to
        load: none when it is kept packed, else its dense weight (and its bias)."""
        weight_key, module_fmt, names = self.groups[key]
        parts = self.pending.setdefault(weight_key, {})
        parts[key.rpartition(".")[2]] = value
        if len(parts) < len(names):
            return []
        del self.pending[weight_key]
        bias = parts.pop("bias", None)
        module, ref = linear_of(model, weight_key, module_fmt, parts)
        if self.packed:
            kept = _packed_or_reason(module, ref, module_fmt, parts, bias)
            if isinstance(kept, PackedLinear):
                self.kept[weight_key] = kept, kept.weight_packed.nbytes + kept.scales.nbytes
                return []
            self.fallbacks.append((weight_key, kept))
        dense = dequantize_module(model, weight_key, module_fmt, parts)
        self.done.append((weight_key, sum(v.nbytes for v in parts.values()), dense.nbytes))
        bias_key = weight_key.removesuffix("weight") + "bias"
        return [(weight_key, dense)] + ([(bias_key, bias)] if bias is not None else [])

    def install(self, model) -> None:
        """Put every kept ``PackedLinear`` in place of its nn.Linear (whose weight is still on meta)."""
        for weight_key, (module, _) in self.kept.items():
            model.set_submodule(weight_key.removesuffix(".weight"), module)

    @property
    def result(self) -> QuantizedLinears:
        return QuantizedLinears(tuple(k for k, _, _ in self.done), sum(p for _, p, _ in self.done),
                                sum(d for _, _, d in self.done), tuple(self.kept),
                                sum(b for _, b in self.kept.values()), tuple(self.fallbacks))

    def check_done(self) -> None:
        if self.pending:
            base, parts = next(iter(self.pending.items()))
            names = next(g[2] for g in self.groups.values() if g[0] == base)
            raise ValueError(
                f"quantized checkpoint tensor {base!r} lacks its companions: has {sorted(parts)}, needs {list(names)}"
            )


def _packed_or_reason(module, ref, module_fmt: ExpertFormat, parts, bias) -> PackedLinear | str:
    """``packed_linear`` of an nn.Linear, or why it stays dequantized (names the limit)."""
    if type(module) is not torch.nn.Linear:
        return NOT_LINEAR
    try:
        return packed_linear(module_fmt, tuple(ref.shape), ref.dtype, parts, bias)
    except ValueError as exc:  # e.g. asymmetric int8 whose codes leave the kernel's range
        return str(exc)


def linear_of(model, weight_key: str, module_fmt: ExpertFormat, parts: dict[str, torch.Tensor]):
    """(module, its weight parameter on meta) of quantized module ``weight_key``. Raises ValueError
    (names module and format): no 2-D weight there, or lm_head tied to the embeddings.
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
    return module, ref


def dequantize_module(model, weight_key: str, module_fmt: ExpertFormat, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The dense weight of quantized module ``weight_key``'s parameter (its shape and dtype in
    ``model``) from its serialized tensors ``parts``. Raises ValueError: see ``linear_of``; what the
    format refuses (names module and format).
    """
    _, ref = linear_of(model, weight_key, module_fmt, parts)
    try:
        tensor = module_fmt.linear_tensor(tuple(ref.shape), ref.dtype)
        if tensor.is_passthrough:
            raise ValueError("the format has no packing for a plain weight")
        return module_fmt.dequantize_linear(tensor, parts)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"checkpoint's quantized module {weight_key.removesuffix('.weight')!r} "
                         f"({module_fmt.name}: {sorted(parts)}): {exc}") from exc


def quantized_modules(files, fmt: ExpertFormat, quantization_config: dict | None) -> dict[str, list[str]]:
    """{checkpoint module name: its serialized keys} of every non-expert module the checkpoint stores
    quantized, from the shards' headers only. Raises ValueError: see ``module_group``; an
    unreadable header.
    """
    return {m: list(keys.values()) for m, (_, keys) in _quantized_groups(files, fmt, quantization_config).items()}


def _quantized_groups(files, fmt: ExpertFormat, quantization_config: dict | None) -> dict:
    """{checkpoint module name: (its format, {serialized name: checkpoint key})} (``quantized_modules``)."""
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
            out[module] = group[0], {n: keys[n] for n in group[1]}
    return out


def planned_linears(config: dict, files, fmt: ExpertFormat, dtype: torch.dtype, keep_fp32: tuple[str, ...] = (),
                    *, packed: bool = False):
    """(``QuantizedLinears`` the load will produce at ``dtype``, the checkpoint keys of those modules)
    from the shards' headers and the model's skeleton on meta (no weight read). ``keep_fp32``:
    modules kept in float32; ``packed``: as ``PlainLinears`` does (``plan_packed_linear``).

    Raises:
        ValueError: see ``module_group``; a config transformers cannot build.
    """
    weights = {key: (shape, torch.float32 if any(k in key for k in keep_fp32) else dtype, linear)
               for key, (shape, linear) in _meta_weights(config).items()}
    return _plan(config, files, fmt, weights, packed=packed)


def plan_model_linears(model, files, fmt: ExpertFormat, *, packed: bool) -> QuantizedLinears:
    """``planned_linears`` for ``model``, built with its parameters on meta (their shapes and
    dtypes as the load fills them): the host-memory plan's count of the quantized modules."""
    weights = {n: (tuple(p.shape), p.dtype, type(model.get_submodule(n.rpartition(".")[0])) is torch.nn.Linear)
               for n, p in model.named_parameters() if n.endswith(".weight") and p.dim() == 2}
    return _plan(model.config.to_dict(), files, fmt, weights, packed=packed)[0]


def _plan(config: dict, files, fmt: ExpertFormat, weights: dict, *, packed: bool):
    """``planned_linears`` over {weight key: (shape, dtype, whether its module is an nn.Linear)}."""
    from pagedexperts.formats import quantization_config_of
    from pagedexperts.loading.checkpoint import KeyMap
    from pagedexperts.storage.safetensors_index import read_header

    entries = {key: entry for f in files for key, entry in read_header(f).items()}
    rename = KeyMap(config["model_type"], {}).rename
    done, kept, fallbacks, keys = [], [], [], []
    for module, (module_fmt, names) in _quantized_groups(files, fmt, quantization_config_of(config)).items():
        weight_key = rename(module + ".weight")
        if weight_key not in weights:
            continue
        shape, dtype, linear = weights[weight_key]
        keys += names.values()
        stored = sum(entries[k].nbytes for k in names.values())
        if packed:
            plan = plan_packed_linear(module_fmt, shape, dtype, {n: entries[k].dtype for n, k in names.items()}) \
                if linear else NOT_LINEAR
            if not isinstance(plan, str):
                kept.append((weight_key, kernel_bytes(plan)))
                continue
            fallbacks.append((weight_key, plan))
        done.append((weight_key, stored, math.prod(shape) * dtype.itemsize))
    linears = QuantizedLinears(tuple(k for k, _, _ in done), sum(p for _, p, _ in done), sum(d for _, _, d in done),
                               tuple(k for k, _ in kept), sum(b for _, b in kept), tuple(fallbacks))
    return linears, keys


def _meta_weights(config: dict) -> dict[str, tuple[tuple[int, ...], bool]]:
    """{2-D weight parameter name: (shape, whether its module is an nn.Linear)} of the model
    ``config`` (config.json's dict) describes, built on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))
    return {n: (tuple(p.shape), type(model.get_submodule(n.rpartition(".")[0])) is torch.nn.Linear)
            for n, p in model.named_parameters() if n.endswith(".weight") and p.dim() == 2}
