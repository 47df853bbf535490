"""A stored kernel layout survives a copy of its checkpoint that does not keep mtimes.

``cp -r``, ``git clone``, ``hf download`` and ``rsync`` without ``-t`` give every file a new
mtime; the layout's header also holds a sha256 of each source file, so a file of the same size
whose mtime alone differs is hashed and the layout used when its bytes are the ones it was made
from (INFO, and the resolved record's reason), rebuilt with a WARNING naming the file when not.
Oracle for the logits: all E resident on the same packed kernels, torch.equal, batch 2, default
threads. Oracle for "used, not rebuilt": no file appears in the cache and no WARNING is logged.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from pagedexperts.cli import main
from pagedexperts.formats.base import TensorSpec
from pagedexperts.loading.loader import load_model
from pagedexperts.storage import kernel_layout_file
from pagedexperts.storage.kernel_layout_file import (LayoutKey, StoredLayout, file_digest, open_stored_layout,
                                                     write_stored_layout)
from support.families import build_model, save_char_tokenizer
from support.tiny import greedy_logits, host_budget_gb, rewrite_expert_bytes

pytest.importorskip("compressed_tensors")


def _key(src: Path, *, content: bool) -> LayoutKey:
    specs = [TensorSpec("w", (4, 3), torch.uint8)]
    return LayoutKey.make(specs=specs, dtype=torch.bfloat16, num_layers=1, num_experts=2, source_files=[src],
                          content=content)


def _rows(layer, first, n):
    return {"w": torch.arange(first * 12, (first + n) * 12, dtype=torch.uint8).view(n, 4, 3)}


def _touch(path: Path, seconds: int) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))


def test_the_header_holds_each_source_files_sha256(tmp_path):
    import hashlib

    src = tmp_path / "shard.safetensors"
    src.write_bytes(bytes(range(256)) * 40000)  # > one 8 MiB read: the digest streams over pieces
    assert file_digest(src, chunk=1 << 12) == "sha256:" + hashlib.sha256(src.read_bytes()).hexdigest()
    layout = write_stored_layout(tmp_path / "l.pxkl", _key(src, content=True), _rows)
    got = open_stored_layout(layout.path, _key(src, content=False), [src])
    assert isinstance(got, StoredLayout) and got.key.source[0][3] == file_digest(src) and got.verified_by_content == ()


def test_same_bytes_other_mtime_is_verified_by_content_other_bytes_is_refused(tmp_path):
    src = tmp_path / "shard.safetensors"
    src.write_bytes(b"abc" * 1000)
    path = write_stored_layout(tmp_path / "l.pxkl", _key(src, content=True), _rows).path
    _touch(src, 7)
    want = _key(src, content=False)
    why = open_stored_layout(path, want)  # no files given: nothing to hash
    assert isinstance(why, str) and "source file shard.safetensors changed (mtime differs)" in why, why
    got = open_stored_layout(path, want, [src])
    assert isinstance(got, StoredLayout) and got.verified_by_content == ("shard.safetensors",)
    src.write_bytes(b"abd" * 1000)  # same size, other bytes
    _touch(src, 9)
    why = open_stored_layout(path, _key(src, content=False), [src])
    assert isinstance(why, str) and "shard.safetensors changed (same size, mtime differs, other content" in why, why


def test_a_layout_without_digests_is_still_used_when_mtimes_match_and_rebuilt_when_not(tmp_path):
    """A header written before digests were stored: (name, size, mtime) per file."""
    src = tmp_path / "shard.safetensors"
    src.write_bytes(b"abc" * 1000)
    key = _key(src, content=False)  # digest "": what such a header reads as
    path = write_stored_layout(tmp_path / "l.pxkl", key, _rows).path
    assert isinstance(open_stored_layout(path, key, [src]), StoredLayout)
    _touch(src, 7)
    why = open_stored_layout(path, _key(src, content=False), [src])
    assert isinstance(why, str) and "changed (mtime differs)" in why, why


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> Path:
    """A tiny w4a16 checkpoint (group 32: it runs packed) with its OUTPUT/kernel-layout/."""
    root = tmp_path_factory.mktemp("copied")
    src, out = root / "src", root / "q"
    build_model("qwen3_moe", hidden_size=64, moe_intermediate_size=64).save_pretrained(src)
    save_char_tokenizer(src)
    assert main(["quantize", "--model-path", str(src), "--format", "w4a16", "--group-size", "32",
                 "--output", str(out)]) == 0
    return out


def _tiered(path: Path):
    opts = dict(num_resident=2, experts_implementation="packed")
    model, _ = load_model(path, host_memory_gb=host_budget_gb(path, 2, **opts), **opts)
    assert model.pagedexperts.host_memory.disk_tier
    return model.eval()


def _copy(src: Path, dst: Path) -> Path:
    """A copy as ``cp -r`` makes it: the bytes, new mtimes (shutil.copyfile keeps no metadata)."""
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    for f in dst.rglob("*"):
        if f.is_file():
            _touch(f, 3600)  # never the source's, even on a filesystem with coarse timestamps
    return dst


@pytest.mark.default_threads
def test_a_copy_without_mtimes_reads_the_shipped_layout(quantized, tmp_path, caplog, stored_layout_cache):
    copy = _copy(quantized, tmp_path / "copy")
    (stored,) = (copy / "kernel-layout").iterdir()
    cached_before = sorted(stored_layout_cache.rglob("*.pxkl"))
    with caplog.at_level(logging.INFO, logger="pagedexperts"):
        tiered = _tiered(copy)
    rt = tiered.pagedexperts
    assert rt.stored_layout == str(stored), rt.resolved.reasons["stored_layout"]
    assert sorted(stored_layout_cache.rglob("*.pxkl")) == cached_before  # no new cache file
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    why = rt.resolved.reasons["stored_layout"]
    assert why.startswith("the checkpoint's own kernel-layout/") and "verified by content (config.json, model.safetensors: " in why
    assert any("verified by content" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    full, _ = load_model(copy, num_resident=rt.num_experts, experts_implementation="packed")
    ids = torch.randint(2, 100, (2, 8), generator=torch.Generator().manual_seed(3))
    got, want = greedy_logits(tiered, ids, steps=3), greedy_logits(full.eval(), ids, steps=3)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


@pytest.mark.default_threads
def test_a_copy_whose_shard_bytes_changed_at_the_same_size_is_rebuilt(quantized, tmp_path, caplog,
                                                                      stored_layout_cache):
    copy = _copy(quantized, tmp_path / "copy")
    shard = copy / "model.safetensors"
    size = shard.stat().st_size
    rewrite_expert_bytes(shard)
    assert shard.stat().st_size == size
    with caplog.at_level(logging.INFO, logger="pagedexperts"):
        tiered = _tiered(copy)
    rt = tiered.pagedexperts
    assert Path(rt.stored_layout).parent.parent == stored_layout_cache  # rebuilt into the cache
    # rebuilt by the full store's load that sizes the tier's budget (host_budget_gb), then read by the tier
    assert any("writing the stored kernel layout" in r.getMessage() for r in caplog.records), caplog.text
    assert rt.resolved.reasons["stored_layout"] == "the cache (the default directory)"
    assert any(r.levelno == logging.WARNING and "model.safetensors changed (same size, mtime differs, other content"
               in r.getMessage() for r in caplog.records), caplog.text
    full, _ = load_model(copy, num_resident=rt.num_experts, experts_implementation="packed")
    ids = torch.randint(2, 100, (2, 8), generator=torch.Generator().manual_seed(3))
    assert torch.equal(greedy_logits(tiered, ids, steps=3), greedy_logits(full.eval(), ids, steps=3))


def _flip_last_byte_of_first_expert(shard: Path) -> None:
    """Another edit at the same size: the last byte of the first routed expert tensor inverted."""
    import json

    with open(shard, "r+b") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
        name = next(k for k in sorted(header) if ".experts." in k)
        f.seek(8 + length + header[name]["data_offsets"][1] - 1)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def test_a_stale_own_layout_is_hashed_once_not_at_every_load_and_a_change_is_still_found(
        quantized, tmp_path, caplog, monkeypatch):
    """Its own kernel-layout/ stale (a shard changed at the same size): the first load hashes each source
    file once (to judge it, then the cache's key reuses the digests); the next load hashes nothing, yet
    judges it stale again by name; a further change at the same size is hashed and found."""
    copy = _copy(quantized, tmp_path / "copy")
    shard = copy / "model.safetensors"
    rewrite_expert_bytes(shard)
    hashed = []

    def counted(path, **kwargs):
        hashed.append(Path(path).name)
        return file_digest(path, **kwargs)

    monkeypatch.setattr(kernel_layout_file, "file_digest", counted)
    opts = dict(num_resident=2, experts_implementation="packed")
    stale = "model.safetensors changed (same size, mtime differs, other content"
    for load, want in ((1, ["config.json", "model.safetensors"]), (2, [])):
        hashed.clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pagedexperts"):
            rt = load_model(copy, **opts)[0].pagedexperts
        assert sorted(hashed) == want, (load, hashed)
        assert any(stale in r.getMessage() for r in caplog.records), (load, caplog.text)
        assert Path(rt.stored_layout).parent.parent != copy  # the cache's, not its own
    _flip_last_byte_of_first_expert(shard)  # same size again, other bytes again
    hashed.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedexperts"):
        rt = load_model(copy, **opts)[0].pagedexperts
    assert hashed == ["model.safetensors"]  # the changed file, once; config.json's identity is unchanged
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and stale in r.getMessage()]
    assert len(warnings) == 2 and warnings[1].endswith("rebuilding it"), warnings  # its own, then the cache's
    assert Path(rt.stored_layout).parent.parent != copy
