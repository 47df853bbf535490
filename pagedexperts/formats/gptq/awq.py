"""AWQ int4 experts (AutoAWQ GEMM checkpoints, ``quant_method: awq``).

Owns: recognising the format, the packed per-expert tensor specs and their ``WeightPacking``.
Does not: unpack (``formats.unpack`` interprets the packing), read files, store, page, or
quantize (AWQ needs calibration; ``quantize`` writes w4a16 instead).

On-disk layout (AutoAWQ ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear`` and
``awq/utils/packing_utils.py`` ``dequantize_gemm``), per expert projection
``experts.{j}.{gate,up,down}_proj`` of an nn.Linear weight [O, I], group size g, G = I / g:

- ``qweight`` int32 [I, O / 8], packed along the OUTPUT dim in AWQ's interleaved order: the
  nibble at bits ``4 * p`` of word [i, c] holds column ``8 * c + AWQ_ORDER[p]``, with
  ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]`` (column j in nibble ``packing.AWQ_POSITION[j]``);
- ``qzeros`` int32 [G, O / 8], the same packing (zero points stored as is, no offset); a
  symmetric checkpoint (``zero_point: false``: AutoRound's ``auto_awq`` export, GPTQModel's AWQ
  with sym) stores them too, every value 8 (AutoRound 0.16 ``export_to_awq/utils.py``
  ``WQLinear_GEMM.from_linear`` packs the scalar zero point), and GPTQModel 7.7's
  ``dequantize_gemm`` subtracts them like any other;
- ``scales`` float16 [G, O].

Dequantize: ``W^T[i, o] = (q[i, o] - z[i // g, o]) * scales[i // g, o]`` in float16 (exact
integer difference, one rounding in the product), transposed to [O, I], cast to the model's
dtype. The GEMV version (a different packing) is not supported.

Legend: n experts dequantized together, O output features, I input features, G groups.
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
    """AWQ int4 GEMM-packed experts, asymmetric or symmetric (stored zero points), any group
    size dividing I."""

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

        Raises:
            ValueError: bits other than 4, a version other than the GEMM packing (e.g. gemv),
                or a group size that is not a positive int. ``zero_point: false`` (symmetric
                AWQ, GPTQModel's and AutoRound's default) reads as any other: the checkpoint
                still stores ``qzeros`` (every value 8) and ``dequantize_gemm`` subtracts them.
        """
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
        """Bound to the dtype the checkpoint stores ``scales`` in (float16 as AutoAWQ writes them;
        ``dequantize_gemm`` computes in the scales' dtype)."""
        stored = dtypes.get("scales")
        return self if stored is None or stored == self.scale_dtype else type(self)(group_size=self.group_size,
                                                                                    scale_dtype=stored)

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """Specs of one dense [sources * O, I] expert tensor: each source's [I, O/8] qweight,
        [G, O/8] qzeros and [G, O] scales side by side along dim 1.

        Raises:
            ValueError: transposed experts, I not a multiple of the group size, or O not a
                multiple of 8.
        """
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
        """qweight [K, N/8] and qzeros [G, N/8] packed along the output dim in AWQ's nibble
        order, scales [G, N] multiplied in float16."""
        name, specs = tensor.dense.name, {p.name: p for p in tensor.packed}
        return int_packing(tensor, weight=specs[f"{name}_qweight"], scale=specs[f"{name}_scales"], bits=4,
                           packed_dim="out", sources=1, group_size=self.group_size, zero=specs[f"{name}_qzeros"],
                           transposed=True, interleaved=True)
