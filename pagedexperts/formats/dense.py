"""The trivial format: an unquantized (bf16 / fp16 / fp32) checkpoint.

Every dense expert tensor stands for itself; dequantize is the identity. Owns nothing else.
"""

from __future__ import annotations

from typing import Mapping

import torch

from pagedexperts.formats.base import ExpertFormat, QuantizedTensor, TensorSpec
from pagedexperts.formats.packing import WeightPacking, dense_packing


class DenseFormat(ExpertFormat):
    """No quantization: the store and slots hold the model's own expert tensors."""

    name = "dense"
    transposed_experts = None
    serialized_names: dict = {}

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        return not quantization_config

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        return (dense,)

    def dequantize(self, tensor: QuantizedTensor, packed: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return packed[tensor.dense.name]

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """The dense weight itself, [N, K] (or [K, N] when ``transposed``)."""
        return dense_packing(tensor, transposed=transposed)
