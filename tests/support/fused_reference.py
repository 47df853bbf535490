"""The fused kernels' test oracle: the format's own dequantization, then the model's dense
experts math; and the whole fused step as the tests run it.

``dense_rows`` (packed rows -> dense rows through ``ExpertFormat.dequantize``, i.e.
``formats.unpack``: the oracle the kernels' in-register dequantization must equal bit for bit),
``fused_experts_reference`` (per entry: gate-up linear (+ bias), the module's activation, down
linear (+ bias), optional post-expert norm, routing weight, sum over k) in the dense weights'
dtype as transformers' ``grouped_mm`` experts compute it, and ``fused_experts``: the launches a
paged step runs (``paging.steps.fused.FusedLaunches``: ``of``, then ``entries``, what a wave of
``FusedStep`` computes) then ``combine`` (the weights and the sum over k, as ``grouped_mm`` ends;
a paged step combines in its body, ``paging.steps.fused.FusedStep.combine``, instead).

What is exact to what. The fused kernels' dequantized weights equal ``dense_rows`` bit for bit
(every format). Their step output differs from this reference only by the GEMMs' summation
order and roundings: the kernel accumulates each output in float32 and rounds once (bias added
before the rounding), the reference rounds the matmul to the weights' dtype and then adds the
bias. ``TOLERANCE`` bounds max |fused - reference| / max |reference| per dense dtype of the
weights (the GEMMs' dtype); measured on the tests' cases (tiny shapes, in_features <= 64):
float32 3e-7, float16 4e-5, bfloat16 8.5e-3 (gpt-oss's clamped SwiGLU amplifies one bfloat16
rounding of the gate-up output); each bound is about 2x (bfloat16) to 30x (float32) that.

Legend: T tokens, H hidden, k top_k, S = T k entries, R rows, N / I output / input features.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from pagedexperts.formats.base import ExpertFormat, QuantizedTensor

# max |fused - reference| <= TOLERANCE[dtype] * max |reference|, dtype the weights' dense dtype
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def dense_rows(fmt: ExpertFormat, tensor: QuantizedTensor, tables: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The dense rows [R, *tensor.dense.shape] of the packed tables {packed name: [R, ...]}, by
    the format's own ``dequantize`` (the table itself for a passthrough tensor)."""
    if tensor.is_passthrough:
        return tables[tensor.dense.name]
    return fmt.dequantize(tensor, {p.name: tables[p.name] for p in tensor.packed})


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """Per entry ``x[s] @ W[s]^T`` ([S, N, I] weights; [S, I, N] when ``transposed``) + bias[s],
    in the weights' dtype."""
    w = weight if transposed else weight.transpose(-1, -2)
    out = torch.bmm(x.to(weight.dtype).unsqueeze(1), w).squeeze(1)
    return out if bias is None else out + bias


def fused_experts_reference(hidden: torch.Tensor, row_ids: torch.Tensor, routing_weights: torch.Tensor,
                            gate_up: torch.Tensor, down: torch.Tensor, *,
                            activation: Callable[[torch.Tensor], torch.Tensor],
                            gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                            transposed: bool = False,
                            post_expert: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """[T, H] in hidden's dtype from dense rows: gate_up [R, 2I, H] and down [R, H, I] (gpt-oss:
    [R, H, 2I] and [R, I, H], ``transposed``), biases [R, 2I] / [R, H]; row_ids [T, k] (-1: the
    entry adds nothing), routing_weights [T, k]."""
    num_tokens, top_k = row_ids.shape
    rows = row_ids.clamp(min=0).reshape(-1)
    x = hidden.repeat_interleave(top_k, dim=0)  # entry s = t * k + j
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    up = _linear(x, gate_up[rows], pick(gate_up_bias), transposed)
    out = _linear(activation(up), down[rows], pick(down_bias), transposed)
    if post_expert is not None:
        out = post_expert(out)
    weighted = out.view(num_tokens, top_k, -1) * routing_weights.unsqueeze(-1)
    weighted = torch.where((row_ids >= 0).unsqueeze(-1), weighted, torch.zeros((), dtype=weighted.dtype))
    return weighted.sum(dim=1).to(hidden.dtype)


def combine(entry_out: torch.Tensor, row_ids: torch.Tensor, routing_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in ``dtype``: sum over k of entry outputs [S, H] times their routing weights, as
    transformers' ``grouped_mm`` ends (``(out * w).view(T, k, H).sum(1)``); entries whose row id
    is negative add nothing."""
    num_tokens, top_k = row_ids.shape
    weighted = entry_out.view(num_tokens, top_k, -1) * routing_weights.unsqueeze(-1)
    weighted = weighted.masked_fill((row_ids < 0).unsqueeze(-1), 0)
    return weighted.sum(dim=1).to(dtype)


def fused_experts(hidden: torch.Tensor, row_ids: torch.Tensor, routing_weights: torch.Tensor, gate_up, down, *,
                  activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The routed experts of one step through the fused kernels as the paged step launches them
    -> [T, H] in hidden's dtype: ``FusedLaunches.of`` the ``ProjectionRows`` gate_up and down for
    this step's shape, its ``entries`` (hidden cast to the GEMMs' dtype, as ``FusedStep.begin``
    does), then ``combine``."""
    from pagedexperts.paging.steps.fused import FusedLaunches

    launches = FusedLaunches.of(gate_up, down, num_entries=row_ids.numel(), top_k=row_ids.shape[1])
    out = launches.entries(hidden.to(launches.gate_up.dense_dtype), row_ids, activation)
    return combine(out, row_ids, routing_weights, hidden.dtype)
