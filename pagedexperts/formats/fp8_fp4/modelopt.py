"""NVIDIA ModelOpt experts (``quant_method: modelopt``, ``quant_algo`` NVFP4 or FP8), as
``export_hf_checkpoint`` writes them.

Layout (nvidia-modelopt 0.47 ``torch/export/unified_export_hf.py``, ``moe_utils._export_fused_experts``)
and dequantization as ``NVFP4QTensor`` / ``FP8QTensor.dequantize`` into the saved dtype, then the
model's: formats/README.md "ModelOpt". Does not: read files, store, page, or quantize activations.

Legend: n experts, O output features, I input features, G groups.
"""

from __future__ import annotations

import fnmatch
from typing import ClassVar

import torch

from pagedexperts.formats.base import QuantizedTensor, TensorSpec, store_name
from pagedexperts.formats.compressed_tensors.w4a16 import _torch_dtype
from pagedexperts.formats.packing import WeightPacking, float8_packing, fp4_packing
from pagedexperts.formats.unpack import PackedFormat

NVFP4_GROUP = 16
# A routed expert's projections as the checkpoint names them (Qwen3-MoE / DeepSeek-V3; Mixtral).
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def quant_algo(quantization_config: dict | None) -> str | None:
    """``quant_algo`` at the top level (config.json) or under ``quantization`` (hf_quant_config.json)."""
    qc = quantization_config or {}
    return qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo")


def _field(quantization_config: dict, key: str):
    return quantization_config.get(key, (quantization_config.get("quantization") or {}).get(key))


class _ModelOptFormat(PackedFormat):
    """Shared: matching one ``quant_algo``, refusals, the per-source specs."""

    quant_algo: ClassVar[str] = ""
    serialized_names = {"weight": ("weight", "weight_scale", "input_scale")}

    def __init__(self, saved_dtype: torch.dtype | None = None) -> None:
        self.saved_dtype = saved_dtype  # None: the model's dtype

    @classmethod
    def matches(cls, quantization_config: dict | None) -> bool:
        qc = quantization_config or {}
        return qc.get("quant_method") == "modelopt" and quant_algo(qc) == cls.quant_algo

    @classmethod
    def from_config(cls, config, quantization_config: dict | None) -> "_ModelOptFormat":
        """Bind the checkpoint's saved dtype (config ``dtype`` / ``torch_dtype``).
        Raises ValueError: an ``exclude_modules`` pattern leaving routed experts unquantized, or (NVFP4) a
        group_size other than 16, or input features not a multiple of it."""
        qc = quantization_config or {}
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        excluded = excluded_experts(qc, int(get("num_hidden_layers") or 1))
        if excluded:
            raise ValueError(f"modelopt {cls.quant_algo} with routed experts in exclude_modules ({excluded}): "
                             "only checkpoints whose routed experts are all quantized are supported")
        cls._check(qc, config)
        saved = get("dtype") or get("torch_dtype")
        return cls(saved if isinstance(saved, torch.dtype) else _torch_dtype(saved))

    @classmethod
    def _check(cls, qc: dict, config) -> None:
        """Algorithm-specific refusals (see ``from_config``)."""

    def pack(self, dense: TensorSpec, *, sources: int, transposed: bool) -> tuple[TensorSpec, ...]:
        """The weight of one dense [sources * O, I] tensor and its per-tensor scales, one [1] per source."""
        if len(dense.shape) != 2:
            return (dense,)
        if transposed:
            raise ValueError(f"{self.name}: experts stored transposed ([in, out], e.g. gpt-oss) are not supported")
        specs = list(self._weight_specs(dense))
        specs += [TensorSpec(store_name(dense.name, "weight", n), (sources,), torch.float32)
                  for n in self.serialized_names["weight"] if n not in self._weight_names()]
        return tuple(specs)

    def _weight_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _weight_specs(self, dense: TensorSpec) -> tuple[TensorSpec, ...]:
        raise NotImplementedError




class ModelOptNvfp4Format(_ModelOptFormat):
    """ModelOpt NVFP4: e2m1 weights, e4m3 scales per 16 inputs, a float32 ``weight_scale_2`` per projection."""

    name = "modelopt-nvfp4"
    quant_algo = "NVFP4"
    serialized_names = {"weight": ("weight", "weight_scale", "weight_scale_2", "input_scale")}

    @classmethod
    def _check(cls, qc: dict, config) -> None:
        group = _field(qc, "group_size")
        if group not in (None, NVFP4_GROUP):
            raise ValueError(f"modelopt NVFP4 with group_size={group!r}: only {NVFP4_GROUP} is supported")
        from pagedexperts.formats.compressed_tensors.schemes import expert_in_features

        for dense, in_features in expert_in_features(config).items():
            if in_features % NVFP4_GROUP:
                raise ValueError(f"modelopt NVFP4 {dense}: in_features {in_features} is not a multiple of "
                                 f"the group size {NVFP4_GROUP}")

    def _weight_names(self) -> tuple[str, ...]:
        return ("weight", "weight_scale")

    def _weight_specs(self, dense: TensorSpec) -> tuple[TensorSpec, ...]:
        rows, in_features = dense.shape
        if in_features % NVFP4_GROUP:
            raise ValueError(f"{self.name} {dense.name}: in_features {in_features} is not a multiple of {NVFP4_GROUP}")
        return (TensorSpec(dense.name, (rows, in_features // 2), torch.uint8),
                TensorSpec(f"{dense.name}_scale", (rows, in_features // NVFP4_GROUP), torch.float8_e4m3fn))

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """e2m1 (code 8 is +0.0), e4m3 scales per 16 times ``weight_scale_2`` in float32, then the saved dtype."""
        name, specs = tensor.dense.name, {p.name: p for p in tensor.packed}
        scale_2 = specs[f"{name}_scale_2"]
        return fp4_packing(tensor, weight=specs[name], scale=specs[f"{name}_scale"], scale_codes="e4m3",
                           group_size=NVFP4_GROUP, sources=scale_2.shape[0], global_scale=scale_2,
                           global_op="multiply", round_dtype=self.saved_dtype or tensor.dense.dtype,
                           negative_zero=False)


class ModelOptFp8Format(_ModelOptFormat):
    """ModelOpt FP8: e4m3 weights, one float32 ``weight_scale`` per projection."""

    name = "modelopt-fp8"
    quant_algo = "FP8"

    def _weight_names(self) -> tuple[str, ...]:
        return ("weight",)

    def _weight_specs(self, dense: TensorSpec) -> tuple[TensorSpec, ...]:
        return (TensorSpec(dense.name, dense.shape, torch.float8_e4m3fn),)

    def packing(self, tensor: QuantizedTensor, *, transposed: bool = False) -> WeightPacking:
        """fp8 [N, K] with one float32 scale per source, multiplied in the saved dtype."""
        scale = next(p for p in tensor.packed if p.name == f"{tensor.dense.name}_scale")
        return float8_packing(tensor, scale=scale, strategy="tensor", sources=scale.shape[0],
                              mul_dtype=self.saved_dtype or tensor.dense.dtype)


def excluded_experts(quantization_config: dict, num_layers: int) -> list[str]:
    """Routed expert projections an ``exclude_modules`` / ``ignore`` pattern naming experts leaves unquantized."""
    patterns = [p for p in (_field(quantization_config, "exclude_modules") or quantization_config.get("ignore") or [])
                if "expert" in p.replace("shared_expert", "")]
    names = [f"model.layers.{layer}.{block}.experts.0.{proj}" for layer in range(num_layers)
             for block in ("mlp", "block_sparse_moe") for proj in EXPERT_PROJECTIONS]
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) or fnmatch.fnmatchcase(n.rsplit(".", 1)[0], p)
                                    for p in patterns)][:3]
