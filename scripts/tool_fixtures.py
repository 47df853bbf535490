"""Write the checkpoints AutoRound and GPTQModel produce, each in its own venv (cached: a
checkpoint whose dir has ``tool_quantize.json`` is skipped unless ``--force``).

    python3 scripts/tool_fixtures.py [--tiny tests/data] [--bundled DIR] [--only NAME ...] \
        [--autoround-venv /work/ar-venv] [--gptqmodel-venv /work/gptqm-venv]

Two sets, one table each (name -> tool, family, ``tool_quantize.py`` arguments):

- ``TINY`` (committed under tests/data/<tool>/, about 0.3 MB each): the tiny random bfloat16
  Qwen3-MoE and Mixtral of ``tool_quantize.py source``, each recipe's dir also holding
  ``tool_dequant.safetensors`` (the tool's own dequantization of a sample of modules);
  ``DERIVED``: a TINY checkpoint with its scales cast (``tool_quantize.py cast-scales``);
- ``BUNDLED`` (``--bundled DIR``, not committed: about 5 MB each): the bundled model
  (pagedexperts/data/tiny-qwen3-moe, float32) through each tool's default recipes, for the
  README table (``check`` verdict, top-1 agreement).

The venvs (CPU torch first, so that pip takes the local CPU wheel)::

    python3 -m venv /work/ar-venv && /work/ar-venv/bin/pip install torch==2.13.0 && \
        /work/ar-venv/bin/pip install auto-round==0.16.1
    python3 -m venv /work/gptqm-venv && /work/gptqm-venv/bin/pip install torch==2.13.0 && \
        BUILD_CUDA_EXT=0 /work/gptqm-venv/bin/pip install gptqmodel==7.7.0

(gptqmodel 7.7.0 requires a newer torch: pip replaces 2.13.0 by 2.14.1, a CUDA build that
runs on the CPU.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "tool_quantize.py"
EXPERTS_ONLY = ["--experts-only"]
# AWQ (AutoRound's auto_awq export and GPTQModel's AWQ) and compressed-tensors (AutoRound's
# llm_compressor export) refuse a group size that does not divide in_features ("Expected
# in_features (32) to be divisible by group_size (128)"): the largest that divides the tiny
# models' 32 (the bundled model's down_proj: 64).
AWQ_TINY = ["--group-size", "32"]

# name -> (tool, family, arguments). "whole": the tool's default recipe (attention quantized).
TINY: dict[str, tuple[str, str, list[str]]] = {
    "autoround/qwen3_moe-auto_round": ("autoround", "qwen3_moe", ["--format", "auto_round"]),
    "autoround/qwen3_moe-auto_gptq": ("autoround", "qwen3_moe", ["--format", "auto_gptq"]),
    "autoround/qwen3_moe-auto_awq": ("autoround", "qwen3_moe", ["--format", "auto_awq", *AWQ_TINY]),
    "autoround/qwen3_moe-llm_compressor": ("autoround", "qwen3_moe", ["--format", "llm_compressor", *AWQ_TINY]),
    "autoround/mixtral-auto_round": ("autoround", "mixtral", ["--format", "auto_round"]),
    "autoround/qwen3_moe-auto_round-experts": ("autoround", "qwen3_moe", ["--format", "auto_round", *EXPERTS_ONLY]),
    "autoround/qwen3_moe-auto_round-asym_g16-experts": (
        "autoround", "qwen3_moe", ["--format", "auto_round", "--asym", "--group-size", "16", *EXPERTS_ONLY]),
    # W8A8 INT8 through the llm_compressor export: float16 weight_scale under a bfloat16 config
    "autoround/qwen3_moe-llm_compressor-INT8_W8A8-experts": (
        "autoround", "qwen3_moe", ["--format", "llm_compressor", "--scheme", "INT8_W8A8", *EXPERTS_ONLY]),
    "autoround/qwen3_moe-auto_awq-experts": ("autoround", "qwen3_moe", ["--format", "auto_awq", *AWQ_TINY, *EXPERTS_ONLY]),
    "autoround/qwen3_moe-auto_round-W8A16-experts": (
        "autoround", "qwen3_moe", ["--format", "auto_round", "--scheme", "W8A16", *EXPERTS_ONLY]),
    "autoround/qwen3_moe-auto_round-FPW8A16-experts": (
        "autoround", "qwen3_moe", ["--format", "auto_round", "--scheme", "FPW8A16", *EXPERTS_ONLY]),
    "autoround/qwen3_moe-auto_round-NVFP4-experts": (
        "autoround", "qwen3_moe", ["--format", "auto_round", "--scheme", "NVFP4", *EXPERTS_ONLY]),
    "autoround/qwen3_moe-auto_round-MXFP4-experts": (
        "autoround", "qwen3_moe", ["--format", "auto_round", "--scheme", "MXFP4", *EXPERTS_ONLY]),
    # asymmetric 2-bit: packing_format "auto_round" (zero points stored as they are); 4-bit asym writes
    # auto_round:auto_awq, and AutoRound refuses 8-bit asym ("vLLM serves W8 GPTQ-format weights symmetric-only")
    "autoround/qwen3_moe-auto_round-asym_W2A16_g16-experts": (
        "autoround", "qwen3_moe", ["--format", "auto_round", "--scheme", "W2A16", "--asym", "--group-size", "16",
                                   *EXPERTS_ONLY]),
    "autoround/qwen3_moe-auto_round-FP8_STATIC-experts": (
        "autoround", "qwen3_moe", ["--format", "auto_round", "--scheme", "FP8_STATIC", *EXPERTS_ONLY]),
    "autoround/qwen3_moe-auto_round-FP8_BLOCK-experts": (
        "autoround", "qwen3_moe", ["--format", "auto_round", "--scheme", "FP8_BLOCK", *EXPERTS_ONLY]),
    "gptqmodel/qwen3_moe-gptq": ("gptqmodel", "qwen3_moe", ["--method", "gptq"]),
    "gptqmodel/qwen3_moe-awq": ("gptqmodel", "qwen3_moe", ["--method", "awq", *AWQ_TINY]),
    "gptqmodel/mixtral-gptq": ("gptqmodel", "mixtral", ["--method", "gptq"]),
    "gptqmodel/qwen3_moe-gptq-experts": ("gptqmodel", "qwen3_moe", ["--method", "gptq", *EXPERTS_ONLY]),
    "gptqmodel/qwen3_moe-awq-experts": ("gptqmodel", "qwen3_moe", ["--method", "awq", *AWQ_TINY, *EXPERTS_ONLY]),
    "gptqmodel/qwen3_moe-gptq_8bit_dyn-experts": (
        "gptqmodel", "qwen3_moe",
        ["--method", "gptq", "--bits", "8", "--dynamic", '{"+:.*\\\\.down_proj": {"group_size": 16}}', *EXPERTS_ONLY]),
    "gptqmodel/qwen3_moe-fp8-experts": ("gptqmodel", "qwen3_moe", ["--method", "fp8", *EXPERTS_ONLY]),
    "gptqmodel/qwen3_moe-fp8": ("gptqmodel", "qwen3_moe", ["--method", "fp8"]),
    # 2-bit asymmetric v1: zero points 0 are stored as -1 and borrow from the next value of the word
    "gptqmodel/qwen3_moe-gptq_2bit_asym_g16-experts": (
        "gptqmodel", "qwen3_moe", ["--method", "gptq", "--bits", "2", "--asym", "--group-size", "16", *EXPERTS_ONLY]),
    # overlapping dynamic rules, first match wins: k_proj left unquantized by a negative rule before
    # the q/k rule; q_proj its own group 16; the experts' down_proj 4-bit g16 before the catch-all 8-bit
    "gptqmodel/qwen3_moe-gptq_dynamic_overlap": (
        "gptqmodel", "qwen3_moe", ["--method", "gptq", "--dynamic", json.dumps({
            r"-:.*\.self_attn\.k_proj": {}, r"+:.*\.self_attn\.[qk]_proj": {"group_size": 16},
            r"+:.*\.experts\.\d+\.down_proj": {"group_size": 16}, r"+:.*_proj": {"bits": 8}})]),
}
# name -> (the tool fixture it is derived from, the dtype its ``scales`` are cast to: ``tool_quantize.py
# cast-scales``, what a loaded model cast to bfloat16 and saved again carries)
DERIVED: dict[str, tuple[str, str]] = {
    "gptqmodel/qwen3_moe-gptq-experts-bf16_scales": ("gptqmodel/qwen3_moe-gptq-experts", "bfloat16"),
    "autoround/qwen3_moe-auto_round-experts-bf16_scales": ("autoround/qwen3_moe-auto_round-experts", "bfloat16"),
}
# The bundled model through each tool's default recipes (attention quantized), for the README table.
BUNDLED: dict[str, tuple[str, list[str]]] = {
    "autoround-auto_round": ("autoround", ["--format", "auto_round"]),
    "autoround-auto_gptq": ("autoround", ["--format", "auto_gptq"]),
    "autoround-auto_awq": ("autoround", ["--format", "auto_awq", "--group-size", "64"]),
    "autoround-llm_compressor": ("autoround", ["--format", "llm_compressor"]),
    "autoround-auto_round-W8A16": ("autoround", ["--format", "auto_round", "--scheme", "W8A16"]),
    "autoround-auto_round-FPW8A16": ("autoround", ["--format", "auto_round", "--scheme", "FPW8A16"]),
    "autoround-auto_round-NVFP4": ("autoround", ["--format", "auto_round", "--scheme", "NVFP4"]),
    "autoround-auto_round-MXFP4": ("autoround", ["--format", "auto_round", "--scheme", "MXFP4"]),
    "gptqmodel-gptq": ("gptqmodel", ["--method", "gptq"]),
    "gptqmodel-awq": ("gptqmodel", ["--method", "awq", "--group-size", "64"]),
    "gptqmodel-gptq_8bit": ("gptqmodel", ["--method", "gptq", "--bits", "8"]),
    "gptqmodel-fp8": ("gptqmodel", ["--method", "fp8"]),
}


def run(python: Path, *args) -> None:
    cmd = [str(python), str(SCRIPT), *map(str, args)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=tempfile.gettempdir())  # GPTQModel writes logs/ into its cwd


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", type=Path, default=ROOT / "tests" / "data", help="where TINY goes (default tests/data)")
    p.add_argument("--bundled", type=Path, default=None, help="also write BUNDLED here")
    p.add_argument("--only", nargs="*", default=None, help="names from TINY / BUNDLED (default: all)")
    p.add_argument("--force", action="store_true", help="rewrite checkpoints that exist")
    p.add_argument("--no-dequant", dest="dequant", action="store_false", help="skip tool_dequant.safetensors")
    p.add_argument("--autoround-venv", type=Path, default=Path("/work/ar-venv"))
    p.add_argument("--gptqmodel-venv", type=Path, default=Path("/work/gptqm-venv"))
    p.add_argument("--calib", type=Path, default=None,
                   help="calibration text for tool_quantize.py (default: its own, WikiText-2 validation)")
    args = p.parse_args(argv)
    python = {"autoround": args.autoround_venv / "bin" / "python", "gptqmodel": args.gptqmodel_venv / "bin" / "python"}
    args.tiny = args.tiny.resolve()
    args.bundled = args.bundled.resolve() if args.bundled else None
    jobs = [(name, tool, ("tiny", family), extra, args.tiny / name) for name, (tool, family, extra) in TINY.items()]
    if args.bundled:
        jobs += [(name, tool, ("bundled", None), extra, args.bundled / name) for name, (tool, extra) in BUNDLED.items()]
    if args.only:
        jobs = [j for j in jobs if j[0] in args.only]
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, tool, (kind, family), extra, out in jobs:
            if (out / "tool_quantize.json").exists() and not args.force:
                print("cached", out)
                continue
            src = ROOT / "pagedexperts" / "data" / "tiny-qwen3-moe" if kind == "bundled" else Path(tmp) / family
            if not src.exists():
                run(python["autoround"], "source", family, src)
            try:
                calib = ["--calib", args.calib.resolve()] if args.calib else []
                run(python[tool], tool, "--model", src, "--out", out, *calib, *extra)
            except subprocess.CalledProcessError as exc:
                failed.append(f"{name}: {exc}")
    for name, (source, dtype) in DERIVED.items():
        out, tool = args.tiny / name, source.partition("/")[0]
        if (args.only is None or name in args.only) and (args.force or not (out / "tool_quantize.json").exists()):
            run(python[tool], "cast-scales", "--model", args.tiny / source, "--out", out, "--dtype", dtype)
            jobs.append((name, tool, ("tiny", None), [], out))
    if args.dequant:
        for name, tool, (kind, _), _, out in jobs:
            method = dequant_tool(out)
            if kind == "tiny" and method and (out / "config.json").exists() and not (out / "tool_dequant.safetensors").exists():
                run(python[method], "tool-dequant", out)
    if failed:
        sys.exit("failed:\n" + "\n".join(failed))


def dequant_tool(out: Path) -> str | None:
    """The venv whose library dequantizes ``out``'s format (GPTQ / AWQ / FP8: GPTQModel's;
    auto-round: AutoRound's), or None (compressed-tensors: the tests call it directly)."""
    import json

    if not (out / "config.json").exists():
        return None
    method = json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"]
    return {"gptq": "gptqmodel", "awq": "gptqmodel", "fp8": "gptqmodel", "auto-round": "autoround"}.get(method)


if __name__ == "__main__":
    sys.exit(main())
