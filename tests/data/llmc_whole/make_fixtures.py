"""Write every whole-model llm-compressor fixture in tests/data/llmc_whole (committed beside this
file): llm-compressor's default recipe, attention quantized (``scripts/llmc_whole_model.py``:
``QuantizationModifier`` over every nn.Linear but lm_head and the routers), from tiny seeded
bfloat16 models (vocab 256, hidden 64, 8 routed experts of intermediate 32, top-2, 2 layers).
Run with llm-compressor 0.14's own venv (it pins an older transformers)::

    /work/llmc-venv/bin/python tests/data/llmc_whole/make_fixtures.py [--out DIR] [--only NAME ...]

``FIXTURES``: name -> ``llmc_whole_model.py`` arguments (``--family`` and ``--output-dir`` added).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
import llmc_whole_model  # noqa: E402

BF16 = ["--dtype", "bfloat16"]
FIXTURES: dict[str, tuple[str, list[str]]] = {
    "qwen3_moe-W4A16-g32": ("qwen3_moe", ["--scheme", "W4A16", "--group-size", "32", *BF16]),
    "qwen3_moe-W4A16_ASYM-g32": ("qwen3_moe", ["--scheme", "W4A16_ASYM", "--group-size", "32", *BF16]),
    # AutoRound's exports: float16 scales under a bfloat16 config dtype
    "qwen3_moe-W4A16_ASYM-g32-fp16scales": ("qwen3_moe", ["--scheme", "W4A16_ASYM", "--group-size", "32", "--dtype",
                                                          "float16", "--config-dtype", "bfloat16"]),
    "qwen3_moe-W8A16-g16": ("qwen3_moe", ["--scheme", "W8A16", "--group-size", "16", *BF16]),
    "qwen3_moe-W8A16_ASYM-g16": ("qwen3_moe", ["--scheme", "W8A16", "--group-size", "16", "--asymmetric", *BF16]),
    "qwen3_moe-W4A16_ASYM-mixed": ("qwen3_moe", ["--scheme", "W4A16_ASYM", "--group-size", "32",
                                                 "--group", r".*down_proj$=16", *BF16]),
    "qwen3_moe-W8A8": ("qwen3_moe", ["--scheme", "W8A8", *BF16]),
    "qwen3_moe-FP8": ("qwen3_moe", ["--scheme", "FP8", *BF16]),
    "qwen3_moe-FP8_DYNAMIC": ("qwen3_moe", ["--scheme", "FP8_DYNAMIC", *BF16]),
    "qwen3_moe-FP8_BLOCK": ("qwen3_moe", ["--scheme", "FP8_BLOCK", *BF16]),
    "qwen3_moe-NVFP4A16": ("qwen3_moe", ["--scheme", "NVFP4A16", *BF16]),
    "qwen3_moe-NVFP4": ("qwen3_moe", ["--scheme", "NVFP4", *BF16]),
    "qwen3_moe-MXFP4A16": ("qwen3_moe", ["--scheme", "MXFP4A16", *BF16]),
    # Mixtral recipes' regex targets: gate/up (w1, w3) group 32, down (w2) group 16, attention group 32
    "mixtral-W4A16_ASYM-regex": ("mixtral", ["--scheme", "W4A16_ASYM", "--group-size", "32", "--group",
                                             r".*(gate_proj|up_proj)$=32", "--group", r".*down_proj$=16",
                                             "--mixtral-names", *BF16]),
    "mixtral-FP8_DYNAMIC": ("mixtral", ["--scheme", "FP8_DYNAMIC", "--mixtral-names", *BF16]),
    # MLA attention, the shared expert and the dense first layer quantized too
    "deepseek_v3-W4A16-g16": ("deepseek_v3", ["--scheme", "W4A16", "--group-size", "16", *BF16]),
    "deepseek_v3-FP8_BLOCK": ("deepseek_v3", ["--scheme", "FP8_BLOCK", *BF16]),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument("--only", nargs="*", default=None, help="fixture names (default: all)")
    args = p.parse_args()
    names = args.only or list(FIXTURES)
    unknown = [n for n in names if n not in FIXTURES]
    if unknown:
        sys.exit(f"--only {unknown}: not a fixture; choose from {list(FIXTURES)}")
    for name in names:
        family, extra = FIXTURES[name]
        llmc_whole_model.main(["--family", family, "--output-dir", str(args.out / name), *extra])


if __name__ == "__main__":
    main()
