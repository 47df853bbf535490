"""The disk tier's experts in the CPU kernels' layout, stored once beside or for a checkpoint.

Owns: ``attach_stored_layout``: when every paged layer runs packed on the CPU
(``formats.cpu_pack.CpuPackedSlots``) over the disk tier, find a stored layout made from this
checkpoint for this torch, CPU capability and run dtype (``storage.kernel_layout_file``) in the
checkpoint's own ``kernel-layout/`` directory (``pagedexperts quantize`` writes it there) or the
cache directory, write it to the cache directory when there is none (once, converting each
expert from the checkpoint: its location, size and source are logged), and point the disk
tier's stores at it (``TieredExpertStore.use_source``) so that a miss is a read and a copy.
A stored layout that does not match (changed checkpoint, other torch or capability, truncated)
is rebuilt with a WARNING naming what differs (a source file whose mtime alone differs, as in a
copy, is hashed and the layout used when its bytes match: INFO, and the resolved record's reason); one that cannot be written (full disk) leaves
the checkpoint untouched and the tier converting at page-in, with a WARNING and a line in the
stats' fallbacks. Does not: convert (``formats.cpu_pack``) or read (``storage.host_tier``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path

from pagedexperts.formats.cpu_pack import CpuPackedSlots
from pagedexperts.loading.cache_root import cache_root
from pagedexperts.paging.runner_contract import PagedExecutor
from pagedexperts.storage.host_store import ExpertStore
from pagedexperts.storage.host_tier import ReadAhead, TieredExpertStore
from pagedexperts.storage.kernel_layout_file import (LayoutKey, StoredLayout, StoredLayoutError, open_stored_layout,
                                                     write_stored_layout)

logger = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = "kernel-layout"  # a checkpoint's own stored layouts (written by quantize)


def default_cache_dir() -> Path:
    """Where stored layouts of checkpoints are cached: ``kernel-layouts/`` in the project's cache
    directory (``loading.cache_root``: $PAGEDEXPERTS_CACHE, else $XDG_CACHE_HOME/pagedexperts,
    else ~/.cache/pagedexperts)."""
    return cache_root() / "kernel-layouts"


def layout_file_name(key: LayoutKey) -> str:
    """experts-<capability>-<dtype>.pxkl: one file per CPU capability and run dtype."""
    return f"experts-{key.capability.lower()}-{key.dtype}.pxkl"


def cache_path(checkpoint: Path, key: LayoutKey, cache_dir: Path) -> Path:
    """The cache's file for ``checkpoint``: <cache_dir>/<name>-<hash of its resolved path>/<file>."""
    resolved = Path(checkpoint).resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    return Path(cache_dir) / f"{resolved.name}-{digest}" / layout_file_name(key)


def packed_layers(runtime) -> list[tuple[ExpertStore, CpuPackedSlots]]:
    """(store, slot table) of every paged layer, in layer order, when each runs packed (its store
    the disk tier, or a full store converted to the kernels' layout); else [] (a stored layout
    serves a model only whole)."""
    out = []
    for _, runner in sorted(runtime.runners.items()):
        if not (isinstance(runner, PagedExecutor) and isinstance(runner.slots, CpuPackedSlots)):
            return []
        out.append((runner.store, runner.slots))
    return out


def packed_tiers(runtime) -> list[tuple[TieredExpertStore, CpuPackedSlots]]:
    """``packed_layers`` when every store is the disk tier's, else []."""
    layers = packed_layers(runtime)
    return layers if all(isinstance(store, TieredExpertStore) for store, _ in layers) else []


def kernel_rows(store: ExpertStore, table: CpuPackedSlots, first: int, n: int) -> dict:
    """Experts ``first..first+n-1`` of one layer in the kernels' layouts {name: [n, ...]}: a full
    store's rows (converted at load), or the disk tier's read and converted."""
    rows = store.rows_in_memory()
    if rows is not None:
        return {name: t[first: first + n] for name, t in rows.items()}
    return table.convert_many(store.read_rows(first, n))


def layout_key(tiers, files: list[Path], *, content: bool = False) -> LayoutKey:
    """The key of the stored layout of ``tiers`` (``packed_tiers``) made from ``files``
    (``content``: with each file's digest, as a written layout's key; reads every file)."""
    store, table = tiers[0]
    dtype = next(iter(table.plans.values())).dtype
    return LayoutKey.make(specs=table.specs, dtype=dtype, num_layers=len(tiers), num_experts=store.num_experts,
                          source_files=files, content=content)


def write_for(tiers, key: LayoutKey, path: Path, *, source_name: str) -> StoredLayout:
    """Write the stored layout of ``tiers`` (``packed_layers``) to ``path``, each expert from its
    store (``kernel_rows``).

    Raises:
        StoredLayoutError: see ``storage.kernel_layout_file.write_stored_layout``."""
    def rows(layer: int, first: int, n: int):
        return kernel_rows(*tiers[layer], first, n)

    layout = write_stored_layout(path, key, rows, source_name=source_name)
    for store, _ in tiers:
        store.reset()  # the conversion's reads are no run's
    return layout


def attach_stored_layout(model, checkpoint: Path, files: list[Path], *, cache_dir: Path | None = None) -> str | None:
    """Point the disk tier of ``model`` (loaded from ``checkpoint``, whose ``files`` it reads) at
    a stored kernel layout, finding or writing it (module docstring). Returns the layout's path,
    or None where the model has no packed disk tier or the layout could not be written (then a
    WARNING, and ``PagingRuntime.stored_layout_fallback`` says why)."""
    runtime = model.pagedexperts
    tiers = packed_tiers(runtime)
    if not tiers:
        return None
    key = layout_key(tiers, files)
    cached = cache_path(checkpoint, key, cache_dir if cache_dir is not None else default_cache_dir())
    where = {cached: "the cache " + ("(--stored-layout-dir)" if cache_dir is not None else "(the default directory)")}
    layout, why = None, None
    for path in (Path(checkpoint) / CHECKPOINT_SUBDIR / layout_file_name(key), cached):
        got = open_stored_layout(path, key, files)
        if isinstance(got, StoredLayout):
            layout, why = got, where.get(path, "the checkpoint's own kernel-layout/ (pagedexperts quantize)")
            if got.verified_by_content:
                why += f"; verified by content ({', '.join(got.verified_by_content)}: mtime differs, sha256 matches)"
                logger.info("stored kernel layout %s: the mtime of %s differs from when it was made (a copy?); "
                            "verified by content (sha256 matches)", path, ", ".join(got.verified_by_content))
            break
        if path.exists():
            logger.warning("stored kernel layout not used: %s; %s", got,
                           "rebuilding it" if path == cached else f"writing the cache {cached} instead")
    if layout is None:
        logger.info("writing the stored kernel layout of %s's experts to %s (once: %d layers x %d experts, "
                    "%.3g GB; torch's CPU pack for %s, %s)", checkpoint, cached, key.num_layers, key.num_experts,
                    key.num_layers * key.num_experts * key.stride / 1e9, key.capability, key.dtype)
        try:
            layout = write_for(tiers, layout_key(tiers, files, content=True), cached,
                               source_name=f"the checkpoint {checkpoint}")
        except StoredLayoutError as exc:
            runtime.stored_layout_fallback = (f"stored kernel layout: {exc}; the disk tier converts each expert at "
                                              "page-in (tens of ms per expert)")
            logger.warning("%s", runtime.stored_layout_fallback)
            record_stored_layout(runtime, None, "not written (the stats' fallbacks say why): each expert converted at page-in")
            return None
        why = f"written now to {where[cached]}"
    _use(runtime, tiers, layout)
    record_stored_layout(runtime, str(layout.path), why)
    logger.info("disk tier reads the stored kernel layout %s (%.3g GB, made from %s: %d files; %s, %s, torch %s)",
                layout.path, layout.file_bytes / 1e9, checkpoint, len(key.source), key.capability, key.dtype,
                key.torch_version)
    return str(layout.path)


def record_stored_layout(runtime, path: str | None, why: str) -> None:
    """Put the stored layout the disk tier reads (``path``; None: none, it converts at page-in)
    and ``why`` into the runtime's ``Resolved`` where every paged layer runs packed over the disk tier;
    elsewhere a stored layout has no part in the run and nothing is recorded."""
    if packed_tiers(runtime):
        resolved = runtime.resolved
        runtime.resolved = dataclasses.replace(resolved, stored_layout=path,
                                               reasons={**resolved.reasons, "stored_layout": why})


def _use(runtime, tiers, layout: StoredLayout) -> None:
    """Every tier reads ``layout`` from now on: host rows and staging rows re-made in its specs
    within the bytes the host-memory plan gave them; the plan updated to say so."""
    specs, old = layout.key.tensor_specs, runtime.read_ahead
    memory = runtime.host_memory
    read_ahead = None
    if old is not None:
        old.shutdown()
        read_ahead = ReadAhead(specs, num_buffers=max(1, memory.staging_bytes // layout.key.expert_bytes))
        runtime.read_ahead = read_ahead
    for layer, (store, _) in enumerate(tiers):
        store.use_source(specs, layout.extents(layer), read_ahead)
    plan = dataclasses.replace(memory, expert_bytes=layout.key.expert_bytes, host_rows=tiers[0][0].host_rows)
    runtime.resolved = dataclasses.replace(runtime.resolved, host_memory=plan)  # the record says what the tier reads


def write_checkpoint_layout(model, checkpoint: Path, files: list[Path]) -> StoredLayout | str:
    """Write the stored kernel layout of ``model`` (loaded packed from ``checkpoint``, whose
    ``files`` it was made from) into the checkpoint's own ``kernel-layout/`` directory, where
    ``attach_stored_layout`` looks first. Returns it, or why the model has none to store.

    Raises:
        StoredLayoutError: the write failed (names the path; the checkpoint is untouched)."""
    layers = packed_layers(model.pagedexperts)
    if not layers:
        return "its experts do not run packed on this CPU (--experts-implementation packed)"
    key = layout_key(layers, files, content=True)
    path = Path(checkpoint) / CHECKPOINT_SUBDIR / layout_file_name(key)
    return write_for(layers, key, path, source_name=f"the checkpoint {checkpoint}")
