"""compressed-tensors config groups, resolved per routed-expert projection.

Owns which config group quantizes each dense experts tensor (gate_proj + up_proj or Mixtral's
w1 + w3; down_proj or w2), matched as compressed-tensors 0.20 does (``utils/match.py``); every
expert module a target names must resolve to one scheme. Also a checkpoint's spelling in
messages and the experts' input dims. Does not: dequantize, read files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Dense experts-module tensor -> the checkpoint projections concatenated into it, per family
# naming (Qwen3-MoE / DeepSeek-V3: gate, up, down; Mixtral: w1 gate, w3 up, w2 down).
DENSE_SOURCES: dict[str, tuple[tuple[str, ...], ...]] = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
}
EXPERT_MODULE = "model.layers.0.mlp.experts.0.{}"


@dataclass(frozen=True)
class ExpertScheme:
    """The config group of one dense experts tensor: weights args, input_activations (or None), ``format``."""

    weights: dict
    input_activations: dict | None
    format: str | None


CLASS_TARGETS = ("Linear",)  # class names an nn.Linear matches (compressed-tensors ``_match_class``)


def _matches(target: str, name: str) -> bool:
    """compressed-tensors' ``is_match`` for an nn.Linear ``name``: ``re:`` regex, exact name, or ``Linear``."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target in CLASS_TARGETS


def _ignored(name: str, ignore: list[str]) -> bool:
    return any(_matches(t, name) for t in ignore)


def named_expert_modules(quantization_config: dict, projection: str) -> list[str]:
    """Expert modules ending in ``projection`` that targets or ``ignore`` name exactly (per layer the
    lowest and highest expert)."""
    names = {t for g in (quantization_config.get("config_groups") or {}).values() for t in g.get("targets", [])}
    names |= set(quantization_config.get("ignore") or [])
    by_layer: dict[str, dict[int, str]] = {}
    for t in names:
        m = re.match(r"(.*)\.experts\.(\d+)\." + re.escape(projection) + "$", t)
        if m and not t.startswith("re:"):
            by_layer.setdefault(m.group(1), {})[int(m.group(2))] = t
    return sorted({e[j] for e in by_layer.values() for j in (min(e), max(e))})


def group_for(quantization_config: dict, projection: str, *, module: str = EXPERT_MODULE) -> ExpertScheme | None:
    """The scheme of ``projection`` of a routed expert (``module``: another name pattern; None: unquantized)."""
    return scheme_of_module(quantization_config, module.format(projection))


def scheme_of_module(quantization_config: dict, name: str) -> ExpertScheme | None:
    """The scheme compressed-tensors gives module ``name`` (None: ignored or unquantized)."""
    key = group_of_module(quantization_config, name)
    if key is None:
        return None
    group = quantization_config["config_groups"][key]
    return ExpertScheme(dict(group.get("weights") or {}), group.get("input_activations"),
                        group.get("format") or quantization_config.get("format"))


def group_of_module(quantization_config: dict, name: str) -> str | None:
    """The key of the config group compressed-tensors 0.20 applies to module ``name``, or None:
    the most specific matching target wins (exact name, then ``re:``, then ``Linear``;
    alphabetical within a kind; a target in two groups: the later group), whatever the groups' order."""
    target = _winning_target(quantization_config, name)
    if target is None:
        return None
    return next(key for key, group in reversed(list((quantization_config.get("config_groups") or {}).items()))
                if target in group.get("targets", []))


def _winning_target(quantization_config: dict, name: str) -> str | None:
    """The target that decides module ``name``'s group, or None."""
    if _ignored(name, quantization_config.get("ignore") or []):
        return None
    targets = sorted({t for g in (quantization_config.get("config_groups") or {}).values() for t in g.get("targets", [])},
                     key=lambda t: ("re:" in t, t))
    ranked = [t for t in targets if t == name or (t.startswith("re:") and re.match(t[3:], name))]
    ranked += [t for t in targets if t == "Linear" and t not in ranked]
    return ranked[0] if ranked else None


def _projection_scheme(resolve, quantization_config: dict, projection: str, dense: str) -> ExpertScheme | None:
    """The one scheme of ``projection`` over layer 0's expert 0 and every expert module a target names.
    Raises ValueError: two of those modules resolve to different schemes (names both)."""
    named = named_expert_modules(quantization_config, projection)
    probe = EXPERT_MODULE.format(projection)
    base = resolve(probe)
    modules = ([probe] if base is not None or not named else []) + named
    schemes = {module: resolve(module) for module in modules}
    first_module, first = next(iter(schemes.items()))
    for module, scheme in schemes.items():
        if scheme != first:
            raise ValueError(
                f"compressed-tensors experts: {module} has scheme {scheme.weights if scheme else None} but {first_module} "
                f"{first.weights if first else None}; one scheme per experts tensor ({dense}) across layers and experts "
                "is supported")
    return first


def dense_schemes(quantization_config: dict) -> dict[str, ExpertScheme]:
    """Dense experts tensor -> its scheme, for the naming (gate/up/down or w1/w3/w2) the config names
    most specifically (a tie reads gate/up/down).
    Raises ValueError: gate and up have different schemes, or only some projections are quantized."""
    def specific(family: int) -> int:
        return sum(_winning_target(quantization_config, EXPERT_MODULE.format(p)) not in (None, "Linear")
                   for names in DENSE_SOURCES.values() for p in names[family])

    resolve = lambda name: scheme_of_module(quantization_config, name)  # noqa: E731
    for family in sorted(range(2), key=lambda f: -specific(f)):
        out: dict[str, ExpertScheme | None] = {}
        for dense, names in DENSE_SOURCES.items():
            schemes = [_projection_scheme(resolve, quantization_config, p, dense) for p in names[family]]
            if any(s != schemes[0] for s in schemes):
                raise ValueError(
                    f"compressed-tensors experts: {' and '.join(names[family])} (merged into {dense}) have different "
                    f"schemes {[s.weights if s else None for s in schemes]}; only one scheme per merged tensor is supported"
                )
            out[dense] = schemes[0]
        if any(s is not None for s in out.values()):
            missing = [d for d, s in out.items() if s is None]
            if missing:
                raise ValueError(f"compressed-tensors experts: {missing} not quantized while others are: not supported")
            return out  # type: ignore[return-value]
    return {}


def resolved_schemes(quantization_config: dict | None) -> dict[str, ExpertScheme]:
    """``dense_schemes`` of a compressed-tensors config, or {} (another quant_method, or refused)."""
    if not quantization_config or quantization_config.get("quant_method") != "compressed-tensors":
        return {}
    try:
        return dense_schemes(quantization_config)
    except ValueError:
        return {}


def quantized_non_expert(quantization_config: dict, module_names: list[str] | None = None) -> str | None:
    """The first non-expert nn.Linear a config group quantizes (``module_names``: the model's own), or None."""
    if module_names is None:
        module_names = [t.format(p) for t in ("model.layers.0.self_attn.{}", "model.layers.0.mlp.shared_experts.{}",
                                              "model.layers.0.mlp.{}") for p in ("q_proj", "o_proj", "gate_proj", "down_proj")]
    for name in module_names:
        if name != "lm_head" and scheme_of_module(quantization_config, name) is not None:
            return name
    return None


def non_expert_linear_names(config) -> list[str] | None:
    """The model's nn.Linear names, routed experts excluded, from its meta-device skeleton (None: no model_type).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config) if isinstance(config, dict) else config.to_dict()
    model_type = fields.pop("model_type", None)
    if not model_type:
        return None
    fields.pop("quantization_config", None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".experts." not in n]


def dense_source_count(dense: str) -> int:
    """Checkpoint projections concatenated into a dense experts tensor (gate_up_proj: 2)."""
    return len(DENSE_SOURCES[dense][0]) if dense in DENSE_SOURCES else 1


def expert_in_features(config) -> dict[str, int]:
    """Dense experts tensor -> input features (hidden size; ``moe_intermediate_size`` else ``intermediate_size``).
    """
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    dims = {"gate_up_proj": get("hidden_size"), "down_proj": get("moe_intermediate_size") or get("intermediate_size")}
    return {name: int(v) for name, v in dims.items() if v}


def spelling(quantization_config: dict | None) -> str:
    """The format as the checkpoint spells it: quant_method, format, the experts' weights args."""
    if not quantization_config:
        return "unquantized"
    qc = quantization_config
    parts = [f"quant_method {qc.get('quant_method')!r}"]
    for key in ("format", "fmt", "quant_algo", "weight_block_size", "bits"):
        if qc.get(key) is not None:
            parts.append(f"{key} {qc[key]!r}")
    if qc.get("quant_method") == "compressed-tensors":
        schemes = _schemes_or_first(qc)
        if len(set(map(repr, schemes.values()))) == 1:
            schemes = {"experts": next(iter(schemes.values()))}
        for dense, scheme in schemes.items():
            parts.append(f"{dense}: {_describe(scheme, qc.get('format'))}")
    return ", ".join(parts)


def _describe(scheme: ExpertScheme, top_format: str | None) -> str:
    w = scheme.weights
    desc = " ".join(f"{k}={w[k]!r}" for k in ("num_bits", "type", "strategy", "group_size", "block_structure",
                                               "actorder", "symmetric") if w.get(k) is not None)
    fmt = f"format {scheme.format!r} " if scheme.format != top_format else ""
    act = scheme.input_activations
    acts = (f", input_activations {act.get('type')}{act.get('num_bits')} {act.get('strategy')} "
            f"{'dynamic' if act.get('dynamic') else 'static'}") if act else ""
    return f"{fmt}weights {desc}{acts}"


def _schemes_or_first(qc: dict) -> dict[str, ExpertScheme]:
    try:
        schemes = dense_schemes(qc)
    except ValueError:
        schemes = {}
    if schemes:
        return schemes
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        return {}
    g = groups[0]
    return {"experts": ExpertScheme(dict(g.get("weights") or {}), g.get("input_activations"),
                                    g.get("format") or qc.get("format"))}
