"""The disk tier (host rows of R experts over the checkpoint files) and the checkpoint fill.

Exactness: the disk tier moves the same bytes as the full store, so logits equal the unpaged
transformers model (torch.equal) in every checkpoint layout, batch 1 and a padded batch, with
and without read-ahead. Counters: a hand-counted LRU sequence. Errors: a shard that vanishes or
is truncated mid-run. Loading: nothing of the checkpoint stays mapped; copied-out weights keep
their file alignment (CPU GEMMs sum differently at other alignments).
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import threading

import pytest
import torch
from safetensors.torch import load_file

import pagedexperts
from support.tiny import E, PAD_ID, TOP_K, VOCAB, copy_dir, greedy_logits, host_budget_gb
from pagedexperts.storage.host_memory import plan_host_memory
from pagedexperts.paging.steps.contract import PackedSlots
from pagedexperts.storage.host_tier import ReadAhead, TieredExpertStore
from pagedexperts.storage.safetensors_index import DiskReadError

EXPERT_BYTES = (2 * 16 * 32 + 32 * 16) * 4  # gate_up + down, float32
LAYERS = 2
R = 4


def budget_gb(rows: int, path) -> float:
    """--host-memory-gb for ``rows`` host rows per layer of the tiny model at ``path``, K = top_k, float32."""
    return host_budget_gb(path, rows, num_resident=TOP_K, dtype="float32")


def prompts(batch: int, length: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(2, VOCAB, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[0, :3], mask[0, :3] = PAD_ID, 0  # left padding on the first row
    return ids, mask


@pytest.mark.parametrize("layout", ["per-expert", "stacked", "sharded"])
@pytest.mark.parametrize("batch", [1, 3])
def test_disk_tier_logits_equal_the_full_store(layout, batch, tiny_moe_dir, tiny_moe_stacked_dir, tiny_moe_sharded_dir):
    path = {"per-expert": tiny_moe_dir, "stacked": tiny_moe_stacked_dir, "sharded": tiny_moe_sharded_dir}[layout]
    full, _ = pagedexperts.load_model(path, num_resident=TOP_K, dtype="float32")
    model, _ = pagedexperts.load_model(path, num_resident=TOP_K, dtype="float32", host_memory_gb=budget_gb(R, path))
    assert model.pagedexperts.host_memory.host_rows == R
    ids, mask = prompts(batch)
    assert torch.equal(greedy_logits(model, ids, mask), greedy_logits(full, ids, mask))
    totals = model.pagedexperts.stats().as_dict()
    assert totals["disk_reads"] > 0 and totals["disk_bytes_read"] == totals["disk_reads"] * EXPERT_BYTES


def test_disk_tier_logits_equal_the_unpaged_model(tiny_moe_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    model, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32", host_memory_gb=budget_gb(R, tiny_moe_dir))
    # batch 1: greedy batches of 3 differ from transformers with the full store too (issue 11,
    # the exactness branch); the test above shows the disk tier equals the full store there
    ids, mask = prompts(1)
    assert torch.equal(greedy_logits(model, ids, mask), greedy_logits(reference, ids, mask))


@pytest.mark.parametrize("threads", [1, None])
def test_disk_tier_with_read_ahead_equals_full_store(tiny_moe_dir, threads):
    old = torch.get_num_threads()
    if threads is None:
        torch.set_num_threads(os.cpu_count() or 1)
    try:
        full, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32", prefetch=True)
        disk, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32", prefetch=True,
                                          host_memory_gb=budget_gb(R, tiny_moe_dir))
        ids, mask = prompts(3)
        assert torch.equal(greedy_logits(disk, ids, mask), greedy_logits(full, ids, mask))
    finally:
        torch.set_num_threads(old)
    d = disk.pagedexperts.stats().as_dict()
    assert d["read_ahead_issued"] > 0 and d["read_ahead_used"] > 0
    # every host miss is one expert read, on demand or ahead; unused read-aheads are reads too
    assert d["disk_reads"] >= d["host_misses"]


@pytest.mark.parametrize("read_ahead", [True, False])
def test_read_ahead_bytes_used_and_wasted_add_up(tiny_moe_dir, read_ahead):
    """Each layer: issued = used + wasted + still held; every disk read is a host miss read on
    demand, or a read-ahead (used, wasted or still held); bytes = reads x expert bytes; and
    /metrics exports the same. Read-ahead off: all of them 0, reads = host misses."""
    from pagedexperts.serving.metrics import _tier_metrics

    model, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32", read_ahead=read_ahead,
                                       host_memory_gb=budget_gb(R, tiny_moe_dir))
    ids, mask = prompts(3)
    greedy_logits(model, ids, mask, steps=4)
    rt = model.pagedexperts
    families = {f.name: f for f in _tier_metrics(rt)}
    for i, runner in rt.runners.items():
        store, t = runner.store, runner.store.tier_stats
        _settle(store)
        held = len(store._ahead)
        assert t.read_ahead_issued == t.read_ahead_used + t.read_ahead_wasted + held, i
        assert t.disk_reads == t.host_misses - t.read_ahead_used + t.read_ahead_issued, i
        assert t.read_ahead_bytes_used == t.read_ahead_used * store.expert_bytes
        assert t.read_ahead_bytes_wasted == t.read_ahead_wasted * store.expert_bytes
        for name in ("read_ahead_bytes_used", "read_ahead_bytes_wasted", "read_ahead_wasted"):
            got = {s.labels["layer"]: s.value for s in families[f"pagedexperts_{name}"].samples}
            assert got[str(i)] == getattr(t, name), name
    d = rt.stats().as_dict()
    if read_ahead:
        assert d["read_ahead_used"] > 0 and d["read_ahead_bytes_used"] > 0
    else:
        assert (d["read_ahead_issued"], d["read_ahead_used"], d["read_ahead_wasted"], d["read_ahead_bytes_used"],
                d["read_ahead_bytes_wasted"]) == (0, 0, 0, 0, 0)
        assert d["disk_reads"] == d["host_misses"]


def make_store(path, *, rows: int = 2, read_ahead=None) -> TieredExpertStore:
    from pagedexperts.loading.checkpoint import KeyMap
    from pagedexperts.storage.safetensors_files import checkpoint_files
    from pagedexperts.loading.fill import CheckpointIndex

    model, _ = pagedexperts.load_model(path, num_resident=TOP_K, dtype="float32")
    site = model.pagedexperts.sites[0]
    index = CheckpointIndex(checkpoint_files(path), KeyMap("qwen3_moe", {site.name: site}), {site.name: site})
    store = TieredExpertStore(site.specs, E, rows, policy="lru", pin=False, layer=0, read_ahead=read_ahead)
    assert store.fill_from(index.experts[site.name]) == []  # the disk tier reads nothing at the fill
    return store


def test_host_rows_pin_exactly_their_bytes_or_fall_back_like_the_store(monkeypatch, caplog):
    """The R host rows are page-locked as the full store is (exactly R x row bytes, no
    power-of-two pinned-allocator block), with its fallback on a failure."""
    from pagedexperts.storage import host_store as store_module
    from pagedexperts.formats.base import TensorSpec

    registered, fail = {}, []

    def register(t):
        if fail:
            return 2  # cudaErrorMemoryAllocation
        registered[t.data_ptr()] = t.numel() * t.element_size()
        return 0

    monkeypatch.setattr(store_module, "host_register", register)
    monkeypatch.setattr(store_module, "host_unregister", lambda ptr: 0 if registered.pop(ptr, None) else 1)
    specs = [TensorSpec("gate_up_proj", (6, 4), torch.float32), TensorSpec("down_proj", (4, 3), torch.float32)]
    store = TieredExpertStore(specs, E, 3, policy="lru", pin=True, layer=0)
    assert store.pinned and store.fallback is None
    assert sorted(registered.values()) == sorted([3 * 6 * 4 * 4, 3 * 4 * 3 * 4])
    fail.append(True)
    with caplog.at_level("WARNING", logger="pagedexperts.storage.host_store"):
        failed = TieredExpertStore(specs, E, 3, policy="lru", pin=True, layer=0)
    assert not failed.pinned and f"page-locking {3 * 6 * 4 * 4:,} bytes" in failed.fallback
    assert caplog.records[-1].getMessage() == failed.fallback


def slots_for(store, k: int = 3) -> PackedSlots:
    return PackedSlots({s.name: torch.zeros((k, *s.shape), dtype=s.dtype) for s in store.specs})


def expected_rows(path, expert: int) -> dict[str, torch.Tensor]:
    sd = load_file(str(path / "model.safetensors"))
    p = f"model.layers.0.mlp.experts.{expert}."
    return {"gate_up_proj": torch.cat([sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]]),
            "down_proj": sd[p + "down_proj.weight"]}


def test_host_rows_follow_lru_and_count_by_hand(tiny_moe_dir):
    store = make_store(tiny_moe_dir, rows=2)
    slots = slots_for(store)
    for expert in [0, 1, 0, 2, 1, 0]:  # R=2 LRU: miss miss hit miss(evicts 1) miss(evicts 0) miss(evicts 2)
        store.copy_to_slot(expert, 1, slots)
        for name, want in expected_rows(tiny_moe_dir, expert).items():
            assert torch.equal(slots[name][1], want), (expert, name)
    t = store.tier_stats
    assert (t.host_hits, t.host_misses, t.disk_reads) == (1, 5, 5)
    assert t.disk_bytes_read == 5 * EXPERT_BYTES and t.disk_preads == 5  # gate, up, down back to back: one preadv per expert
    assert 0 < t.as_dict()["disk_read_p50_s"] <= t.as_dict()["disk_read_p99_s"]


def test_a_miss_never_waits_for_a_read_ahead_it_does_not_need(tiny_moe_dir):
    ra = ReadAhead(make_store(tiny_moe_dir).specs, num_buffers=2)
    store = make_store(tiny_moe_dir, rows=2, read_ahead=ra)
    release, original = threading.Event(), store._read

    def slow_read(expert, dst):
        if threading.current_thread().name.startswith("pagedexperts-readahead"):
            assert release.wait(30)
        original(expert, dst)

    store._read = slow_read
    assert store.read_ahead([5]) == 1
    slots = slots_for(store)
    worker = threading.Thread(target=store.copy_to_slot, args=(3, 0, slots))
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "a miss of expert 3 waited for the read-ahead of expert 5"
    release.set()
    store.copy_to_slot(5, 1, slots)
    assert store.tier_stats.read_ahead_used == 1
    for name, want in expected_rows(tiny_moe_dir, 5).items():
        assert torch.equal(slots[name][1], want)
    assert len(ra.free) == 2  # the staging buffer went back


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_a_shard_lost_mid_run_fails_clearly_and_stays_failed(tmp_path, tiny_moe_dir, damage):
    path = copy_dir(tiny_moe_dir, tmp_path / "model")
    model, _ = pagedexperts.load_model(path, num_resident=TOP_K, dtype="float32", host_memory_gb=budget_gb(R, path))
    shard = path / "model.safetensors"
    if damage == "removed":
        shard.rename(path / "moved.safetensors")
        match = r"cannot read expert .* from checkpoint file .*model.safetensors.*must stay in place"
    else:
        os.truncate(shard, 4096)
        match = r"model.safetensors ends at byte 4,096, before the"  # its size, not the offset read
    ids, mask = prompts(1)
    for _ in range(2):  # the second request fails at once with the same error
        with pytest.raises(DiskReadError, match=match):
            greedy_logits(model, ids, mask)


def test_nothing_of_the_checkpoint_stays_mapped(tiny_moe_dir, tmp_path):
    # a copy of its own: the session's shared unpaged models (conftest.reference_model) keep the
    # shared checkpoint's file mapped, as from_pretrained does
    path = copy_dir(tiny_moe_dir, tmp_path / "model")
    model, _ = pagedexperts.load_model(path, num_resident=TOP_K, dtype="float32")
    gc.collect()
    with open("/proc/self/maps") as f:
        mapped = [line for line in f if str(path) in line]
    assert mapped == []
    assert model is not None


def test_copied_weights_keep_their_file_alignment(tiny_moe_dir):
    from pagedexperts.storage.safetensors_index import read_header

    model, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32")
    header = read_header(tiny_moe_dir / "model.safetensors")
    params = dict(model.named_parameters())
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert params[key].data_ptr() % mmap.PAGESIZE == header[key].start % mmap.PAGESIZE, key


def test_host_memory_plan_by_hand():
    """G budgets everything: slots 800 + non-expert 5000 + KV 700 + runtime 1000 = 7500 come first."""
    common = dict(num_layers=4, num_experts=10, expert_bytes=100, slot_bytes_on_host=4 * 2 * 100,
                  staging_bytes=300, non_expert_bytes_on_host=5000, kv_bytes_on_host=700, runtime_bytes=1000)
    full = plan_host_memory(budget_bytes=None, available_bytes=10**6, **common)
    assert (full.host_rows, full.staging_bytes, full.total_bytes) == (10, 0, 4000 + 800 + 5000 + 700 + 1000)
    tier = plan_host_memory(budget_bytes=9200, available_bytes=10**6, **common)
    assert tier.host_rows == (9200 - 7500 - 300) // 400 == 3 and tier.disk_tier
    assert tier.total_bytes == 3 * 400 + 300 + 7500 <= 9200
    # no budget given: the available memory is the budget
    assert plan_host_memory(budget_bytes=None, available_bytes=9000, **common).host_rows == 3
    with pytest.raises(ValueError, match=r"below the minimum .* 8,200 bytes .*runtime allowance \(1,000\)"):
        plan_host_memory(budget_bytes=8199, available_bytes=10**6, **common)  # 7500 + 4 x 100 + 300
    with pytest.raises(MemoryError, match=r"needs 9,000 bytes"):  # 1200 rows + 300 + 7500
        plan_host_memory(budget_bytes=9200, available_bytes=8999, **common)
    # no budget given and not even one host row per layer fits: both needs named, no advice to
    # give a smaller --host-memory-gb (the disk tier's least does not fit either)
    with pytest.raises(MemoryError) as info:
        plan_host_memory(budget_bytes=None, available_bytes=8199, **common)
    assert "needs 11,500 bytes" in str(info.value)  # 4 x 10 x 100 + 7500, no staging: the full store
    assert "with the disk tier at least 8,200 bytes" in str(info.value)  # 4 x 100 + 300 + 7500
    assert "only 8,199 bytes" in str(info.value) and "--host-memory-gb" not in str(info.value)


def test_generate_reports_disk_reads_in_the_stats_json(tmp_path):
    from pagedexperts.cli import main

    out = tmp_path / "stats.json"
    # G = 0.64 GB: the runtime allowance (0.6, fixed in tests: conftest; a run measures its own) + slots,
    # weights and KV (0.026) leave 0.014 of the 0.038 GB store
    assert main(["generate", "--host-memory-gb", "0.64", "--prompt", "Once upon a time", "--max-new-tokens", "4",
                 "--stats-json", str(out), "--quiet"]) == 0
    paging = json.loads(out.read_text())["paging"]
    assert paging["disk_tier"] and paging["disk_reads"] > 0
    cfg = json.loads((pagedexperts.bundled_model_path() / "config.json").read_text())
    expert_bytes = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 4  # gate, up, down in float32
    assert paging["disk_bytes_read"] == paging["disk_reads"] * expert_bytes


@pytest.mark.parametrize("read_ahead", [False, True])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_runtime_host_counters_equal_the_two_level_simulator(tiny_moe_dir, tmp_path, policy, read_ahead):
    """The simulator has no read-ahead: with it on (the default), the same host decisions, and the
    disk reads of the simulator plus the read-aheads that were not used."""
    from pagedexperts.analysis import simulate as sim
    from pagedexperts.analysis.trace import load_trace
    from support.recorded import run_recorded

    model = run_recorded(tiny_moe_dir, tmp_path / "t.npz", policy=policy, num_resident=TOP_K, dtype="float32",
                         host_memory_gb=budget_gb(R, tiny_moe_dir), read_ahead=read_ahead)
    rt = model.pagedexperts
    trace = load_trace(tmp_path / "t.npz", num_experts=E, top_k=TOP_K)
    everything, _ = sim.replay(sim.recorded_steps(trace), num_experts=E, num_resident=TOP_K, policy=policy,
                               expert_bytes=rt.expert_bytes, host_rows=R)
    got = rt.stats()
    assert sorted(got.tiers) == sorted(everything.tiers)
    for layer, t in got.tiers.items():
        s = everything.tiers[layer]
        assert (t.host_hits, t.host_misses) == (s.host_hits, s.host_misses), layer
        unused = t.read_ahead_issued - t.read_ahead_used  # read, never taken
        assert t.read_ahead_used <= t.read_ahead_issued and (t.read_ahead_issued > 0) == (read_ahead and layer > 0)
        assert t.disk_bytes_read - unused * rt.expert_bytes == s.disk_bytes_read, layer
        assert t.host_hits + t.host_misses == got.layers[layer].misses  # every device page-in asks the host
    assert sum(t.host_hits for t in got.tiers.values()) > 0


def test_preflight_three_tiers_by_hand():
    from pagedexperts.commands.preflight import build_report, tier_report
    from pagedexperts.storage.host_memory import RUNTIME_ALLOWANCE_BYTES

    runtime_gb = RUNTIME_ALLOWANCE_BYTES["cuda"] / 1e9  # G covers the runtime allowance first

    base = build_report(model="x", moe_layers=4, num_experts=16, top_k=2, expert_bytes=10**6, kv_bytes_per_token=1,
                        non_expert_bytes=0, num_resident=4, link_gbps=None, tok_s=None, device_memory_gb=None,
                        context_length=1, max_running_requests=1, runtime_reserve_gb=0)
    # G = runtime + 14 MB: staging 2 x 2 experts = 4 MB, rows (14 - 4) // (4 layers x 1 MB) = 2
    r = tier_report(base, host_memory_gb=runtime_gb + 0.014, disk_gbps=2.0, miss_rate=0.5, host_miss_rate=None)
    assert (r["host_rows"], r["disk_experts_per_layer"]) == (2, 14)
    assert r["host_miss_rate"] == 1 - 2 / 16
    assert r["disk_bytes_per_token"] == pytest.approx(4 * 2 * 10**6 * 0.5 * (14 / 16))
    assert r["disk_bound_tok_s"] == pytest.approx(2e9 / r["disk_bytes_per_token"])
    minimum = RUNTIME_ALLOWANCE_BYTES["cuda"] + 8_000_000  # + 4 rows + 4 MB staging
    with pytest.raises(ValueError, match=rf"below the minimum .*{minimum:,} bytes"):
        tier_report(base, host_memory_gb=runtime_gb + 0.007, disk_gbps=None, miss_rate=None, host_miss_rate=None)


def test_linkbench_disk_reads_a_checkpoint(tiny_moe_dir, capsys):
    from pagedexperts.analysis.diskbench import measure_disk

    r = measure_disk(tiny_moe_dir, max_bytes=1 << 20)
    assert r["sequential_bytes"] == min(1 << 20, (tiny_moe_dir / "model.safetensors").stat().st_size)
    assert r["sequential_cold_gbps"] > 0 and r["pread_cold_gbps"] > 0 and r["safetensors_slice_cold_gbps"] > 0
    with pytest.raises(FileNotFoundError, match="--disk"):
        measure_disk(tiny_moe_dir / "nothing")


def test_a_lost_shard_fails_the_served_request_and_the_next_one(tmp_path):
    """The server's batch scheduler: the step raises DiskReadError, the request finishes with
    reason "error" naming the file, and the scheduler keeps serving (no hang)."""
    from pagedexperts.generation.config import SamplingConfig
    from pagedexperts.engine.scheduler import BatchScheduler
    from pagedexperts.engine.scheduler_config import SchedulerConfig

    path = copy_dir(pagedexperts.bundled_model_path(), tmp_path / "model")
    model, tokenizer = pagedexperts.load_model(path, num_resident=4, host_memory_gb=0.64)  # disk tier (see above)
    (path / "model.safetensors").unlink()
    sched = BatchScheduler(model, tokenizer, SchedulerConfig(2, 128))
    events = []
    for _ in range(2):
        sched.submit(tokenizer("Once upon a time")["input_ids"], SamplingConfig(max_new_tokens=4), events.append)
        for _ in range(20):
            if not (sched.num_running or sched.num_waiting):
                break
            sched.step()
    finished = [e for e in events if e.finish_reason is not None]
    assert [e.finish_reason for e in finished] == ["error", "error"]
    assert all("model.safetensors" in e.error and "DiskReadError" in e.error for e in finished)


def test_metrics_export_each_layers_tier_counters(tiny_moe_dir):
    """/metrics: every layer's host and disk counters as the runtime's stats give them."""
    from pagedexperts.serving.metrics import _tier_metrics

    R = 3
    model, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32", host_memory_gb=budget_gb(R, tiny_moe_dir))
    ids, mask = prompts(2)
    greedy_logits(model, ids, mask, steps=3)
    tiers = model.pagedexperts.stats().tiers
    families = {f.name: f for f in _tier_metrics(model.pagedexperts)}
    assert families["pagedexperts_disk_reads"].type == "counter"
    assert families["pagedexperts_host_hit_rate"].type == "gauge"
    for name in ("disk_reads", "disk_bytes_read", "host_hits", "host_misses"):
        got = {s.labels["layer"]: s.value for s in families[f"pagedexperts_{name}"].samples}
        assert got == {str(i): getattr(t, name) for i, t in tiers.items()}, name
    assert sum(t.disk_reads for t in tiers.values()) > 0
    plain, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32")
    assert list(_tier_metrics(plain.pagedexperts)) == []


def _settle(store) -> None:
    """Wait for every read-ahead in flight."""
    for future, _ in list(store._ahead.values()):
        future.result()


@pytest.mark.parametrize("used", [False, True])
def test_read_ahead_pauses_where_it_does_not_pay(tiny_moe_dir, monkeypatch, caplog, used):
    """Window 4, pause 3 steps: 4 read-aheads of which none is used pause the layer (one WARNING,
    ``read_ahead_paused`` counts the skipped steps, then it reads ahead again); all used: no pause."""
    from pagedexperts.storage import host_tier

    monkeypatch.setattr(host_tier, "READ_AHEAD_WINDOW", 4)
    monkeypatch.setattr(host_tier, "READ_AHEAD_PAUSE", 3)
    ra = ReadAhead(make_store(tiny_moe_dir).specs, num_buffers=4)
    store = make_store(tiny_moe_dir, rows=2, read_ahead=ra)
    slots = slots_for(store)
    for pair in ([4, 5], [6, 7]):
        assert store.read_ahead(pair) == 2
        _settle(store)
        if used:
            for slot, expert in enumerate(pair):
                store.copy_to_slot(expert, slot, slots)
    t = store.tier_stats
    assert (t.read_ahead_issued, t.read_ahead_used) == (4, 4 if used else 0)
    started = [store.read_ahead([8 + i]) for i in range(4)]
    assert started == ([1, 1, 1, 1] if used else [0, 0, 0, 1])  # paused 3 steps, then tries again
    assert t.read_ahead_paused == (0 if used else 3)
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "read-ahead paused" in r.getMessage()]
    assert len(warned) == (0 if used else 1)
    _settle(store)
