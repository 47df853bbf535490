"""Where the tests find the repository and their committed data (tests/data)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: tests/support/paths.py -> the clone
DATA = ROOT / "tests" / "data"  # committed checkpoints and traces (tests/data/README.md per tool)
