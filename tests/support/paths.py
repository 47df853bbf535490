"""Where the tests find the repository and their committed data (tests/data)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: tests/support/paths.py -> the clone
DATA = ROOT / "tests" / "data"  # committed checkpoints and traces (tests/data/README.md per tool)

# The tiny checkpoints the quantization tools wrote under DATA/<tool>/ (scripts/tool_fixtures.py;
# each one's config.json): E routed experts, top_k, H hidden, I expert intermediate, vocab.
# tests/data/llmc's older qwen3_moe/deepseek_v3 fixtures have support.tiny's shapes instead.
FIXTURE_E, FIXTURE_TOP_K, FIXTURE_HIDDEN, FIXTURE_MOE_INTERMEDIATE, FIXTURE_VOCAB = 8, 2, 64, 32, 256
