"""Digests of a checkpoint's source files, remembered by each file's identity so that a file that has
not changed is hashed once, not at every load (docs/disk-tier.md "Packed experts: the kernels'
layout stored on disk").

Owns ``DigestMemo``: a small JSON file (beside a checkpoint's cached stored layout) of resolved path
-> (device, inode, size, mtime ns, ctime ns, digest). A file whose identity differs from the one
remembered in any of these is hashed again (``storage.kernel_layout_file.file_digest``): every
write to a file sets its ctime to the clock's time, which no user-space call sets back, so a
changed file is never judged by an old digest. Does not: decide whether a stored layout is valid
(``storage.kernel_layout_file.open_stored_layout``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from pagedexperts.storage import kernel_layout_file

logger = logging.getLogger(__name__)

MEMO_NAME = "source-digests.json"


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class DigestMemo:
    """The digests of source files remembered in the JSON file ``path`` (read once, at construction;
    missing or unreadable: empty)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            known = json.loads(self.path.read_text())
            self.known = known if isinstance(known, dict) else {}
        except (OSError, ValueError):
            self.known = {}
        self._warned = False  # the WARNING that the memo cannot be written: once per memo, not per file

    def digest(self, file: Path) -> str:
        """``file_digest`` of ``file``: the remembered one while the file's identity is unchanged, else
        hashed now and remembered (a WARNING where the memo cannot be written: hashed again next time).

        Raises:
            OSError: ``file`` unreadable."""
        name = str(Path(file).resolve())
        identity = _identity(os.stat(file))
        entry = self.known.get(name)
        if isinstance(entry, list) and len(entry) == 6 and entry[:5] == identity:
            return entry[5]
        digest = kernel_layout_file.file_digest(Path(file))
        if identity == _identity(os.stat(file)):  # not written to while it was read
            self.known[name] = [*identity, digest]
            self._save()
        return digest

    def _save(self) -> None:
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.known, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if self._warned:
                return
            self._warned = True
            logger.warning("the source files' digests could not be remembered in %s (%s); the next load hashes "
                           "them again", self.path, exc)
