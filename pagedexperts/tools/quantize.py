"""Round-to-nearest quantization of a checkpoint's routed experts into a published format.

Owns: ``quantize_checkpoint`` (an unquantized Hugging Face checkpoint in, its ROUTED expert
weights quantized, everything else copied byte for byte, written in the format's published
layout that transformers' ``from_pretrained`` loads; w4a16 ``scope`` "model": every nn.Linear
but the routers, ``tools.quantize_model``), the bundled model's quantized variants built on
first use into the cache, and ``write_kernel_layout``. The formats (w4a16, fp8-block, mxfp4)
and their writers: ``tools.quantize_writers``. Does not: calibrate (plain round-to-nearest),
dequantize (``formats``) or load models for inference.

Legend: E experts, O output features, I input features (nn.Linear [O, I]).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pagedexperts.storage.safetensors_files import checkpoint_files, read_header_json
from pagedexperts.storage.safetensors_index import check_readable
from pagedexperts.tools.quantize_writers import WRITERS, QuantizeOptions, Writer, writer_for

_AUX_SKIP = ("model.safetensors.index.json", "config.json")


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
    group_size: int | None = None  # w4a16: the group size written (the one chosen when none was given)


def quantize_checkpoint(*, model_path: str | Path, output: str | Path, options: QuantizeOptions,
                        progress: bool = False) -> QuantizeReport:
    """Quantize ``model_path``'s routed experts into ``output``, keeping the source's shard names and
    index; everything validated from the headers before any tensor is read; ``progress``: a tqdm
    bar on stderr where it is a terminal.

    Raises:
        ValueError: unknown format or scope, an already quantized source, no routed expert weight,
            an expert shape the format cannot hold (names the tensor, the size and the flag), with
            scope "model" a module the CPU kernels cannot compute packed, a truncated shard, or an
            output that is a file or a non-empty directory. Nothing is left in ``output`` when
            writing fails.
        FileNotFoundError: no config.json in ``model_path``.
    """
    src, dst = Path(model_path), Path(output)
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"--output {dst} is a file; choose a new directory")
    config = _read_config(src)
    writer = writer_for(options)
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
    return QuantizeReport(dst, options.format, len(keys - writer.linear_keys), *sizes, len(writer.linear_keys),
                          writer.group_size)


def _write(src: Path, dst: Path, config: dict, headers: dict, keys: set[str], writer: Writer,
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
    """The bundled model quantized to ``fmt``, built on first use into ``cache_dir`` (its name
    carries a hash of the source weights and options; written to a temporary directory renamed
    into place) and reused after.

    Raises:
        ValueError: a format the bundled model has no variant in (lists them).
    """
    from pagedexperts.loading.bundled import bundled_model_path

    options = BUNDLED_VARIANTS.get(fmt)
    if options is None:
        raise ValueError(f"the bundled model has no {fmt!r} variant; choose one of {sorted(BUNDLED_VARIANTS)}")
    writer_for(options)  # a missing extra is reported before the cache is touched
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


BUNDLED_VARIANTS = {w.format: QuantizeOptions(w.format, **w.bundled) for w in WRITERS.values() if w.bundled is not None}


def _read_config(src: Path) -> dict:
    path = src / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in --model-path {src}")
    config = json.loads(path.read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method")
        raise ValueError(f"--model-path {src} is already quantized (quant_method {method!r}); pass a bf16/fp16/fp32 one")
    return config


def _quantize_shard(path: Path, expert_keys: set[str], writer: Writer, bar) -> dict[str, torch.Tensor]:
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
    """One shard, with the mode ``open()`` gives a new file under the umask (safetensors writes a
    0600 temporary file and renames it over ``path``)."""
    from safetensors.torch import save_file

    save_file({k: t.contiguous() for k, t in tensors.items()}, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~current_umask())


def current_umask() -> int:
    """This process's umask: /proc/self/status's ``Umask`` (Linux >= 4.7), else read by setting
    and restoring it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _copy_aux(src: Path, dst: Path, weight_map: dict[str, str] | None, total_size: int) -> None:
    """Tokenizer, generation config, chat template, README...; a fresh index for sharded sources
    (``total_size``: bytes of every tensor written)."""
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _AUX_SKIP:
            shutil.copyfile(f, dst / f.name)  # a new file: the umask decides its mode, as for the shards
    if weight_map is not None:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _nbytes(info: dict) -> int:
    begin, end = info["data_offsets"]
    return end - begin


def write_kernel_layout(checkpoint: str | Path) -> str:
    """Store ``checkpoint``'s experts in torch's CPU kernel layouts for this CPU and its dtype
    (``loading.stored_layout.write_checkpoint_layout``: its ``kernel-layout/``, what the packed disk
    tier reads so that a miss is a read and a copy); one line saying what was written, or why not.

    Raises:
        StoredLayoutError: the write failed (the checkpoint itself is complete and untouched)."""
    from pagedexperts.loading.loader import load_model
    from pagedexperts.loading.stored_layout import write_checkpoint_layout
    from pagedexperts.storage.kernel_layout_file import StoredLayout
    from pagedexperts.storage.safetensors_files import checkpoint_files

    path = Path(checkpoint)
    model, _ = load_model(path, experts_implementation="packed", stored_layout=False, check_independence=False)
    got = write_checkpoint_layout(model, path, [*checkpoint_files(path), path / "config.json"])
    if not isinstance(got, StoredLayout):
        return f"no stored kernel layout: {got}"
    return (f"stored kernel layout {got.path} ({got.file_bytes / 1e6:.1f} MB; torch's CPU pack for "
            f"{got.key.capability}, {got.key.dtype}, torch {got.key.torch_version})")
