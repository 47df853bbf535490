"""The package's import graph, read from the source (AST, nothing imported or run).

Every import counts: module level, inside functions, and under ``if TYPE_CHECKING:`` (a
type-only import still ties the two modules: the one that names the other's type cannot be
read, moved or split apart from it), absolute and relative. Checked:

- no import cycle between modules of the package (docs/design.md "Layout");
- neither executor imports the other (``paging.host_executor``, ``paging.device_executor``);
- no module over 400 lines unless its docstring says why it is one concept (docs/design.md
  "Layout": the count asks the question, the reason answers it; a reason left on a module back
  under the count is stale and fails too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pagedexperts

PACKAGE = Path(pagedexperts.__file__).parent
MAX_LINES = 400
# A module docstring line that begins with this, then the one concept the file holds, lets the file
# grow past MAX_LINES: "One concept past 400 lines: the scheduler's step loop, ...".
LONGER = "One concept past 400 lines:"
EXECUTORS = ("pagedexperts.paging.host_executor", "pagedexperts.paging.device_executor")


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root`` (a package is its ``__init__``)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its source. ``from a import b`` counts as
    ``a.b`` when that is a module, else as ``a``; importing ``a.b.c`` also runs ``a`` and ``a.b``."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                module = ".".join([*anchor, module] if module else anchor)
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module)
    out = set()
    for target in found:
        parts = target.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {m for m in out if m in modules and m != name and not name.startswith(m + ".")}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted: every import cycle lies inside one."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = package_modules(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_a_type_checking_import_closes_a_cycle(tmp_path):
    """The checker sees a cycle made only of an import under ``if TYPE_CHECKING:`` and one made
    by relative imports inside functions; and none in a chain."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import thing\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import other\n")
    (pkg / "sub" / "c.py").write_text("def f():\n    from . import d\n")
    (pkg / "sub" / "d.py").write_text("def g():\n    from ..sub.c import f\n")
    (pkg / "e.py").write_text("import pkg.a\n")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]
    (pkg / "b.py").write_text("thing = 1\n")
    (pkg / "sub" / "d.py").write_text("")
    assert cycles(import_graph(pkg)) == []


def test_neither_executor_imports_the_other():
    graph = import_graph()
    host, device = EXECUTORS
    assert host in graph and device in graph
    assert device not in graph[host] and host not in graph[device]

def long_module_problems(modules: dict[str, Path], max_lines: int = MAX_LINES) -> list[str]:
    """A problem for each module over ``max_lines`` whose docstring gives no ``LONGER`` reason (a
    line beginning with it and naming the concept in a few words), and for each reason given by a
    module no longer over the count."""
    problems = []
    for name, path in sorted(modules.items()):
        source = path.read_text()
        lines = len(source.splitlines())
        doc = ast.get_docstring(ast.parse(source)) or ""
        reason = next((line.removeprefix(LONGER).strip() for line in doc.splitlines() if line.startswith(LONGER)), None)
        if lines > max_lines and (reason is None or len(reason.split()) < 3):
            problems.append(f"{name}: {lines} lines > {max_lines}; split it by concept, or say at its top "
                            f"'{LONGER} <the one concept it holds>'")
        elif lines <= max_lines and reason is not None:
            problems.append(f"{name}: {lines} lines, not over {max_lines}: drop its '{LONGER}' line")
    return problems


def test_a_module_over_400_lines_says_why_it_is_one_concept():
    assert long_module_problems(package_modules()) == []


def test_the_line_count_rule_can_fail(tmp_path):
    body = "x = 1\n" * 10
    (tmp_path / "long_silent.py").write_text('"""A module."""\n' + body)
    (tmp_path / "long_reasoned.py").write_text(f'"""A module.\n\n{LONGER} the step loop and its states.\n"""\n' + body)
    (tmp_path / "long_vague.py").write_text(f'"""A module.\n\n{LONGER} it is.\n"""\n' + body)
    (tmp_path / "short_stale.py").write_text(f'"""A module.\n\n{LONGER} the step loop and its states.\n"""\n')
    problems = long_module_problems({p.stem: p for p in tmp_path.glob("*.py")}, max_lines=8)
    assert [p.split(":")[0] for p in problems] == ["long_silent", "long_vague", "short_stale"]
