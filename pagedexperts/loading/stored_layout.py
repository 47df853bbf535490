"""Experts in the CPU kernels' layout, stored once beside or for a checkpoint (docs/disk-tier.md
"Packed experts: the kernels' layout stored on disk").

Owns: ``attach_stored_layout`` (points the packed disk tier's stores at a valid stored layout, from
the checkpoint's ``kernel-layout/`` or the cache, writing the cache once when there is none),
``read_stored_layout`` (a full packed host store read from one at load instead of converted) and
``warn_no_effect`` (the flags where nothing runs packed). A layout that does not match its source
is rebuilt with a WARNING naming what differs; one that cannot be written leaves the checkpoint
untouched and the experts converted, with a WARNING and a stats fallback. Does not: convert
(``formats.cpu_pack``) or read (``storage.host_tier``, ``loading.fill``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
from pathlib import Path

import torch

from pagedexperts.formats.base import TensorSpec
from pagedexperts.formats.cpu_pack import CpuPackedSlots, kernel_specs, plan_layout
from pagedexperts.loading.cache_root import cache_root
from pagedexperts.loading.fill import DEFAULT_READ_THREADS, read_expert_rows
from pagedexperts.paging.runner_contract import PagedExecutor
from pagedexperts.paging.steps.table import PACKED
from pagedexperts.storage.host_store import ExpertStore, HostExpertStore
from pagedexperts.storage.host_tier import ReadAhead, TieredExpertStore
from pagedexperts.storage.kernel_layout_file import (LayoutKey, StoredLayout, StoredLayoutError, open_stored_layout,
                                                     write_stored_layout)
from pagedexperts.storage.source_digests import MEMO_NAME, DigestMemo

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


def full_packed_stores(runtime) -> list[tuple[HostExpertStore, list[TensorSpec], torch.dtype]]:
    """(store, one expert's tensors in the kernels' layouts, the run dtype) of every paged layer, before its runner
    exists, when each will run packed over a full, unpinned host store (``loading.runners
    .slot_table`` converts such a store at load unless it holds those tensors already); else []."""
    resolved = runtime.resolved
    if runtime.config.mode != "paged" or resolved.experts_implementation != PACKED or resolved.experts_fallbacks:
        return []
    out = []
    for site in runtime.sites:
        store, layout = runtime.stores[site.name], runtime.layouts.get(site.name)
        plans = plan_layout(layout)
        if not isinstance(store, HostExpertStore) or store.pinned or isinstance(plans, str):
            return []
        out.append((store, kernel_specs(layout, plans), plans[0].dtype))
    return out


def kernel_rows(store: ExpertStore, table: CpuPackedSlots, first: int, n: int) -> dict:
    """Experts ``first..first+n-1`` of one layer in the kernels' layouts {name: [n, ...]}: a full
    store's rows (converted at load), or the disk tier's read and converted."""
    rows = store.rows_in_memory()
    if rows is not None:
        return {name: t[first: first + n] for name, t in rows.items()}
    return table.convert_many(store.read_rows(first, n))


def layout_key(tiers, files: list[Path], *, content: bool = False, digest=None) -> LayoutKey:
    """The key of the stored layout of ``tiers`` (``packed_tiers``) made from ``files``
    (``content``: with each file's ``digest``, default a hash of every file, as a written layout's key)."""
    store, table = tiers[0]
    dtype = next(iter(table.plans.values())).dtype
    return LayoutKey.make(specs=table.specs, dtype=dtype, num_layers=len(tiers), num_experts=store.num_experts,
                          source_files=files, content=content, digest=digest)


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


def digest_memo(cached: Path) -> DigestMemo:
    """The memo of the source files' digests kept beside the cache's file ``cached`` (``_cache``): an
    unchanged source is hashed once, by the first load that needs its digest, not by every load
    that judges a stale or copied stored layout (``storage.source_digests``)."""
    return DigestMemo(Path(cached).parent / MEMO_NAME)


def _cache(checkpoint: Path, key: LayoutKey, cache_dir: Path | None) -> tuple[Path, str]:
    """The cache's file for ``checkpoint`` and ``key`` (``cache_path``), and its name in words."""
    cached = cache_path(checkpoint, key, cache_dir if cache_dir is not None else default_cache_dir())
    return cached, "the cache " + ("(--stored-layout-dir)" if cache_dir is not None else "(the default directory)")


def read_stored_layout(runtime, checkpoint: Path, files: list[Path], *, cache_dir: Path | None = None) -> str | None:
    """Read every expert of the full packed host stores (``full_packed_stores``) from a valid stored
    layout of ``checkpoint`` (made from ``files``; looked for as ``attach_stored_layout`` does) into
    the stores, already in the kernels' layouts, so that nothing is converted at load; the fill
    then reads none of their experts (``ExpertStore.rows_from``). Called before the fill
    (``loading.build.build_paged_model``'s ``before_fill``). Returns the layout's path; None where
    the stores are not full and packed, or no valid layout exists (they are converted at load
    and the cache written then: ``attach_stored_layout``).

    Raises:
        DiskReadError / OSError: the stored layout could not be read."""
    layers = full_packed_stores(runtime)
    if not layers:
        return None
    key = LayoutKey.make(specs=layers[0][1], dtype=layers[0][2], num_layers=len(layers), num_experts=layers[0][0].num_experts,
                         source_files=files)
    layout, why = _find(checkpoint, key, files, *_cache(checkpoint, key, cache_dir))
    if layout is None:
        return None
    jobs, before = [], [list(store.specs) for store, _, _ in layers]
    for layer, (store, _, _) in enumerate(layers):
        store.use_specs(layout.key.tensor_specs)
        jobs += store.fill_from(layout.extents(layer))
    seconds = read_expert_rows(jobs, threads=DEFAULT_READ_THREADS)
    damage = _first_damage(layout, layers)
    if damage is not None:  # never computed with: back to the checkpoint's specs, converted at load
        for (store, _, _), specs in zip(layers, before):
            store.use_specs(specs)
        logger.warning("%s; not used: the experts are converted at load instead (%s)", damage,
                       _set_aside(layout.path, checkpoint))
        return None
    for store, _, _ in layers:
        store.rows_from = str(layout.path)
        store.after_fill()
    record_stored_layout(runtime, str(layout.path), f"read at load from {why}")
    logger.info("host store read from the stored kernel layout %s at load (%.3g GB in %.2f s, nothing converted)",
                layout.path, layout.file_bytes / 1e9, seconds)
    return str(layout.path)


def _first_damage(layout: StoredLayout, layers) -> str | None:
    """The first expert whose bytes read into the full stores ``layers`` differ from the layout's
    CRC-32 (``StoredLayout.damaged``), in words; None: every one matches."""
    specs = layout.key.tensor_specs
    for layer, (store, _, _) in enumerate(layers):
        for e in range(store.num_experts):
            why = layout.damaged(layer, e, [store.tensors[s.name][e] for s in specs])
            if why is not None:
                return why
    return None


def _set_aside(path: Path, checkpoint: Path) -> str:
    """Remove a damaged stored layout when it is the cache's (never a file of the checkpoint's);
    what was done or what the user does, in words."""
    if Path(checkpoint) / CHECKPOINT_SUBDIR in Path(path).parents:
        return (f"delete {path} (the checkpoint's own copy: the cache is used then) or rewrite it with "
                "pagedexperts quantize; --no-stored-layout converts every expert")
    with contextlib.suppress(OSError):
        Path(path).unlink()
    return f"the cache file {path} is removed: the next load rebuilds it"


def _find(checkpoint: Path, key: LayoutKey, files: list[Path], cached: Path,
          cache_name: str) -> tuple[StoredLayout | None, str | None]:
    """A valid stored layout of ``key``, the checkpoint's own ``kernel-layout/`` first, then
    ``cached``, and where it was found in words; (None, None): neither (a WARNING names why an
    existing one is not used). Sources are hashed through the cache's ``digest_memo``."""
    memo = digest_memo(cached)
    for path in (Path(checkpoint) / CHECKPOINT_SUBDIR / layout_file_name(key), cached):
        got = open_stored_layout(path, key, files, digest=memo.digest)
        if isinstance(got, StoredLayout):
            why = cache_name if path == cached else "the checkpoint's own kernel-layout/ (pagedexperts quantize)"
            if got.verified_by_content:
                why += f"; verified by content ({', '.join(got.verified_by_content)}: mtime differs, sha256 matches)"
                logger.info("stored kernel layout %s: the mtime of %s differs from when it was made (a copy?); "
                            "verified by content (sha256 matches)", path, ", ".join(got.verified_by_content))
            return got, why
        if path.exists():
            logger.warning("stored kernel layout not used: %s; %s", got,
                           "rebuilding it" if path == cached else f"the cache {cached} instead (written where it is missing or stale)")
    return None, None


def attach_stored_layout(model, checkpoint: Path, files: list[Path], *, cache_dir: Path | None = None) -> str | None:
    """Point the disk tier of ``model`` (loaded from ``checkpoint``, whose ``files`` it reads) at
    a stored kernel layout, finding or writing it (module docstring); or, where full host stores
    were converted at load (``read_stored_layout`` found none), write the cache they will be read
    from next time. Returns the layout's path, or None where the model has no packed experts or
    the layout could not be written (then a WARNING, and ``PagingRuntime.stored_layout_fallback``
    says why)."""
    runtime = model.pagedexperts
    tiers = packed_tiers(runtime)
    if not tiers:
        return _cache_converted(runtime, checkpoint, files, cache_dir)
    key = layout_key(tiers, files)
    cached, cache_name = _cache(checkpoint, key, cache_dir)
    layout, why = _find(checkpoint, key, files, cached, cache_name)
    if layout is None:
        logger.info("writing the stored kernel layout of %s's experts to %s (once: %d layers x %d experts, "
                    "%.3g GB; torch's CPU pack for %s, %s)", checkpoint, cached, key.num_layers, key.num_experts,
                    key.num_layers * key.num_experts * key.stride / 1e9, key.capability, key.dtype)
        layout = _write_cache(runtime, tiers, files, cached, checkpoint, converts="at page-in")
        if layout is None:
            return None
        why = f"written now to {cache_name}"
    _use(runtime, tiers, layout)
    record_stored_layout(runtime, str(layout.path), why)
    logger.info("disk tier reads the stored kernel layout %s (%.3g GB, made from %s: %d files; %s, %s, torch %s)",
                layout.path, layout.file_bytes / 1e9, checkpoint, len(key.source), key.capability, key.dtype,
                key.torch_version)
    return str(layout.path)


def _write_cache(runtime, layers, files: list[Path], cached: Path, checkpoint: Path, *,
                 converts: str) -> StoredLayout | None:
    """``write_for`` of ``layers`` to the cache file ``cached``; None when it failed: then a WARNING,
    ``PagingRuntime.stored_layout_fallback`` and the record say that each expert converts
    ``converts`` ("at page-in", "at load")."""
    try:
        key = layout_key(layers, files, content=True, digest=digest_memo(cached).digest)
        return write_for(layers, key, cached, source_name=f"the checkpoint {checkpoint}")
    except StoredLayoutError as exc:
        again = "the disk tier converts each expert at page-in" if converts == "at page-in" else \
            "the next start converts each expert at load again"
        runtime.stored_layout_fallback = f"stored kernel layout: {exc}; {again} (tens of ms per expert)"
        logger.warning("%s", runtime.stored_layout_fallback)
        record_stored_layout(runtime, None, f"not written (the stats' fallbacks say why): each expert converted {converts}")
        return None


def _cache_converted(runtime, checkpoint: Path, files: list[Path], cache_dir: Path | None) -> str | None:
    """Where every paged layer runs packed over a full host store: its path when the rows were
    read from a stored layout; else (converted at load) the cache written from the converted
    rows, recorded, and its path (None: no packed layers, or the write failed: a WARNING and a
    line in the stats' fallbacks)."""
    layers = packed_layers(runtime)
    if not layers:
        return None
    if layers[0][0].rows_from is not None:
        return layers[0][0].rows_from
    key = layout_key(layers, files)
    cached, cache_name = _cache(checkpoint, key, cache_dir)
    logger.info("writing the stored kernel layout of %s's experts to %s (once, from the rows converted at load: "
                "%.3g GB; the next start reads it instead of converting)", checkpoint, cached,
                key.num_layers * key.num_experts * key.stride / 1e9)
    layout = _write_cache(runtime, layers, files, cached, checkpoint, converts="at load")
    if layout is None:
        return None
    record_stored_layout(runtime, str(layout.path), f"converted at load; written now to {cache_name}")
    return str(layout.path)


def skip_stored_layout(runtime) -> None:
    """--no-stored-layout: record that the packed experts are converted (the disk tier's at
    page-in, a full store's at load), or WARN that the flag has no effect (``warn_no_effect``)."""
    layers = packed_layers(runtime)
    if not layers:
        warn_no_effect(runtime, "--no-stored-layout")
        return
    when = "at page-in" if packed_tiers(runtime) else "at load"
    record_stored_layout(runtime, None, f"--no-stored-layout: each expert converted {when}")


def warn_no_effect(runtime, flag: str) -> bool:
    """A WARNING naming ``flag`` (--no-stored-layout, --stored-layout-dir) where no paged layer
    runs packed on the CPU, so no stored kernel layout has a part in the run; returns whether it warned."""
    if packed_layers(runtime):
        return False
    resolved = runtime.resolved
    why = (f"mode {runtime.config.mode}: no layer is paged" if runtime.config.mode != "paged" else
           f"the experts run {resolved.experts_implementation} ({resolved.reasons.get('experts_implementation')})"
           if resolved.experts_implementation != PACKED else
           f"MoE layers {sorted(resolved.experts_fallbacks)} run grouped_mm")
    logger.warning("%s has no effect: a stored kernel layout serves only experts run packed on the CPU "
                   "(--experts-implementation packed), and here %s", flag, why)
    return True


def record_stored_layout(runtime, path: str | None, why: str) -> None:
    """Put the stored layout the packed experts are read from (``path``; None: none, they are
    converted) and ``why`` into the runtime's ``Resolved``. Recorded only where every paged layer
    runs packed (the callers' check); elsewhere a stored layout has no part in the run."""
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
        store.use_source(specs, layout.extents(layer), read_ahead, check=functools.partial(layout.damaged, layer))
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
    # the digests go to the default cache's memo too: a load there judges this layout by them, unhashed
    memo = digest_memo(_cache(checkpoint, layout_key(layers, files), None)[0])
    key = layout_key(layers, files, content=True, digest=memo.digest)
    path = Path(checkpoint) / CHECKPOINT_SUBDIR / layout_file_name(key)
    return write_for(layers, key, path, source_name=f"the checkpoint {checkpoint}")
