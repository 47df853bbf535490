"""The contract every expert format implements: per-expert packed tensors, bytes, dequantize.

Owns: ``TensorSpec`` (one per-expert tensor: name, per-expert shape, dtype, bytes), the
``ExpertLayout`` of one experts module in a format (which packed tensors stand for each of the
model's dense expert tensors), and ``ExpertFormat``, the interface of one format module.
Does not: read checkpoints (``loading``), hold bytes (``storage``) or page (``paging``).

Terms. The *dense* tensors are the experts module's own parameters as transformers builds the
unquantized model (Qwen3-MoE ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]; gpt-oss
``gate_up_proj`` [E, H, 2I] and biases). The *packed* tensors are what a quantized checkpoint
stores for them, one row per expert (block FP8: ``gate_up_proj`` float8_e4m3fn [E, 2I, H] and
``gate_up_proj_scale_inv`` float32 [E, 2I/128, H/128]). The host store and the K slots hold
packed rows; a page-in moves packed bytes; per wave the pager asks the format to turn the
wave's packed rows into dense rows and runs the model's own experts kernel on them.

The contract a format module fulfils (``formats/README.md`` has the worked example):

1. ``name`` (the ``--format`` / stats name) and ``matches(quantization_config)``: recognise
   config.json's ``quantization_config`` dict (None for an unquantized checkpoint).
2. ``serialized_names``: per checkpoint parameter suffix, the names the checkpoint stores for
   it, exactly as transformers' quantizer declares them (block FP8: ``{"weight": ("weight",
   "weight_scale_inv")}``). A per-expert key ``experts.{j}.gate_proj.weight_scale_inv`` then
   lands in the store tensor ``gate_up_proj_scale_inv`` (the dense target + the suffix
   ``"weight_scale_inv".removeprefix("weight")``), row j, in the source's row slice along the
   packed spec's ``concat_dim``. A stacked key ``experts.gate_up_proj_blocks`` [E, ...] lands in
   the store tensor of the same name.
3. ``layout(dense_specs, sources=..., transposed=...)``: the ``ExpertLayout`` of one experts
   module: for every dense spec, the packed specs standing for it (a dense spec a format leaves
   unquantized, e.g. a bias, stands for itself).
4. ``dequantize(tensor, packed)``: packed rows of n experts {name: [n, *packed shape]} ->
   dense rows [n, *dense shape] in the dense spec's dtype, computed with the same operations in
   the same order and dtypes as transformers' own loading of the checkpoint, so that every
   element is bit-identical to the model ``from_pretrained`` builds. Rows are independent:
   dequantizing experts (3, 5) together equals dequantizing each alone. A quantized format
   does not write it: ``formats.unpack.PackedFormat`` interprets its ``packing`` (a
   ``formats.packing.WeightPacking``: how the checkpoint packs, the one description the
   dequantizing path and the fused kernels both read).
5. ``reference_kwargs()``: what ``check`` passes to ``from_pretrained`` for the dequantized
   reference (e.g. ``quantization_config=...(dequantize=True)``).
6. Non-expert nn.Linear weights (attention projections, shared experts, dense MLP layers,
   lm_head, a router) come for free: a plain Linear is one row with one source under the dense
   name ``LINEAR_WEIGHT`` (``linear_tensor``, ``dequantize_linear``: ``pack`` and ``dequantize``
   above). ``linear_format(module, quantization_config)`` says which format stores a module
   (default: this one; compressed-tensors: the module's own config group).
7. ``with_stored_dtypes``: the format bound to the dtypes the checkpoint stores its experts'
   tensors in (scales, zero points), so that the store holds them uncast and ``dequantize``
   computes in them, as the format's library does. Default: unchanged.

Legend: E experts, n experts dequantized together, H hidden, I expert intermediate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch

LINEAR_WEIGHT = "weight"  # the dense name of one plain nn.Linear weight (``ExpertFormat.linear_tensor``)


@dataclass(frozen=True)
class TensorSpec:
    """One per-expert tensor: its name (on the experts module or in the store), one expert's
    shape (without the leading E), dtype.

    ``concat_dim``: for a tensor that several checkpoint sources fill (Qwen3's gate and up
    projections merged into ``gate_up_proj``), the per-expert dim along which the sources are
    concatenated, in source order (transformers' ``Concatenate(dim=1)`` on [E, ...] = dim 0 per
    expert). Formats that pack along another dim (GPTQ's ``qweight`` [H/8, 2I]) say so here.
    """

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
    """The per-expert tensors of one experts module in one format.

    ``packed_specs`` is what the host store and packed slots hold (one row per expert);
    ``dense_specs`` is what the model's experts kernel takes.
    """

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
        """Packed rows of n experts {packed name: [n, ...]} -> {dense name: [n, ...]}.

        Passthrough tensors are returned as given (no copy). Raises KeyError naming a packed
        tensor missing from ``packed``.
        """
        out = {}
        for t in self.tensors:
            if t.is_passthrough:
                out[t.dense.name] = packed[t.dense.name]
            else:
                out[t.dense.name] = self.format.dequantize(t, {p.name: packed[p.name] for p in t.packed})
        return out


class ExpertFormat:
    """Base of every expert format. Subclasses set the class attributes and implement
    ``matches``, ``pack`` (the specs of one dense tensor) and ``dequantize``: a quantized format
    through ``packing`` (``formats.unpack.PackedFormat``), the dense one as the identity.

    Instances are immutable after construction and built by ``from_quantization_config``.
    """

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

        Raises:
            ValueError: a parameter this format does not support (names the key and value).
        """
        return cls()

    @classmethod
    def from_config(cls, config, quantization_config: dict | None) -> "ExpertFormat":
        """The format bound to a checkpoint from its whole config (transformers object or
        config.json dict) and its ``quantization_config``. By default the latter alone; a format
        whose tensors take the checkpoint's saved dtype (compressed-tensors scales) reads it here.
        """
        return cls.from_quantization_config(quantization_config)

    def experts_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype transformers keeps this format's dequantized routed experts in when the
        model is loaded at ``model_dtype`` (``layout``'s quantized dense specs are in it).
        Default: ``model_dtype``; compressed-tensors int4 keeps the scales' dtype."""
        return model_dtype

    def reference_kwargs(self) -> dict:
        """Extra ``from_pretrained`` kwargs that make transformers build the dequantized model
        this format's ``dequantize`` matches on every device (on a GPU transformers would
        otherwise run its own quantized kernels: another computation). Default: none."""
        return {}

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """Packed specs standing for ``dense`` (return ``(dense,)`` to leave it unquantized).

        ``sources``: checkpoint tensors concatenated into ``dense`` (2 for Qwen3's gate+up,
        1 otherwise); ``transposed``: the module's ``is_transposed`` (dense weight is [in, out]
        instead of nn.Linear's [out, in]).
        """
        raise NotImplementedError

    def dequantize(self, tensor: QuantizedTensor, packed: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Packed rows of n experts {name: [n, *spec.shape]} -> [n, *tensor.dense.shape] in
        ``tensor.dense.dtype``, bit-identical to transformers' loading (see module docstring)."""
        raise NotImplementedError

    def linear_format(self, module: str, quantization_config: dict | None) -> "ExpertFormat | None":
        """The format storing the weight of the non-expert nn.Linear ``module`` (its name as the
        checkpoint spells it, e.g. ``model.layers.0.self_attn.q_proj``), bound for one plain
        weight (``linear_tensor``), or None when ``quantization_config`` leaves it unquantized.

        Default: ``self``, one scheme for every module (GPTQ, AWQ, block FP8, ModelOpt); whether a
        module is quantized is then read from its keys (``loading.checkpoint``). A format whose
        schemes differ per module overrides it (compressed-tensors: ``formats.compressed_tensors.linear``).

        Raises:
            ValueError: the module's scheme is not a supported format (names the module).
        """
        return self

    def linear_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> QuantizedTensor:
        """The packed specs standing for one plain nn.Linear weight [O, I] dequantized into
        ``dtype``: ``pack`` of the dense spec ``LINEAR_WEIGHT`` with one source, untransposed
        (a non-expert module is one row of one source). A passthrough result means the format
        leaves such a tensor unquantized.

        Raises:
            ValueError: what ``pack`` refuses (e.g. a dim not a multiple of the group size).
        """
        dense = TensorSpec(LINEAR_WEIGHT, tuple(shape), dtype)
        return QuantizedTensor(dense, self.pack(dense, sources=1, transposed=False))

    def dequantize_linear(self, tensor: QuantizedTensor, serialized: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One plain nn.Linear's serialized tensors -> its dense weight [O, I] in
        ``tensor.dense.dtype`` (``linear_tensor``), contiguous.

        ``serialized``: {name as the checkpoint stores it under the module (``qweight``,
        ``weight_scale``): tensor}, each in the dtype the checkpoint holds: the format is bound to
        those dtypes (``with_stored_dtypes``), so that ``dequantize`` computes in them as the
        format's library does (a bfloat16 scale multiplies in bfloat16). Each is reshaped to its
        packed spec (a 0-d per-tensor scale is a [1] row) and given as one row to ``dequantize``.

        Raises:
            ValueError: a packed tensor missing from ``serialized``, or one whose element count
                is not its packed spec's (names both).
        """
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
        """A constant tensor of this format (a shift table, an FP4 lookup table) on ``device``,
        built by ``build(device)`` once per device and kept on the instance, so that a dequantize
        does not send it host-to-device again (a synchronous copy on CUDA, every wave)."""
        cache = self.__dict__.setdefault("_device_constants", {})  # also on frozen dataclasses
        key = (name, torch.device(device))
        if key not in cache:
            cache[key] = build(device)
        return cache[key]

    def with_stored_dtypes(self, dtypes: Mapping[str, torch.dtype]) -> "ExpertFormat":
        """This format bound to the dtypes the checkpoint stores the routed experts' serialized
        tensors in ({serialized name such as ``weight_scale``: dtype}, read from the shards'
        headers by ``loading.checkpoint.stored_expert_dtypes``): packed specs of scales and zero
        points in those dtypes (the store holds them as stored, no cast) and ``experts_dtype``
        following them where the library dequantizes into the scales' dtype. Default: ``self``
        (a format whose stored dtypes are fixed by its layout)."""
        return self

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False):
        """How ``tensor``'s packed rows encode its weight: a ``formats.packing.WeightPacking``
        (that module imports this one, so no annotation here), what ``dequantize``
        (``formats.unpack``) and the fused kernels read; ``transposed``: the experts module's
        ``is_transposed`` (its dense weight is [in, out]).

        Raises:
            NotImplementedError: this format has no packing description (names the format).
        """
        raise NotImplementedError(f"expert format {self.name!r} has no WeightPacking: fused kernels cannot read it")

    def layout(
        self, dense_specs: tuple[TensorSpec, ...], *, sources: Mapping[str, int] | None = None, transposed: bool = False
    ) -> ExpertLayout:
        """The ExpertLayout of an experts module whose dense per-expert tensors are ``dense_specs``.

        ``sources``: dense name -> number of checkpoint sources concatenated into it (default 1).
        """
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
    """The store tensor of a checkpoint's serialized companion of ``target``'s ``param``:
    ``target`` + the name minus the param prefix (``gate_up_proj`` + ``_scale_inv``); a name
    that does not extend the param (GPTQ's ``qweight``, ``scales``) joins with ``_``
    (``gate_up_proj_qweight``)."""
    suffix = serialized.removeprefix(param)
    return target + (suffix if not suffix or suffix.startswith("_") else "_" + suffix)
