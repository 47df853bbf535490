"""Which format stores each non-expert nn.Linear of a compressed-tensors checkpoint.

``ct_linear_format``, every compressed-tensors format's ``ExpertFormat.linear_format``: the
registered format recognising the module's own config group (``one_group_config``), or None.
Does not: read tensors or group a module's keys (``loading.checkpoint``).
"""

from __future__ import annotations

from pagedexperts.formats.base import ExpertFormat


def one_group_config(quantization_config: dict, module: str) -> dict | None:
    """``quantization_config`` with the one group compressed-tensors matches to ``module``, retargeted
    to ``Linear``, nothing ignored; None when the module is ignored or no group targets it."""
    from pagedexperts.formats.compressed_tensors.schemes import scheme_of_module

    scheme = scheme_of_module(quantization_config, module)
    if scheme is None:
        return None
    group = {"targets": ["Linear"], "weights": scheme.weights, "input_activations": scheme.input_activations,
             "format": scheme.format}
    return {**quantization_config, "config_groups": {"group_0": group}, "ignore": []}


def ct_linear_format(self: ExpertFormat, module: str, quantization_config: dict | None) -> ExpertFormat | None:
    """The first registered format recognising ``module``'s one-group config, bound; None: unquantized.
    Raises ValueError: no registered format recognises the group, or it refuses its parameters
    (``formats.refusal_message``, naming the module)."""
    from pagedexperts.formats import FORMATS, format_class, refusal_message

    qc = one_group_config(quantization_config or {}, module)
    if qc is None:
        return None
    for name in FORMATS:
        try:
            cls = format_class(name)
        except ValueError:
            continue
        if cls.matches(qc):
            try:
                return cls.from_quantization_config(qc)
            except ValueError as exc:
                raise ValueError(refusal_message(qc, f"module {module}: {exc}")) from exc
    raise ValueError(refusal_message(qc, f"module {module}: its config group is not a supported format"))
