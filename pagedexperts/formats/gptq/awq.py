"""AWQ int4 experts (AutoAWQ GEMM checkpoints, ``quant_method: awq``; not the GEMV packing).

Layout and dequantization as AutoAWQ's ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM`` and
``awq/utils/packing_utils.py`` ``dequantize_gemm`` (stored zero points, also ``zero_point: false``'s
8s): formats/README.md "Packings". Does not: read files, store, page, or quantize.

Legend: n experts, O output features, I input features, G groups.
"""

from __future__ import annotations

import torch

from pagedexperts.formats.base import QuantizedTensor, TensorSpec
from pagedexperts.formats.packing import WeightPacking, int_packing
from pagedexperts.formats.unpack import PackedFormat

PACK_FACTOR = 8  # int4 values per int32 word
SCALE_DTYPE = torch.float16  # AWQ checkpoints store float16 scales
GEMM_VERSIONS = ("gemm", "exllama", "ipex")  # versions whose checkpoints use the GEMM packing


class AwqFormat(PackedFormat):
    """AWQ int4 GEMM-packed experts (stored zero points), any group size dividing I."""

    name = "awq"
    serialized_names = {"weight": ("qweight", "qzeros", "scales")}

    def __init__(self, *, group_size: int, scale_dtype: torch.dtype = SCALE_DTYPE) -> None:
        self.group_size = group_size
        self.scale_dtype = scale_dtype  # the checkpoint's (``with_stored_dtypes``): dequantize computes in it

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        return bool(quantization_config) and quantization_config.get("quant_method") == "awq"

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None) -> "AwqFormat":
        """Bind the group size (``group_size`` or AutoAWQ's ``q_group_size``).
        Raises ValueError: bits other than 4, a version other than gemm, or a group size that is not a
        positive int."""
        qc = quantization_config or {}
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(f"awq checkpoint with bits={bits!r}: only 4 is supported")
        version = str(qc.get("version", "gemm")).lower()
        if version not in GEMM_VERSIONS:
            raise ValueError(f"awq checkpoint with version={version!r}: only the GEMM packing {GEMM_VERSIONS} is supported")
        group_size = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"awq checkpoint with group_size={group_size!r}: must be a positive int")
        return cls(group_size=group_size)

    def with_stored_dtypes(self, dtypes) -> "AwqFormat":
        """Bound to the dtype the checkpoint stores ``scales`` in."""
        stored = dtypes.get("scales")
        return self if stored is None or stored == self.scale_dtype else type(self)(group_size=self.group_size,
                                                                                    scale_dtype=stored)

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """Per source qweight [I, O/8], qzeros [G, O/8], scales [G, O] side by side on dim 1. Raises
        ValueError: transposed experts, I not a multiple of the group size, or O not of 8."""
        if transposed:
            raise ValueError(f"{self.name}: experts stored transposed ([in, out], e.g. gpt-oss) are not supported")
        rows, in_features = dense.shape
        if in_features % self.group_size:
            raise ValueError(f"awq expert {dense.name}: in_features {in_features} is not a multiple of group_size {self.group_size}")
        if (rows // sources) % PACK_FACTOR:
            raise ValueError(f"awq expert {dense.name}: out_features {rows // sources} is not a multiple of {PACK_FACTOR}")
        groups = in_features // self.group_size
        return (
            TensorSpec(f"{dense.name}_qweight", (in_features, rows // PACK_FACTOR), torch.int32, concat_dim=1),
            TensorSpec(f"{dense.name}_qzeros", (groups, rows // PACK_FACTOR), torch.int32, concat_dim=1),
            TensorSpec(f"{dense.name}_scales", (groups, rows), self.scale_dtype, concat_dim=1),
        )

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """AWQ's packing (formats/README.md "Packings"): along N in AWQ's nibble order, scales in their dtype."""
        name, specs = tensor.dense.name, {p.name: p for p in tensor.packed}
        return int_packing(tensor, weight=specs[f"{name}_qweight"], scale=specs[f"{name}_scales"], bits=4,
                           packed_dim="out", sources=1, group_size=self.group_size, zero=specs[f"{name}_qzeros"],
                           transposed=True, interleaved=True)
