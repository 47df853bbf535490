"""Round-to-nearest quantization of a checkpoint's routed experts into a published format.

Owns: reading an unquantized (bf16 / fp16 / fp32) Hugging Face checkpoint, quantizing its
ROUTED expert weights only (attention, router, norms, embeddings, shared experts and dense MLPs
are copied unchanged, byte for byte; w4a16 ``scope`` "model": every nn.Linear but routers,
``tools.quantize_model``), and writing the format's published on-disk layout so that
transformers' own ``from_pretrained`` loads the result. Also builds, on first use, the bundled
model's quantized variants into a cache directory. Does not: calibrate (no GPTQ/AWQ
search; plain round-to-nearest), dequantize (``formats``), or load models for inference.

Formats written:

- ``w4a16``: compressed-tensors ``pack-quantized`` int4, group strategy (default group 128,
  symmetric), per-expert keys ``experts.{j}.{proj}.weight_packed / weight_scale /
  weight_shape`` (+ ``weight_zero_point`` when asymmetric), written by the compressed-tensors
  package itself (``calculate_qparams`` min/max round-to-nearest, ``PackedQuantizationCompressor
  .compress``, ``ModelCompressor.update_config``), as llm-compressor's W4A16 preset saves.
- ``fp8-block``: DeepSeek-V3 / Qwen3-FP8 block FP8 (``weight`` float8_e4m3fn + float32
  ``weight_scale_inv`` per 128 x 128 block), ``quantization_config`` {"quant_method": "fp8",
  "weight_block_size": [128, 128], "modules_to_not_convert": [every module left unquantized]}.
- ``mxfp4``: gpt-oss's stacked ``experts.{gate_up,down}_proj_blocks / _scales`` (E8M0 scales,
  32-value blocks), biases unquantized.

Legend: E experts, O output features, I input features (nn.Linear [O, I]).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pagedexperts.extras import require
from pagedexperts.formats import QUANTIZE_FORMATS
from pagedexperts.models.families import experts_transposed
from pagedexperts.storage.safetensors_files import checkpoint_files, read_header_json
from pagedexperts.storage.safetensors_index import check_readable

QUANTIZE_SCOPES = ("experts", "model")  # what is quantized: the routed experts, or every nn.Linear but routers
# A routed expert's weight, one tensor per expert (Qwen3/DeepSeek gate|up|down_proj, Mixtral w1|w2|w3).
_PER_EXPERT_WEIGHT = re.compile(r"layers\.\d+\..*\.experts\.\d+\.[A-Za-z0-9_]+\.weight$")
# A routed experts module's stacked weight [E, ...] (transformers' fused layout, gpt-oss).
_STACKED_WEIGHT = re.compile(r"layers\.\d+\..*\.experts\.(gate_up_proj|down_proj)$")
# compressed-tensors target of the routed experts' projections (shared experts have no index).
W4A16_TARGET = r"re:.*\.experts\.\d+\.[^.]+$"
_AUX_SKIP = ("model.safetensors.index.json", "config.json")


@dataclass(frozen=True)
class QuantizeOptions:
    """What to write. ``group_size``, ``symmetric`` and ``scope`` (QUANTIZE_SCOPES) apply to w4a16, ``block`` to fp8-block."""

    format: str
    group_size: int = 128
    symmetric: bool = True
    block: tuple[int, int] = (128, 128)
    scope: str = "experts"


@dataclass(frozen=True)
class QuantizeReport:
    """What ``quantize_checkpoint`` wrote: expert weight tensors quantized and their bytes
    before (source dtype) and after (every packed tensor, scales and metadata included), and how
    many non-expert weights were quantized (``scope`` "model")."""

    output: Path
    format: str
    expert_tensors: int
    expert_bytes_in: int
    expert_bytes_out: int
    linear_tensors: int = 0


def quantize_checkpoint(*, model_path: str | Path, output: str | Path, options: QuantizeOptions,
                        progress: bool = False) -> QuantizeReport:
    """Quantize ``model_path``'s routed experts into ``output`` (see the module docstring).

    The source's shards are kept (same file names, same index); only routed expert weights
    change. Everything is validated from the headers before any tensor is read. ``progress``: a
    tqdm bar of the expert weights quantized, on stderr when it is a terminal (as ``bench``).

    Raises:
        ValueError: unknown format or scope (lists them), a source that is already quantized, no
            routed expert weight, an expert shape the format cannot hold (names the tensor,
            the size and the flag), with scope "model" a module torch's CPU kernels cannot compute
            packed (names it and why), a truncated or corrupt shard, or an output that is a file or a
            directory that is not empty. Nothing is left in ``output`` when writing fails (or is
            interrupted).
        FileNotFoundError: no config.json in ``model_path``.
    """
    src, dst = Path(model_path), Path(output)
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"--output {dst} is a file; choose a new directory")
    config = _read_config(src)
    writer = _writer_for(options)
    files = checkpoint_files(src)
    check_readable(files)  # a truncated shard, named before the output exists (it failed mid-write)
    headers = {f: read_header_json(f)[0] for f in files}
    keys = writer.validate(config, headers)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"--output {dst} exists and is not empty; choose a new directory")
    existed = dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    try:
        sizes = _write(src, dst, config, headers, keys, writer, progress)
    except BaseException:  # an error or Ctrl-C leaves no half-written checkpoint behind
        shutil.rmtree(dst, ignore_errors=True)
        if existed:
            dst.mkdir()
        raise
    return QuantizeReport(dst, options.format, len(keys - writer.linear_keys), *sizes, len(writer.linear_keys))


def _write(src: Path, dst: Path, config: dict, headers: dict, keys: set[str], writer: "_Writer",
           progress: bool) -> tuple[int, int]:
    """Write ``quantize_checkpoint``'s output into the (empty) ``dst``: (expert bytes in, out)."""
    options = writer.options
    bytes_in = bytes_out = total_size = 0
    weight_map: dict[str, str] = {}
    bar = tqdm(total=len(keys), desc=f"quantize {options.format}", unit="weight", leave=False,
               disable=None if progress else True)  # None: tqdm's rule, a bar only on a terminal
    for path in headers:
        tensors = _quantize_shard(path, keys, writer, bar)
        bytes_in += sum(_nbytes(info) for k, info in headers[path].items() if k in keys - writer.linear_keys)
        bytes_out += sum(t.nbytes for k, t in tensors.items() if writer.is_output_of_expert(k))
        total_size += sum(t.nbytes for t in tensors.values())
        _save(tensors, dst / path.name)
        weight_map.update({k: path.name for k in tensors})
    bar.close()
    _copy_aux(src, dst, weight_map if (src / "model.safetensors.index.json").is_file() else None, total_size)
    writer.write_config(dst, config, headers, keys)
    return bytes_in, bytes_out


def bundled_variant_path(fmt: str, *, cache_dir: str | Path, source: str | Path | None = None) -> Path:
    """The bundled model quantized to ``fmt`` (w4a16 group 64 symmetric, or fp8-block),
    built on first use into ``cache_dir`` and reused after.

    The directory name carries a hash of the source weights and options, so a retrained
    bundled model gets a fresh build; the build goes to a temporary directory renamed into
    place, so an interrupted build never leaves a half-written variant.

    Raises:
        ValueError: a format the bundled model has no variant in (lists them).
    """
    from pagedexperts.loading.bundled import bundled_model_path

    options = BUNDLED_VARIANTS.get(fmt)
    if options is None:
        raise ValueError(f"the bundled model has no {fmt!r} variant; choose one of {sorted(BUNDLED_VARIANTS)}")
    _writer_for(options)  # a missing extra is reported before the cache is touched
    src = Path(source) if source is not None else bundled_model_path()
    digest = hashlib.sha256(repr(options).encode())
    for f in checkpoint_files(src):
        digest.update(Path(f).read_bytes())
    final = Path(cache_dir) / f"{src.name}-{fmt}-{digest.hexdigest()[:12]}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".build-") as tmp:
        quantize_checkpoint(model_path=src, output=Path(tmp) / "out", options=options)
        try:
            (Path(tmp) / "out").rename(final)
        except OSError:
            if not (final / "config.json").is_file():  # lost a race to another builder: fine
                raise
    return final


class _Writer:
    """One format's expert quantizer: validation from headers, per-tensor quantization, config.
    ``format``: the format it writes (``formats.FORMATS``, a record with ``quantize``);
    ``bundled``: the options of the bundled model's variant (``bundled:FORMAT``), None: none."""

    format: str = ""
    bundled: dict | None = None

    plan = None  # tools.quantize_model.WholeModelPlan: the non-expert weights quantized too (w4a16 scope "model")

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


class _W4A16Writer(_Writer):
    """compressed-tensors pack-quantized int4, written by the compressed-tensors package (scope
    "model": ``tools.quantize_model``'s plan, lm_head int8 per channel)."""

    format = "w4a16"
    bundled = dict(group_size=64, symmetric=True)  # the bundled model's I = 64: groups of 64 divide down_proj

    def __init__(self, options: QuantizeOptions) -> None:
        super().__init__(options)
        require("quant", "quantize --format w4a16 (and --model-path bundled:w4a16)", ("compressed_tensors",))
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        if options.group_size <= 0:
            raise ValueError(f"--group-size {options.group_size} must be a positive int")
        self.args = QuantizationArgs(num_bits=4, type="int", symmetric=options.symmetric, strategy="group",
                                     group_size=options.group_size)
        target = "Linear" if options.scope == "model" else W4A16_TARGET
        self.scheme = QuantizationScheme(targets=[target], weights=self.args, format="pack-quantized")

    def validate(self, config: dict, headers: dict[Path, dict]) -> set[str]:
        keys = super().validate(config, headers)
        if self.options.scope != "model":
            return keys
        from pagedexperts.tools.quantize_model import plan_whole_model

        self.plan = plan_whole_model(config, headers, keys, group_size=self.options.group_size,
                                     symmetric=self.options.symmetric)
        return keys | self.plan.keys

    def check_shape(self, key: str, shape: tuple[int, ...]) -> None:
        super().check_shape(key, shape)
        if shape[1] % self.options.group_size:
            raise ValueError(
                f"{key}: in_features {shape[1]} is not a multiple of --group-size {self.options.group_size}; "
                "pass a group size that divides every expert's input size"
            )

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


class _Fp8BlockWriter(_Writer):
    """Block FP8 (``formats.fp8.quantize_fp8_block``), the DeepSeek-V3 / Qwen3-FP8 layout."""

    format = "fp8-block"
    bundled = dict(block=(128, 128))

    def check_shape(self, key: str, shape: tuple[int, ...]) -> None:
        super().check_shape(key, shape)
        if min(self.options.block) <= 0:
            raise ValueError(f"fp8 block {self.options.block} must be two positive ints")

    def quantize(self, key: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        from pagedexperts.formats.fp8 import quantize_fp8_block

        q, scale_inv = quantize_fp8_block(weight, self.options.block)
        return {key: q, key + "_scale_inv": scale_inv}

    def quantization_config(self, config: dict, headers: dict[Path, dict], expert_keys: set[str]) -> dict:
        plain = sorted({k.removesuffix(".weight") for h in headers.values() for k, info in h.items()
                        if k.endswith(".weight") and len(info["shape"]) == 2 and k not in expert_keys})
        if not config.get("tie_word_embeddings", False) or "lm_head" not in plain:
            plain = sorted(set(plain) | {"lm_head"})
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.options.block), "modules_to_not_convert": plain}


class _Mxfp4Writer(_Writer):
    """MXFP4 of gpt-oss's stacked, transposed experts (``formats.mxfp4.quantize_mxfp4``)."""

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
        from pagedexperts.formats.mxfp4 import quantize_mxfp4

        blocks, scales = quantize_mxfp4(weight.transpose(1, 2).contiguous())  # [E, in, out] -> [E, out, in]
        return {key + "_blocks": blocks, key + "_scales": scales}

    def quantization_config(self, config: dict, headers: dict[Path, dict], expert_keys: set[str]) -> dict:
        plain = sorted({k.removesuffix(".weight") for h in headers.values() for k, info in h.items()
                        if k.endswith(".weight") and len(info["shape"]) == 2})
        return {"quant_method": "mxfp4", "modules_to_not_convert": sorted(set(plain) | {"lm_head"})}


_WRITERS = {w.format: w for w in (_W4A16Writer, _Fp8BlockWriter, _Mxfp4Writer)}
BUNDLED_VARIANTS = {w.format: QuantizeOptions(w.format, **w.bundled) for w in _WRITERS.values() if w.bundled is not None}


def _writer_for(options: QuantizeOptions) -> _Writer:
    if options.format not in _WRITERS:
        raise ValueError(f"--format {options.format!r}: choose one of {list(QUANTIZE_FORMATS)}")
    if options.scope not in QUANTIZE_SCOPES:
        raise ValueError(f"--scope {options.scope!r}: choose one of {list(QUANTIZE_SCOPES)}")
    if options.scope == "model" and options.format != "w4a16":
        raise ValueError(f"--scope model writes w4a16 only; --format {options.format} takes --scope experts")
    return _WRITERS[options.format](options)


def _read_config(src: Path) -> dict:
    path = src / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in --model-path {src}")
    config = json.loads(path.read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method")
        raise ValueError(f"--model-path {src} is already quantized (quant_method {method!r}); pass a bf16/fp16/fp32 one")
    return config


def _quantize_shard(path: Path, expert_keys: set[str], writer: _Writer, bar) -> dict[str, torch.Tensor]:
    """Every tensor of one shard, the routed expert weights quantized (each one ticks ``bar``)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            tensor = f.get_tensor(key)
            if key in expert_keys:
                out.update(writer.quantize(key, tensor))
                bar.update()
            else:
                out[key] = tensor
    return out


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: t.contiguous() for k, t in tensors.items()}, str(path), metadata={"format": "pt"})


def _copy_aux(src: Path, dst: Path, weight_map: dict[str, str] | None, total_size: int) -> None:
    """Tokenizer, generation config, chat template, README...; a fresh index for sharded sources
    (``total_size``: bytes of every tensor written)."""
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _AUX_SKIP:
            shutil.copy2(f, dst / f.name)
    if weight_map is not None:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _nbytes(info: dict) -> int:
    begin, end = info["data_offsets"]
    return end - begin
