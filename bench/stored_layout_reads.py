"""Cold reads of experts from a stored kernel layout: preadv, mmap + copy, O_DIRECT preadv.

Issue 46, item 1 ("reads by whatever is fastest here, measured"). A disk-tier miss reads one
expert's extent of the stored layout (``storage.kernel_layout_file``: one contiguous extent per
expert, every extent starting at a multiple of 4096) into a host row. Three ways to do that read:

- ``preadv``: ``os.preadv`` into the row's tensor memory (what ``storage.host_tier`` does);
- ``mmap``: the file mapped once, the expert's bytes copied from the mapping into the row
  (``memmove``: page faults read the file);
- ``odirect``: the file opened with ``O_DIRECT``, ``os.preadv`` of the expert's stride (a
  multiple of 4096) into a 4096-aligned row (no page cache);
- ``odirect+copy``: the same into a 4096-aligned staging row per reader thread, then ``memmove``-d into
  the row (what the tier would do: its rows are views of per-tensor [R, ...] tensors, whose
  addresses and lengths O_DIRECT cannot take in general).

Each at 1 and 4 reads in flight (a thread pool, as the tier reads a step's misses). A round drops
the file from the page cache (``bench/real_disk.py``'s ``drop_page_cache``: posix_fadvise
DONTNEED) before every (method, in-flight) cell, then reads the round's ``--experts`` experts at
random (the same ones for every cell of the round) into rows allocated and touched beforehand;
cells run in a rotated order each round. Reported per cell: milliseconds per expert (wall),
MB/s, CPU ms per expert (``time.process_time``, every thread), medians [min-max] over rounds.

``--warm``: the round's experts read once (buffered) before each cell instead: what a read costs
when the page cache holds the expert (O_DIRECT reads the disk regardless).

End to end (``decode``): ``bench/real_disk.py disk``'s run (the disk tier, cold, in a fresh memory
cgroup, teacher-forced decode) with the tier's reads as they are (``preadv``) and with
``odirect_read_run`` in place of ``TieredExpertStore._read_run`` (O_DIRECT into a per-thread
aligned bounce buffer, then memmove into the rows), alternating run by run.

Usage: python bench/stored_layout_reads.py /work/ckpts/kernel-layouts/real4-w4a16-a08a0332c088/experts-avx512-bfloat16.pxkl
       flock /work/notes/bigmem.lock python bench/stored_layout_reads.py decode /work/ckpts/real4-w4a16 \
           --stored-layout-dir /work/ckpts/kernel-layouts --experts-implementation packed --cgroup-mb 1180 \
           --tokens 32 --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_disk import drop_page_cache  # noqa: E402

from pagedexperts.storage.kernel_layout_file import ALIGN, _read_key  # noqa: E402
from pagedexperts.storage.safetensors_index import bytes_view  # noqa: E402

METHODS = ("preadv", "mmap", "odirect", "odirect+copy")


def aligned_rows(n: int, nbytes: int) -> list[torch.Tensor]:
    """``n`` uint8 rows of ``nbytes``, each starting at a multiple of ALIGN, touched."""
    rows = []
    for _ in range(n):
        buf = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
        shift = (-buf.data_ptr()) % ALIGN
        row = buf[shift: shift + nbytes]
        row.fill_(1)
        rows.append(row)
    return rows


def read_full(fd: int, row: torch.Tensor, offset: int) -> None:
    """preadv until ``row`` is full (a short read continues; 0 bytes raises)."""
    view, done = memoryview(bytes_view(row)).cast("B"), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"file ended at {offset + done}")
        done += n


class Reader:
    """One method's reads of experts at ``offsets`` into ``rows``."""

    def __init__(self, path: Path, method: str, expert_bytes: int, stride: int) -> None:
        self.method, self.expert_bytes, self.stride = method, expert_bytes, stride
        self.fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if method.startswith("odirect") else 0))
        self.map, self.staging = None, threading.local()
        if method == "mmap":
            self.map = mmap.mmap(self.fd, 0, prot=mmap.PROT_READ)
            self.array = np.frombuffer(self.map, dtype=np.uint8)  # a view: its address, no copy
            self.base = self.array.ctypes.data

    def read(self, offset: int, row: torch.Tensor) -> None:
        if self.method == "preadv":
            read_full(self.fd, row[: self.expert_bytes], offset)
        elif self.method == "odirect":
            read_full(self.fd, row[: self.stride], offset)  # a multiple of 4096 at an aligned offset
        elif self.method == "odirect+copy":
            if not hasattr(self.staging, "row"):
                self.staging.row = aligned_rows(1, self.stride)[0]
            read_full(self.fd, self.staging.row, offset)
            ctypes.memmove(row.data_ptr(), self.staging.row.data_ptr(), self.expert_bytes)
        else:
            ctypes.memmove(row.data_ptr(), self.base + offset, self.expert_bytes)

    def read_all(self, offsets, rows) -> None:
        for off, row in zip(offsets, rows):
            self.read(off, row)
        self.close()

    def close(self) -> None:
        if self.map is not None:
            del self.array
            self.map.close()
        os.close(self.fd)


def run_cell(path: Path, method: str, inflight: int, offsets: list[int], rows, expert_bytes: int, stride: int,
             warm: bool = False):
    if warm:  # the round's experts in the page cache (a buffered read of each first)
        Reader(path, "preadv", expert_bytes, stride).read_all(offsets, rows)
    else:
        drop_page_cache(path.parent, path.parent)
    reader = Reader(path, method, expert_bytes, stride)
    try:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if inflight == 1:
            for off, row in zip(offsets, rows):
                reader.read(off, row)
        else:
            with ThreadPoolExecutor(max_workers=inflight) as pool:
                list(pool.map(reader.read, offsets, rows))
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        reader.close()
    return wall, cpu


def _spread(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


_BOUNCE = threading.local()


def odirect_read_run(self, expert: int, jobs) -> None:
    """``TieredExpertStore._read_run`` by O_DIRECT: the run's bytes (rounded up to ALIGN) read
    into this thread's ALIGN-aligned bounce buffer, then copied into the rows; a short read
    continues, an early end of file or an error raises ``DiskReadError`` (sticky, as the tier's)."""
    from pagedexperts.storage.host_tier import DiskReadError

    path, (first, _) = jobs[0]
    total = sum(job[0].nbytes for _, job in jobs)
    span = -(-total // ALIGN) * ALIGN
    assert first.offset % ALIGN == 0, "a stored layout's extents start at multiples of ALIGN"
    if getattr(_BOUNCE, "buf", None) is None or _BOUNCE.buf.numel() < span:
        _BOUNCE.buf = aligned_rows(1, span)[0]
    buf = _BOUNCE.buf
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        raise DiskReadError(f"cannot open {path} with O_DIRECT: {exc}") from exc
    try:
        view, done = memoryview(bytes_view(buf[:span])).cast("B"), 0
        while done < span:
            n = os.preadv(fd, [view[done:]], first.offset + done)
            if n == 0:
                break
            done += n
    except OSError as exc:
        raise DiskReadError(f"reading expert {expert} of layer {self.layer} from {path} failed: {exc}") from exc
    finally:
        os.close(fd)
    if done < total:
        raise DiskReadError(f"file {path} ended at byte {first.offset + done} while reading {total} bytes (truncated?)")
    pos = 0
    for _, (ext, dst) in jobs:
        ctypes.memmove(dst[ext.dst_elem: ext.dst_elem + ext.numel].data_ptr(), buf.data_ptr() + pos, ext.nbytes)
        pos += ext.nbytes


def decode_child(method: str, argv: list[str]) -> None:
    """``bench/real_disk.py disk-child`` with the tier reading by ``method``."""
    import real_disk

    from pagedexperts.storage.host_tier import TieredExpertStore

    if method == "odirect":
        TieredExpertStore._read_run = odirect_read_run
    real_disk.main(["disk-child", *argv])


def decode(argv: list[str]) -> None:
    """Alternate ``bench/real_disk.py disk`` runs reading by preadv and by O_DIRECT; medians."""
    import json
    import subprocess

    import real_disk

    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--stored-layout-dir", required=True)
    p.add_argument("--cgroup-mb", type=float, default=1180)
    p.add_argument("--rounds", type=int, default=3)
    args, rest = p.parse_known_args(argv)
    child_argv = [args.dir, "--stored-layout-dir", args.stored_layout_dir, *rest]
    results: dict[str, list[dict]] = {"preadv": [], "odirect": []}
    for r in range(args.rounds):
        for method in ("preadv", "odirect") if r % 2 == 0 else ("odirect", "preadv"):
            real_disk.drop_page_cache(Path(args.dir), Path(args.stored_layout_dir))
            cgroup = real_disk.make_cgroup(int(args.cgroup_mb * 1e6), f"pagedexperts-odirect-{os.getpid()}")
            enter = (lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))) if cgroup else None
            proc = subprocess.run([sys.executable, __file__, "decode-child", method, *child_argv], capture_output=True,
                                  text=True, preexec_fn=enter)
            out = {"tree": method, "cgroup": str(cgroup), "cgroup_mb": args.cgroup_mb, "host_memory_gb": None}
            if proc.returncode == 0:
                out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            out = real_disk._finish(out, proc, cgroup, stderr_chars=1500)
            print(real_disk.disk_line(out), flush=True)
            if "wall_s_per_token" in out:
                results[method].append(out)
    print("\n| tier reads | wall s / token | CPU s / token | ms per expert read | MB / token from storage | runs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for method, rows in results.items():
        if rows:
            print(f"| {method} | {_spread([x['wall_s_per_token'] for x in rows], '{:.3f}')} | "
                  f"{_spread([x['cpu_s_per_token'] for x in rows], '{:.3f}')} | "
                  f"{_spread([x.get('disk_read_ms_per_expert', float('nan')) for x in rows])} | "
                  f"{_spread([x['io_mb_per_token'] for x in rows], '{:.1f}')} | {len(rows)} of {args.rounds} |")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["decode"]:
        return decode(argv[1:])
    if argv[:1] == ["decode-child"]:
        return decode_child(argv[1], argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("layout", type=Path, help="a stored kernel layout file (.pxkl)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--experts", type=int, default=48, help="random experts read per cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm", action="store_true", help="the experts in the page cache before each cell (not dropped)")
    args = p.parse_args(argv)
    got = _read_key(args.layout)
    if isinstance(got, str):
        raise SystemExit(f"{args.layout}: {got}")
    key, data_start = got
    total = key.num_layers * key.num_experts
    rows = aligned_rows(args.experts, key.stride)
    rng = random.Random(args.seed)
    cells = [(m, k) for m in METHODS for k in (1, 4)]
    out: dict[tuple, list[tuple[float, float]]] = {c: [] for c in cells}
    want = None
    for r in range(args.rounds):
        picks = rng.sample(range(total), args.experts)
        offsets = [data_start + i * key.stride for i in picks]
        for c in cells[r % len(cells):] + cells[: r % len(cells)]:
            out[c].append(run_cell(args.layout, *c, offsets, rows, key.expert_bytes, key.stride, warm=args.warm))
            if r == 0 and c == cells[0]:
                want = [row[: key.expert_bytes].clone() for row in rows]
            elif r == 0:  # every method reads the same bytes
                assert all(torch.equal(a[: key.expert_bytes], b) for a, b in zip(rows, want)), c
        print(f"round {r} done", file=sys.stderr, flush=True)
    mb = key.expert_bytes / 1e6
    state = "warm (the experts in the page cache)" if args.warm else "cold (page cache dropped before each cell)"
    print(f"\n{args.experts} random experts of {mb:.2f} MB per cell (stride {key.stride:,} B), {args.rounds} rounds, "
          f"{state}; medians [min-max]\n")
    print("| method | in flight | ms per expert (wall) | MB/s | CPU ms per expert |\n| --- | --- | --- | --- | --- |")
    for (m, k), vals in out.items():
        ms = [w / args.experts * 1e3 for w, _ in vals]
        mbs = [args.experts * mb / w for w, _ in vals]
        cpu = [c / args.experts * 1e3 for _, c in vals]
        print(f"| {m} | {k} | {_spread(ms)} | {_spread(mbs, '{:.0f}')} | {_spread(cpu)} |")


if __name__ == "__main__":
    main()
