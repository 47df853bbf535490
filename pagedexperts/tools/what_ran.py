"""What a paged model actually computes with, read from its runtime: the labels ``check`` prints.

Owns: ``KernelsRan`` (the resolved experts implementation, the MoE layers that run it and those
that fell back to grouped_mm with why; the quantized non-expert linears packed and dequantized)
and its labels: what ran, never what was asked. Does not: compare models or decide a fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GROUPED_MM = "grouped_mm"  # what a packed layer falls back to (``loading.runners``)


@dataclass(frozen=True)
class KernelsRan:
    """The kernels one paged model runs: the resolved ``implementation``, how many ``moe_layers``, the
    ``fallbacks`` (MoE layer -> why it runs grouped_mm), how many quantized non-expert linears are
    packed / dequantized, and ``linear_reasons`` (why a module was not packed, once each).
    """

    implementation: str
    moe_layers: int
    fallbacks: dict[int, str] = field(default_factory=dict)
    linears_packed: int = 0
    linears_dequantized: int = 0
    linear_reasons: tuple[str, ...] = ()

    @property
    def layers_run(self) -> int:
        """MoE layers that run ``implementation`` itself."""
        return self.moe_layers - len(self.fallbacks)

    @property
    def ran_at_all(self) -> bool:
        """Whether ``implementation`` computed anything: a MoE layer, or a packed non-expert linear."""
        return self.layers_run > 0 or self.linears_packed > 0

    @property
    def kernel(self) -> str:
        """The one name of what ran: ``implementation``, or grouped_mm where it ran nowhere."""
        return self.implementation if self.ran_at_all else GROUPED_MM

    def experts_label(self) -> str:
        """The MoE layers: "packed on 6 of 6 MoE layers", or with the layers that fell back and why."""
        line = f"{self.implementation} on {self.layers_run} of {self.moe_layers} MoE layers"
        if self.fallbacks:
            reasons = "; ".join(dict.fromkeys(self.fallbacks[i] for i in sorted(self.fallbacks)))
            line += f", {GROUPED_MM} on layers {sorted(self.fallbacks)} ({reasons})"
        return line

    def linears_label(self) -> str:
        """The quantized non-expert linears ("" when the checkpoint has none)."""
        if not self.linears_packed and not self.linears_dequantized:
            return ""
        line = f"quantized non-expert linears: {self.linears_packed} packed, {self.linears_dequantized} dequantized"
        return line + "".join(f" ({why})" for why in self.linear_reasons)

    def label(self) -> str:
        """Everything that ran, one line: the MoE layers, then the non-expert linears."""
        return "; ".join(part for part in (self.experts_label(), self.linears_label()) if part)


def kernels_ran(model) -> KernelsRan:
    """``KernelsRan`` of a model loaded by ``loading.loader.load_model`` (its ``PagingRuntime``)."""
    rt = model.pagedexperts
    linears = rt.quantized_linears
    packed = len(linears.packed) if linears is not None else 0
    dequantized = len(linears.modules) if linears is not None else 0
    reasons = tuple(dict.fromkeys(why for _, why in linears.fallbacks)) if linears is not None else ()
    return KernelsRan(rt.resolved.experts_implementation, len(rt.runners), dict(rt.resolved.experts_fallbacks), packed,
                      dequantized, reasons)
