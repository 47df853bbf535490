"""The writer of each format ``quantize`` writes: which tensors, checked from the headers before
anything is written, each tensor's quantization, the config written.

Owns: ``QuantizeOptions``, ``Writer`` (the contract), ``W4A16Writer`` (compressed-tensors
pack-quantized int4, written by the compressed-tensors package; no group size given: the largest
of ``GROUP_SIZES`` that fits), ``Fp8BlockWriter`` (block FP8) and ``Mxfp4Writer`` (gpt-oss
MXFP4). Does not: read or write shards (``tools.quantize``).

Legend: E experts, O output features, I input features (nn.Linear [O, I]).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedexperts.extras import require
from pagedexperts.formats import QUANTIZE_FORMATS
from pagedexperts.models.families import experts_transposed

QUANTIZE_SCOPES = ("experts", "model")  # what is quantized: the routed experts, or every nn.Linear but routers
# A routed expert's weight, one tensor per expert (Qwen3/DeepSeek gate|up|down_proj, Mixtral w1|w2|w3).
_PER_EXPERT_WEIGHT = re.compile(r"layers\.\d+\..*\.experts\.\d+\.[A-Za-z0-9_]+\.weight$")
# A routed experts module's stacked weight [E, ...] (transformers' fused layout, gpt-oss).
_STACKED_WEIGHT = re.compile(r"layers\.\d+\..*\.experts\.(gate_up_proj|down_proj)$")
# compressed-tensors target of the routed experts' projections (shared experts have no index).
W4A16_TARGET = r"re:.*\.experts\.\d+\.[^.]+$"
GROUP_SIZES = (128, 64, 32)  # w4a16 without a group size: the largest that fits (torch's CPU int4 kernel takes each)


@dataclass(frozen=True)
class QuantizeOptions:
    """What to write. ``group_size`` (None: the largest of ``GROUP_SIZES`` that fits), ``symmetric``
    and ``scope`` (QUANTIZE_SCOPES) apply to w4a16, ``block`` to fp8-block."""

    format: str
    group_size: int | None = None
    symmetric: bool = True
    block: tuple[int, int] = (128, 128)
    scope: str = "experts"


class Writer:
    """One format's expert quantizer: validation from headers, per-tensor quantization, config.
    ``format``: the format it writes (``formats.FORMATS``, a record with ``quantize``);
    ``bundled``: the options of the bundled model's variant (``bundled:FORMAT``), None: none."""

    format: str = ""
    bundled: dict | None = None
    flags: dict[str, str] = {}  # its own command flags (argparse dest -> flag), refused with another format

    plan = None  # tools.quantize_model.WholeModelPlan: the non-expert weights quantized too (w4a16 scope "model")
    group_size: int | None = None  # w4a16: the group size it writes

    def __init__(self, options: QuantizeOptions) -> None:
        self.options = options

    def validate(self, config: dict, headers: dict[Path, dict]) -> set[str]:
        """The routed expert weight keys to quantize; ValueError if a shape does not fit."""
        keys = {k: info for h in headers.values() for k, info in h.items() if _PER_EXPERT_WEIGHT.search(k)}
        stacked = [k for h in headers.values() for k in h if _STACKED_WEIGHT.search(k)]
        if not keys:
            where = f" (stacked experts such as {stacked[0]}: write them per expert first)" if stacked else ""
            raise ValueError(f"{self.options.format}: no per-expert routed weight (…experts.J.*.weight) found{where}")
        for key, info in keys.items():
            self.check_shape(key, tuple(info["shape"]))
        return set(keys)

    def check_shape(self, key: str, shape: tuple[int, ...]) -> None:
        if len(shape) != 2:
            raise ValueError(f"{key}: expert weight of shape {list(shape)}, expected [O, I]")

    def is_output_of_expert(self, key: str) -> bool:
        return bool(re.search(r"layers\.\d+\..*\.experts\.\d+\.", key))

    @property
    def linear_keys(self) -> frozenset[str]:
        return frozenset() if self.plan is None else self.plan.keys

    def quantize(self, key: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def quantization_config(self, config: dict, headers: dict[Path, dict], expert_keys: set[str]) -> dict:
        raise NotImplementedError

    def write_config(self, dst: Path, config: dict, headers: dict[Path, dict], expert_keys: set[str]) -> None:
        config = dict(config, quantization_config=self.quantization_config(config, headers, expert_keys))
        (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


class W4A16Writer(Writer):
    """compressed-tensors pack-quantized int4, written by the compressed-tensors package (scope
    "model": ``tools.quantize_model``'s plan, lm_head int8 per channel)."""

    format = "w4a16"
    flags = {"group_size": "--group-size", "asymmetric": "--asymmetric", "scope": "--scope"}
    bundled = dict(group_size=64, symmetric=True)  # the bundled model's I = 64: groups of 64 divide down_proj

    def __init__(self, options: QuantizeOptions) -> None:
        super().__init__(options)
        require("quant", "quantize --format w4a16 (and --model-path bundled:w4a16)", ("compressed_tensors",))
        if options.group_size is not None and options.group_size <= 0:
            raise ValueError(f"--group-size {options.group_size} must be a positive int")

    def validate(self, config: dict, headers: dict[Path, dict]) -> set[str]:
        """The keys to quantize at the given group size, or at the largest of ``GROUP_SIZES`` that
        fits (``group_size`` is the one chosen). Raises ValueError naming what does not fit and a
        group size that would."""
        experts = super().validate(config, headers)  # the experts' shapes, before any group size
        tried = {}
        for size in GROUP_SIZES if self.options.group_size is None else (self.options.group_size,):
            try:
                return self._validate_at(size, config, headers, experts)
            except ValueError as exc:
                tried[size] = str(exc)
        fits = [g for g in GROUP_SIZES if g not in tried and self._fits(g, config, headers, experts)]
        widths = [info["shape"][1] for h in headers.values() for k, info in h.items() if k in experts]
        divides = math.gcd(*widths) & -math.gcd(*widths)  # the largest power of two dividing each
        hint = f"--group-size {' or '.join(map(str, fits))} fits" if fits else (
            f"--group-size {divides} divides every expert's input size" if self.options.scope != "model"
            else "pass --group-size")
        first = next(iter(tried.values()))
        if self.options.group_size is None:
            raise ValueError(f"no group size of {list(GROUP_SIZES)} fits (at {GROUP_SIZES[0]}: {first}); {hint}")
        raise ValueError(f"{first}; {hint}")

    def _fits(self, size: int, config: dict, headers: dict[Path, dict], experts: set[str]) -> bool:
        try:
            self._validate_at(size, config, headers, experts)
            return True
        except ValueError:
            return False

    def _validate_at(self, size: int, config: dict, headers: dict[Path, dict], experts: set[str]) -> set[str]:
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        self.group_size, self.plan = size, None
        self.args = QuantizationArgs(num_bits=4, type="int", symmetric=self.options.symmetric, strategy="group",
                                     group_size=size)
        target = "Linear" if self.options.scope == "model" else W4A16_TARGET
        self.scheme = QuantizationScheme(targets=[target], weights=self.args, format="pack-quantized")
        for h in headers.values():
            for key, info in h.items():
                if key in experts and info["shape"][1] % size:
                    raise ValueError(f"{key}: in_features {info['shape'][1]} is not a multiple of --group-size {size}")
        if self.options.scope != "model":
            return experts
        from pagedexperts.tools.quantize_model import plan_whole_model

        self.plan = plan_whole_model(config, headers, experts, group_size=size, symmetric=self.options.symmetric)
        return experts | self.plan.keys

    def quantize(self, key: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from compressed_tensors.quantization.utils import calculate_qparams

        scheme = self.scheme if self.plan is None else self.plan.scheme_of(key, self.scheme)
        size = scheme.weights.group_size or weight.shape[-1]  # channel: one group per row
        groups = weight.unflatten(-1, (weight.shape[-1] // size, size))
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
        packed = PackedQuantizationCompressor.compress(state, scheme)
        base = key.removesuffix("weight")
        return {base + name: tensor.contiguous() for name, tensor in packed.items()}

    def write_config(self, dst: Path, config: dict, headers: dict[Path, dict], expert_keys: set[str]) -> None:
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import QuantizationConfig

        (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        groups = {"group_0": self.scheme} if self.plan is None else self.plan.config_groups(self.scheme)
        qc = QuantizationConfig(config_groups=groups, format="pack-quantized", quantization_status="compressed",
                                ignore=[] if self.plan is None else list(self.plan.ignore))
        ModelCompressor(quantization_config=qc).update_config(str(dst))


class Fp8BlockWriter(Writer):
    """Block FP8 (``formats.fp8_fp4.fp8_block.quantize_fp8_block``), the DeepSeek-V3 / Qwen3-FP8 layout."""

    format = "fp8-block"
    flags = {"block_size": "--block-size"}
    bundled = dict(block=(128, 128))

    def check_shape(self, key: str, shape: tuple[int, ...]) -> None:
        super().check_shape(key, shape)
        if min(self.options.block) <= 0:
            raise ValueError(f"fp8 block {self.options.block} must be two positive ints")

    def quantize(self, key: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        from pagedexperts.formats.fp8_fp4.fp8_block import quantize_fp8_block

        q, scale_inv = quantize_fp8_block(weight, self.options.block)
        return {key: q, key + "_scale_inv": scale_inv}

    def quantization_config(self, config: dict, headers: dict[Path, dict], expert_keys: set[str]) -> dict:
        plain = sorted({k.removesuffix(".weight") for h in headers.values() for k, info in h.items()
                        if k.endswith(".weight") and len(info["shape"]) == 2 and k not in expert_keys})
        if not config.get("tie_word_embeddings", False) or "lm_head" not in plain:
            plain = sorted(set(plain) | {"lm_head"})
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.options.block), "modules_to_not_convert": plain}


class Mxfp4Writer(Writer):
    """MXFP4 of gpt-oss's stacked, transposed experts (``formats.fp8_fp4.mxfp4.quantize_mxfp4``)."""

    format = "mxfp4"

    def validate(self, config: dict, headers: dict[Path, dict]) -> set[str]:
        if not experts_transposed(config):  # the published layout is of transposed experts ([in, out])
            raise ValueError(
                f"mxfp4: the published MXFP4 expert layout is gpt-oss's; model_type {config.get('model_type')!r} "
                "has none (use --format w4a16 or fp8-block)"
            )
        keys = {k: info for h in headers.values() for k, info in h.items() if _STACKED_WEIGHT.search(k)}
        if not keys:
            raise ValueError("mxfp4: no stacked experts (…experts.gate_up_proj / down_proj) found")
        for key, info in keys.items():
            if len(info["shape"]) != 3 or info["shape"][1] % 32:
                raise ValueError(f"{key}: shape {info['shape']}, MXFP4 needs [E, in, out] with in a multiple of 32")
        return set(keys)

    def is_output_of_expert(self, key: str) -> bool:
        return bool(re.search(r"\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$", key))

    def quantize(self, key: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        from pagedexperts.formats.fp8_fp4.mxfp4 import quantize_mxfp4

        blocks, scales = quantize_mxfp4(weight.transpose(1, 2).contiguous())  # [E, in, out] -> [E, out, in]
        return {key + "_blocks": blocks, key + "_scales": scales}

    def quantization_config(self, config: dict, headers: dict[Path, dict], expert_keys: set[str]) -> dict:
        plain = sorted({k.removesuffix(".weight") for h in headers.values() for k, info in h.items()
                        if k.endswith(".weight") and len(info["shape"]) == 2})
        return {"quant_method": "mxfp4", "modules_to_not_convert": sorted(set(plain) | {"lm_head"})}


WRITERS = {w.format: w for w in (W4A16Writer, Fp8BlockWriter, Mxfp4Writer)}


def writer_for(options: QuantizeOptions) -> Writer:
    if options.format not in WRITERS:
        raise ValueError(f"--format {options.format!r}: choose one of {list(QUANTIZE_FORMATS)}")
    if options.scope not in QUANTIZE_SCOPES:
        raise ValueError(f"--scope {options.scope!r}: choose one of {list(QUANTIZE_SCOPES)}")
    if options.scope == "model" and options.format != "w4a16":
        raise ValueError(f"--scope model writes w4a16 only; --format {options.format} takes --scope experts")
    return WRITERS[options.format](options)


