"""``storage.source_digests.DigestMemo`` where the memo cannot be written (a read-only cache, a path
through a file): each digest is still right (sha256 of the file, computed here independently with
hashlib), and the WARNING that it could not be remembered is logged once per memo, not once per
source file (a checkpoint of N shards logged N + 1, config.json counted)."""

from __future__ import annotations

import hashlib
import logging

from pagedexperts.storage.source_digests import MEMO_NAME, DigestMemo


def test_an_unwritable_memo_warns_once_and_still_gives_each_files_digest(tmp_path, caplog):
    files = []
    for i in range(3):
        f = tmp_path / f"model-{i}.safetensors"
        f.write_bytes(bytes([i]) * (1000 + i))
        files.append(f)
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the memo's directory would be")
    memo = DigestMemo(blocker / "layout-dir" / MEMO_NAME)
    with caplog.at_level(logging.WARNING, logger="pagedexperts"):
        got = [memo.digest(f) for f in files]
    assert got == ["sha256:" + hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "could not be remembered" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
