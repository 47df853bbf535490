"""A quantized non-expert nn.Linear kept packed on a CPU, computed by torch's int4 / int8 kernel.

Owns: ``PackedLinear`` (an ``nn.Module`` in place of one ``nn.Linear`` whose forward is
``formats.cpu_pack.packed_matmul`` over the weight converted by the experts' own
``KernelTensor.convert``: docs/formats.md "Computed packed on a CPU"), ``packed_linear`` (the
module, or why the kernel cannot take it) and ``plan_packed_linear`` (the same answer from the
stored dtypes alone, for preflight and the host-memory plan). Exact to the kernel on the same
packed data, within the kernel's rounding of the format's dequantized module. Does not: choose
the modules or read bytes (``loading.linears``).
"""

from __future__ import annotations

from typing import Mapping

import torch

from pagedexperts.formats.base import ExpertFormat
from pagedexperts.formats.base import LINEAR_WEIGHT, store_name
from pagedexperts.formats.cpu_pack import KernelTensor, packed_matmul, plan_tensor


class PackedLinear(torch.nn.Module):
    """y = x @ W^T (+ bias) with W held in torch's CPU kernel layout (``KernelTensor``).

    Buffers: ``weight_packed`` (int4: uint8 [N, K/2]; int8: int8 [N, K]), ``scales`` (int4:
    [K/group_size, N, 2] scale and zero; int8: [N]) in ``dtype``, ``bias`` [N] or None.
    forward: x [..., K] in any float dtype -> [..., N] in x's dtype (computed in ``dtype``).
    """

    def __init__(self, plan: KernelTensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.plan = plan
        self.kind, self.group_size = plan.kind, plan.group_size
        self.in_features, self.out_features, self.dtype = plan.in_features, plan.out_features, plan.dtype
        self.register_buffer("weight_packed", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.to(plan.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"PackedLinear: input has {x.shape[-1]} features, the weight takes {self.in_features}")
        flat = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        y = packed_matmul(self.plan, self.weight_packed, self.scales, flat)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.kind == "int4" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}{group}, dtype={self.dtype}"


def plan_packed_linear(module_fmt: ExpertFormat, shape: tuple[int, int], dtype: torch.dtype,
                       stored_dtypes: Mapping[str, torch.dtype]) -> KernelTensor | str:
    """The ``KernelTensor`` one quantized nn.Linear's weight [out, in] runs as at run dtype
    ``dtype``, or why torch's CPU kernels cannot take it (``packed_linear``'s reasons), from the
    dtypes its serialized tensors are stored in ({name under the module: dtype}); no tensor read."""
    bound = module_fmt.with_stored_dtypes(stored_dtypes)
    tensor = bound.linear_tensor(tuple(shape), dtype)
    if tensor.is_passthrough:
        return f"{bound.name}: the format leaves a {tuple(shape)} weight unquantized"
    return plan_tensor(bound, tensor, dtype)


def kernel_bytes(plan: KernelTensor) -> int:
    """Bytes of one weight in the kernel's layout (``PackedLinear``'s ``weight_packed`` and ``scales``)."""
    return sum(spec.numel * spec.dtype.itemsize for spec in plan.specs)


def packed_linear(module_fmt: ExpertFormat, shape: tuple[int, int], dtype: torch.dtype,
                  serialized: Mapping[str, torch.Tensor], bias: torch.Tensor | None = None) -> PackedLinear | str:
    """The ``PackedLinear`` of one quantized nn.Linear, or one sentence saying why torch's CPU kernels
    cannot take it (``formats.cpu_pack.plan_tensor``'s reasons). ``module_fmt``: the module's
    format; ``shape``: its weight [out, in]; ``dtype``: the run dtype; ``serialized``: {name as
    stored under the module: tensor}.

    Raises:
        ValueError: a packed tensor missing or of the wrong element count (names both); int8 codes
            minus their zero points outside [-128, 127] (``KernelTensor.convert``).
    """
    plan = plan_packed_linear(module_fmt, shape, dtype, {n: v.dtype for n, v in serialized.items()})
    if isinstance(plan, str):
        return plan
    bound, tensor = plan.fmt, plan.tensor
    by_spec = {store_name(LINEAR_WEIGHT, LINEAR_WEIGHT, n): v for n, v in serialized.items()}
    rows = {}
    for spec in tensor.packed:
        value = by_spec.get(spec.name)
        if value is None:
            raise ValueError(f"{bound.name}: packed tensor {spec.name!r} missing (have {sorted(serialized)})")
        if value.numel() != spec.numel:
            raise ValueError(f"{bound.name}: {spec.name!r} has shape {tuple(value.shape)}, the weight {tuple(shape)} "
                             f"needs {spec.shape}")
        rows[spec.name] = value.reshape(spec.shape).unsqueeze(0)
    out = plan.convert(rows)
    return PackedLinear(plan, out[plan.weight_name][0], out[plan.scale_name][0], bias)
