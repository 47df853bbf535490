"""One checked configuration, resolved once: ``load_model`` builds one ``PagingConfig``, checks
it once, and every choice made from it lives in one record (``loading.resolved.Resolved``) that
the runtime, the start-up line and ``/server_info`` read.

Legend: E experts per layer, K slots, TOP_K routed per token (the bundled model's config.json).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

import pagedexperts
import pagedexperts.loading.config as config_module
from pagedexperts.commands.common import experts_note
from pagedexperts.loading.config import PagingConfig
from pagedexperts.loading.loader import load_model
from pagedexperts.loading.resolved import Resolved
from pagedexperts.loading.runtime import PagingRuntime
from pagedexperts.loading.bundled import bundled_model_path

PACKAGE = Path(pagedexperts.__file__).parent
BUNDLED = json.loads((bundled_model_path() / "config.json").read_text())
E, TOP_K = BUNDLED["num_local_experts"], BUNDLED["num_experts_per_tok"]
# Fields of PagingConfig whose value the load resolves ("auto" or None made concrete): read from
# ``PagingRuntime.resolved``, never from the options kept on ``PagingRuntime.config``.
RESOLVED_OPTIONS = ("num_resident", "experts_implementation", "slot_format", "decide", "beyond_k", "admit_per_step",
                    "device")


@pytest.fixture
def counted(monkeypatch):
    """Counts of ``PagingConfig`` constructions (``dataclasses.replace`` included) and of the
    option and model checks while the test runs."""
    counts = dict(constructed=0, option_checks=0, model_checks=0, checked_implementations=[])
    init, options, model = PagingConfig.__init__, config_module.option_problems, config_module.model_problems

    def constructed(self, *args, **kwargs):
        counts["constructed"] += 1
        init(self, *args, **kwargs)

    def option_checks(cfg):
        counts["option_checks"] += 1
        return options(cfg)

    def model_checks(cfg, model_config, fmt, implementation):
        counts["model_checks"] += 1
        counts["checked_implementations"].append(implementation)
        return model(cfg, model_config, fmt, implementation)

    monkeypatch.setattr(PagingConfig, "__init__", constructed)
    monkeypatch.setattr(config_module, "option_problems", option_checks)
    monkeypatch.setattr(config_module, "model_problems", model_checks)
    return counts


@pytest.mark.parametrize("options", [
    dict(),
    dict(num_resident=TOP_K, experts_implementation="auto", slot_format="auto"),
    dict(num_resident=TOP_K, prefetch=True, prefetch_budget=1),  # install_prefetch on the load path
    dict(mode="resident"),
])
def test_the_load_builds_and_checks_its_config_once(counted, options):
    model, _ = load_model(**options)
    # the model check read the implementation the record holds ("auto" resolved), not the option
    implementation = model.pagedexperts.resolved.experts_implementation
    assert counted == dict(constructed=1, option_checks=1, model_checks=1,
                           checked_implementations=[implementation]), options
    assert model.pagedexperts.config == PagingConfig(**options)  # the options as given, nothing resolved into them


def test_every_resolved_choice_lives_in_the_record_with_its_reason():
    model, _ = load_model(experts_implementation="auto", decide="auto")
    rt = model.pagedexperts
    resolved = rt.resolved
    assert isinstance(resolved, Resolved)
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.num_resident = E  # type: ignore[misc]
    # the options stay as given; the record holds what they resolved to, each with a reason
    assert (rt.config.num_resident, rt.config.experts_implementation, rt.config.decide) == (None, "auto", "auto")
    k = max(TOP_K, E // 4)  # the default K (residency.planner.default_num_resident), computed here independently
    assert (resolved.num_resident, resolved.experts_implementation, resolved.decide) == (k, "grouped_mm", "host")
    assert (resolved.device, resolved.cuda_graphs, resolved.beyond_k) == ("cpu", "off", "waves")
    assert (resolved.dtype, resolved.reasons["dtype"]) == (BUNDLED["dtype"], "the checkpoint's")
    assert set(resolved.reasons) >= {"num_resident", "experts_implementation", "slot_format", "decide", "cuda_graphs",
                                     "beyond_k", "host_memory"}
    assert resolved.reasons["experts_implementation"] == "auto: grouped_mm for dense on cpu"
    # the runners were built from the record: K slots in every paged layer
    assert {r.num_slots for r in rt.runners.values()} == {k}
    assert f"K={k}" in experts_note(rt) and "host (--decide auto)-planned" in experts_note(rt)
    assert resolved.as_dict()["num_resident"] == k and resolved.as_dict()["host_memory"] == rt.host_memory.describe()


def test_the_runtime_keeps_no_resolved_choice_of_its_own():
    """K, decide, graphs and fallbacks are read from ``PagingRuntime.resolved``: the runtime has no
    field of its own for any of them (K was kept on the config and on the runtime before)."""
    runtime_fields = {f.name for f in dataclasses.fields(PagingRuntime)}
    resolved_fields = {f.name for f in dataclasses.fields(Resolved)}
    assert runtime_fields & resolved_fields == set()
    assert "resolved" in runtime_fields


def test_no_module_reads_a_resolved_choice_from_the_runtime_s_options():
    """``runtime.config.<option>`` / ``rt.config.<option>`` for an option the load resolves would
    read "auto" or None: the package reads those from ``.resolved``."""
    pattern = re.compile(r"\b(?:runtime|rt|pagedexperts)\.config\.(" + "|".join(RESOLVED_OPTIONS) + r")\b")
    found = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) for n, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert found == []


def test_repage_resolves_again_into_a_new_record():
    from pagedexperts.loading.runners import repage

    model, _ = load_model(num_resident=TOP_K)
    before = model.pagedexperts.resolved
    repage(model, mode="paged", num_resident=E // 2)
    after = model.pagedexperts.resolved
    assert (before.num_resident, after.num_resident) == (TOP_K, E // 2)
    assert after.reasons["num_resident"] == f"--num-resident {E // 2}" and model.pagedexperts.config.num_resident == E // 2
    assert {r.num_slots for r in model.pagedexperts.runners.values()} == {E // 2}
    repage(model, mode="resident")
    assert model.pagedexperts.num_resident == E and model.pagedexperts.resolved.reasons["num_resident"].startswith(
        "mode resident")
    assert torch.device(model.pagedexperts.resolved.device).type == "cpu"


def test_the_slot_format_and_host_memory_reasons_are_true_for_the_flags_given():
    """Under --experts-implementation packed every layer's slots are torch's CPU kernel layout
    (``formats.cpu_pack.CpuPackedSlots``), whatever --slot-format says; the host-memory reason
    names the budget given."""
    from pagedexperts.formats.cpu_pack import CpuPackedSlots
    from support.paths import DATA

    int4 = DATA / "autoround/qwen3_moe-auto_round-experts"
    for slot_format in ("auto", "packed", "dense"):
        model, _ = load_model(int4, num_resident=2, experts_implementation="packed", slot_format=slot_format,
                              host_memory_gb=1.5)
        rt = model.pagedexperts
        assert all(isinstance(r.slots, CpuPackedSlots) for r in rt.runners.values()), slot_format
        assert rt.resolved.reasons["slot_format"] == ("unused: every MoE layer's slots hold torch's CPU kernel layout "
                                                      "(--experts-implementation packed)"), slot_format
        assert rt.resolved.reasons["host_memory"] == "--host-memory-gb 1.5"
    grouped, _ = load_model(int4, num_resident=2, experts_implementation="grouped_mm", slot_format="packed")
    assert grouped.pagedexperts.resolved.reasons["slot_format"] == "--slot-format packed"
    assert grouped.pagedexperts.resolved.reasons["host_memory"] == "the available memory"


def test_only_the_resolve_step_evaluates_the_experts_implementation_rule():
    """``loading.config.resolve_experts_implementation`` is called from ``loading.resolved`` only:
    the check, the memory plan, the fill and the record read the value ``resolve_implementation``
    made once (they evaluated the rule at three moments, each with its own dtype, before)."""
    import ast

    callers = sorted({f"{path.relative_to(PACKAGE)}" for path in PACKAGE.rglob("*.py")
                      for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, ast.Call) and "resolve_experts_implementation" in ast.unparse(node.func)})
    assert callers == ["loading/resolved.py"]


@pytest.mark.parametrize("options, runs", [
    (dict(dtype="float32"), "grouped_mm"),  # auto: packed at bfloat16 only (the int4 kernel's vectorised x dtype)
    (dict(dtype="bfloat16"), "packed"),  # auto: an int4 format torch's CPU kernels compute packed
    (dict(dtype="bfloat16", experts_implementation="grouped_mm"), "grouped_mm"),
])
def test_a_load_evaluates_the_experts_implementation_rule_once(monkeypatch, options, runs):
    import pagedexperts.loading.resolved as resolved_module
    from support.paths import DATA

    calls = []
    rule = resolved_module.resolve_experts_implementation

    def counted_rule(*args, **kwargs):
        calls.append(args)
        return rule(*args, **kwargs)

    monkeypatch.setattr(resolved_module, "resolve_experts_implementation", counted_rule)
    model, _ = load_model(DATA / "autoround/qwen3_moe-auto_round-experts", num_resident=2, **options)
    assert len(calls) == 1
    assert model.pagedexperts.resolved.experts_implementation == runs
