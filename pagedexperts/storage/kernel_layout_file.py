"""Experts stored on disk in a compute kernel's layout (docs/disk-tier.md "Packed experts: the kernels'
layout stored on disk"): the file (``StoredLayout``: a JSON header, one ALIGN-aligned extent per
expert, then a trailer of one CRC-32 per expert), its key (``LayoutKey``), the check
(``open_stored_layout``), the per-expert check of bytes read (``StoredLayout.damaged``) and the one
write (``write_stored_layout``).

Legend: L MoE layers, E experts per layer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import zlib
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from pagedexperts.formats.base import TensorSpec
from pagedexperts.storage.safetensors_index import Extent, advance, bytes_view

FORMAT_VERSION = 2  # 2: a CRC-32 per expert after the extents (1 had none: rebuilt)
MAGIC = b"PXKLAYT1"  # 8 bytes, then the header's length (8 bytes little-endian), then the header (JSON)
ALIGN = 4096  # every expert's extent starts at a multiple of this (a page; O_DIRECT's alignment)


class StoredLayoutError(OSError):
    """A stored layout could not be written (full disk, file size limit, permissions)."""


@dataclass(frozen=True)
class LayoutKey:
    """What the stored bytes depend on (a file whose key differs is never used); ``source``: (name,
    size, mtime ns, digest) per file, ``specs``: one expert's tensors in file order."""

    torch_version: str
    capability: str
    dtype: str
    num_layers: int
    num_experts: int
    specs: tuple[tuple[str, tuple[int, ...], str], ...]
    source: tuple[tuple[str, int, int, str], ...]
    format_version: int = FORMAT_VERSION

    @staticmethod
    def make(*, specs: list[TensorSpec], dtype: torch.dtype, num_layers: int, num_experts: int,
             source_files: list[Path], capability: str | None = None, content: bool = False,
             digest: Callable[[Path], str] | None = None) -> "LayoutKey":
        """The key of a layout of ``specs`` made now by this torch on this CPU from ``source_files``
        (``content``: also each file's ``digest``, default ``file_digest``)."""
        return LayoutKey(torch_version=torch.__version__,
                         capability=capability or torch.backends.cpu.get_cpu_capability(),
                         dtype=str(dtype).removeprefix("torch."), num_layers=num_layers, num_experts=num_experts,
                         specs=tuple((s.name, tuple(s.shape), str(s.dtype).removeprefix("torch.")) for s in specs),
                         source=source_fingerprint(source_files, content=content, digest=digest))

    @property
    def tensor_specs(self) -> list[TensorSpec]:
        return [TensorSpec(n, tuple(shape), getattr(torch, d)) for n, shape, d in self.specs]

    @property
    def expert_bytes(self) -> int:
        return sum(s.row_bytes for s in self.tensor_specs)

    @property
    def stride(self) -> int:
        """Bytes from one expert's extent to the next (expert bytes rounded up to ALIGN)."""
        return -(-self.expert_bytes // ALIGN) * ALIGN

    def differences(self, other: "LayoutKey", content: Mapping[str, bool] | None = None) -> list[str]:
        """What differs between ``self`` (stored) and ``other`` (wanted), one item per field or file;
        sources compare by size and mtime, or as equal where ``content`` says the bytes matched."""
        out = []
        for name in ("format_version", "torch_version", "capability", "dtype", "num_layers", "num_experts", "specs"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name} {a if name != 'specs' else 'of the expert tensors'} (now "
                           f"{b if name != 'specs' else 'other shapes'})")
        content = content or {}
        stored, now = {f[0]: f[1:3] for f in self.source}, {f[0]: f[1:3] for f in other.source}
        for name in sorted(set(stored) | set(now)):
            if stored.get(name) == now.get(name) or content.get(name):
                continue
            out.append(f"source file {name} " + ("added" if name not in stored else "removed" if name not in now
                       else f"changed (size {stored[name][0]:,} -> {now[name][0]:,}, mtime differs)"
                       if stored[name][0] != now[name][0]
                       else "changed (same size, mtime differs, other content: its sha256 differs)" if name in content
                       else "changed (mtime differs)"))
        return out

    def moved_sources(self, other: "LayoutKey") -> list[str]:
        """Source files whose size ``other`` shares but whose mtime differs (as after a copy), stored
        with a digest: those a hash can vouch for."""
        now = {f[0]: f[1:3] for f in other.source}
        return [f[0] for f in self.source if f[3] and f[0] in now and now[f[0]][0] == f[1] and now[f[0]][1] != f[2]]


def source_fingerprint(files: list[Path], *, content: bool = False,
                       digest: Callable[[Path], str] | None = None) -> tuple[tuple[str, int, int, str], ...]:
    """(name, size, mtime_ns, digest) of each file, sorted by name; the digest (``digest(file)``, default
    ``file_digest``) is "" unless ``content``."""
    digest = digest or file_digest
    out = []
    for f in sorted(Path(p) for p in files):
        st = f.stat()
        out.append((f.name, st.st_size, st.st_mtime_ns, digest(f) if content else ""))
    return tuple(out)


def file_digest(path: Path, *, chunk: int = 1 << 23) -> str:
    """"sha256:<hex>" of the file's bytes, read ``chunk`` bytes at a time; OSError when unreadable."""
    h = hashlib.sha256()
    buf = memoryview(bytearray(chunk))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(buf[:n])
    return "sha256:" + h.hexdigest()


@dataclass(frozen=True)
class StoredLayout:
    """A valid stored layout: ``path``, ``key``, data offset, ``verified_by_content`` (sources hashed
    equal)."""

    path: Path
    key: LayoutKey
    data_start: int
    verified_by_content: tuple[str, ...] = ()
    checksums: tuple[int, ...] = ()  # CRC-32 of each expert's bytes, layer-major (read by ``open_stored_layout``)

    @property
    def trailer_start(self) -> int:
        return self.data_start + self.key.num_layers * self.key.num_experts * self.key.stride

    @property
    def file_bytes(self) -> int:
        return self.trailer_start + 4 * self.key.num_layers * self.key.num_experts

    def damaged(self, layer: int, expert: int, rows: Sequence[torch.Tensor]) -> str | None:
        """None when ``rows`` (the expert's tensors in spec order, as read) match its stored CRC-32;
        else a one-line reason naming the file, layer and expert."""
        got = expert_crc(rows)
        want = self.checksums[layer * self.key.num_experts + expert]
        if got == want:
            return None
        return (f"stored kernel layout {self.path}: expert {expert} of MoE layer {layer} is damaged (CRC-32 "
                f"{got:08x}, stored {want:08x})")

    def offset(self, layer: int, expert: int) -> int:
        """Byte offset of the extent of ``expert`` of MoE layer index ``layer`` (0..L-1)."""
        return self.data_start + (layer * self.key.num_experts + expert) * self.key.stride

    def extents(self, layer: int) -> dict[str, list[list[Extent]]]:
        """The layer's experts as the disk tier reads them: name -> [E] lists of one ``Extent`` each."""
        out: dict[str, list[list[Extent]]] = {s.name: [] for s in self.key.tensor_specs}
        for e in range(self.key.num_experts):
            at = self.offset(layer, e)
            for s in self.key.tensor_specs:
                out[s.name].append([Extent(self.path, at, s.row_bytes, s.dtype, 0, s.numel)])
                at += s.row_bytes
        return out


def _header_bytes(key: LayoutKey) -> tuple[bytes, int]:
    body = json.dumps(asdict(key), sort_keys=True).encode()
    head = MAGIC + len(body).to_bytes(8, "little") + body
    return head, -(-len(head) // ALIGN) * ALIGN


def _read_key(path: Path) -> tuple[LayoutKey, int] | str:
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) < 16 or head[:8] != MAGIC:
                return "not a stored kernel layout (bad magic)"
            length, size = int.from_bytes(head[8:], "little"), os.fstat(f.fileno()).st_size
            if length > size - 16:  # a damaged length field: never allocate what the file does not hold
                return f"unreadable header (its length {length:,} bytes exceeds the file's {size:,})"
            body = f.read(length)
        raw = json.loads(body)
        raw["specs"] = tuple((n, tuple(s), d) for n, s, d in raw["specs"])
        raw["source"] = tuple((*x, "") if len(x) == 3 else tuple(x) for x in raw["source"])  # 3: no digest
        key = LayoutKey(**raw)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return f"unreadable header ({type(exc).__name__}: {exc})"
    return key, -(-(16 + len(body)) // ALIGN) * ALIGN


def open_stored_layout(path: Path, want: LayoutKey, source_files: Sequence[Path] = (), *,
                       digest: Callable[[Path], str] | None = None) -> StoredLayout | str:
    """The stored layout at ``path`` if made for ``want`` and complete, else a one-line reason; sources
    differing only by mtime are hashed (``digest``, default ``file_digest``) and accepted if equal.
    Given a ``digest`` (a ``storage.source_digests.DigestMemo``'s, which hashes a file again only when
    its identity, ctime included, changed), sources whose size and mtime match are compared by
    content too: a same-size write with its mtime set back is seen."""
    remembers = digest is not None
    digest = digest or file_digest
    path = Path(path)
    if not path.exists():
        return f"{path} does not exist"
    got = _read_key(path)
    if isinstance(got, str):
        return f"{path}: {got}"
    key, data_start = got
    diffs = key.differences(want)
    moved = key.moved_sources(want)
    files = {Path(f).name: Path(f) for f in source_files}
    content = {}
    stored = {f[0]: f[3] for f in key.source}
    if diffs and moved and len(moved) == len(diffs) and all(name in files for name in moved):
        try:
            content = {name: digest(files[name]) == stored[name] for name in moved}
        except OSError as exc:
            return f"{path}: a source file could not be read to compare its content ({exc})"
        diffs = key.differences(want, content)
    if not diffs and remembers:  # size and mtime match: the memo says whether the bytes were written since
        try:
            changed = [name for name, file in sorted(files.items())
                       if stored.get(name) and name not in content and digest(file) != stored[name]]
        except OSError as exc:
            return f"{path}: a source file could not be read to compare its content ({exc})"
        diffs = [f"source file {name} changed (same size and mtime, other content: its sha256 differs)"
                 for name in changed]
    if diffs:
        return f"{path} was made for another source or setting: {'; '.join(diffs)}"
    layout = StoredLayout(path, key, data_start, tuple(name for name, same in content.items() if same))
    size = path.stat().st_size
    if size != layout.file_bytes:
        return f"{path} is {size:,} bytes, not the {layout.file_bytes:,} its header promises (truncated?)"
    n = key.num_layers * key.num_experts
    try:
        with open(path, "rb") as f:
            f.seek(layout.trailer_start)
            trailer = f.read(4 * n)
    except OSError as exc:
        return f"{path}: its checksums could not be read ({exc})"
    if len(trailer) != 4 * n:
        return f"{path}: its checksums are cut short (truncated?)"
    checksums = tuple(int.from_bytes(trailer[4 * i:4 * i + 4], "little") for i in range(n))
    return dataclasses.replace(layout, checksums=checksums)


def expert_crc(rows: Sequence[torch.Tensor]) -> int:
    """CRC-32 (zlib) of the bytes of ``rows`` in order: one expert's tensors in spec order."""
    crc = 0
    for t in rows:
        crc = zlib.crc32(bytes_view(t.contiguous().view(-1)), crc)
    return crc


def write_stored_layout(path: Path, key: LayoutKey, rows: Callable[[int, int, int], Mapping[str, torch.Tensor]], *,
                        chunk: int = 2, source_name: str = "the checkpoint") -> StoredLayout:
    """Write ``key``'s layout to ``path`` from ``rows(layer, first, n)`` -> {spec name: [n,
    *spec.shape]}: to a temporary sibling, flushed and dropped from the page cache every ``chunk``
    experts, then renamed. StoredLayoutError (names path, bytes and that the source is untouched;
    nothing left behind)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    head, data_start = _header_bytes(key)
    layout = StoredLayout(path, key, data_start)
    specs = key.tensor_specs
    _remove_stale_temps(path)
    crcs = bytearray()
    made_dir = not path.parent.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # as open(): the umask decides
        try:
            _write_all(fd, [memoryview(head)], 0)
            for layer in range(key.num_layers):
                for first in range(0, key.num_experts, chunk):
                    n = min(chunk, key.num_experts - first)
                    got = rows(layer, first, n)
                    for i in range(n):
                        bufs = [bytes_view(got[s.name][i].contiguous().view(-1)) for s in specs]
                        _write_all(fd, [memoryview(b) for b in bufs], layout.offset(layer, first + i))
                        crcs += expert_crc([got[s.name][i] for s in specs]).to_bytes(4, "little")
                    del got
                    # written pages leave the page cache (and a memory cgroup's count) chunk by chunk
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            _write_all(fd, [memoryview(bytes(crcs))], layout.trailer_start)
            os.ftruncate(fd, layout.file_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if made_dir:  # nothing left behind: the directory made for it too, when empty
            with contextlib.suppress(OSError):
                path.parent.rmdir()
        raise StoredLayoutError(
            exc.errno, f"writing the stored kernel layout {path} ({layout.file_bytes:,} bytes) failed: "
            f"{exc.strerror or exc}; the partial file is removed and {source_name} is untouched") from exc
    return dataclasses.replace(layout, checksums=tuple(int.from_bytes(crcs[i:i + 4], "little")
                                                       for i in range(0, len(crcs), 4)))


def _remove_stale_temps(path: Path) -> None:
    """Remove temporary siblings left by a writer that no longer runs (e.g. OOM-killed mid-write)."""
    for tmp in path.parent.glob(f"{path.name}.tmp-*"):
        try:
            os.kill(int(tmp.name.rsplit("-", 1)[1]), 0)
        except ValueError:
            continue
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                tmp.unlink()
        except PermissionError:
            continue  # alive, another user's


def _write_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    """pwritev every byte of ``bufs`` at ``offset`` (a short write continues; 0 raises ENOSPC)."""
    bufs = [b.cast("B") for b in bufs]
    while bufs:
        n = os.pwritev(fd, bufs, offset)
        if n <= 0:
            raise OSError(28, "No space left on device (short write)")
        offset += n
        advance(bufs, n)
