"""The tests mirror the package (issue 37 part 3): every test file sits in a directory named for
the package area it tests (``tests/paging/``, ``tests/paging/kernels/``, ``tests/formats/``,
...; ``tests/project/`` for the repository itself: layout, lint, bootstrap, README commands), no
test module imports another test module or ``conftest`` (what two test modules share lives in
``tests/support/``, fixtures in ``tests/conftest.py``), basenames are unique (pytest's default
import mode puts each test directory on ``sys.path``), and a shared model's shape is not written
down again: two or more of one support module's shape constants with its values in a test module
is a copy, and the bundled model's shape comes from ``support.bundled`` (its config.json).

Each rule is a function of the tests' root directory, run on this repository's tests/ and, to
show that it can fail, on a small tree that breaks it.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from support import bundled
from support.paths import ROOT

TESTS = ROOT / "tests"
PACKAGE = ROOT / "pagedexperts"
REPO_AREA = "project"  # tests of the repository rather than of a package module
SHAPE_NAMES = {"E", "TOP_K", "HIDDEN", "MOE_INTERMEDIATE", "EXPERT_I", "INTERMEDIATE", "VOCAB", "PAD_ID", "H", "I"}


def python_files(root: Path) -> list[Path]:
    """Every .py file under ``root`` except the committed data (tests/data holds tool scripts)."""
    return sorted(p for p in root.rglob("*.py") if "data" not in p.relative_to(root).parts[:1])


def imports_of_test_modules(root: Path) -> list[str]:
    """'file: imports X' for every import of a test module (test_*) or of conftest."""
    bad = []
    for path in python_files(root):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                first = name.split(".")[0]
                if first == "conftest" or first.startswith("test_") or any(p.startswith("test_") for p in name.split(".")):
                    bad.append(f"{path.relative_to(root)}:{node.lineno}: imports {name}")
    return bad


def misplaced_files(root: Path, package: Path) -> list[str]:
    """Test files outside a directory mirroring a package area, and helper modules outside
    support/ (only conftest.py sits at the top)."""
    bad = []
    for path in python_files(root):
        rel = path.relative_to(root)
        parts = rel.parts[:-1]
        if path.name.startswith("test_"):
            area = package.joinpath(*parts)
            if not parts or not (parts == (REPO_AREA,) or (area / "__init__.py").is_file()):
                bad.append(f"{rel}: not in tests/<package area>/ (pagedexperts/{'/'.join(parts)} is no package)")
        elif rel.as_posix() != "conftest.py" and parts[:1] != ("support",):
            bad.append(f"{rel}: a module shared by tests belongs in tests/support/")
    return bad


def repeated_basenames(root: Path) -> list[str]:
    names = Counter(p.name for p in python_files(root) if p.name.startswith("test_"))
    return sorted(n for n, c in names.items() if c > 1)


def _int_constants(tree: ast.Module) -> dict[str, int]:
    """NAME -> value of every module-level assignment of int literals (``A, B = 1, 2`` too)."""
    out = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                     else [(target, node.value)])
            for t, v in pairs:
                if isinstance(t, ast.Name) and isinstance(v, ast.Constant) and type(v.value) is int:
                    out[t.id] = v.value
    return out


def copied_shapes(root: Path) -> list[str]:
    """Test modules that write a shared model's shape down again: two or more shape constants of
    one support module with its values, a *BUNDLED* name bound to a literal, or the bundled
    model's E / top_k / H / I as literals beside a "bundled" label."""
    shapes = {p.stem: {n: v for n, v in _int_constants(ast.parse(p.read_text())).items() if n in SHAPE_NAMES}
              for p in sorted((root / "support").glob("*.py"))}
    shapes["bundled"] = {"E": bundled.E, "TOP_K": bundled.TOP_K, "HIDDEN": bundled.HIDDEN,
                         "MOE_INTERMEDIATE": bundled.MOE_INTERMEDIATE}
    bundled_ints = set(shapes["bundled"].values())
    bad = []
    for path in python_files(root):
        if not path.name.startswith("test_"):
            continue
        tree = ast.parse(path.read_text())
        mine = _int_constants(tree)
        for module, shape in shapes.items():
            same = sorted(n for n in mine if shape.get(n) == mine[n])
            if len(same) >= 2:
                bad.append(f"{path.relative_to(root)}: {', '.join(same)} repeat support.{module}'s")
        bad += [f"{path.relative_to(root)}: {n} = {v} (use support.bundled)" for n, v in mine.items() if "BUNDLED" in n]
        for node in ast.walk(tree):
            labelled = ([node.elts[1:]] if isinstance(node, ast.Tuple) and node.elts and
                        isinstance(node.elts[0], ast.Constant) and node.elts[0].value == "bundled" else [])
            if isinstance(node, ast.Dict):
                labelled += [v.elts for k, v in zip(node.keys, node.values)
                             if isinstance(k, ast.Constant) and k.value == "bundled" and isinstance(v, ast.Tuple)]
            for elts in labelled:
                ints = [e.value for e in elts if isinstance(e, ast.Constant) and type(e.value) is int]
                if set(ints) & bundled_ints:
                    bad.append(f"{path.relative_to(root)}:{node.lineno}: the bundled model's shape as literals {ints}")
    return bad


def test_no_test_module_imports_another():
    assert imports_of_test_modules(TESTS) == []


def test_every_test_file_sits_in_its_package_area():
    assert misplaced_files(TESTS, PACKAGE) == []
    assert repeated_basenames(TESTS) == []
    areas = {p.parent.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py") if "data" not in p.parts}
    assert {"paging", "paging/kernels", "residency", "formats", "engine", "serving", REPO_AREA} <= areas


def test_shared_shapes_are_not_written_down_again():
    assert copied_shapes(TESTS) == []


def test_the_rules_catch_what_they_forbid(tmp_path):
    """A tree that breaks each rule once: each check names the file."""
    (tmp_path / "support").mkdir()
    (tmp_path / "support" / "tiny.py").write_text("E = 16\nTOP_K = 2\n")
    (tmp_path / "paging").mkdir()
    (tmp_path / "paging" / "test_a.py").write_text("from test_b import helper\nE, TOP_K = 16, 2\n")
    (tmp_path / "nowhere").mkdir()
    (tmp_path / "nowhere" / "test_b.py").write_text("def helper():\n    from conftest import E\n")
    (tmp_path / "test_top.py").write_text(f'SHAPES = (("bundled", {bundled.E}, {bundled.TOP_K}),)\nE_BUNDLED = 3\n')
    (tmp_path / "helpers.py").write_text("")
    (tmp_path / "formats").mkdir()
    (tmp_path / "formats" / "test_a.py").write_text("")
    assert imports_of_test_modules(tmp_path) == ["nowhere/test_b.py:2: imports conftest", "paging/test_a.py:1: imports test_b"]
    assert misplaced_files(tmp_path, PACKAGE) == [
        "helpers.py: a module shared by tests belongs in tests/support/",
        "nowhere/test_b.py: not in tests/<package area>/ (pagedexperts/nowhere is no package)",
        "test_top.py: not in tests/<package area>/ (pagedexperts/ is no package)",
    ]
    assert repeated_basenames(tmp_path) == ["test_a.py"]
    assert copied_shapes(tmp_path) == [
        "paging/test_a.py: E, TOP_K repeat support.tiny's",
        "test_top.py: E_BUNDLED = 3 (use support.bundled)",
        f"test_top.py:1: the bundled model's shape as literals {[bundled.E, bundled.TOP_K]}",
    ]
