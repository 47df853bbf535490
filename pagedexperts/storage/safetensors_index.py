"""Byte ranges of a checkpoint's tensors (``TensorEntry``), their map to per-expert store rows
(``Extent``), the check that every shard's header is readable, and positional reads (``os.preadv``)
straight into tensor memory, no memory map. Generic over dtype and packing. Does not decide what to
read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch

from pagedexperts.storage.safetensors_files import read_header_json

# safetensors dtype strings -> torch dtypes (those this torch build has)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in {
        "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
        "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16",
        "BF16": "bfloat16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    }.items()
    if hasattr(torch, attr)
}


class TensorEntry(NamedTuple):
    """One tensor of a safetensors file: absolute byte offset ``start`` and ``nbytes``."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


class Extent(NamedTuple):
    """Bytes ``[offset, offset + nbytes)`` of ``path`` (``src_dtype``, ``numel`` elements) filling part
    of one expert's flat row. ``outer`` 1: elements ``[dst_elem, dst_elem + numel)``; ``outer`` > 1
    (a source concatenated along a per-expert dim d > 0, e.g. GPTQ's gate and up): the row viewed as
    [outer, numel_row / outer], columns ``[dst_elem, dst_elem + numel / outer)`` of every row."""

    path: Path
    offset: int
    nbytes: int
    src_dtype: torch.dtype
    dst_elem: int
    numel: int
    outer: int = 1


class DiskReadError(OSError):
    """A checkpoint file could not be read while the model runs (moved, deleted, truncated)."""


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one file by key (``__metadata__`` skipped). ValueError names the file: not the
    safetensors layout, unknown dtype, or bytes past the end."""
    path = Path(path)
    header, base = read_header_json(path)
    size = path.stat().st_size
    out = {}
    for key, meta in header.items():
        if meta["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"checkpoint shard {path}: tensor {key!r} has dtype {meta['dtype']!r}, not readable here")
        begin, end = meta["data_offsets"]
        if base + end > size:
            raise ValueError(
                f"checkpoint shard {path}: tensor {key!r} ends at byte {base + end}, past the file's "
                f"{size} bytes (truncated or corrupt?)"
            )
        out[key] = TensorEntry(path, SAFETENSORS_DTYPES[meta["dtype"]], tuple(meta["shape"]), base + begin, end - begin)
    return out


def check_readable(files: list[Path]) -> None:
    """Read every shard's header so a truncated or corrupt shard is found before any allocation
    (ValueError names it)."""
    for file in files:
        try:
            read_header(file)
        except ValueError as exc:  # the reason without the file's name, said once here
            reason = str(exc).removeprefix(f"checkpoint shard {file}: ").removeprefix(f"{file}: ")
            reason = reason if "truncated or corrupt" in reason else f"{reason} (truncated or corrupt?)"
            raise ValueError(f"cannot read checkpoint shard {file}: {reason}") from exc


def bytes_view(flat: torch.Tensor):
    """A writable uint8 numpy view of a contiguous 1-D CPU tensor's memory (for ``preadv``)."""
    return flat.view(torch.uint8).numpy()


def pread_into(fd: int, buf, offset: int, *, path: Path) -> None:
    """Fill ``buf`` from byte ``offset`` of ``fd``; DiskReadError (names file and offset) if the file
    ends early."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise DiskReadError(f"checkpoint file {path} ends at byte {os.fstat(fd).st_size:,}, before the {len(view):,} "
                                f"bytes at {offset:,} were read (truncated?)")
        done += n


def read_extent(fd: int, extent: Extent, dst_row: torch.Tensor, staging: torch.Tensor | None) -> None:
    """Read ``extent`` into the flat CPU row ``dst_row``, one read: straight into the row when
    contiguous and of the same dtype, else through ``staging`` (uint8) and one ``copy_``."""
    if extent.outer == 1:
        dst = dst_row[extent.dst_elem : extent.dst_elem + extent.numel]
        if extent.src_dtype == dst.dtype:
            pread_into(fd, bytes_view(dst), extent.offset, path=extent.path)
            return
    else:
        cols = extent.numel // extent.outer
        dst = dst_row.view(extent.outer, -1)[:, extent.dst_elem : extent.dst_elem + cols]
    if staging is None or staging.numel() < extent.nbytes:
        staging = torch.empty(extent.nbytes, dtype=torch.uint8)
    buf = staging[: extent.nbytes]
    pread_into(fd, bytes_view(buf), extent.offset, path=extent.path)
    dst.copy_(buf.view(extent.src_dtype).view(dst.shape))


def one_run(jobs: list[tuple[Extent, torch.Tensor]]) -> bool:
    """Whether sorted (extent, row) jobs lie back to back in one file, each a whole run in its own
    dtype."""
    if len(jobs) < 2:
        return False
    for (ext, _), (nxt, _) in zip(jobs, jobs[1:]):
        if nxt.path != ext.path or nxt.offset != ext.offset + ext.nbytes:
            return False
    return all(ext.outer == 1 and ext.src_dtype == dst.dtype for ext, dst in jobs)


def read_run(fd: int, jobs: list[tuple[Extent, torch.Tensor]]) -> None:
    """Back-to-back extents into their rows in one ``os.preadv`` (more only after a short read);
    DiskReadError."""
    first = jobs[0][0]
    bufs = [memoryview(bytes_view(dst[ext.dst_elem: ext.dst_elem + ext.numel])).cast("B") for ext, dst in jobs]
    offset, total = first.offset, sum(len(b) for b in bufs)
    while bufs:
        n = os.preadv(fd, bufs, offset)
        if n == 0:
            raise DiskReadError(f"file {first.path} ends at byte {os.fstat(fd).st_size:,}, before the {total:,} bytes "
                                f"at {first.offset:,} were read (truncated?)")
        offset += n
        advance(bufs, n)


def advance(bufs: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``bufs`` in place (a vectored read or write that moved ``n``)."""
    while bufs and n >= len(bufs[0]):
        n -= len(bufs[0])
        bufs.pop(0)
    if bufs and n:
        bufs[0] = bufs[0][n:]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def expert_extents(entry: TensorEntry, *, spec, expert: int | None, num_experts: int,
                   src_index: int, n_src: int, key: str) -> list[tuple[int, Extent]]:
    """(expert, Extent) pairs of one checkpoint tensor for store tensor ``spec``: ``expert`` None for a
    stacked [E, *row] tensor, else one expert's source ``src_index`` of ``n_src`` concatenated along
    ``spec.concat_dim``. ValueError names the key and both shapes."""
    row_numel = _numel(spec.shape)
    if expert is None:
        if entry.shape[:1] != (num_experts,):
            raise ValueError(f"expert tensor {key!r} has {entry.shape[0]} experts along its leading dim, config says "
                             f"E={num_experts}: a stacked expert tensor is [E, ...] (one expert's bytes contiguous)")
        if tuple(entry.shape[1:]) != tuple(spec.shape):
            raise ValueError(f"expert tensor {spec.name!r} ({key!r}): checkpoint shape {entry.shape[1:]} per expert "
                             f"does not match the config's {tuple(spec.shape)}")
        row_bytes = entry.nbytes // num_experts
        return [(e, Extent(entry.path, entry.start + e * row_bytes, row_bytes, entry.dtype, 0, row_numel))
                for e in range(num_experts)]
    dim = spec.concat_dim if n_src > 1 else 0
    want = tuple(size // n_src if d == dim else size for d, size in enumerate(spec.shape))
    # a 0-d per-expert scalar (ModelOpt's per-tensor scales) is a [1] source: the same bytes
    if (tuple(entry.shape) or (1,)) != want or (n_src > 1 and spec.shape[dim] % n_src):
        raise ValueError(
            f"expert tensor {spec.name!r} of expert {expert}: checkpoint shape {entry.shape} ({key!r}) does not match "
            f"the config's {want}" + (f" from each of its {n_src} sources along dim {dim}" if n_src > 1 else "")
            + " (config moe_intermediate_size?)"
        )
    numel, outer = _numel(want), _numel(spec.shape[:dim])
    cols = numel // outer
    return [(expert, Extent(entry.path, entry.start, entry.nbytes, entry.dtype, src_index * cols, numel, outer))]
