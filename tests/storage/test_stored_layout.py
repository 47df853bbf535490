"""The packed disk tier reads the experts stored in the CPU kernels' layout (issue 46, item 1).

Oracle for the logits: the same packed kernels with all E resident (itself checked against
transformers in tests/paging/test_packed_cpu_exact.py), torch.equal, batch 2, float32 and
bfloat16, default threads, read-ahead on and off. Oracle for "no conversion on the path": the
int4 pack op is never called while the tiered model decodes. A stored layout that no longer
matches its source (a shard's bytes changed at the same size, the file truncated, another CPU
capability) is rebuilt
with a WARNING naming what differs, never read; a full disk while writing leaves the checkpoint
byte-identical, no partial file, and the tier converting at page-in with the reason in the stats.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import resource
from pathlib import Path

import pytest
import torch

from pagedexperts.formats.base import TensorSpec
from pagedexperts.loading import stored_layout
from pagedexperts.loading.loader import load_model
from pagedexperts.storage import kernel_layout_file
from pagedexperts.storage.source_digests import MEMO_NAME
from pagedexperts.storage.safetensors_files import checkpoint_files
from pagedexperts.storage.kernel_layout_file import (LayoutKey, StoredLayout, StoredLayoutError, open_stored_layout,
                                                     write_stored_layout)
from support.paths import DATA
from support.tiny import copy_dir, count_int4_packs, greedy_logits, host_budget_gb, rewrite_expert_bytes

INT4 = DATA / "autoround/qwen3_moe-auto_round-experts"


def _ids() -> torch.Tensor:
    return torch.randint(2, 100, (2, 6), generator=torch.Generator().manual_seed(2))


def _tiered(path: Path, dtype: str, cache: Path, **options):
    top_k = 2
    budget = host_budget_gb(path, 2, num_resident=top_k, dtype=dtype, experts_implementation="packed")
    where = {"stored_layout_dir": str(cache)} if options.get("stored_layout", True) else {}  # both: refused
    model, _ = load_model(path, num_resident=top_k, dtype=dtype, experts_implementation="packed",
                          host_memory_gb=budget, **where, **options)
    assert model.pagedexperts.host_memory.disk_tier
    return model.eval()


def _all_resident(path: Path, dtype: str):
    model, _ = load_model(path, num_resident=8, dtype=dtype, experts_implementation="packed")
    return model.eval()



def _digest(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.is_file()}


@pytest.mark.default_threads
@pytest.mark.parametrize("ahead", ["read-ahead", "prefetch", "none"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tier_over_the_stored_layout_equals_all_resident_without_converting(tmp_path, monkeypatch, dtype, ahead):
    """Read ahead (the disk tier's default), prefetch (page-ins into the next layer's slots too) or
    neither: the same logits as all E resident."""
    read_ahead = ahead != "none"
    oracle = _all_resident(INT4, dtype)
    tiered = _tiered(INT4, dtype, tmp_path, read_ahead=read_ahead, prefetch=ahead == "prefetch")
    rt = tiered.pagedexperts
    stored = Path(rt.stored_layout)
    assert stored.parent.parent == tmp_path and stored.name.endswith(f"-{dtype}.pxkl")
    table = next(iter(rt.runners.values())).slots
    assert all(store.specs == table.specs for store in rt.stores.values())  # rows in the kernels' layout
    packs = count_int4_packs(monkeypatch)
    got = greedy_logits(tiered, _ids(), steps=4)
    assert packs == []  # a miss is a read and a copy
    want = greedy_logits(oracle, _ids(), steps=4)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    totals = rt.stats().as_dict()
    assert totals["disk_reads"] > 0 and rt.stats().fallbacks == []
    expert_bytes = sum(s.row_bytes for s in table.specs)
    assert totals["disk_bytes_read"] == totals["disk_reads"] * expert_bytes
    assert totals["disk_preads"] == totals["disk_reads"]  # one contiguous extent, one preadv per expert
    assert (totals["read_ahead_issued"] > 0) == read_ahead


def test_a_second_load_reads_the_file_without_writing(tmp_path, monkeypatch):
    first = Path(_tiered(INT4, "float32", tmp_path).pagedexperts.stored_layout)
    stamp = first.stat().st_mtime_ns

    def refuse(*args, **kwargs):
        raise AssertionError("a valid stored layout was written again")

    monkeypatch.setattr(stored_layout, "write_stored_layout", refuse)
    again = _tiered(INT4, "float32", tmp_path)
    assert Path(again.pagedexperts.stored_layout) == first and first.stat().st_mtime_ns == stamp


@pytest.mark.default_threads
@pytest.mark.parametrize("damage", ["shard-rewritten", "shard-rewritten-mtime-kept", "truncated"])
def test_a_stale_stored_layout_is_rebuilt_naming_why(tmp_path, caplog, damage):
    """A source's bytes changed at the same size (its mtime moved, or set back as it was: the digest
    memo sees the write by the file's ctime), or the layout truncated: rebuilt, with a WARNING."""
    path = copy_dir(INT4, tmp_path / "model")
    cache = tmp_path / "cache"
    stored = Path(_tiered(path, "float32", cache).pagedexperts.stored_layout)
    if damage == "truncated":
        os.truncate(stored, stored.stat().st_size - 4096)
        why = "truncated"
    else:  # same shapes, same size, other bytes (and mtime): only the content digest tells
        shard = checkpoint_files(path)[0]
        st = shard.stat()
        rewrite_expert_bytes(shard)
        assert shard.stat().st_size == st.st_size
        if damage == "shard-rewritten-mtime-kept":
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
            why = f"source file {shard.name} changed (same size and mtime, other content"
        else:
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
            why = f"source file {shard.name} changed (same size, mtime differs, other content"
    with caplog.at_level(logging.INFO, logger="pagedexperts"):
        tiered = _tiered(path, "float32", cache)
    assert any(why in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records), caplog.text
    assert any("writing the stored kernel layout" in r.getMessage() for r in caplog.records)
    files = [*checkpoint_files(path), path / "config.json"]
    key = stored_layout.layout_key(stored_layout.packed_tiers(tiered.pagedexperts), files)
    assert isinstance(open_stored_layout(stored, key), StoredLayout)  # rebuilt, valid for the source as it is now
    want = greedy_logits(_all_resident(path, "float32"), _ids(), steps=3)
    assert torch.equal(greedy_logits(tiered, _ids(), steps=3), want)


@pytest.mark.default_threads
def test_a_full_disk_leaves_the_checkpoint_untouched_and_says_so(tmp_path, monkeypatch, caplog):
    path = copy_dir(INT4, tmp_path / "model")
    before = _digest(path)
    writes = []
    original = os.pwritev

    def full_after_three(fd, bufs, offset):
        writes.append(offset)
        if len(writes) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(fd, bufs, offset)

    monkeypatch.setattr(kernel_layout_file.os, "pwritev", full_after_three)
    with caplog.at_level(logging.WARNING, logger="pagedexperts"):
        tiered = _tiered(path, "float32", tmp_path / "cache")
    rt = tiered.pagedexperts
    assert rt.stored_layout is None and rt.resolved.reasons["stored_layout"].startswith("not written")
    assert any("No space left on device" in r.getMessage() and "is untouched" in r.getMessage()
               for r in caplog.records), caplog.text
    assert any("converts each expert at page-in" in f for f in rt.stats().fallbacks)
    assert _digest(path) == before
    left = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.name != MEMO_NAME]
    assert left == []  # no partial file left (the sources' digests are remembered beside it: storage.source_digests)
    want = greedy_logits(_all_resident(path, "float32"), _ids(), steps=3)
    assert torch.equal(greedy_logits(tiered, _ids(), steps=3), want)  # converting at page-in, still exact


def _key(tmp_path: Path, **changes) -> LayoutKey:
    src = tmp_path / "shard.safetensors"
    if not src.exists():
        src.write_bytes(b"x" * 100)
    specs = [TensorSpec("w", (4, 3), torch.uint8), TensorSpec("s", (2,), torch.bfloat16)]
    key = LayoutKey.make(specs=specs, dtype=torch.bfloat16, num_layers=2, num_experts=3, source_files=[src])
    return LayoutKey(**{**key.__dict__, **changes})


def _rows(key: LayoutKey):
    """rows(layer, first, n): expert e of layer l holds arange(numel) + 100 l + 7 e (any chunking)."""
    def rows(layer, first, n):
        return {s.name: torch.stack([torch.arange(s.numel, dtype=torch.int32).add(100 * layer + 7 * e)
                                     for e in range(first, first + n)]).to(s.dtype).view(n, *s.shape)
                for s in key.tensor_specs}
    return rows


def test_every_expert_is_one_aligned_extent_holding_its_rows(tmp_path):
    key = _key(tmp_path)
    layout = write_stored_layout(tmp_path / "l.pxkl", key, _rows(key), chunk=2)
    assert layout.data_start % kernel_layout_file.ALIGN == 0 and key.stride % kernel_layout_file.ALIGN == 0
    data = (tmp_path / "l.pxkl").read_bytes()
    for layer in range(2):
        for e in range(3):
            at = layout.offset(layer, e)
            for spec in key.tensor_specs:
                want = _rows(key)(layer, e, 1)[spec.name][0]
                got = torch.frombuffer(bytearray(data[at: at + spec.row_bytes]), dtype=spec.dtype).view(spec.shape)
                assert torch.equal(got, want), (layer, e, spec.name)
                (ext,) = layout.extents(layer)[spec.name][e]
                assert ext.offset == at
                at += spec.row_bytes


@pytest.mark.parametrize("umask", [0o022, 0o002], ids=["022", "002"])
def test_the_written_file_gets_the_mode_open_gives_under_the_umask(tmp_path, umask):
    key = _key(tmp_path)
    old = os.umask(umask)
    try:
        open(tmp_path / "probe", "wb").close()
        layout = write_stored_layout(tmp_path / "l.pxkl", key, _rows(key))
    finally:
        os.umask(old)
    want = (tmp_path / "probe").stat().st_mode & 0o777
    assert want == 0o666 & ~umask and layout.path.stat().st_mode & 0o777 == want


def test_another_capability_or_torch_is_refused_by_name(tmp_path):
    key = _key(tmp_path)
    write_stored_layout(tmp_path / "l.pxkl", key, _rows(key))
    other = "AVX2" if key.capability != "AVX2" else "AVX512"
    why = open_stored_layout(tmp_path / "l.pxkl", _key(tmp_path, capability=other))
    assert isinstance(why, str) and f"capability {key.capability} (now {other})" in why
    why = open_stored_layout(tmp_path / "l.pxkl", _key(tmp_path, torch_version="0.0"))
    assert isinstance(why, str) and "torch_version" in why


def test_a_file_size_limit_while_writing_removes_the_partial_file(tmp_path):
    key = _key(tmp_path, num_experts=3)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * kernel_layout_file.ALIGN, hard))  # Python ignores SIGXFSZ
    try:
        with pytest.raises(StoredLayoutError, match=r"l\.pxkl .*failed: File too large; the partial file is "
                                                    r"removed and the checkpoint is untouched"):
            write_stored_layout(tmp_path / "l.pxkl", key, _rows(key))
        with pytest.raises(StoredLayoutError):  # into a directory made for it: removed too
            write_stored_layout(tmp_path / "cache" / "ckpt-1234" / "l.pxkl", key, _rows(key))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "shard.safetensors"]
    assert list((tmp_path / "cache").iterdir()) == []  # ckpt-1234/ gone; cache/ (a parent it made) is harmless


def test_a_writer_killed_mid_write_leaves_a_temporary_file_the_next_write_removes(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"l.pxkl.tmp-{int(dead.stdout)}"
    stale.write_bytes(b"half")
    alive = tmp_path / f"l.pxkl.tmp-{os.getpid()}-other"  # not a pid suffix: left alone
    alive.write_bytes(b"x")
    key = _key(tmp_path)
    write_stored_layout(tmp_path / "l.pxkl", key, _rows(key))
    assert not stale.exists() and alive.exists()


@pytest.mark.parametrize("damage", ["length", "json"])
def test_a_damaged_header_is_refused_by_name_not_raised(tmp_path, damage):
    key = _key(tmp_path)
    path = tmp_path / "l.pxkl"
    write_stored_layout(path, key, _rows(key))
    with open(path, "r+b") as f:
        if damage == "length":  # the header's length field: 8 bytes after the magic
            f.seek(len(kernel_layout_file.MAGIC))
            f.write((2 ** 62).to_bytes(8, "little"))
        else:
            f.seek(16)
            f.write(b"\xff\xfe{{")
    why = open_stored_layout(path, key)
    assert isinstance(why, str) and str(path) in why and "unreadable header" in why, why
    if damage == "length":
        assert f"{2 ** 62:,}" in why and f"{path.stat().st_size:,}" in why


def test_the_resolved_record_says_which_stored_layout_the_tier_reads_and_why(tmp_path, monkeypatch, capsys):
    """Written now, found again, turned off: ``Resolved.stored_layout`` and its reason say which,
    in /server_info's and --stats-json's record (``as_dict``) and on the start-up line; a repage
    keeps them (its stores read what they read before)."""
    from pagedexperts.commands.common import print_host_memory
    from pagedexperts.loading.runners import repage

    cache = tmp_path / "cache"
    written = _tiered(INT4, "float32", cache).pagedexperts.resolved
    path = written.stored_layout
    assert Path(path).is_file() and Path(path).parent.parent == cache
    assert written.reasons["stored_layout"] == "written now to the cache (--stored-layout-dir)"
    found = _tiered(INT4, "float32", cache)
    record = found.pagedexperts.resolved.as_dict()
    assert (record["stored_layout"], record["reasons"]["stored_layout"]) == (path, "the cache (--stored-layout-dir)")
    print_host_memory(found)
    assert f"disk tier: reads the stored kernel layout {path} (the cache (--stored-layout-dir))" in capsys.readouterr().err
    repage(found, mode="paged", num_resident=4)
    assert (found.pagedexperts.resolved.stored_layout, found.pagedexperts.resolved.reasons["stored_layout"]) == (
        path, "the cache (--stored-layout-dir)")
    off = _tiered(INT4, "float32", cache, stored_layout=False).pagedexperts.resolved
    assert off.stored_layout is None and off.reasons["stored_layout"].startswith("--no-stored-layout")
    dense, _ = load_model(INT4, num_resident=2, experts_implementation="grouped_mm")  # nothing packed: nothing to say
    assert dense.pagedexperts.resolved.stored_layout is None and "stored_layout" not in dense.pagedexperts.resolved.reasons


def _damage_body(stored: Path, experts: list[tuple[int, int]]) -> None:
    """XOR the first 64 bytes of each (layer, expert)'s extent, the file's size and mtime kept (bit rot:
    the header and the sources still match)."""
    got = open_stored_layout(stored, kernel_layout_file._read_key(stored)[0])
    assert isinstance(got, StoredLayout), got
    stamp = stored.stat()
    with open(stored, "r+b") as f:
        for layer, expert in experts:
            f.seek(got.offset(layer, expert))
            chunk = f.read(64)
            f.seek(got.offset(layer, expert))
            f.write(bytes(b ^ 0x5A for b in chunk))
    os.utime(stored, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))


def test_every_expert_has_a_checksum_that_names_a_damaged_one(tmp_path):
    """The trailer holds zlib's CRC-32 of each expert's bytes in spec order (computed here
    independently from the bytes at each extent); bytes that differ are named by layer and expert."""
    import zlib

    stored = Path(_tiered(INT4, "float32", tmp_path).pagedexperts.stored_layout)
    layout = open_stored_layout(stored, kernel_layout_file._read_key(stored)[0])
    raw = stored.read_bytes()
    for layer in range(layout.key.num_layers):
        for e in range(layout.key.num_experts):
            at = layout.offset(layer, e)
            want = zlib.crc32(raw[at:at + layout.key.expert_bytes])
            assert layout.checksums[layer * layout.key.num_experts + e] == want
    specs = layout.key.tensor_specs
    rows, at = [], layout.offset(1, 3)
    for s in specs:
        rows.append(torch.frombuffer(bytearray(raw[at:at + s.row_bytes]), dtype=torch.uint8))
        at += s.row_bytes
    assert layout.damaged(1, 3, rows) is None
    rows[0][5] ^= 1
    assert "expert 3 of MoE layer 1 is damaged" in layout.damaged(1, 3, rows)


@pytest.mark.default_threads
def test_a_damaged_expert_in_the_tiers_stored_layout_is_refused_by_name_never_computed(tmp_path):
    stored = Path(_tiered(INT4, "bfloat16", tmp_path).pagedexperts.stored_layout)
    num_experts = kernel_layout_file._read_key(stored)[0].num_experts
    _damage_body(stored, [(layer, e) for layer in range(2) for e in range(num_experts)])
    with pytest.raises(OSError, match=r"stored kernel layout .*: expert \d+ of MoE layer \d+ is damaged .*"
                                      r"--no-stored-layout"):  # header and sources match: the first read says
        greedy_logits(_tiered(INT4, "bfloat16", tmp_path), _ids(), steps=2)  # (the start-up check's, here)
    model = _tiered(INT4, "bfloat16", tmp_path, check_independence=False)
    assert Path(model.pagedexperts.stored_layout) == stored
    with pytest.raises(OSError, match=r"expert \d+ of MoE layer \d+ is damaged"):  # a decode step's page-in
        greedy_logits(model, _ids(), steps=2)


@pytest.mark.default_threads
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_damaged_full_store_layout_is_not_used_but_converted_and_rebuilt(tmp_path, caplog, dtype):
    from support.tiny import greedy_logits as logits

    def full(**options):
        where = {"stored_layout_dir": str(tmp_path)} if options.get("stored_layout", True) else {}  # both: refused
        model, _ = load_model(INT4, num_resident=2, dtype=dtype, experts_implementation="packed", **where, **options)
        return model.eval()

    stored = Path(full().pagedexperts.resolved.stored_layout)  # converted, the cache written
    num_experts = kernel_layout_file._read_key(stored)[0].num_experts
    _damage_body(stored, [(0, num_experts // 2)])
    with caplog.at_level(logging.WARNING, logger="pagedexperts"):
        model = full()
    assert any(f"expert {num_experts // 2} of MoE layer 0 is damaged" in r.getMessage() and "converted at load"
               in r.getMessage() for r in caplog.records), caplog.text
    assert model.pagedexperts.resolved.reasons["stored_layout"].startswith("converted at load; written now")
    want = logits(full(stored_layout=False), _ids(), steps=3)
    assert torch.equal(logits(model, _ids(), steps=3), want)
    again = full()  # the rebuilt cache, read
    assert again.pagedexperts.resolved.reasons["stored_layout"].startswith("read at load")
    assert torch.equal(logits(again, _ids(), steps=3), want)


def test_the_cli_says_a_damaged_expert_in_one_line_and_exits_1(tmp_path, capsys):
    from pagedexperts.cli import main

    stored = Path(_tiered(INT4, "bfloat16", tmp_path).pagedexperts.stored_layout)
    num_experts = kernel_layout_file._read_key(stored)[0].num_experts
    _damage_body(stored, [(layer, e) for layer in range(2) for e in range(num_experts)])
    budget = host_budget_gb(INT4, 2, num_resident=2, dtype="bfloat16", experts_implementation="packed")
    code = main(["generate", "--model-path", str(INT4), "--num-resident", "2", "--dtype", "bfloat16",
                 "--host-memory-gb", str(budget), "--stored-layout-dir", str(tmp_path), "--prompt", "Hello",
                 "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert last.startswith(f"pagedexperts generate: error: stored kernel layout {stored}: expert ") and "damaged" in last
