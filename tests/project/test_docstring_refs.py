"""Every reference to this package's code in its own docstrings and comments resolves.

A rename must not leave stale names behind (a stale name is worse than none). Scanned: the
module, class and function docstrings (``ast``) and the comments (``tokenize``) of every module
of ``pagedexperts``. Checked, each to a module and then to an attribute of it, a class member
(an attribute, a dataclass or NamedTuple field, an annotated or ``self.``-assigned attribute of
the class or a base) or a submodule:

- every dotted ``pagedexperts.x.y`` (not one inside a longer dotted name: ``model.pagedexperts``
  is the runtime attribute, ``torch.ops.pagedexperts`` the op namespace);
- every backquoted dotted path (``paging.steps.contract.LayerStep``, or single backquotes) whose
  first part names a subpackage or module of the package, looked up from the referring module's
  own package outwards (``steps.contract`` inside ``paging/`` is ``pagedexperts.paging.steps.contract``).

A backquoted path whose first part names no module of the package (``torch.sort``,
``self.slots``, ``cfg.decide``) is not a reference to the package and is not checked; nor is a
file name (``config.json``, ``bench/policy_eval.py``), nor a path whose first part also names a
top-level module outside the package (``compressed_tensors.quantization`` is the library, not
``formats.compressed_tensors``; ``trace`` is a standard-library module too).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import io
import pkgutil
import re
import tokenize
from pathlib import Path

import pytest

import pagedexperts

PACKAGE_DIR = Path(pagedexperts.__file__).parent
ABSOLUTE = re.compile(r"(?<![\w./])pagedexperts(?:\.[A-Za-z_]\w*)+")
BACKQUOTED = re.compile(r"``([^`\n]+)``|`([^`\n]+)`")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
FILE_NAME = re.compile(r"\.(py|json|md|npz|txt|safetensors|toml|yaml|yml|sh|gguf|bin|pt)\b|/")


def package_modules() -> list[str]:
    """Dotted names of every module of the package (the package itself included)."""
    names = ["pagedexperts"]
    for info in pkgutil.walk_packages([str(PACKAGE_DIR)], prefix="pagedexperts."):
        names.append(info.name)
    return names


MODULES = set(package_modules())


def module_path(name: str) -> Path:
    rel = Path(*name.split(".")[1:])
    pkg = PACKAGE_DIR / rel / "__init__.py"
    return pkg if pkg.exists() else PACKAGE_DIR / rel.with_suffix(".py")


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of the file."""
    source = path.read_text()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno, doc))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def references(module: str, text: str) -> list[str]:
    """Absolute dotted names of the package that ``text`` (prose of ``module``) refers to."""
    found = ABSOLUTE.findall(text)
    scopes = []  # the referring module's packages, innermost first: "pagedexperts.paging", ...
    parts = module.split(".")
    is_package = module_path(module).name == "__init__.py"
    for end in range(len(parts) if is_package else len(parts) - 1, 0, -1):
        scopes.append(".".join(parts[:end]))
    for quoted in BACKQUOTED.finditer(text):
        span = quoted.group(1) or quoted.group(2)
        head = DOTTED.match(span.strip())
        if head is None or FILE_NAME.search(span):
            continue
        ref = head.group(0)
        if ref.startswith("pagedexperts."):
            continue  # found above
        first = ref.split(".")[0]
        scope = next((s for s in scopes if f"{s}.{first}" in MODULES), None)
        if scope is not None and not outside_module(first):
            found.append(f"{scope}.{ref}")
    return found


def outside_module(name: str) -> bool:
    """Whether ``name`` is also an importable top-level module outside the package. Under pytest
    tests/ is on sys.path and its directories mirror the package's (tests/paging/, ...): such a
    namespace package of test directories is no module outside the package."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    tests = PACKAGE_DIR.parent / "tests"
    locations = [Path(p) for p in (spec.submodule_search_locations or [])]
    return not (spec.origin is None and locations and all(p.is_relative_to(tests) for p in locations))


def class_member(cls: type, name: str) -> bool:
    """Whether ``name`` is a member of ``cls``: a class attribute, a dataclass or NamedTuple
    field, an annotation, or an attribute some method of the class or a base assigns on self."""
    for klass in cls.__mro__:
        if klass is object:
            continue
        if name in vars(klass) or name in getattr(klass, "__annotations__", {}):
            return True
        if dataclasses.is_dataclass(klass) and name in {f.name for f in dataclasses.fields(klass)}:
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\b\s*(:[^=\n]+)?=(?!=)", source):
            return True
    return False


def resolve(ref: str) -> str | None:
    """None when ``ref`` (absolute) names a module, then attributes; else what fails."""
    parts = ref.split(".")
    end = len(parts)
    while end > 0 and ".".join(parts[:end]) not in MODULES:
        end -= 1
    obj = importlib.import_module(".".join(parts[:end]))
    for i in range(end, len(parts)):
        name = parts[i]
        if inspect.isclass(obj) and not hasattr(obj, name):
            if class_member(obj, name):
                return None  # an instance attribute: its own members are not known here
            return f"{'.'.join(parts[:i])} has no member {name!r}"
        if not hasattr(obj, name):
            return f"{'.'.join(parts[:i])} has no attribute {name!r}"
        obj = getattr(obj, name)
    return None


def stale_references() -> list[str]:
    out = []
    for module in sorted(MODULES):
        path = module_path(module)
        for line, text in prose(path):
            for ref in references(module, text):
                problem = resolve(ref)
                if problem is not None:
                    out.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {ref}: {problem}")
    return out


def test_every_package_reference_in_docstrings_and_comments_resolves():
    stale = stale_references()
    assert not stale, "stale references:\n" + "\n".join(stale)


@pytest.mark.parametrize("text,want", [
    ("see ``paging.steps.contract.LayerStep``", ["pagedexperts.paging.steps.contract.LayerStep"]),
    ("``steps.contract.SlotView``'s attributes", ["pagedexperts.paging.steps.contract.SlotView"]),
    ("(pagedexperts.residency.eviction, and `residency.planner.Residency`)",
     ["pagedexperts.residency.eviction", "pagedexperts.residency.planner.Residency"]),
    ("``torch.sort``, ``self.slots``, ``model.pagedexperts.runners``, ``config.json``", []),
])
def test_references_are_found_from_the_referring_package(text, want):
    assert references("pagedexperts.paging.host_executor", text) == want


@pytest.mark.parametrize("ref,ok", [
    ("pagedexperts.paging.steps.contract.LayerStep.combine", True),
    ("pagedexperts.loading.runtime.PagingRuntime.runners", True),  # a dataclass field
    ("pagedexperts.paging.runner_contract.ExpertsRunner.padding_count", True),  # assigned on self
    ("pagedexperts.paging.wave_compute", False),  # a module that no longer exists
    ("pagedexperts.paging.steps.contract.check_inner", False),  # a function that moved
    ("pagedexperts.paging.host_executor.HostExecutor.no_such_member", False),
])
def test_resolution_tells_a_stale_name_from_a_live_one(ref, ok):
    assert (resolve(ref) is None) == ok
