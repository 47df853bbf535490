"""Which format stores each non-expert nn.Linear of a compressed-tensors checkpoint.

Owns: ``one_group_config`` (a checkpoint's quantization_config cut down to the config group of
one module) and ``ct_linear_format``, what every compressed-tensors format's
``ExpertFormat.linear_format`` is: a module name -> the registered format bound to its group,
for one plain weight (``ExpertFormat.linear_tensor``), or None when the config leaves it
unquantized. Does not: read tensors, dequantize (``ExpertFormat.dequantize_linear``) or group a
module's keys (``loading.checkpoint``).

compressed-tensors quantizes per module by config group (``schemes.scheme_of_module``:
``ignore`` first, then ``re:`` targets matched on the module name, class-name targets such as
``Linear`` on every nn.Linear), so an attention projection may sit in another group, even
another format, than the routed experts (FP8 attention beside NVFP4 experts; a per-projection
group size). The module's group alone, targeting ``Linear``, is a one-group config that the
registered formats recognise as they recognise a checkpoint (``FORMATS`` order).
"""

from __future__ import annotations

from pagedexperts.formats.base import ExpertFormat


def one_group_config(quantization_config: dict, module: str) -> dict | None:
    """``quantization_config`` with one config group: the one compressed-tensors matches to
    ``module`` (a checkpoint name such as ``model.layers.0.self_attn.q_proj``), retargeted to
    ``Linear`` and nothing ignored; None when the module is ignored or no group targets it."""
    from pagedexperts.formats.compressed_tensors.schemes import scheme_of_module

    scheme = scheme_of_module(quantization_config, module)
    if scheme is None:
        return None
    group = {"targets": ["Linear"], "weights": scheme.weights, "input_activations": scheme.input_activations,
             "format": scheme.format}
    return {**quantization_config, "config_groups": {"group_0": group}, "ignore": []}


def ct_linear_format(self: ExpertFormat, module: str, quantization_config: dict | None) -> ExpertFormat | None:
    """``ExpertFormat.linear_format`` of the compressed-tensors formats: the first registered
    format recognising ``module``'s group (``one_group_config``), bound by
    ``from_quantization_config``; None: the module is stored unquantized.

    Raises:
        ValueError: no registered format recognises the group, or it refuses its parameters
            (``formats.refusal_message``, naming the module).
    """
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
