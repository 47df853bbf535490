"""The contract every expert format implements: per-expert packed tensors, their bytes, dequantize.

Owns ``TensorSpec``, ``ExpertLayout`` (the packed tensors standing for each dense tensor of one
experts module) and ``ExpertFormat`` (members and store naming: ``formats/README.md``). Dense
tensors are the experts module's own; packed ones what the checkpoint stores, one row per expert;
``dequantize`` is bit-identical to transformers' loading. Does not: read checkpoints or page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch

LINEAR_WEIGHT = "weight"  # the dense name of one plain nn.Linear weight (``ExpertFormat.linear_tensor``)


@dataclass(frozen=True)
class TensorSpec:
    """One per-expert tensor: name, one expert's shape (no leading E), dtype, and ``concat_dim``,
    the per-expert dim along which several checkpoint sources are concatenated (gate + up)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    concat_dim: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_bytes(self) -> int:
        """Bytes of one expert's row of this tensor."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class QuantizedTensor:
    """One dense expert tensor of the model and the packed tensors that stand for it."""

    dense: TensorSpec
    packed: tuple[TensorSpec, ...]

    @property
    def is_passthrough(self) -> bool:
        """True when the format stores the dense tensor itself (unquantized: biases, ``dense``)."""
        return len(self.packed) == 1 and self.packed[0] == self.dense


@dataclass(frozen=True)
class ExpertLayout:
    """The per-expert tensors of one experts module in one format: ``packed_specs`` (store and
    packed slots), ``dense_specs`` (what the experts kernel takes)."""

    format: "ExpertFormat"
    tensors: tuple[QuantizedTensor, ...]

    @property
    def packed_specs(self) -> tuple[TensorSpec, ...]:
        return tuple(p for t in self.tensors for p in t.packed)

    @property
    def dense_specs(self) -> tuple[TensorSpec, ...]:
        return tuple(t.dense for t in self.tensors)

    @property
    def expert_bytes(self) -> int:
        """Packed bytes of one expert (every packed tensor): the unit of one page-in."""
        return sum(s.row_bytes for s in self.packed_specs)

    @property
    def dense_expert_bytes(self) -> int:
        """Bytes of one expert dequantized (the dense specs' dtype): one dense slot."""
        return sum(s.row_bytes for s in self.dense_specs)

    @property
    def is_dense(self) -> bool:
        return all(t.is_passthrough for t in self.tensors)

    def dequantize(self, packed: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Packed rows of n experts {packed name: [n, ...]} -> {dense name: [n, ...]}; passthrough
        tensors as given (no copy). Raises KeyError naming a missing packed tensor."""
        out = {}
        for t in self.tensors:
            if t.is_passthrough:
                out[t.dense.name] = packed[t.dense.name]
            else:
                out[t.dense.name] = self.format.dequantize(t, {p.name: packed[p.name] for p in t.packed})
        return out


class ExpertFormat:
    """Base of every expert format; instances are immutable, built by ``from_quantization_config``.
    A quantized format dequantizes through its ``packing`` (``formats.unpack.PackedFormat``)."""

    name: ClassVar[str] = ""
    serialized_names: ClassVar[dict[str, tuple[str, ...]]] = {}
    # The experts layouts this format has a published packing for: False nn.Linear's [out, in]
    # only (every quantized format but gpt-oss's MXFP4), True transposed [in, out] only, None
    # either (dense). ``formats.format_for_config`` refuses the others (the family says which it has).
    transposed_experts: ClassVar[bool | None] = False

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        """True if config.json's ``quantization_config`` (None: unquantized) is this format."""
        raise NotImplementedError

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None) -> "ExpertFormat":
        """The format bound to this checkpoint's parameters (block size, bits, group size).
        Raises ValueError: a parameter this format does not support (names the key and value)."""
        return cls()

    @classmethod
    def from_config(cls, config, quantization_config: dict | None) -> "ExpertFormat":
        """The format bound from the whole config and its ``quantization_config`` (default: the latter alone)."""
        return cls.from_quantization_config(quantization_config)

    def experts_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the dequantized experts take at ``model_dtype`` (default ``model_dtype``)."""
        return model_dtype

    def reference_kwargs(self) -> dict:
        """Extra ``from_pretrained`` kwargs for the dequantized reference on every device; default none."""
        return {}

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """Packed specs standing for ``dense`` (``(dense,)``: left unquantized). ``sources``: checkpoint
        tensors concatenated into it; ``transposed``: the dense weight is [in, out]."""
        raise NotImplementedError

    def dequantize(self, tensor: QuantizedTensor, packed: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Packed rows {name: [n, *spec.shape]} -> [n, *tensor.dense.shape] in ``tensor.dense.dtype``,
        bit-identical to transformers' loading."""
        raise NotImplementedError

    def linear_format(self, module: str, quantization_config: dict | None) -> "ExpertFormat | None":
        """The format storing the non-expert nn.Linear ``module``'s weight (checkpoint name), bound for
        one plain weight, or None when unquantized. Default ``self``; compressed-tensors: the module's
        config group (``formats.compressed_tensors.linear``).
        Raises ValueError: the module's scheme is not a supported format (names the module)."""
        return self

    def linear_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> QuantizedTensor:
        """The packed specs of one plain nn.Linear weight [O, I] dequantized into ``dtype`` (``pack``
        of ``LINEAR_WEIGHT``, one source, untransposed).
        Raises ValueError: what ``pack`` refuses (e.g. a dim not a multiple of the group size)."""
        dense = TensorSpec(LINEAR_WEIGHT, tuple(shape), dtype)
        return QuantizedTensor(dense, self.pack(dense, sources=1, transposed=False))

    def dequantize_linear(self, tensor: QuantizedTensor, serialized: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One plain nn.Linear's serialized tensors {checkpoint name: tensor, in its stored dtype} ->
        its dense weight [O, I] in ``tensor.dense.dtype``, contiguous (computed in the stored dtypes:
        ``with_stored_dtypes``).
        Raises ValueError: a packed tensor missing, or one whose element count is not its spec's."""
        bound = self.with_stored_dtypes({n: v.dtype for n, v in serialized.items()})
        if bound is not self:
            tensor = bound.linear_tensor(tensor.dense.shape, tensor.dense.dtype)
        by_spec = {store_name(LINEAR_WEIGHT, LINEAR_WEIGHT, n): v for n, v in serialized.items()}
        rows = {}
        for spec in tensor.packed:
            value = by_spec.get(spec.name)
            if value is None:
                raise ValueError(f"{self.name}: packed tensor {spec.name!r} missing (have {sorted(serialized)})")
            if value.numel() != spec.numel:
                raise ValueError(f"{self.name}: {spec.name!r} has shape {tuple(value.shape)}, the module's weight "
                                 f"{tensor.dense.shape} needs {spec.shape}")
            rows[spec.name] = value.reshape(spec.shape).unsqueeze(0)
        return bound.dequantize(tensor, rows)[0].contiguous()

    def device_constant(self, name: str, device, build) -> torch.Tensor:
        """A constant tensor on ``device``, ``build(device)`` once per device, kept on the instance."""
        cache = self.__dict__.setdefault("_device_constants", {})  # also on frozen dataclasses
        key = (name, torch.device(device))
        if key not in cache:
            cache[key] = build(device)
        return cache[key]

    def with_stored_dtypes(self, dtypes: Mapping[str, torch.dtype]) -> "ExpertFormat":
        """This format bound to the dtypes the checkpoint stores the experts' tensors in (default ``self``)."""
        return self

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False):
        """The ``formats.packing.WeightPacking`` of ``tensor``'s packed rows (``transposed``: the dense
        weight is [in, out]).
        Raises NotImplementedError: this format has no packing description (names the format)."""
        raise NotImplementedError(f"expert format {self.name!r} has no WeightPacking: fused kernels cannot read it")

    def layout(
        self, dense_specs: tuple[TensorSpec, ...], *, sources: Mapping[str, int] | None = None, transposed: bool = False
    ) -> ExpertLayout:
        """The ExpertLayout of an experts module with dense per-expert ``dense_specs``; ``sources``:
        dense name -> checkpoint sources concatenated into it (default 1)."""
        sources = sources or {}
        tensors = tuple(
            QuantizedTensor(d, self.pack(d, sources=sources.get(d.name, 1), transposed=transposed))
            for d in dense_specs
        )
        return ExpertLayout(self, tensors)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def store_name(target: str, param: str, serialized: str) -> str:
    """The store tensor of a serialized companion of ``target``'s ``param``: ``target`` + the name
    minus the param prefix (``gate_up_proj_scale_inv``), else joined with ``_`` (``gate_up_proj_qweight``)."""
    suffix = serialized.removeprefix(param)
    return target + (suffix if not suffix or suffix.startswith("_") else "_" + suffix)
