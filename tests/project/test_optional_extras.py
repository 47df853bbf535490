"""The package works with none of its optional extras installed (a fresh ``pip install -e .``),
and a feature that needs one says which, exit 2, before any work.

Each case runs in a subprocess whose extras are blocked the way a missing package looks to an
import (``sys.modules[name] = None``): every module of the package imports (those of
``pagedexperts.serving`` raise ``MissingExtra`` naming the server extra), ``--help`` of every
command and a short ``generate`` run, and ``serve`` / ``quantize --format w4a16`` /
``simulate --plot-dir`` / ``--experts-implementation fused`` answer one line naming their
extra. The slow case builds the wheel and runs the main job from it, outside the source tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from pagedexperts.commands import COMMANDS
from pagedexperts.extras import EXTRAS
from support.paths import ROOT

# what the test extra brings (a user's install has none of it either)
TEST_PEERS = ("openai", "httpx", "requests")
ALL_BLOCKED = tuple(m for mods in EXTRAS.values() for m in mods) + TEST_PEERS

WALK = """
import importlib, json, pkgutil, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
import pagedexperts
from pagedexperts.extras import MissingExtra
out = {}
for m in pkgutil.walk_packages(pagedexperts.__path__, "pagedexperts."):
    try:
        importlib.import_module(m.name)
        out[m.name] = "ok"
    except MissingExtra as exc:
        out[m.name] = "missing extra: " + str(exc)
    except BaseException as exc:
        out[m.name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

CLI = """
import sys
for name in sys.argv[1].split(","):
    if name:
        sys.modules[name] = None
from pagedexperts.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _run(code: str, *args: str, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)


def _cli(blocked: tuple[str, ...], *argv: str, cwd=None, **env) -> subprocess.CompletedProcess:
    return _run(CLI, ",".join(blocked), *argv, cwd=cwd, env=dict(os.environ, TRITON_INTERPRET="0", **env))


# "all" blocks every extra at once (the quick run); each extra alone is slow
@pytest.mark.parametrize("extra", [*(pytest.param(e, marks=pytest.mark.slow) for e in EXTRAS), "all"])
def test_every_module_imports_without_the_extra(extra):
    blocked = ALL_BLOCKED if extra == "all" else EXTRAS[extra]
    done = _run(WALK, ",".join(blocked))
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert len(results) > 100  # the walk saw the package, not an empty path
    server_blocked = any(m in blocked for m in EXTRAS["server"])
    for name, result in results.items():
        if name.startswith("pagedexperts.serving") and server_blocked:
            assert result.startswith("missing extra: ") and "'server' extra" in result, (name, result)
        else:
            assert result == "ok", (name, result)


HELP = """
import contextlib, io, json, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from pagedexperts.cli import main
out = {}
for command in sys.argv[2:]:
    argv = [command, "--help"] if command else ["--help"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    out[command] = [code, buf.getvalue()]
print(json.dumps(out))
"""


def test_help_of_every_command_without_any_extra():
    """``--help`` of the top level and of every command, one after another in one process (one
    interpreter start: each command's parser is built fresh by ``main``)."""
    done = _run(HELP, ",".join(ALL_BLOCKED), "", *COMMANDS, env=dict(os.environ, TRITON_INTERPRET="0"))
    assert done.returncode == 0, done.stderr
    helped = json.loads(done.stdout)
    assert sorted(helped) == sorted(["", *COMMANDS])
    for command, (code, text) in helped.items():
        assert code in (0, None), (command, code, done.stderr)
        assert text.startswith("usage: pagedexperts" + (f" {command}" if command else "")), (command, text[:200])


def test_generate_without_any_extra():
    done = _cli(ALL_BLOCKED, "generate", "--prompt", "ROMEO:", "--max-new-tokens", "4", "--num-resident", "8",
                "--threads", "1", "--seed", "0", "--temperature", "0.8", "--top-p", "0.95")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ROMEO:") and "K=8 of E=64" in done.stderr


@pytest.mark.parametrize("argv, extra", [
    (["serve"], "server"),
    (["quantize", "--format", "w4a16", "--model-path", "bundled", "--output", "{tmp}/out"], "quant"),
    pytest.param(["generate", "--model-path", "bundled:w4a16", "--max-new-tokens", "1"], "quant", marks=pytest.mark.slow),
    pytest.param(["simulate", "--trace", "{tmp}/trace.jsonl", "--plot-dir", "{tmp}/plots"], "plots", marks=pytest.mark.slow),
    (["generate", "--experts-implementation", "fused", "--max-new-tokens", "1"], "gpu"),
])
def test_a_feature_needing_an_extra_names_it_and_does_nothing(argv, extra, tmp_path):
    (tmp_path / "trace.jsonl").write_text('{"type": "meta", "top_k": 2, "num_experts": 4}\n'
                                          '{"type": "route", "req_id": 0, "token_idx": 0, "layer": 0, '
                                          '"topk_ids": [0, 1], "topk_weights": [0.5, 0.5]}\n')
    argv = [a.format(tmp=tmp_path) for a in argv]
    done = _cli(EXTRAS[extra], *argv, PAGEDEXPERTS_CACHE=str(tmp_path / "cache"))  # bundled variants built here
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"'{extra}' extra" in done.stderr and f"pip install -e '.[{extra}]'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.jsonl"]  # nothing written, nothing half done


@pytest.mark.slow
def test_the_wheel_carries_the_bundled_model_and_runs_the_main_job(tmp_path):
    """``pip wheel .`` -> a wheel holding the bundled model and tokenizer; the package unpacked
    from it (not the source tree) runs the main job."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True, timeout=600)
    if built.returncode and "setuptools" in built.stderr and "Could not find" in built.stderr:
        pytest.skip(f"no build backend reachable: {built.stderr[-300:]}")
    assert built.returncode == 0, built.stderr
    wheel = next(tmp_path.glob("pagedexperts-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(tmp_path / "site")
    data = [n for n in names if n.startswith("pagedexperts/data/")]
    for required in ("config.json", "model.safetensors", "tokenizer.json"):
        assert any(n.endswith("/" + required) for n in data), (required, sorted(data)[:20])
    assert any(n.startswith("pagedexperts/data/traces/tiny-qwen3-moe/") and n.endswith(".npz") for n in data)  # simulate --trace bundled
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import pagedexperts; "
            "assert pagedexperts.__file__.startswith(sys.argv[1]), pagedexperts.__file__; "
            "from pagedexperts.cli import main; sys.exit(main(sys.argv[2:]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site"), "generate", "--prompt", "ROMEO:",
                           "--max-new-tokens", "4", "--threads", "1"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ROMEO:")
