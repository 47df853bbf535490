"""The one fill of a paged model from its checkpoint, at disk speed, with nothing left mapped.

Owns: ``CheckpointIndex`` (every checkpoint tensor located: each expert row of each store tensor
as byte ranges, and the non-expert tensors) and ``fill_from_checkpoint``, for every format:
expert rows are read with ``os.preadv`` straight into the host store rows (each store page is
touched once, by the read; no memory map, no intermediate tensor), in file order, by a few
threads (reads release the GIL), then advised for transparent huge pages; non-expert tensors
are read into freshly allocated tensors (copied out, so no shard stays mapped for the model's
life; a quantized one dequantized by its format, or kept packed on a CPU: ``loading.linears``).
A disk-tier store gets its experts' byte ranges instead of the bytes.
Every floating-point tensor is checked for NaN and infinity as it is read (``torch.isfinite``
over the bytes just read, in the reading thread): a corrupt checkpoint is refused naming the
tensor, before it can reach a client as NaN logits. The disk tier's rows, read on demand
later, are not checked here (a NaN there fails only the requests whose logits it reaches:
``engine.sampling.NonFiniteLogits``).
A tqdm bar shows GB/s on a terminal.
Does not: build the model (``loading.build``) or map keys (``loading.checkpoint.KeyMap``).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pagedexperts.formats import quantization_config_of
from pagedexperts.loading.checkpoint import KeyMap, check_model_filled, load_plain_tensor
from pagedexperts.loading.linears import PlainLinears, QuantizedLinears
from pagedexperts.storage.safetensors_index import Extent, bytes_view, expert_extents, pread_into, read_extent, read_header

logger = logging.getLogger(__name__)

READ_CHUNK_BYTES = 64 << 20  # one thread's unit of work: extents of about this many bytes
DEFAULT_READ_THREADS = 4


class CheckpointIndex:
    """Where every tensor of a checkpoint lives, from the shards' headers (reads no weights).

    ``specs``: site name -> the store's per-expert tensors (a quantized format's packed specs,
    ``ExpertLayout.packed_specs``); None: each site's own (dense) specs. A site it lacks has its
    experts read elsewhere (a stored kernel layout): their tensors are skipped.

    Attributes:
        experts: site name -> store tensor name -> [E] lists of ``Extent`` (an expert row can
            come from several checkpoint tensors, e.g. gate and up, or a weight and its scales).
        plain: (model key, checkpoint key, TensorEntry) of every non-expert tensor.
        expert_bytes_on_disk: bytes of all expert extents (what a full fill reads).

    Raises:
        ValueError: an unreadable header, a key mapping to an unknown expert tensor, shapes that
            do not match the config, or expert rows the checkpoint lacks (names a few).
    """

    def __init__(self, files: list[Path], keymap, sites: dict, specs: dict | None = None) -> None:
        specs = specs if specs is not None else {name: site.specs for name, site in sites.items()}
        self.experts: dict[str, dict[str, list[list[Extent]]]] = {
            name: {spec.name: [[] for _ in range(site.num_experts)] for spec in specs[name]}
            for name, site in sites.items() if name in specs
        }
        sources: dict[tuple[str, str, int], set[int]] = {}
        n_sources: dict[tuple[str, str], int] = {}
        self.plain = []
        for file in files:
            for raw_key, entry in read_header(file).items():
                key = keymap.rename(raw_key)
                target = keymap.expert_target(key)
                if target is None:
                    self.plain.append((key, raw_key, entry))
                    continue
                site, tname, expert, src_index, n_src = target
                if site.name not in specs:
                    continue
                spec = next((s for s in specs[site.name] if s.name == tname), None)
                if spec is None:
                    raise ValueError(f"checkpoint tensor {raw_key!r} maps to unknown expert tensor {tname!r} of {site.name}")
                n_sources[(site.name, tname)] = n_src
                for e, ext in expert_extents(entry, spec=spec, expert=expert, num_experts=site.num_experts,
                                             src_index=src_index, n_src=n_src, key=raw_key):
                    self.experts[site.name][tname][e].append(ext)
                    sources.setdefault((site.name, tname, e), set()).add(src_index)
        lacking = [
            (name, tname, e)
            for name, tensors in self.experts.items()
            for tname, rows in tensors.items()
            for e in range(len(rows))
            if len(sources.get((name, tname, e), ())) != n_sources.get((name, tname), -1)
        ]
        if lacking:
            raise ValueError(f"checkpoint lacks expert tensors: {len(lacking)} (site, tensor, expert) rows, e.g. {lacking[:4]}")
        self.expert_bytes_on_disk = sum(
            x.nbytes for tensors in self.experts.values() for rows in tensors.values() for row in rows for x in row
        )


def fill_from_checkpoint(model, sites, stores, device, *, model_type: str, files: list[Path], fmt=None,
                         threads: int = DEFAULT_READ_THREADS, progress: bool = True,
                         packed_linears: bool = False) -> QuantizedLinears:
    """Put every checkpoint tensor in its place: the one fill (``fill`` of
    ``loading.build.build_paged_model``), for every format.

    Expert rows: each store takes its experts' byte ranges (``ExpertStore.fill_from``: a full
    store returns the reads into its rows, done here; the disk tier keeps the ranges). ``fmt``:
    the checkpoint's expert format (None: dense); the stores hold its packed tensors.
    A store with ``rows_from`` set holds its rows already (read from a stored kernel layout).
    Non-expert tensors: read at their mapped alignment and put on ``device`` in the model's
    dtype; a quantized module (attention, shared experts, dense MLPs, lm_head) dequantized once
    its tensors are read (``linears.PlainLinears``), with a WARNING naming the memory it costs on
    a CUDA device, or with ``packed_linears`` (a CPU whose experts run packed) computed packed
    where torch's CPU kernels take it (one WARNING per reason naming the modules they cannot).
    Returns what was dequantized and packed (the start-up report's line).

    Raises:
        ValueError: see ``CheckpointIndex``; a model tensor the checkpoint lacks; a quantized
            weight without its companions; a floating-point tensor holding NaN or infinity
            (``NonFiniteWeights``, naming it).
        DiskReadError: a shard that ends early.
    """
    keymap = KeyMap(model_type, sites, fmt)
    filling = {name: store for name, store in stores.items() if store.rows_from is None}  # else: read already
    index = CheckpointIndex(files, keymap, sites, specs={name: store.specs for name, store in filling.items()})
    jobs = [job for name, store in filling.items() for job in store.fill_from(index.experts[name])]
    total = sum(ext.nbytes for ext, _ in jobs) + sum(entry.nbytes for _, _, entry in index.plain)
    with _progress(total, enabled=progress) as bar:
        read_expert_rows(jobs, threads=threads, on_bytes=bar.update)
        for store in filling.values():
            store.after_fill()
        unexpected, linears = _fill_plain(model, index.plain, device, fmt, on_bytes=bar.update, packed=packed_linears)
    if unexpected:
        logger.warning("checkpoint keys not used by the model: %d (first: %s)", len(unexpected), unexpected[:3])
    check_model_filled(model)
    _report_linears(linears, fmt, device)
    return linears


def _report_linears(linears: QuantizedLinears, fmt, device) -> None:
    """INFO on the CPU, a WARNING naming the memory cost on CUDA (no fused kernel keeps them packed
    yet); a WARNING per reason a module could not be kept packed."""
    for line in linears.fallback_lines():
        logger.warning("non-expert linears: %s", line)
    line = linears.describe(getattr(fmt, "name", "dense"))
    if not line:
        return
    if torch.device(device).type == "cuda":
        logger.warning("%s on the device: %.1f MB more than packed (a packed single-matrix kernel is not "
                       "available yet)", line, (linears.dense_bytes - linears.packed_bytes) / 1e6)
    else:
        logger.info("%s", line)


def _fill_plain(model, plain, device, fmt, *, on_bytes, packed: bool = False) -> tuple[list[str], QuantizedLinears]:
    """Read every non-expert tensor (``CheckpointIndex.plain``) into place; returns the
    checkpoint keys the model has no place for, and the quantized modules dequantized or packed."""
    quantized = PlainLinears(fmt, [(key, raw_key) for key, raw_key, _ in plain],
                             quantization_config_of(model.config), packed=packed)
    unexpected = []
    for key, raw_key, entry in plain:
        value = read_tensor(entry)
        if not all_finite(value):
            raise NonFiniteWeights(_non_finite_message(raw_key, entry.path))
        on_bytes(entry.nbytes)
        loads = quantized.add(model, key, value) if quantized.takes(key) else [(key, value)]
        for key, value in loads:
            if not load_plain_tensor(model, key, value, device):
                unexpected.append(raw_key)
    quantized.check_done()
    quantized.install(model)
    return unexpected, quantized.result


class NonFiniteWeights(ValueError):
    """A checkpoint tensor holds NaN or infinity (a corrupt or badly converted checkpoint)."""


def all_finite(value: torch.Tensor) -> bool:
    """Whether a tensor has no NaN or infinity (True for integer and empty tensors; 1-byte
    floats as float16). Its min and max are finite exactly then (both propagate NaN):
    ``torch.aminmax`` runs at about 2.4 GB/s per thread on bfloat16 where ``isfinite().all()``
    ran at 0.16 (measured on one CPU core)."""
    if not value.is_floating_point() or value.numel() == 0:
        return True
    low, high = torch.aminmax(value if value.element_size() > 1 else value.half())
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _non_finite_message(key: str, path: Path) -> str:
    return (f"checkpoint tensor {key!r} ({Path(path).name}) holds NaN or infinite values: the checkpoint is corrupt "
            "or was converted wrongly; re-download or re-convert it")


def _extent_key(ext: Extent) -> str:
    """The checkpoint key whose bytes hold ``ext`` (from its shard's header)."""
    try:
        header = read_header(ext.path)
    except (OSError, ValueError):  # not a safetensors file (a stored kernel layout)
        return f"bytes {ext.offset}..{ext.offset + ext.nbytes} of {ext.path}"
    for key, entry in header.items():
        if entry.start <= ext.offset < entry.start + entry.nbytes:
            return key
    return f"bytes {ext.offset}..{ext.offset + ext.nbytes}"


def _extent_part(ext: Extent, row: torch.Tensor) -> torch.Tensor:
    """The elements of the flat ``row`` that ``ext`` filled."""
    if ext.outer == 1:
        return row[ext.dst_elem: ext.dst_elem + ext.numel]
    return row.view(ext.outer, -1)[:, ext.dst_elem: ext.dst_elem + ext.numel // ext.outer]


def read_tensor(entry) -> torch.Tensor:
    """One checkpoint tensor (``TensorEntry``) read into fresh memory at its mapped alignment."""
    value = empty_like_mapped(entry)
    with open(entry.path, "rb", buffering=0) as f:
        pread_into(f.fileno(), bytes_view(value.view(-1)), entry.start, path=entry.path)
    return value


def empty_like_mapped(entry) -> torch.Tensor:
    """An uninitialised tensor for ``entry`` whose address is congruent to its file offset
    modulo the page size, as it would be in a memory map of the shard.

    CPU kernels (oneDNN/MKL GEMMs) can sum in a different order for differently aligned
    inputs: transformers' own loading keeps non-expert weights memory-mapped, so a copy at
    another alignment gives logits that differ in the last bits (measured on the bundled model).
    Costs at most one page per tensor.
    """
    page = mmap.PAGESIZE
    buf = torch.empty(entry.nbytes + page, dtype=torch.uint8)
    shift = (entry.start - buf.data_ptr()) % page
    flat = buf[shift : shift + entry.nbytes]
    try:
        return flat.view(entry.dtype).view(entry.shape)
    except RuntimeError:  # an offset not a multiple of the element size: no mapped twin either
        return torch.empty(entry.shape, dtype=entry.dtype)


def read_expert_rows(jobs: list[tuple[Extent, torch.Tensor]], *, threads: int, on_bytes=None) -> float:
    """Read every (extent, flat destination row) job, in file order, ``threads`` at a time.

    Returns the wall seconds. Raises DiskReadError (a shard that ends early), OSError, or
    NonFiniteWeights (a floating-point extent holding NaN or infinity, naming its tensor).
    """
    t0 = time.perf_counter()
    jobs = sorted(jobs, key=lambda j: (str(j[0].path), j[0].offset))
    chunks, chunk, size = [], [], 0
    for job in jobs:
        if chunk and (size >= READ_CHUNK_BYTES or job[0].path != chunk[0][0].path):
            chunks.append(chunk)
            chunk, size = [], 0
        chunk.append(job)
        size += job[0].nbytes
    if chunk:
        chunks.append(chunk)

    def run(chunk) -> int:
        fd = os.open(chunk[0][0].path, os.O_RDONLY)
        try:
            for ext, row in chunk:
                read_extent(fd, ext, row, None)
                if not all_finite(_extent_part(ext, row)):
                    raise NonFiniteWeights(_non_finite_message(_extent_key(ext), ext.path))
        finally:
            os.close(fd)
        return sum(ext.nbytes for ext, _ in chunk)

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="pagedexperts-read") as pool:
        for nbytes in pool.map(run, chunks):
            if on_bytes is not None:
                on_bytes(nbytes)
    return time.perf_counter() - t0


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _progress(total: int, *, enabled: bool):
    """A tqdm bar in bytes (shows GB/s) on a terminal; silent otherwise."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="loading checkpoint",
                disable=None, leave=False)
