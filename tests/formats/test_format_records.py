"""One record per format (issue 47, step 1): every view of the formats is derived from ``FORMATS``.

A format's facts (its class, how checkpoints spell it, whether torch's CPU kernels compute it
packed, preflight's example, whether ``quantize`` writes it) live in its ``FormatRecord``; the
CLI's choices, ``--experts-implementation auto``'s choice, preflight's sizing and the refusals
read them from there. A format name spelled in a second table anywhere in the package is the
drift this guards against (adding a format = its module plus one record).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import pagedexperts
from pagedexperts.formats import EXAMPLE_FORMATS, FORMATS, QUANTIZE_FORMATS, format_class, refusal_message
from pagedexperts.loading.config import PagingConfig, resolve_experts_implementation

PACKAGE = Path(pagedexperts.__file__).parent
REGISTRY = PACKAGE / "formats" / "__init__.py"


def _choices(argv: list[str], dest: str) -> list[str]:
    """The choices of flag ``dest`` of the command that ``argv`` names, as the CLI builds it."""
    from pagedexperts.cli import build_parser

    command = build_parser(argv)._subparsers._group_actions[0].choices[argv[0]]
    return list(next(a for a in command._actions if a.dest == dest).choices)


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_record_names_its_class(name):
    """The record's class is where it says and carries the record's name (the stats' name)."""
    record = FORMATS[name]
    assert record.name == name
    try:
        cls = format_class(name)
    except ValueError as exc:  # an optional library missing: the record still names the module
        pytest.skip(str(exc))
    assert cls.name == name and cls.__module__ == record.where.partition(":")[0]


def test_the_cli_choices_are_the_records():
    """preflight's --expert-format and quantize's --format offer exactly the records that say so."""
    assert _choices(["preflight", "--layers", "1"], "expert_format") == [
        n for n, r in FORMATS.items() if r.example is not None] == list(EXAMPLE_FORMATS)
    assert _choices(["quantize"], "format") == [n for n, r in FORMATS.items() if r.quantize] == list(QUANTIZE_FORMATS)


def test_quantize_has_a_writer_for_each_record_that_says_it_writes():
    from pagedexperts.tools import quantize, quantize_writers

    assert sorted(quantize_writers.WRITERS) == sorted(n for n, r in FORMATS.items() if r.quantize)
    assert set(quantize.BUNDLED_VARIANTS) <= set(quantize_writers.WRITERS)


@pytest.mark.parametrize("name", list(FORMATS))
def test_auto_runs_packed_on_a_cpu_exactly_for_the_records_that_say_so(name):
    cfg = PagingConfig(experts_implementation="auto", device="cpu")
    want = "packed" if FORMATS[name].cpu_packed else "grouped_mm"
    assert resolve_experts_implementation(cfg, SimpleNamespace(name=name)) == want


@pytest.mark.parametrize("name", [n for n in EXAMPLE_FORMATS])
def test_preflight_sizes_each_example_with_its_own_class(name):
    """An example is an instance of the record's class, its bytes what preflight reports."""
    import torch

    from pagedexperts.commands.preflight_explicit import packed_expert_bytes
    from pagedexperts.formats import example_format
    from pagedexperts.formats.base import TensorSpec

    fmt = example_format(name, group_size=32)
    assert type(fmt) is format_class(name)
    dense = (TensorSpec("gate_up_proj", (256, 128), torch.bfloat16), TensorSpec("down_proj", (128, 128), torch.bfloat16))
    want = fmt.layout(dense, sources={"gate_up_proj": 2}).expert_bytes
    assert packed_expert_bytes(name, hidden=128, intermediate=128, group_size=32, dtype="bfloat16")[0] == want


def test_refusals_spell_every_format_as_its_record_says():
    """The list closing every refusal: each format whose module imports here, as its record spells it."""
    from pagedexperts.formats import available_formats

    listed = refusal_message({"quant_method": "bitsandbytes"}, "not supported").split("; supported: ")[1].split("; ")
    assert len(listed) == len(available_formats()) >= len(FORMATS) - 2
    assert listed == [f"{n} ({FORMATS[n].spelled})" for n in available_formats()]
    assert "gptq (quant_method 'gptq' int2/int4/int8, GPTQModel dynamic overrides)" in listed


def test_the_registry_imports_without_torch():
    """The light commands read the table: importing ``formats`` and building preflight's and
    quantize's flags load no torch."""
    code = ("import sys; from pagedexperts.cli import build_parser; build_parser(['preflight', '--layers', '1']); "
            "build_parser(['quantize']); sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _format_tables(tree: ast.AST) -> list[tuple[int, list[str]]]:
    """(line, names) of every literal dict / tuple / list / set holding two or more format names
    (as keys of a dict, as elements of the others)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            items = node.keys
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        else:
            continue
        names = sorted({i.value for i in items if isinstance(i, ast.Constant) and i.value in FORMATS})
        if len(names) >= 2:
            out.append((node.lineno, names))
    return out


def test_no_format_is_spelled_in_a_table_outside_its_record():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == REGISTRY:
            continue
        found += [f"{path.relative_to(PACKAGE)}:{line}: {names}" for line, names in _format_tables(ast.parse(path.read_text()))]
    assert found == [], "format names in a table outside formats.FORMATS (derive the view from the records):\n" + \
        "\n".join(found)


def test_the_table_check_sees_a_table():
    """The check above finds a hand-written table of format names (and not one name alone)."""
    tree = ast.parse('BY_DEFAULT = ("gptq", "awq")\nONE = ("dense", "auto")\nWRITERS = {"w4a16": 1, "mxfp4": 2}')
    assert _format_tables(tree) == [(1, ["awq", "gptq"]), (3, ["mxfp4", "w4a16"])]
