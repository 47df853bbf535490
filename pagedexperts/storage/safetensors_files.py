"""A checkpoint's safetensors files and their headers: the one shard listing (``checkpoint_files``) and
the one header parse (``read_header_json``) of the published format
(https://huggingface.co/docs/safetensors: an 8-byte little-endian length N, then N bytes of JSON
with each key's ``dtype``, ``shape`` and ``data_offsets`` from the byte after the header). Standard
library only; reads no tensor data.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The index's shards (sorted, distinct), else ``model.safetensors``, else every ``*.safetensors``.
    FileNotFoundError names the files and --model-path."""
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
    """(header without ``__metadata__``, absolute data offset 8 + N) of one file. ValueError names the
    file: too short, length past the end, or invalid JSON."""
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
