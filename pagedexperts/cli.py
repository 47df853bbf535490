"""The ``pagedexperts`` command line: one subcommand per module in ``pagedexperts.commands``.

Owns argv parsing only. Each command module defines ``add_parser(subparsers)`` that registers
its flags (kebab-case, grouped by purpose) and sets ``func``, a function of the parsed
arguments that calls library functions with keyword arguments and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Subcommand name -> module under pagedexperts.commands. Modules import heavy libraries
# (torch, transformers) inside their ``func`` so that ``--help`` and ``preflight`` stay fast.
COMMANDS = {
    "generate": "generate",
    "check": "check",
    "preflight": "preflight",
    "linkbench": "linkbench",
    "simulate": "simulate",
    "serve": "serve",
    "bench": "bench",
    "quantize": "quantize",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedexperts",
        description="Run MoE models whose experts do not fit in device memory: K resident "
        "expert slots per layer, paged in from host memory on demand.",
    )
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(f"pagedexperts.commands.{module}")
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("pagedexperts.commands"):
                continue  # command not built yet
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if args.command != "quantize" and str(getattr(args, "model_path", "") or "").startswith("bundled:"):
            from pagedexperts.commands.quantize import resolve_model_path

            if getattr(args, "source_model_path", "") is None:  # check's float32 source: the bundled model
                from pagedexperts.loading.loader import bundled_model_path

                args.source_model_path = str(bundled_model_path())
            args.model_path = resolve_model_path(args.model_path)
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedexperts {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
