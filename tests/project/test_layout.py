"""The package's layout and its one-definition concepts (issue 19).

- The layout's list of modules (docs/design.md "Layout") names every module of the package, and
  docs/design-layer-step.md's table of bodies is ``steps.table.STEP_BODIES``: inventories a test
  keeps true, not ones maintained by hand.
- Layering: each subpackage imports only those below it (docs/design.md "Layout"), read from the
  source (AST), module- and function-level imports alike; ``engine`` (no HTTP) below ``serving``,
  and ``generate`` on the engine alone.
- One configuration check reports every problem at once (options and model together).
- One quantile: the disk tier's p50/p99 equal the host times' nearest rank on the same samples.
- One read-back parse: top-k ids, prediction and padding rows out of one transfer.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import pagedexperts
from pagedexperts.loading.config import ConfigError, PagingConfig, check_config
from pagedexperts.paging.transfer import read_step
from pagedexperts.stats.tiers import TierStats
from pagedexperts.stats.accounting import TimeDistribution
from support.paths import ROOT

PACKAGE = Path(pagedexperts.__file__).parent
# bottom first: a module may import its own layer and the layers before it
LAYERS = ("formats", "residency", "stats", "models", "storage", "paging", "integration", "loading",
          "analysis", "generation", "engine", "serving", "tools", "commands", "cli")


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "pagedexperts" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_every_subpackage_imports_only_those_below_it():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("pagedexperts", *path.relative_to(PACKAGE).with_suffix("").parts))
        own = _layer(name)
        if own is None:
            continue
        for imported in _imports(path):
            target = _layer(imported)
            if target is not None and target > own:
                upward.append(f"{name} imports {imported}")
    assert upward == []



def _section(doc: str, title: str) -> str:
    return (ROOT / "docs" / doc).read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_design_layout_names_every_module():
    """Every package module is named in docs/design.md "Layout", but the format modules (their
    records in ``formats.FORMATS`` name them) and the command modules (``commands.COMMANDS``)."""
    from pagedexperts.commands import COMMANDS
    from pagedexperts.formats import FORMATS

    named = set(re.findall(r"`([a-z_0-9]+)(?:\.py)?`", _section("design.md", "Layout")))
    by_record = {r.where.partition(":")[0] for r in FORMATS.values()}
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(("pagedexperts", *path.relative_to(PACKAGE).with_suffix("").parts))
        if path.stem.startswith("_") or module in by_record or (path.parent.name == "commands" and path.stem in COMMANDS):
            continue
        if path.stem not in named:
            missing.append(module)
    assert missing == [], f"docs/design.md \"Layout\" does not name {missing}"


def test_the_design_layout_names_no_module_that_is_gone():
    """Every lowercase name in backticks in docs/design.md "Layout" is a module or subpackage of
    the package: the list is an inventory that a move or a merge must keep true."""
    named = set(re.findall(r"`([a-z_0-9]+)(?:\.py)?`", _section("design.md", "Layout")))
    exists = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.rglob("*") if p.is_dir()}
    assert sorted(named - exists) == []


def test_the_table_of_bodies_is_the_step_table():
    """docs/design-layer-step.md's table (implementation | host-planned | device-planned) lists
    ``STEP_BODIES``: each implementation, with the module of each body or "none"."""
    from pagedexperts.paging.steps.table import STEP_BODIES

    rows = {}
    for line in _section("design-layer-step.md", "The step contract").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in STEP_BODIES:
            rows[cells[0]] = tuple(re.match(r"`?([a-z_]+)", c).group(1) for c in cells[1:])
    want = {name: tuple(b.__module__.rsplit(".", 1)[1] if b is not None else "none" for b in (bodies.host, bodies.device))
            for name, bodies in STEP_BODIES.items()}
    assert rows == want


def test_generate_runs_on_the_engine_without_the_http_server():
    """``generate --speculative`` goes through the engine's scheduler, never the HTTP package
    (issue 28): the server extra stays optional for ``generate``."""
    serving = sorted(m for m in _imports(PACKAGE / "commands" / "generate.py") if m.startswith("pagedexperts.serving"))
    engine = [m for m in _imports(PACKAGE / "commands" / "generate.py") if m.startswith("pagedexperts.engine")]
    assert serving == [] and engine != []

def test_the_package_root_holds_at_most_ten_modules():
    root = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= 10, root


def _tiny_model_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(pagedexperts.bundled_model_path())


def test_config_check_reports_every_problem_at_once():
    config = _tiny_model_config()
    cfg = PagingConfig(num_resident=config.num_experts + 1, device="tpu", policy="mru", prefetch_budget=2)
    with pytest.raises(ConfigError) as info:
        check_config(cfg, config)
    problems = info.value.problems
    assert len(problems) == 4, problems
    text = str(info.value)
    for needle in ("4 problems", "--device 'tpu'", "unknown eviction policy 'mru'", "--prefetch-budget 2 needs --prefetch",
                   f"K={config.num_experts + 1} exceeds the E={config.num_experts}"):
        assert needle in text, (needle, text)


def test_config_check_with_one_problem_says_just_it():
    with pytest.raises(ValueError, match=r"^unknown mode 'fast'; choose one of .* \(--mode\)$"):
        check_config(PagingConfig(mode="fast"))
    check_config(PagingConfig(), _tiny_model_config())  # the defaults are valid


def test_load_model_reports_option_and_path_problems_together(tmp_path):
    with pytest.raises(ConfigError, match=r"(?s)2 problems.*--experts-implementation.*does not exist"):
        pagedexperts.load_model(tmp_path / "missing", experts_implementation="fast_mm")


@pytest.mark.parametrize("n", [1, 2, 7, 100, 101])
def test_tier_read_time_quantiles_are_the_host_times_nearest_rank(n):
    samples = [((i * 37) % n + 1) * 1e-6 for i in range(n)]  # a permutation of 1..n microseconds
    tier, dist = TierStats(), TimeDistribution()
    for s in samples:
        tier.record_read(nbytes=1, preads=1, seconds=s)
        dist.observe(s)
    d = tier.as_dict()
    p50, p99 = dist.quantiles(0.5, 0.99)
    # nearest rank by hand: the ceil(q n)-th smallest
    assert p50 == sorted(samples)[max(1, -(-n // 2)) - 1] and (d["disk_read_p50_s"], d["disk_read_p99_s"]) == (p50, p99)


def test_read_step_parses_ids_prediction_and_padding_from_one_read():
    ids = torch.tensor([[3, 1], [0, 2], [5, 4]])
    predicted = torch.tensor([[7], [6], [7]])
    read = read_step(ids, predicted, torch.tensor(2))
    assert torch.equal(read.ids, ids) and torch.equal(read.predicted, predicted) and read.padding == 2
    bare = read_step(ids)
    assert torch.equal(bare.ids, ids) and bare.predicted is None and bare.padding == 0
