"""``pagedexperts quantize``: write a checkpoint's routed experts in a quantized published format.

Owns: the flags, their validation, the report line, and the ``bundled`` and ``bundled:FORMAT``
model paths of every command (the bundled model, and its quantized variants built on first use
into the cache directory: ``$PAGEDEXPERTS_CACHE``, else ``$XDG_CACHE_HOME/pagedexperts``, else
``~/.cache/pagedexperts``).
The work is ``pagedexperts.tools.quantize``.
"""

from __future__ import annotations

import os
from pathlib import Path

from pagedexperts.commands import COMMANDS
from pagedexperts.formats import QUANTIZE_FORMATS

BUNDLED_PREFIX = "bundled:"


def add_parser(subparsers) -> None:
    """Register the subcommand, its flags and ``func`` on the CLI's ``subparsers``."""
    p = subparsers.add_parser(
        "quantize",
        help=COMMANDS["quantize"],
        description="Quantize the ROUTED experts of a bf16/fp16/fp32 checkpoint (everything else is "
        "copied unchanged; w4a16 --scope model: every nn.Linear but the routers) into a published on-disk layout that transformers loads: w4a16 = "
        "compressed-tensors pack-quantized int4 (written by the compressed-tensors package), "
        "fp8-block = DeepSeek-V3/Qwen3-FP8 block FP8, mxfp4 = gpt-oss MXFP4 (gpt-oss only). "
        "Plain round-to-nearest, no calibration. Without --model-path and --output, builds the "
        f"bundled model's variant into the cache and prints its path (also usable as --model-path "
        f"{BUNDLED_PREFIX}FORMAT in every command).",
    )
    p.add_argument("--model-path", default=None, help="unquantized checkpoint directory (default: the bundled model)")
    p.add_argument("--format", required=True, choices=list(QUANTIZE_FORMATS), help="format to write")
    p.add_argument("--output", default=None, help="new directory to write (default with no --model-path: the cache)")
    g = p.add_argument_group("format parameters")
    g.add_argument("--group-size", type=int, default=128,
                   help="w4a16: input channels per scale group; must divide every expert's input size (default 128)")
    g.add_argument("--asymmetric", action="store_true", help="w4a16: asymmetric with int4 zero points (default symmetric)")
    g.add_argument("--scope", default="experts", choices=["experts", "model"],
                   help="w4a16: what is quantized (default experts: the routed experts only; model: every nn.Linear but "
                   "the routers, as llm-compressor's whole-model exports: attention, shared experts and dense MLP layers "
                   "in int4 at --group-size, lm_head int8 per channel unless tied to the embeddings; refused when torch's "
                   "CPU kernels cannot compute a module packed)")
    g.add_argument("--block-size", type=int, default=128, help="fp8-block: square weight block edge (default 128)")
    p.add_argument("--cache-dir", default=None, help="where bundled variants are built (default: $PAGEDEXPERTS_CACHE, "
                   "else $XDG_CACHE_HOME/pagedexperts, else ~/.cache/pagedexperts)")
    p.set_defaults(func=run_quantize)


def default_cache_dir() -> Path:
    """``$PAGEDEXPERTS_CACHE``, else ``$XDG_CACHE_HOME/pagedexperts``, else ``~/.cache/pagedexperts``."""
    if os.environ.get("PAGEDEXPERTS_CACHE"):
        return Path(os.environ["PAGEDEXPERTS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedexperts"


def resolve_model_path(value: str | None, cache_dir: str | None = None) -> str | None:
    """``bundled`` -> the bundled model's directory; ``bundled:FORMAT`` -> its quantized variant's
    directory (built on first use); any other value unchanged."""
    from pagedexperts.loading.bundled import bundled_model_path

    if value == BUNDLED_PREFIX.rstrip(":"):
        return str(bundled_model_path())
    if not value or not value.startswith(BUNDLED_PREFIX):
        return value
    from pagedexperts.tools.quantize import bundled_variant_path

    fmt = value.removeprefix(BUNDLED_PREFIX)
    return str(bundled_variant_path(fmt, cache_dir=cache_dir or default_cache_dir()))


def run_quantize(args) -> int:
    """Quantize, print what was written; 0 on success, ValueError on bad input."""
    from pagedexperts.tools.quantize import QuantizeOptions, quantize_checkpoint

    if args.group_size <= 0:
        raise ValueError(f"--group-size {args.group_size} must be > 0")
    if args.block_size <= 0:
        raise ValueError(f"--block-size {args.block_size} must be > 0")
    if args.model_path and args.model_path.startswith(BUNDLED_PREFIX):
        raise ValueError(f"--model-path {args.model_path} is already quantized (a bundled variant); pass an "
                         "unquantized bf16/fp16/fp32 checkpoint, e.g. --model-path bundled")
    if args.model_path is None and args.output is None:
        if args.asymmetric or args.group_size != 128 or args.block_size != 128 or args.scope != "experts":
            raise ValueError("the bundled variants have fixed parameters; pass --model-path and --output to choose them")
        print(resolve_model_path(BUNDLED_PREFIX + args.format, args.cache_dir))
        return 0
    if args.output is None:
        raise ValueError("--output DIR is required with --model-path")
    from pagedexperts.loading.bundled import bundled_model_path

    options = QuantizeOptions(args.format, group_size=args.group_size, symmetric=not args.asymmetric,
                              block=(args.block_size, args.block_size), scope=args.scope)
    report = quantize_checkpoint(model_path=args.model_path or bundled_model_path(), output=args.output, options=options,
                                 progress=True)
    ratio = report.expert_bytes_out / report.expert_bytes_in
    print(f"{report.format}: {report.expert_tensors} routed expert weights, "
          f"{report.expert_bytes_in / 1e6:.2f} MB -> {report.expert_bytes_out / 1e6:.2f} MB ({ratio:.3f}x)"
          + (f"; {report.linear_tensors} non-expert weights" if report.linear_tensors else "") + f" in {report.output}")
    return 0
