"""Per-module parameters of GPTQ-family checkpoints: GPTQModel's ``dynamic`` and AutoRound's
``extra_config``, resolved for the routed experts and for one non-expert module.

Rules as each tool matches them: GPTQModel 7.7 (``quantization/config.py``
``_resolve_dynamic_override``: the FIRST ``re.match``ing pattern, ``-:`` unquantized); AutoRound
0.16 (``export/export_to_autoround/export.py``: exact name, else a regex; ``bits`` 16 unquantized).
One binding serves every layer and expert, so their projections must agree. Does not: pack.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from pagedexperts.formats.base import ceil_div

OVERRIDABLE = ("bits", "group_size", "sym")
# config.json model_type -> how checkpoints name a routed expert's module and its projections
# per dense experts tensor (Mixtral: block_sparse_moe.experts.{j}.w1/w3/w2, both spellings seen).
EXPERT_NAMES = {
    "mixtral": (("model.layers.{l}.block_sparse_moe.experts.{j}.", "model.layers.{l}.mlp.experts.{j}."),
                {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
}
DEFAULT_EXPERT_NAMES = (("model.layers.{l}.mlp.experts.{j}.",),
                        {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)})


@dataclass(frozen=True)
class IntArgs:
    """One module's integer quantization: bits, group size (-1: one group per row), symmetry."""

    bits: int
    group_size: int
    sym: bool = True

    def groups(self, in_features: int) -> int:
        """G = ceil(I / g); one group when g = -1 or g > I."""
        return 1 if self.group_size == -1 else ceil_div(in_features, self.group_size)

    def group_of(self, in_features: int) -> int:
        """The group size in effect for a row of ``in_features`` (g, or I for one group)."""
        return in_features if self.group_size == -1 else min(self.group_size, in_features)


def dynamic_override(dynamic: dict | None, module: str) -> dict | bool | None:
    """GPTQModel's rule for ``module``: the first matching pattern's overrides, False for a ``-:``
    pattern, None when none matches."""
    for pattern, fields in (dynamic or {}).items():
        negative = pattern.startswith("-:")
        if re.match(pattern[2:] if pattern[:2] in ("-:", "+:") else pattern, module):
            return False if negative else dict(fields or {})
    return None


def extra_config_override(extra_config: dict | None, module: str) -> dict | bool | None:
    """AutoRound's ``extra_config`` entry for ``module`` (exact name, then the first key that
    ``re.fullmatch``es), False when it leaves the module unquantized (bits >= 16), else None."""
    extra = extra_config or {}
    fields = extra.get(module)
    if fields is None:
        fields = next((v for k, v in extra.items() if _fullmatch(k, module)), None)
    if fields is None:
        return None
    return False if int(fields.get("bits", 0) or 0) >= 16 else dict(fields)


def _fullmatch(pattern: str, name: str) -> bool:
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False


def module_args(base: IntArgs, override: dict | bool | None, *, what: str) -> IntArgs | None:
    """``base`` with a module's overrides applied; None for an unquantized module.
    Raises ValueError: an override field this reader does not apply (names it and ``what``)."""
    if override is False:
        return None
    fields = {k: v for k, v in (override or {}).items() if v is not None}
    unknown = sorted(set(fields) - set(OVERRIDABLE) - {"desc_act", "act_bits", "data_type"})
    if unknown:
        raise ValueError(f"{what}: per-module override fields {unknown} are not supported")
    return replace(base, **{k: fields[k] for k in OVERRIDABLE if k in fields})


def expert_args(base: IntArgs, config, resolve, *, what: str) -> dict[str, IntArgs]:
    """Dense experts tensor -> its ``IntArgs`` from ``resolve(module name)`` over every layer's first
    and last expert's projections.
    Raises ValueError: projections of one dense tensor resolve differently, or a routed expert is left
    unquantized (names both modules)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    model_type = get("model_type")
    prefixes, projections = EXPERT_NAMES.get(model_type, DEFAULT_EXPERT_NAMES)
    layers = int(get("num_hidden_layers") or 1)
    experts = int(get("num_local_experts") or get("num_experts") or get("n_routed_experts") or 1)
    out = {}
    for dense, projs in projections.items():
        seen: dict[IntArgs | None, str] = {}
        for layer in range(layers):
            for j in sorted({0, experts - 1}):
                for proj in projs:
                    names = [prefix.format(l=layer, j=j) + proj for prefix in prefixes]
                    rule = next((r for r in map(resolve, names) if r is not None), None)  # a rule for either spelling
                    seen.setdefault(module_args(base, rule, what=what), names[0])
        if None in seen:
            raise ValueError(f"{what}: routed expert module {seen[None]} is left unquantized by a per-module rule; "
                             "experts must all be quantized")
        if len(seen) > 1:
            (a, na), (b, nb) = list(seen.items())[:2]
            raise ValueError(f"{what}: per-module rules give {na} {a} but {nb} {b}; one binding per experts tensor "
                             f"({dense}) across layers is supported")
        out[dense] = next(iter(seen))
    return out
