"""Available host memory: the machine's and the memory cgroup's (v1 and v2), and the loader using
the smaller, so a container's limit refuses a run at start-up instead of OOM-killing it later.

The cgroup files are written by hand under tmp_path in the kernel's layouts
(Documentation/admin-guide/cgroup-v2.rst, cgroup-v1/memory.rst) with /proc/self/cgroup and
/proc/self/mountinfo lines as the kernel prints them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import pagedexperts
from support.tiny import TOP_K
from pagedexperts.storage import host_memory

MEASURED_ANON = host_memory.process_anon_bytes  # the real one (conftest fixes it per test)

MB = 10**6


def write_cgroup(directory: Path, version: int, *, limit, usage: int, inactive_file: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if version == 2:
        (directory / "memory.max").write_text(f"{limit}\n")
        (directory / "memory.current").write_text(f"{usage}\n")
        (directory / "memory.stat").write_text(f"anon {usage}\nfile 0\ninactive_file {inactive_file}\n")
    else:
        (directory / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (directory / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (directory / "memory.stat").write_text(f"cache 0\ninactive_file 1\ntotal_inactive_file {inactive_file}\n")


def proc_files(tmp_path: Path, cgroup: str, mounts: list[tuple[str, str, str, str]]) -> dict:
    """/proc/self/cgroup text and mountinfo lines (root, mount point, fstype, super options)."""
    (tmp_path / "cgroup").write_text(cgroup)
    lines = [f"{30 + i} 25 0:{26 + i} {root} {mount} rw,nosuid - {fstype} cgroup {opts}"
             for i, (root, mount, fstype, opts) in enumerate(mounts)]
    lines.insert(0, "25 1 0:23 / / rw,relatime - overlay overlay rw")
    (tmp_path / "mountinfo").write_text("\n".join(lines) + "\n")
    return dict(proc_cgroup=str(tmp_path / "cgroup"), mountinfo=str(tmp_path / "mountinfo"))


def test_cgroup_v2_takes_the_tightest_ancestor(tmp_path):
    unified = tmp_path / "fs" / "unified"
    write_cgroup(unified / "user.slice", 2, limit=4000 * MB, usage=2500 * MB, inactive_file=100 * MB)  # 1600 MB
    write_cgroup(unified / "user.slice" / "job", 2, limit=1500 * MB, usage=700 * MB, inactive_file=50 * MB)  # 850
    (unified / "memory.stat").write_text("anon 1\n")  # the root has no memory.max: no limit there
    files = proc_files(tmp_path, "0::/user.slice/job\n", [("/", str(unified), "cgroup2", "rw")])
    assert host_memory.cgroup_available_bytes(**files) == 1500 * MB - 700 * MB + 50 * MB
    (unified / "user.slice" / "job" / "memory.max").write_text("max\n")  # the job unlimited: the parent's
    assert host_memory.cgroup_available_bytes(**files) == 4000 * MB - 2500 * MB + 100 * MB


def test_cgroup_v1_memory_controller_and_unlimited(tmp_path):
    memory = tmp_path / "fs" / "memory"
    write_cgroup(memory, 1, limit=9223372036854771712, usage=9000 * MB, inactive_file=0)  # the root: unlimited
    write_cgroup(memory / "bench", 1, limit=1500 * MB, usage=400 * MB, inactive_file=30 * MB)
    files = proc_files(tmp_path, "5:cpu,cpuacct:/\n4:memory:/bench\n1:name=systemd:/\n",
                       [("/", str(tmp_path / "fs" / "cpu"), "cgroup", "rw,cpu,cpuacct"),
                        ("/", str(memory), "cgroup", "rw,memory")])
    assert host_memory.cgroup_available_bytes(**files) == 1500 * MB - 400 * MB + 30 * MB
    write_cgroup(memory / "bench", 1, limit=9223372036854771712, usage=400 * MB, inactive_file=0)
    assert host_memory.cgroup_available_bytes(**files) is None


def test_a_container_sees_its_cgroup_as_the_mount_root(tmp_path):
    """Docker's namespaced mount: /proc/self/cgroup says /docker/abc, the mount's root is that path."""
    unified = tmp_path / "fs" / "cgroup"
    write_cgroup(unified, 2, limit=2000 * MB, usage=1200 * MB, inactive_file=0)
    files = proc_files(tmp_path, "0::/docker/abc\n", [("/docker/abc", str(unified), "cgroup2", "rw")])
    assert host_memory.cgroup_available_bytes(**files) == 800 * MB


def test_no_cgroup_files_means_no_limit(tmp_path):
    assert host_memory.cgroup_available_bytes(proc_cgroup=str(tmp_path / "none"), mountinfo=str(tmp_path / "no")) is None


def test_available_is_the_smaller_of_machine_and_cgroup(monkeypatch):
    monkeypatch.setattr(host_memory, "_meminfo_available", lambda: 20_000 * MB)
    monkeypatch.setattr(host_memory, "cgroup_available_bytes", lambda: 1_100 * MB)
    assert host_memory.host_memory_available_bytes() == 1_100 * MB
    monkeypatch.setattr(host_memory, "cgroup_available_bytes", lambda: None)
    assert host_memory.host_memory_available_bytes() == 20_000 * MB


def test_a_cgroup_limit_refuses_the_load_at_start_up(tiny_moe_dir, monkeypatch):
    """The machine has room, the cgroup does not: refused before any allocation, every part
    named; the run's own RSS is credited up to the runtime allowance (MemAvailable excludes it)."""
    monkeypatch.setattr(host_memory, "process_anon_bytes", lambda: 100 * MB)  # held now: runtime = it + margin
    model, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32")
    plan = model.pagedexperts.host_memory
    assert (plan.runtime_bytes, plan.runtime_held_bytes) == (100 * MB + host_memory.STEP_MARGIN_BYTES, 100 * MB)
    monkeypatch.setattr(host_memory, "_meminfo_available", lambda: 10**12)
    room = plan.total_bytes - 100 * MB  # exactly what is needed, after the credit of what is held
    monkeypatch.setattr(host_memory, "cgroup_available_bytes", lambda: room - 1)
    with pytest.raises(MemoryError, match=r"runtime allowance .* is available \(the smaller of the machine's"):
        pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32", host_memory_gb=plan.total_bytes / 1e9)
    monkeypatch.setattr(host_memory, "cgroup_available_bytes", lambda: room)
    again, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32")
    assert again.pagedexperts.host_memory.host_rows == plan.num_experts  # the full store: it fits


def test_the_budget_covers_every_part_on_a_cpu_device(tiny_moe_dir):
    """--host-memory-gb G is the total: the store gets G minus slots, weights, KV and runtime."""
    from support.tiny import host_budget_gb

    model, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32",
                                       host_memory_gb=host_budget_gb(tiny_moe_dir, 3, num_resident=TOP_K, dtype="float32"))
    plan = model.pagedexperts.host_memory
    assert plan.host_rows == 3 and plan.disk_tier
    rt = model.pagedexperts
    slots = sum(t.numel() * t.element_size() for p in rt.runners.values() for t in p.slots.values())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = sum(s.host_bytes for s in rt.stores.values())
    assert (plan.slot_bytes_on_host, plan.non_expert_bytes_on_host, plan.store_bytes) == (slots, weights, rows)
    assert plan.runtime_bytes == host_memory.RUNTIME_ALLOWANCE_BYTES["cpu"]
    assert plan.total_bytes == rows + plan.staging_bytes + slots + weights + plan.kv_bytes_on_host + plan.runtime_bytes


def test_the_runtime_part_is_the_anonymous_memory_held_now_plus_a_margin(monkeypatch):
    """CPU: runtime = RssAnon now + STEP_MARGIN_BYTES, all but the margin held: 256 MB touched
    now moves both by 256 MB (within a few pages of the interpreter's own churn)."""
    import torch

    monkeypatch.setattr(host_memory, "process_anon_bytes", MEASURED_ANON)
    before, held_before = host_memory.runtime_allowance("cpu")
    assert before - held_before == host_memory.STEP_MARGIN_BYTES
    block = torch.ones(256 * MB, dtype=torch.uint8)
    after, held_after = host_memory.runtime_allowance("cpu")
    assert abs((held_after - held_before) - 256 * MB) < 8 * MB and after - held_after == host_memory.STEP_MARGIN_BYTES
    del block
    assert host_memory.runtime_allowance("cuda")[0] == host_memory.RUNTIME_ALLOWANCE_BYTES["cuda"]


@pytest.mark.parametrize("options", [dict(experts_implementation="packed", dtype="float32"),
                                     dict(dtype="bfloat16")])  # the default, auto: packed at bfloat16
def test_packed_slots_are_counted_at_the_kernel_layouts_bytes_and_the_split_is_logged(caplog, options):
    """Experts run packed (asked, or auto's choice). Over the disk tier "slots on host" = the slot
    tables' own bytes (torch's int4 layout, not the dense size); over a full store the slots read its
    rows in place, so the plan counts none. The start-up line names the budget's source and the split."""
    import logging

    from support.paths import DATA
    from support.tiny import host_budget_gb

    path = DATA / "autoround/qwen3_moe-auto_round-experts"
    with caplog.at_level(logging.INFO, logger="pagedexperts"):
        model, _ = pagedexperts.load_model(path, num_resident=2, **options)
    rt = model.pagedexperts
    assert rt.resolved.experts_implementation == "packed" and not rt.host_memory.disk_tier
    slots = sum(t.numel() * t.element_size() for r in rt.runners.values() for t in r.slots.values())
    assert slots < 2 * len(rt.runners) * rt.dense_expert_bytes
    assert rt.host_memory.slot_bytes_on_host == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("host memory (budget: "))
    assert "none given: what is available" in line and "slots on host 0 GB" in line
    assert "runtime allowance" in line and "(held now " in line
    tiered, _ = pagedexperts.load_model(path, num_resident=2, **options,
                                        host_memory_gb=host_budget_gb(path, 2, num_resident=2, **options))
    assert tiered.pagedexperts.host_memory.disk_tier and tiered.pagedexperts.host_memory.slot_bytes_on_host == slots


@pytest.mark.parametrize("in_place", [True, False])
def test_a_budget_that_fits_the_full_store_but_not_its_slots_gets_it_when_slots_read_it_in_place(in_place):
    """Where the slots read the full store's rows in place (packed on a CPU), the full plan counts no
    slot bytes: a budget of exactly the rest gets the full store; else the disk tier."""
    parts = dict(num_layers=4, num_experts=16, expert_bytes=1000, slot_bytes_on_host=4 * 2 * 1000, staging_bytes=4000,
                 non_expert_bytes_on_host=5000, kv_bytes_on_host=3000, runtime_bytes=7000)
    budget = 4 * 16 * 1000 + 5000 + 3000 + 7000  # the store and the rest, no slots
    plan = host_memory.plan_host_memory(budget_bytes=budget, available_bytes=None, slots_read_full_store=in_place,
                                        **parts)
    assert plan.disk_tier is not in_place
    assert plan.slot_bytes_on_host == (0 if in_place else 8000) and plan.total_bytes <= budget
