"""``pagedexperts quantize``: write a checkpoint's routed experts in a quantized published format.

Owns: the flags, their validation, the report line, and the ``bundled`` and ``bundled:FORMAT``
model paths of every command (the bundled model, and its quantized variants built on first use
into the cache directory, ``loading.cache_root``: ``$PAGEDEXPERTS_CACHE``, else
``$XDG_CACHE_HOME/pagedexperts``, else ``~/.cache/pagedexperts``).
The work is ``pagedexperts.tools.quantize``.
"""

from __future__ import annotations

import sys

from pagedexperts.commands import COMMANDS
from pagedexperts.formats import QUANTIZE_FORMATS
from pagedexperts.loading.cache_root import cache_root

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
    p.add_argument("--no-kernel-layout", dest="kernel_layout", action="store_false",
                   help="do not also store the experts in torch's CPU kernel layouts for this CPU (OUTPUT/kernel-layout/: "
                   "what the packed disk tier reads, so that a miss is a read and a copy; written by default)")
    g = p.add_argument_group("format parameters (each format's own; another format's is refused)")
    g.add_argument("--group-size", type=int, default=None,
                   help="w4a16: input channels per scale group; must divide every quantized module's input size "
                   "(default: the largest of 128, 64, 32 that does; the report line says which)")
    g.add_argument("--asymmetric", action="store_true", default=None,
                   help="w4a16: asymmetric with int4 zero points (default symmetric)")
    g.add_argument("--scope", default=None, choices=["experts", "model"],
                   help="w4a16: what is quantized (default experts: the routed experts only; model: every nn.Linear but "
                   "the routers, as llm-compressor's whole-model exports: attention, shared experts and dense MLP layers "
                   "in int4 at --group-size, lm_head int8 per channel unless tied to the embeddings; refused when torch's "
                   "CPU kernels cannot compute a module packed)")
    g.add_argument("--block-size", type=int, default=None, help="fp8-block: square weight block edge (default 128)")
    p.add_argument("--cache-dir", default=None, help="where bundled variants are built (default: $PAGEDEXPERTS_CACHE, "
                   "else $XDG_CACHE_HOME/pagedexperts, else ~/.cache/pagedexperts)")
    p.set_defaults(func=run_quantize)


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
    return str(bundled_variant_path(fmt, cache_dir=cache_dir or cache_root()))


def format_flags_given(args) -> dict[str, str]:
    """dest -> flag of every format parameter given on the command line (their defaults are None).

    Raises:
        ValueError: a flag of another format than --format's, naming it and whose it is.
    """
    from pagedexperts.tools.quantize_writers import WRITERS

    format_flags = {name: writer.flags for name, writer in WRITERS.items()}  # a format's flag with another is refused
    given = {dest: flag for flags in format_flags.values() for dest, flag in flags.items()
             if getattr(args, dest) is not None}
    foreign = [flag for dest, flag in given.items() if dest not in format_flags[args.format]]
    if foreign:
        owners = {flag: fmt for fmt, flags in format_flags.items() for flag in flags.values()}
        own = ", ".join(format_flags[args.format].values()) or "no format parameter"
        raise ValueError(f"--format {args.format} takes {own}; " + "; ".join(
            f"{flag} is --format {owners[flag]}'s" for flag in foreign))
    return given


def run_quantize(args) -> int:
    """Quantize, print what was written; 0 on success, ValueError on bad input."""
    from pagedexperts.tools.quantize import QuantizeOptions, quantize_checkpoint
    from pagedexperts.tools.quantize_writers import GROUP_SIZES

    given = format_flags_given(args)
    for dest in ("group_size", "block_size"):
        if getattr(args, dest) is not None and getattr(args, dest) <= 0:
            raise ValueError(f"{given[dest]} {getattr(args, dest)} must be > 0")
    if args.model_path and args.model_path.startswith(BUNDLED_PREFIX):
        raise ValueError(f"--model-path {args.model_path} is already quantized (a bundled variant); pass an "
                         "unquantized bf16/fp16/fp32 checkpoint, e.g. --model-path bundled")
    if args.model_path is None and args.output is None:
        if given:
            raise ValueError(f"the bundled variants have fixed parameters ({', '.join(given.values())} given); pass "
                             "--model-path and --output to choose them")
        print(resolve_model_path(BUNDLED_PREFIX + args.format, args.cache_dir))
        return 0
    if args.output is None:
        raise ValueError("--output DIR is required with --model-path")
    from pagedexperts.loading.bundled import bundled_model_path

    block = args.block_size or 128
    options = QuantizeOptions(args.format, group_size=args.group_size, symmetric=not args.asymmetric,
                              block=(block, block), scope=args.scope or "experts")
    report = quantize_checkpoint(model_path=args.model_path or bundled_model_path(), output=args.output, options=options,
                                 progress=True)
    ratio = report.expert_bytes_out / report.expert_bytes_in
    group = "" if report.group_size is None else f" group size {report.group_size}" + (
        "" if args.group_size is not None else f" (the largest of {list(GROUP_SIZES)} that fits; --group-size to choose)")
    print(f"{report.format}{group}: {report.expert_tensors} routed expert weights, "
          f"{report.expert_bytes_in / 1e6:.2f} MB -> {report.expert_bytes_out / 1e6:.2f} MB ({ratio:.3f}x)"
          + (f"; {report.linear_tensors} non-expert weights" if report.linear_tensors else "") + f" in {report.output}")
    if args.kernel_layout:
        from pagedexperts.storage.kernel_layout_file import StoredLayoutError
        from pagedexperts.tools.quantize import write_kernel_layout

        try:
            print(write_kernel_layout(report.output))
        except StoredLayoutError as exc:
            print(f"error: {exc} (the quantized checkpoint in {report.output} is complete; a packed run writes the "
                  "layout to its cache on first load)", file=sys.stderr)
            return 1
    return 0
