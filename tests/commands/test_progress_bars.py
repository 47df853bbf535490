"""Progress bars only on a terminal: a command whose stderr is a file or a pipe writes no
carriage-return updates (``quantize ... > log 2>&1`` wrote one per update, ~200 KB on a large
checkpoint), and on a terminal the bar is still drawn (issue 36 part 3.6). The package's bars
use tqdm's own rule (``disable=None``); transformers' "Loading weights" bar is switched off
through huggingface_hub's ``HF_HUB_DISABLE_PROGRESS_BARS`` (``cli.progress_bars_on_a_terminal_only``)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

QUANTIZE = ["quantize", "--format", "fp8-block", "--model-path", "bundled", "--output"]


def _cli(argv, **kwargs) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    return subprocess.Popen([sys.executable, "-m", "pagedexperts.cli", *argv], env=env, **kwargs)


def test_quantize_to_a_file_writes_no_bar(tmp_path):
    log = tmp_path / "log"
    with open(log, "wb") as f:
        assert _cli(QUANTIZE + [str(tmp_path / "out")], stdout=f, stderr=subprocess.STDOUT).wait(timeout=300) == 0
    text = log.read_bytes()
    assert b"\r" not in text and b"quantize fp8-block:" not in text, text[:500]
    assert b"1152 routed expert weights" in text  # the result line is still there


def test_quantize_on_a_terminal_draws_its_bar(tmp_path):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 0-column terminal draws no bar
    proc = _cli(QUANTIZE + [str(tmp_path / "out")], stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the terminal's other side closed
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert proc.wait(timeout=300) == 0
    assert b"quantize fp8-block:" in seen and b"\r" in seen, seen[:500]


@pytest.mark.slow
def test_check_to_a_pipe_writes_no_transformers_bar():
    """check loads its unpaged reference with from_pretrained, whose "Loading weights" bar wrote
    every update to a pipe."""
    proc = _cli(["check", "--check-resident", "4", "--max-new-tokens", "1", "--threads", "1"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    assert b"\r" not in err and b"Loading weights" not in err and b"check K=4:" not in err, err[:800]
    assert b"PASS" in out + err


def test_check_to_a_pipe_writes_no_compressed_tensors_bar(tmp_path):
    """transformers' loading of a compressed-tensors checkpoint (check's reference candidate) runs
    compressed-tensors' own bars ("Applying quantization config", "Dispatching model"), which pass
    ``disable=False``: tqdm's environment default ``TQDM_DELAY`` keeps them undrawn on a pipe."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DELAY")}
    proc = subprocess.run([sys.executable, "-m", "pagedexperts.cli", "check", "--model-path", "bundled:w4a16",
                           "--check-resident", "8", "--max-new-tokens", "1", "--prompt", "hi", "--threads", "1"],
                          env={**env, "PAGEDEXPERTS_CACHE": str(tmp_path)}, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert b"reference: transformers" in proc.stdout  # its loading ran (the cross-check against the library)
    assert b"\r" not in proc.stderr and b"Dispatching model" not in proc.stderr, proc.stderr[:800]
