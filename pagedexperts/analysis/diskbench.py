"""Disk read benchmark of a checkpoint: what the disk tier's reads cost on this machine.

Owns timing reads of a checkpoint's safetensors files cold (page cache dropped with
``posix_fadvise(DONTNEED)``; ``cold: false`` where unavailable) and warm: sequential chunks, and
the largest tensors by ``os.preadv`` (the disk tier's way) and by safetensors' slicing.
GB/s = 1e9 B/s. Does not: decide anything.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from pagedexperts.storage.safetensors_index import bytes_view, pread_into, read_header

SEQUENTIAL_CHUNK = 16 << 20


def drop_page_cache(files: list[Path]) -> bool:
    """Ask the kernel to drop ``files`` from the page cache; False where that is unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _sequential(files: list[Path], max_bytes: int) -> tuple[int, float]:
    buf = torch.empty(SEQUENTIAL_CHUNK, dtype=torch.uint8)
    done, t0 = 0, time.perf_counter()
    for f in files:
        size = f.stat().st_size
        fd = os.open(f, os.O_RDONLY)
        try:
            for off in range(0, size, SEQUENTIAL_CHUNK):
                n = min(SEQUENTIAL_CHUNK, size - off, max_bytes - done)
                if n <= 0:
                    break
                pread_into(fd, bytes_view(buf[:n]), off, path=f)
                done += n
        finally:
            os.close(fd)
        if done >= max_bytes:
            break
    return done, time.perf_counter() - t0


def _per_tensor(entries: dict, *, how: str) -> tuple[int, float]:
    """Read every entry (key -> TensorEntry) by ``how``: "pread" or "safetensors_slice"."""
    from safetensors import safe_open

    t0 = time.perf_counter()
    if how == "pread":
        for e in entries.values():
            out = torch.empty(e.nbytes, dtype=torch.uint8)
            with open(e.path, "rb", buffering=0) as f:
                pread_into(f.fileno(), bytes_view(out), e.start, path=e.path)
    else:
        by_file: dict = {}
        for key, e in entries.items():
            by_file.setdefault(e.path, []).append(key)
        for path, keys in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for key in keys:
                    f.get_slice(key)[:]
    return sum(e.nbytes for e in entries.values()), time.perf_counter() - t0


def measure_disk(path: str | Path, *, max_bytes: int = 2 << 30, tensors: int = 64) -> dict:
    """Read GB/s of a checkpoint (a directory of safetensors, or one file): files, cold,
    sequential_{cold,warm}_gbps over up to ``max_bytes``, and cold per-tensor GB/s over the
    ``tensors`` largest of the first file for ``pread`` and ``safetensors_slice``.
    Raises FileNotFoundError: no safetensors file at ``path``."""
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not files[0].exists():
        raise FileNotFoundError(f"no safetensors file at {str(p)!r} (--disk)")
    out: dict = {"files": [str(f) for f in files]}
    out["cold"] = drop_page_cache(files)
    n, s = _sequential(files, max_bytes)
    out.update(sequential_bytes=n, sequential_cold_gbps=n / s / 1e9)
    n, s = _sequential(files, max_bytes)
    out["sequential_warm_gbps"] = n / s / 1e9
    header = read_header(files[0])
    largest = dict(sorted(header.items(), key=lambda kv: -kv[1].nbytes)[:tensors])
    for how in ("pread", "safetensors_slice"):
        drop_page_cache(files[:1])
        n, s = _per_tensor(largest, how=how)
        out[f"{how}_cold_gbps"] = n / s / 1e9
    out["tensor_bytes"] = sum(e.nbytes for e in largest.values())
    out["tensors"] = len(largest)
    return out
