"""The ``pagedexperts`` command line: one subcommand per module in ``pagedexperts.commands``, each
registering its flags (``add_parser``) and a ``func`` of the parsed arguments that returns an
exit code. Owns argv parsing only.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from pagedexperts import __version__
from pagedexperts.commands import COMMANDS


INTERRUPTED = 130  # the exit status of Ctrl-C: 128 + SIGINT, what a shell reports for a process it interrupted


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: every command listed (``commands.COMMANDS``), but only the
    command ``argv`` names is imported and given its flags, so that ``--help`` and the light
    commands (preflight, simulate) never import torch or transformers."""
    parser = argparse.ArgumentParser(
        prog="pagedexperts",
        description="Run MoE models whose experts do not fit in device memory: K resident "
        "expert slots per layer, paged in from host memory on demand.",
    )
    parser.add_argument("--version", action="version", version=f"pagedexperts {__version__}")
    add_log_level(parser, default="WARNING")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    named = command_named(sys.argv[1:] if argv is None else argv)
    for name, summary in COMMANDS.items():
        if name == named:
            importlib.import_module(f"pagedexperts.commands.{name}").add_parser(sub)
            add_log_level(sub.choices[name], default=argparse.SUPPRESS)  # after the command too
        else:
            sub.add_parser(name, help=summary)
    return parser


def add_log_level(parser: argparse.ArgumentParser, *, default: str) -> None:
    """``--log-level`` on ``parser``; a command's copy defaults to SUPPRESS, so that the value
    given before the command stands unless the flag is repeated after it."""
    parser.add_argument("--log-level", default=default, type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="logging level (default WARNING)")


def command_named(argv: list[str]) -> str | None:
    """The subcommand of ``argv``: its first word that is not an option (or --log-level's
    value), when that word is a command; else None."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def main(argv: list[str] | None = None) -> int:
    progress_bars_on_a_terminal_only()
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if getattr(args, "source_model_path", "") is None and str(args.model_path or "").startswith("bundled:"):
            from pagedexperts.loading.loader import bundled_model_path

            args.source_model_path = str(bundled_model_path())  # check's float32 source: the bundled model
        if getattr(args, "model_path", None):
            args.model_path = model_path(args.command, args.model_path)
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe (`| head`) raises here, inside the handler below
        return code
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedexperts {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback from wherever the work was; nothing more is written
        print(f"\npagedexperts {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:  # the reader left: no traceback; the recipe of Python's signal docs
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit flush finds a sink
        return 1
    except OSError as exc:  # after BrokenPipeError (one too): a file unreadable mid-run, one line naming it
        from pagedexperts.storage.safetensors_index import DiskReadError

        if not isinstance(exc, DiskReadError):
            raise
        print(f"pagedexperts {args.command}: error: {exc}", file=sys.stderr)
        return 1


# tqdm's default ``delay`` (seconds before a bar is first drawn) where stderr is no terminal: never
# (a bar never drawn writes nothing when it closes either). tqdm reads TQDM_<PARAMETER> defaults
# from the environment when it is imported.
NEVER_DRAWN_S = str(10**9)


def progress_bars_on_a_terminal_only() -> None:
    """Progress bars only where stderr is a terminal: where it is a file or a pipe, set
    huggingface_hub's ``HF_HUB_DISABLE_PROGRESS_BARS`` and tqdm's ``TQDM_DELAY`` (``NEVER_DRAWN_S``,
    for other libraries' bars that pass ``disable=False``) before any command imports them; an
    explicit value in the environment stands. The package's own bars pass ``disable=None``.
    """
    if sys.stderr.isatty():
        return
    if "transformers" not in sys.modules:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "tqdm" not in sys.modules:
        os.environ.setdefault("TQDM_DELAY", NEVER_DRAWN_S)


def model_path(command: str, value: str) -> str:
    """--model-path with ``bundled`` and ``bundled:FORMAT`` resolved to directories (quantize
    resolves ``bundled`` only: a quantized variant is no source to quantize)."""
    from pagedexperts.commands.quantize import BUNDLED_PREFIX, resolve_model_path

    if command == "quantize" and value.startswith(BUNDLED_PREFIX):
        return value
    return resolve_model_path(value)


if __name__ == "__main__":
    sys.exit(main())
