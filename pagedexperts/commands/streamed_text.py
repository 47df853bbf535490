"""Text streamed to stdout while log records go to stderr, as ``generate`` writes both to a terminal.

Owns ``StreamedText``: the writer of the streamed text, which knows whether that text stands
mid-line, and ``logs_on_their_own_lines``, under which a log record written to the console while
the text is mid-line starts on a line of its own (a newline first on the log's stream; the text
on stdout is never changed). Does not: configure logging (``cli.main``) or generate text.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import TextIO


class StreamedText:
    """Writes streamed text to ``out`` (default: ``sys.stdout`` at construction), flushed at each
    write; ``mid_line``: the last text written did not end a line (and no log record has since)."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = sys.stdout if out is None else out
        self.mid_line = False

    def write(self, text: str) -> None:
        """Write ``text`` and flush (a piece of a line, a line, or several)."""
        self.out.write(text)
        self.out.flush()
        if text:
            self.mid_line = not text.endswith("\n")

    @contextlib.contextmanager
    def logs_on_their_own_lines(self):
        """While in the block: each console handler of the root logger (a ``StreamHandler`` on
        stderr or stdout, as ``logging.basicConfig`` makes it; not a file's) whose stream shows where
        the text does (the same stream, or the same terminal or file: ``2> log`` is not) writes a
        newline before a record that comes while the text is mid-line. Restored on exit."""
        console = (sys.stderr, sys.stdout)
        handlers = [h for h in logging.getLogger().handlers
                    if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                    and getattr(h, "stream", None) in console and _same_place(h.stream, self.out)]
        saved = [h.formatter for h in handlers]
        for handler in handlers:
            handler.setFormatter(_OwnLineFirst(handler.formatter or logging.Formatter(), self))
        try:
            yield self
        finally:
            for handler, formatter in zip(handlers, saved):
                handler.setFormatter(formatter)


def _same_place(a: TextIO, b: TextIO) -> bool:
    """Whether streams ``a`` and ``b`` write to one place: the same object, or file descriptors on the
    same file or terminal (``os.path.samestat``); False where either has none."""
    if a is b:
        return True
    try:
        return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (AttributeError, OSError, ValueError):
        return False


class _OwnLineFirst(logging.Formatter):
    """``inner``'s text of a record, after a newline when ``text`` stands mid-line (then no longer)."""

    def __init__(self, inner: logging.Formatter, text: StreamedText) -> None:
        super().__init__()
        self.inner, self.text = inner, text

    def format(self, record: logging.LogRecord) -> str:
        line = self.inner.format(record)
        if self.text.mid_line:
            self.text.mid_line = False
            return "\n" + line
        return line
