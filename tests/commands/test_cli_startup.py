"""What a user meets before any work: the command list, which commands stay light, and one-line
start-up errors (exit 2) for a damaged checkpoint in every command that reads one (issue 33)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedexperts.cli import command_named, main
from pagedexperts.commands import COMMANDS
from pagedexperts.loading.bundled import bundled_model_path

HEAVY = ("torch", "triton", "transformers")
PROBE = ("import sys\nfrom pagedexperts.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
         f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)")


def _heavy_modules_after(argv: list[str]) -> list[str]:
    """The heavy libraries a fresh interpreter has imported after ``pagedexperts ARGV``."""
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    line = [ln for ln in done.stderr.splitlines() if ln.startswith("HEAVY ")][-1]
    return eval(line.removeprefix("HEAVY "))  # a list literal printed by PROBE


@pytest.mark.parametrize("argv", [
    ["--help"], ["preflight", "--help"], ["simulate", "--help"], ["quantize", "--help"], ["linkbench", "--help"],
    ["preflight"], ["preflight", "--model-path", "bundled", "--num-resident", "16", "--json"],
], ids=" ".join)
def test_help_and_light_commands_import_no_torch(argv):
    assert _heavy_modules_after(argv) == []


def test_a_model_command_still_gets_all_its_flags():
    """Only the command named is imported, and it registers every flag (here generate's)."""
    assert "torch" in _heavy_modules_after(["generate", "--help"])  # its choices come from the paging modules
    with pytest.raises(SystemExit):
        main(["generate", "--no-such-flag"])


def test_every_command_is_listed_with_its_summary(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = " ".join(capsys.readouterr().out.split())
    for name, summary in COMMANDS.items():
        assert f"{name} {' '.join(summary.split())}" in listed


@pytest.mark.parametrize("argv,named", [
    (["preflight", "--json"], "preflight"), (["--log-level", "debug", "check"], "check"),
    (["--log-level=INFO", "serve", "--port", "1"], "serve"), (["--help"], None), (["nope"], None), ([], None),
])
def test_command_named(argv, named):
    assert command_named(argv) == named


@pytest.mark.parametrize("argv,level", [
    (["preflight", "--log-level", "info"], "INFO"), (["--log-level", "debug", "preflight"], "DEBUG"),
    (["--log-level", "debug", "preflight", "--log-level", "error"], "ERROR"), (["preflight"], "WARNING"),
])
def test_log_level_before_or_after_the_command(argv, level):
    """`pagedexperts preflight --log-level INFO` was refused ("unrecognized arguments")."""
    from pagedexperts.cli import build_parser

    assert build_parser(argv).parse_args(argv).log_level == level


def test_python_m_pagedexperts_is_the_command():
    """``python -m pagedexperts`` said "'pagedexperts' is a package and cannot be directly executed"."""
    done = subprocess.run([sys.executable, "-m", "pagedexperts", "preflight", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout)["num_experts"] == 64, done.stderr


def test_version_is_the_package_s_and_light():
    """`pagedexperts --version` said "unrecognized arguments"; it prints the package version and
    imports no torch."""
    from pagedexperts import __version__

    done = subprocess.run([sys.executable, "-c", PROBE, "--version"], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == f"pagedexperts {__version__}"
    assert "HEAVY []" in done.stderr


def test_a_closed_stdout_pipe_is_no_traceback():
    """`pagedexperts preflight --json | head -1`: the reader closes the pipe; the command ends
    with exit 1 and nothing on stderr (it printed a BrokenPipeError traceback)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader at all: the first write to stdout fails with EPIPE
    done = subprocess.run([sys.executable, "-m", "pagedexperts.cli", "preflight", "--json"], stdout=write_end,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write_end)
    assert (done.returncode, done.stderr) == (1, "")


# ---- damaged checkpoints: one line, exit 2, in every command (item 7) --------------------------


def _damaged(tmp_path, config_text: str | None = None, drop: str | None = None, **edits):
    """The bundled model with its config.json rewritten (or edited) and a file dropped; the
    weights are symlinked (nothing here reads past the start-up checks)."""
    src = bundled_model_path()
    dst = tmp_path / "model"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json" and f.name != drop:
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text()) | edits
    (dst / "config.json").write_text(config_text if config_text is not None else json.dumps(config))
    return dst


LOADING = [["generate", "--prompt", "x"], ["check"], ["serve"], ["bench"], ["preflight"]]


@pytest.mark.parametrize("argv", LOADING, ids=lambda a: a[0])
def test_invalid_config_json_is_one_line_and_exit_2(argv, tmp_path, capsys):
    path = _damaged(tmp_path, config_text='{"model_type": "qwen3_moe",\n')
    assert main([*argv, "--model-path", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"pagedexperts {argv[0]}: error: {path / 'config.json'} is not valid JSON: Expecting property name "
        "enclosed in double quotes at line 2 column 1 (--model-path)\n")


@pytest.mark.parametrize("argv", LOADING, ids=lambda a: a[0])
def test_top_k_above_e_names_config_json_not_a_flag(argv, tmp_path, capsys):
    path = _damaged(tmp_path, num_experts_per_tok=80)
    assert main([*argv, "--model-path", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"pagedexperts {argv[0]}: error: config.json has num_experts_per_tok = 80 but num_local_experts "
                   "= 64: a token cannot route to more experts than a layer has; the checkpoint's config.json is "
                   "inconsistent (--model-path)\n")


def test_missing_tokenizer_json_is_named_in_generate(tmp_path, capsys):
    path = _damaged(tmp_path, drop="tokenizer.json")
    assert main(["generate", "--prompt", "x", "--model-path", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedexperts generate: error: {path} has tokenizer_config.json but no tokenizer.json")
    assert err.count("\n") == 1 and "sentencepiece" not in err


def test_ctrl_c_in_generate_is_one_line_and_exit_130(tmp_path):
    """SIGINT while generate streams: one line on stderr, exit 130 (128 + SIGINT), no report and no
    --stats-json file (it printed a KeyboardInterrupt traceback from inside the experts kernel)."""
    import signal

    stats = tmp_path / "stats.json"
    argv = [sys.executable, "-m", "pagedexperts.cli", "generate", "--prompt", "ROMEO:", "--max-new-tokens", "500",
            "--min-tokens", "500", "--threads", "1", "--stats-json", str(stats)]
    # SIGINT as at a terminal: a run started in the background (nohup, `cmd &` in a script) hands
    # its children SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.read(len("ROMEO:") + 1)  # the prompt and a first token: generation is under way
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    lines = [ln for ln in err.decode().splitlines() if ln.strip()]
    assert proc.returncode == 130, err.decode()
    assert "Traceback" not in err.decode() and lines[-1] == "pagedexperts generate: interrupted"
    assert not stats.exists()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_says_what_it_does_and_its_default(command):
    """Each flag of ``COMMAND --help`` has a help text, and one with a default value names it
    (six of bench's flags printed no help at all; quantize's --cache-dir said "see description",
    which did not say)."""
    import argparse

    from pagedexperts.cli import build_parser

    parser = build_parser([command])._subparsers._group_actions[0].choices[command]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag, text = "/".join(action.option_strings), action.help or ""
        assert text.strip(), f"{command} {flag} has no help text"
        valued = not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction))
        if valued and action.default not in (None, "", [], argparse.SUPPRESS):
            assert "default" in text, f"{command} {flag}: default {action.default!r} is not in its help"
        assert "see description" not in text, f"{command} {flag}: say the default here"


def test_serve_on_an_address_in_use_is_refused_before_loading(capsys, monkeypatch):
    """uvicorn said "address already in use" after the whole model had loaded, and exited 3."""
    pytest.importorskip("fastapi")
    import socket

    import pagedexperts.commands.serve

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr(pagedexperts.commands.serve, "load_from_args", fail)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert capsys.readouterr().err == (f"pagedexperts serve: error: --host 127.0.0.1 --port {port}: cannot listen there "
                                       "(Address already in use); choose another --port (or stop what listens on it)\n")
