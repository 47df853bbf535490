"""A checkpoint's safetensors files and their headers: the one shard listing, the one header parse.

Owns: which files make a Hugging Face checkpoint (``checkpoint_files``: the shards named by
``model.safetensors.index.json``, else ``model.safetensors``, else every ``*.safetensors``) and
the parse of one file's header (``read_header_json``), the published format
(https://huggingface.co/docs/safetensors): an 8-byte little-endian header length N, then N bytes
of JSON mapping each key to ``dtype``, ``shape`` and ``data_offsets`` [begin, end) relative to
the byte after the header. Standard library only: sizing and preflight read headers without
torch; ``safetensors_index`` turns the same parse into byte ranges and reads.
Does not: read tensor data.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The safetensors files of a model directory: the shards named by its index (sorted,
    distinct), else ``model.safetensors``, else every ``*.safetensors`` file, sorted.

    Raises:
        FileNotFoundError: no safetensors in the directory, or a shard named by the index is
            missing (names the files and --model-path).
    """
    model_path = Path(model_path)
    index = model_path / INDEX_FILE
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_path / s for s in shards]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"checkpoint shards named in {index} are missing: {missing}")
        return files
    if (model_path / SINGLE_FILE).exists():
        return [model_path / SINGLE_FILE]
    found = sorted(model_path.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(
        f"no safetensors checkpoint in {model_path}: no *.safetensors file ({SINGLE_FILE}, or shards "
        "named by an index); pass a checkpoint directory (--model-path)"
    )


def read_header_json(path: str | Path) -> tuple[dict, int]:
    """(header, data_start) of one safetensors file: name -> {dtype, shape, data_offsets}, with
    ``__metadata__`` dropped, and the absolute offset of the data (8 + N).

    Raises:
        ValueError: the file is shorter than its header length, the length exceeds the file,
            or the header is not valid JSON (names the file).
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length; truncated?)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{path}: safetensors header length {n} exceeds the file size {size} (truncated or corrupt?)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: safetensors header is not valid JSON: {exc} (truncated or corrupt?)") from None
    header.pop("__metadata__", None)
    return header, 8 + n
