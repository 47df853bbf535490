"""Transfers and device-facing bookkeeping that a GPU run depends on, checked on CPU.

- generate's decode-time switch of experts implementation (grouped_mm -> batched_mm on a
  non-CPU device) is followed by the paged model, which stays bit-identical to the reference.
- the padding hook follows ``repage`` (right padding counts, dropped pagers freed).
- the page-in timing event ring stays bounded and folds every pair exactly once.
- a slot-map upload is a copy: the host map may change at once after it.

Legend: E experts, k top_k, K slots.
"""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from support.tiny import E, PAD_ID, TOP_K
from pagedexperts.loading.loader import load_model
from pagedexperts.loading.runners import repage
from pagedexperts.paging.transfer import CopyTimer, read_back, upload


def _forced_device(monkeypatch, device: str):
    """Make every model report ``device`` (only what the decode switch reads)."""
    monkeypatch.setattr(PreTrainedModel, "device", property(lambda self: torch.device(device)))


@pytest.fixture(params=["1-thread", "default-threads"])
def threads(request):
    """Run at 1 thread and at torch's default (one per CPU core), restoring the suite's 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1 if request.param == "1-thread" else os.cpu_count() or 1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k_slots", [TOP_K, E])
def test_paged_model_follows_generate_decode_switch(tiny_moe_dir, monkeypatch, k_slots, batch, threads):
    """The context manager generate() wraps its decode loop in, entered as on a GPU: the
    reference switches to batched_mm, the pagers follow, and logits stay bit-identical
    (K = top_k: multi-wave)."""
    ref = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, experts_implementation="grouped_mm").eval()
    model, _ = load_model(tiny_moe_dir, num_resident=k_slots, experts_implementation="grouped_mm")
    pagers = list(model.pagedexperts.runners.values())
    ids = torch.randint(2, 100, (batch, 12), generator=torch.Generator().manual_seed(0))
    with monkeypatch.context() as m:
        _forced_device(m, "cuda")  # read once, on entry
        ref_ctx, paged_ctx = ref._optimize_model_for_decode(), model._optimize_model_for_decode()
        ref_ctx.__enter__()
        paged_ctx.__enter__()
    try:
        assert ref.get_experts_implementation()[""] == "batched_mm"
        assert {p.inner for p in pagers} == {"batched_mm"}
        with torch.no_grad():
            want, got = ref(ids).logits, model(ids).logits
        assert torch.equal(got, want)
    finally:
        paged_ctx.__exit__(None, None, None)
        ref_ctx.__exit__(None, None, None)
    assert {p.inner for p in pagers} == {"grouped_mm"}


def test_no_decode_switch_on_cpu(tiny_moe_dir):
    model, _ = load_model(tiny_moe_dir, num_resident=TOP_K, experts_implementation="grouped_mm")
    with model._optimize_model_for_decode():
        assert {p.inner for p in model.pagedexperts.runners.values()} == {"grouped_mm"}


def test_padding_hook_follows_repage(tiny_moe_dir):
    """After repage, a left-padded batch counts its padding rows on the NEW pagers, and the
    dropped pagers (and their slot tensors) are freed."""
    model, _ = load_model(tiny_moe_dir, num_resident=TOP_K)
    old = weakref.ref(next(iter(model.pagedexperts.runners.values())).slots["down_proj"])
    repage(model, num_resident=E // 2)
    gc.collect()
    assert old() is None, "a dropped pager's slots are still referenced"
    ids = torch.randint(2, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # 3 padding rows in row 0
    ids[0, :3] = PAD_ID
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for pager in model.pagedexperts.runners.values():
        assert (pager.stats.padding_tokens, pager.stats.tokens) == (3, 2 * 7 - 3)


class FakeEvent:
    """A CUDA event stand-in: completes when the test says so; elapsed = 1 ms per pair."""

    def __init__(self, clock: list) -> None:
        self.clock, self.recorded_at, self.synchronized = clock, None, 0

    def record(self, stream) -> None:
        self.recorded_at = len(self.clock)
        self.clock.append(self)

    def query(self) -> bool:
        return self.recorded_at < self.clock.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.clock.done = max(self.clock.done, self.recorded_at + 1)

    def elapsed_time(self, end) -> float:
        return 1.0  # ms


class Clock(list):
    done = 0  # events recorded before this index have completed


def test_copy_timer_ring_is_bounded_and_counts_each_pair_once():
    clock = Clock()
    timer = CopyTimer(lambda: FakeEvent(clock), capacity=4)
    for _ in range(10):  # nothing completes: the 5th begin must wait for the oldest
        timer.begin(None)
        timer.end(None)
    assert timer.created <= 2 * (4 + 1)
    assert len(timer._in_flight) <= 4
    clock.done = len(clock)  # all done: the next begin folds them without waiting
    timer.begin(None)
    timer.end(None)
    assert timer.created <= 2 * (4 + 1)
    assert timer.collect() == pytest.approx(11 * 1e-3)
    assert timer.collect() == 0.0


def test_read_back_gives_each_part_in_its_shape():
    ids = torch.tensor([[3, 1], [2, 5]], dtype=torch.int32)
    pred = torch.tensor([[7], [6]])
    host = read_back([ids, pred, torch.tensor(4)])
    assert [h.tolist() for h in host] == [[[3, 1], [2, 5]], [[7], [6]], 4]
    assert all(h.dtype == torch.int64 for h in host)


def test_upload_is_a_copy():
    values = np.array([2, -1, 0], dtype=np.int64)
    dev = upload(values, torch.device("cpu"))
    values[0] = 9
    assert dev.tolist() == [2, -1, 0]


def test_no_expert_tensor_left_on_experts_modules(tiny_moe_dir):
    """test_cuda's residency check, on CPU: experts modules hold no [E, ...] tensor, while the
    router weight, also [E, H], is no expert tensor and must not trip the check."""
    from support.device import expert_tensors_on_device

    model, _ = load_model(tiny_moe_dir, num_resident=TOP_K)
    assert expert_tensors_on_device(model) == []
    assert any(p.dim() == 2 and p.shape[0] == E for p in model.parameters())  # the router weight
    site = model.pagedexperts.sites[0]
    site.module.register_buffer(site.specs[0].name, torch.zeros(E, 1))  # put one back
    assert expert_tensors_on_device(model) == [f"{site.name}.{site.specs[0].name}"]


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister calls; fails registration number ``fail_at``."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.registered: dict[int, int] = {}
        self.calls = 0
        self.fail_at = fail_at

    def register(self, tensor) -> int:
        self.calls += 1
        if self.calls == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return 0

    def unregister(self, ptr: int) -> int:
        return 0 if self.registered.pop(ptr, None) is not None else 1


SPECS = [("gate_up_proj", (96, 64), torch.bfloat16), ("down_proj", (64, 48), torch.bfloat16)]


def _store(monkeypatch, cudart: FakeCudart):
    from pagedexperts.storage import host_store as store_module

    monkeypatch.setattr(store_module, "host_register", cudart.register)
    monkeypatch.setattr(store_module, "host_unregister", cudart.unregister)
    specs = [store_module.TensorSpec(n, s, d) for n, s, d in SPECS]
    return store_module.HostExpertStore(specs, 12, pin=True)


def test_store_pins_exactly_its_bytes_and_unpins_on_release(monkeypatch):
    cudart = FakeCudart()
    store = _store(monkeypatch, cudart)
    want = {t.data_ptr(): 12 * 2 * int(np.prod(s)) for t, (_, s, _) in zip(store.tensors.values(), SPECS)}
    assert cudart.registered == want  # one registration per tensor, exactly E x row bytes
    assert store.pinned and store.pinned_bytes == store.host_bytes == sum(want.values())
    store.release()
    assert cudart.registered == {} and not store.pinned and store.pinned_bytes == 0
    store2 = _store(monkeypatch, cudart)
    assert cudart.registered
    del store2
    gc.collect()
    assert cudart.registered == {}  # unregistered when the store is collected


def test_store_pin_failure_unpins_the_rest_and_says_bytes(monkeypatch, caplog):
    cudart = FakeCudart(fail_at=2)
    with caplog.at_level("WARNING", logger="pagedexperts.storage.host_store"):
        store = _store(monkeypatch, cudart)
    assert cudart.registered == {} and not store.pinned and store.pinned_bytes == 0
    assert f"{12 * 64 * 48 * 2:,} bytes" in store.fallback and "down_proj" in store.fallback
    assert caplog.records and caplog.records[-1].getMessage() == store.fallback


class FakeCuda:
    """Stand-ins for torch.cuda's streams and events that log every ordering call, so the
    copy-stream protocol of ``SlotTransfers`` can be read back on CPU."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.compute, self.copy = "compute", "copy"
        self.current = self.compute
        self.events = 0

    def Event(self, enable_timing=False):  # noqa: N802 (torch's name)
        fake = self
        fake.events += 1
        name = f"ev{fake.events}"

        class Ev:
            def record(self, stream=None):
                fake.log.append(("record", name, stream or fake.current))

            def synchronize(self):
                fake.log.append(("synchronize", name))

            def query(self):
                return True

            def elapsed_time(self, end):
                return 1.0

            def __repr__(self):
                return name

        return Ev()

    def current_stream(self, device=None):
        return self.compute

    def stream(self, s):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            before, self.current = self.current, s
            yield
            self.current = before

        return ctx()


class LoggingStream(str):
    def wait_event(self, ev):
        LOG.append(("wait", str(self), repr(ev)))


LOG: list = []


def test_copy_stream_protocol(monkeypatch):
    """Every batch of copies waits for every compute issued before it (so for the last compute
    that read the slots, and for fresh slots' zero fill: a compute-done event recorded on the
    compute stream as the batch is issued) and is waited on by the next compute (also when the
    batch is a prefetch and the step itself loads nothing); slots are record_stream-ed on the
    copy stream; drain waits for the last copy."""
    from pagedexperts.paging import transfer
    from pagedexperts.residency.planner import Load

    fake = FakeCuda()
    fake.log = LOG
    LOG.clear()
    fake.compute, fake.copy = LoggingStream("compute"), LoggingStream("copy")
    fake.current = fake.compute
    monkeypatch.setattr(transfer.torch, "cuda", fake)

    class Slot:
        def record_stream(self, s):
            LOG.append(("record_stream", str(s)))

    class Store:
        num_experts = 8

        def copy_to_slot(self, expert, slot, slots):
            LOG.append(("copy", expert, slot, str(fake.current)))

        def copy_to_slots(self, loads, slots):  # ExpertStore's: one step's page-ins together
            for load in loads:
                self.copy_to_slot(load.expert, load.slot, slots)

        def rows_in_memory(self):  # ExpertStore's: rows reached through copy_to_slots only
            return None

    tr = transfer.SlotTransfers({"w": Slot()}, "cuda", fake.copy, store=Store())
    assert LOG == [("record_stream", "copy")]  # ev1 = compute done, ev2 = copied: nothing recorded yet
    LOG.clear()
    tr.page_in([Load(3, 0), Load(5, 1)], now=False)
    assert LOG[:2] == [("record", "ev1", "compute"), ("wait", "copy", "ev1")]  # after every compute issued so far
    assert [e for e in LOG if e[0] == "copy"] == [("copy", 3, 0, "copy"), ("copy", 5, 1, "copy")]
    assert LOG[-1] == ("record", "ev2", "copy")  # ev2 = copied, after the last copy
    LOG.clear()
    tr.page_in([])  # a wave that loads nothing: the compute waits for the copies above
    assert LOG == [("wait", "compute", "ev2")]
    LOG.clear()
    tr.page_in([])  # nothing new copied: no wait
    assert LOG == []
    tr.page_in([Load(7, 0)], now=False)  # a prefetch from the previous layer: after the compute above
    assert LOG[:2] == [("record", "ev1", "compute"), ("wait", "copy", "ev1")]
    LOG.clear()
    tr.page_in([])  # the step's own wave loads nothing
    assert LOG == [("wait", "compute", "ev2")]
    LOG.clear()
    tr.drain()
    assert LOG == [("synchronize", "ev2")]
