"""The README's and docs' commands stay runnable (issue 36 part 2).

- Every ``pagedexperts COMMAND ...`` in a fenced block of README.md, docs/*.md and the package's
  README files parses with that command's own argparse parser (the command exists, every flag
  exists, choices and types hold); every inline ``pagedexperts COMMAND --flag`` span (or
  ``COMMAND --flag``) names a command and flags that exist.
- The README's two commands are the ones ``.ci/run`` runs (its own grep, run here), each the
  first line of a fenced block.
- The README's Python block and the package docstring's quick start run.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

import pagedexperts
from pagedexperts.cli import build_parser
from pagedexperts.commands import COMMANDS
from support.paths import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "pagedexperts").rglob("README.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
OPERATORS = {";", "&&", "||", "|", "&", "(", ")", ">", "<", ">>", "2>&1"}


def _fenced(path: Path) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of a markdown file."""
    return FENCE.findall(path.read_text())


def _commands(body: str) -> list[list[str]]:
    """argv after ``pagedexperts`` of every invocation in a shell block: continuations joined,
    comments dropped, each pipeline and list member on its own, env assignments and redirections
    left out."""
    found = []
    for line in body.replace("\\\n", " ").splitlines():
        if "pagedexperts " not in line:  # sample output and other tools' commands
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        words, member = list(lexer), []
        for word in words + [";"]:
            if word in OPERATORS or set(word) <= set("&|;<>()"):
                if member:
                    found.append(member)
                member = []
            else:
                member.append(word)
    out = []
    for member in found:
        heads = [i for i, w in enumerate(member) if w == "pagedexperts" or w.endswith("/pagedexperts")]
        if heads:
            out.append(member[heads[0] + 1:])
    return out


def _cases():
    for path in DOCS:
        for language, body in _fenced(path):
            if language in ("", "bash", "sh", "shell", "console"):
                for argv in _commands(body):
                    yield pytest.param(argv, id=f"{path.relative_to(ROOT)}: pagedexperts {' '.join(argv)[:60]}")


@pytest.mark.parametrize("argv", list(_cases()))
def test_every_fenced_command_parses_with_its_own_parser(argv):
    assert argv and argv[0] in COMMANDS, f"no command {argv[:1]}; the commands are {list(COMMANDS)}"
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as exc:  # argparse prints why on stderr
        raise AssertionError(f"`pagedexperts {' '.join(argv)}` does not parse (exit {exc.code})") from None
    assert args.command == argv[0]


# `pagedexperts check --flag ...`, or a command name alone before its flags (`preflight --model-path DIR`)
INLINE = re.compile(r"`(?:pagedexperts ([a-z]+)((?: [^`]*)?)|(" + "|".join(COMMANDS) + r")( --[^`]*))`")


def _inline_spans():
    for path in DOCS:
        text = FENCE.sub("", path.read_text())
        for named, rest, bare, bare_rest in INLINE.findall(text):
            yield path, named or bare, re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest or bare_rest)


def test_every_inline_command_and_flag_exists():
    problems, seen = [], 0
    for path, command, flags in _inline_spans():
        seen += 1
        if command not in COMMANDS:
            problems.append(f"{path.relative_to(ROOT)}: `pagedexperts {command}` is no command")
            continue
        known = build_parser([command])._subparsers._group_actions[0].choices[command]._option_string_actions
        problems += [f"{path.relative_to(ROOT)}: `pagedexperts {command}` has no {flag}" for flag in flags
                     if flag not in known]
    assert seen > 30 and problems == []


def _ci_readme_command(prefix: str) -> str:
    """What .ci/run runs for ``prefix``: its own readme_command function, run in bash."""
    script = f'source <(sed -n "/^readme_command()/,/^}}/p" .ci/run); readme_command "{prefix}"'
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_readme_s_two_commands_are_what_ci_runs():
    first_lines = [body.splitlines()[0] for language, body in _fenced(ROOT / "README.md") if body.strip()]
    main_job, tests = _ci_readme_command("pagedexperts"), _ci_readme_command("python -m pytest")
    assert main_job == ('bash scripts/bootstrap.sh && .venv/bin/pagedexperts generate --prompt "ROMEO:" '
                        "--max-new-tokens 80 --temperature 0.8 --top-p 0.95 --seed 0")
    assert tests == "bash scripts/bootstrap.sh && .venv/bin/python -m pytest -q"
    assert first_lines[:2] == [main_job, tests]  # the first two blocks, each the command alone


def _python_blocks() -> list[str]:
    blocks = [body for language, body in _fenced(ROOT / "README.md") if language == "python"]
    doc = pagedexperts.__doc__
    quick = doc[doc.index("Quick start::") + len("Quick start::"):].split("\n\n")[1]
    return blocks + [re.sub(r"^    ", "", quick, flags=re.M)]


@pytest.mark.parametrize("index", range(2))
def test_the_python_quick_starts_run(index, capsys):
    """The README's block and the package docstring's (``model.paging_stats()`` did not exist)."""
    code = _python_blocks()[index].replace("max_new_tokens=30", "max_new_tokens=4").replace(
        "max_new_tokens=20", "max_new_tokens=4")
    exec(compile(code, f"quick start {index}", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("ROMEO:") and re.search(r" 0\.\d+\n$", out), out


LIGHT = ("preflight", "simulate")  # standard library and numpy only: run every example of them


@pytest.mark.parametrize("argv", [p for p in _cases() if p.values[0][0] in LIGHT
                                  and "--model-path" not in p.values[0]])
def test_the_light_fenced_commands_run(argv, capsys):
    from pagedexperts.cli import main

    assert main(list(argv)) in (0, 1), capsys.readouterr().err  # preflight: 1 = does not fit, as it prints
    assert capsys.readouterr().out.strip()


def test_a_command_given_a_gpu_runs_on_it():
    """A fenced command that picks a GPU (CUDA_VISIBLE_DEVICES=N) passes --device cuda: --device is
    cpu by default, and docs/server.md's two replicas under a router ran on the CPU."""
    lines = [line for path in DOCS for _, body in _fenced(path) for line in body.replace("\\\n", " ").splitlines()
             if "CUDA_VISIBLE_DEVICES=" in line and "pagedexperts " in line]
    assert lines and [line for line in lines if "--device cuda" not in line] == []


def _try_them() -> list[str]:
    """The README's "Try them on the bundled model" block, a command a line."""
    text = (ROOT / "README.md").read_text()
    body = FENCE.search(text, text.index("Try them on the bundled model")).group(2)
    return [line for line in body.splitlines() if line.strip()]


@pytest.mark.parametrize("line", _try_them())
def test_the_try_them_commands_run_as_printed(line, tmp_path):
    """Each line exactly as printed, from the repository root, after the bootstrap: the venv is
    not activated (a PATH without it; a bare ``pagedexperts`` was rc 127), and ``bundled`` works in
    every command that takes a path (``linkbench --disk bundled`` was refused)."""
    venv = ROOT / ".venv/bin/pagedexperts"
    if not venv.exists():
        pytest.skip("no .venv here: scripts/bootstrap.sh makes it")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PAGEDEXPERTS_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (line, done.stdout[-1000:], done.stderr[-2000:])
