"""A log record written while ``generate`` streams text starts on a line of its own.

Found by a fresh user: the disk tier's read-ahead-paused WARNING (stderr) landed in the middle of a
line of streamed text (stdout) on a terminal, where both are one stream. Here both go to one
buffer, as on a terminal; the oracle is the text as written with the record placed on its own line.
"""

from __future__ import annotations

import contextlib
import io
import logging

import pagedexperts.engine.logits_processor
from pagedexperts.cli import main
from pagedexperts.commands.streamed_text import StreamedText

FORMAT = "%(levelname)s %(name)s: %(message)s"  # cli.main's
TIER_LOGGER = "pagedexperts.storage.host_tier"  # where the read-ahead WARNING comes from


@contextlib.contextmanager
def terminal(monkeypatch):
    """stdout and stderr as one stream, with a console handler on it as ``logging.basicConfig`` makes.
    Entered in the test's body: pytest sets its own capture of sys.stdout / sys.stderr after fixtures."""
    screen = io.StringIO()
    monkeypatch.setattr("sys.stdout", screen)
    monkeypatch.setattr("sys.stderr", screen)
    handler = logging.StreamHandler(screen)
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield screen, handler
    finally:
        root.removeHandler(handler)


def test_a_record_mid_line_starts_its_own_line_and_the_text_is_unchanged(monkeypatch):
    log = logging.getLogger(TIER_LOGGER)
    with terminal(monkeypatch) as (screen, handler), StreamedText().logs_on_their_own_lines() as text:
        text.write("The history")
        log.warning("read-ahead paused")
        text.write(" of the")
        text.write(" city\n")
        log.warning("after a whole line")  # at a line's start already: no blank line
    assert screen.getvalue() == (f"The history\nWARNING {TIER_LOGGER}: read-ahead paused\n of the city\n"
                                 f"WARNING {TIER_LOGGER}: after a whole line\n")
    assert isinstance(handler.formatter, logging.Formatter) and handler.formatter._fmt == FORMAT  # restored


def test_a_file_handler_is_left_alone(tmp_path):
    """Only the console's handlers: a log file gets no newline for text it never held."""
    path = tmp_path / "run.log"
    handler = logging.FileHandler(path)
    logging.getLogger().addHandler(handler)
    try:
        text = StreamedText(io.StringIO())
        with text.logs_on_their_own_lines():
            text.write("mid")
            logging.getLogger(TIER_LOGGER).warning("paused")
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert path.read_text() == "paused\n"


def test_generate_puts_a_warning_during_streaming_on_its_own_line(monkeypatch):
    """The prompt is echoed without a newline, so a WARNING at the first token comes mid-line."""
    call = pagedexperts.engine.logits_processor.SamplingProcessor.__call__
    warned = []

    def warn_once(self, input_ids, scores):
        if not warned:
            warned.append(True)
            logging.getLogger(TIER_LOGGER).warning("read-ahead paused (test)")
        return call(self, input_ids, scores)

    monkeypatch.setattr(pagedexperts.engine.logits_processor.SamplingProcessor, "__call__", warn_once)
    with terminal(monkeypatch) as (screen, _):
        assert main(["generate", "--prompt", "The history of the city", "--max-new-tokens", "4"]) == 0
    out = screen.getvalue()
    # stderr's start-up lines come before the echoed prompt; the record follows the prompt on a line of its own
    assert warned and f"\nThe history of the city\nWARNING {TIER_LOGGER}: read-ahead paused (test)\n" in out, out


def test_a_log_redirected_elsewhere_gets_no_newline(monkeypatch, tmp_path):
    """``generate ... 2> log``: the text and the log are two files, so the log gets no blank line for
    text it never held; two descriptors on one file (a terminal's case) still get it."""
    for same in (False, True):
        text_file = open(tmp_path / "text.txt", "w")
        log_file = open(tmp_path / ("text.txt" if same else "log.txt"), "a")
        monkeypatch.setattr("sys.stdout", text_file)
        monkeypatch.setattr("sys.stderr", log_file)
        handler = logging.StreamHandler(log_file)
        handler.setFormatter(logging.Formatter(FORMAT))
        logging.getLogger().addHandler(handler)
        try:
            with StreamedText().logs_on_their_own_lines() as text:
                text.write("mid")
                logging.getLogger(TIER_LOGGER).warning("paused")
        finally:
            logging.getLogger().removeHandler(handler)
            text_file.close()
            log_file.close()
        log = (tmp_path / ("text.txt" if same else "log.txt")).read_text()
        assert log.endswith(f"\nWARNING {TIER_LOGGER}: paused\n" if same else f"WARNING {TIER_LOGGER}: paused\n")
        assert log.startswith("mid" if same else "WARNING"), log
        (tmp_path / "text.txt").unlink()
