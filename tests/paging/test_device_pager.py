"""The device-planned layer-step equals the host-planned pager and the unpaged experts (CPU).

Oracles: the experts module's own unpaged computation with the same implementation, and the
host-planned executor (``paging.host_executor.HostExecutor``) with the same policy on the same steps. Compared with
torch.equal at the default thread count and at 1 thread, batch 1 and batches whose routed
entries exceed K (multi-wave), fp32 and bf16, dense slots and packed block-FP8 slots, and the
bundled model's experts. After every step the device slot map equals the host's and each
occupied slot holds its expert's host rows; the device counters equal the host's stats and a
hand count. The step makes no host read from pagedexperts code (instrumented).

Legend: T tokens, H hidden, k top_k, E experts, K slots, I expert intermediate.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernels are defined (see test_device_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from support.tiny import assert_same  # noqa: E402
from pagedexperts.residency.eviction import LFUPolicy  # noqa: E402
from pagedexperts.formats.base import ExpertLayout, QuantizedTensor, TensorSpec  # noqa: E402
from pagedexperts.formats.fp8_fp4.fp8_block import Fp8BlockFormat, quantize_fp8_block  # noqa: E402
from pagedexperts.formats.slots import DenseSlots, DequantizingSlots, allocate  # noqa: E402
from pagedexperts.paging.host_executor import HostExecutor  # noqa: E402
from pagedexperts.paging.device_executor import DeviceExecutor  # noqa: E402
from pagedexperts.paging.kernels import HAVE_TRITON  # noqa: E402
from pagedexperts.stats.accounting import LayerStats  # noqa: E402
from pagedexperts.storage.host_store import HostExpertStore  # noqa: E402
from pagedexperts.storage.host_tier import TieredExpertStore  # noqa: E402
from pagedexperts.paging.steps import device_grouped, host_grouped  # noqa: E402
from pagedexperts.paging.steps.contract import DeviceRouting, HostRouting, SlotSetup  # noqa: E402
from support.quantized_dirs import fp8_block_dense  # noqa: E402
from support.synthetic_layer import E, SCRIPT, TOP_K, paged, step_inputs, synthetic_experts, unpaged  # noqa: E402
from support.synthetic_layer import host_and_device, routings
from support.reads import HostReads
from pagedexperts import bundled_model_path  # noqa: E402

BUNDLED = bundled_model_path()


def assert_slots_hold_host_rows(dev: DeviceExecutor) -> None:
    for slot, expert in enumerate(dev.residency.expert_of_slot()):
        if expert >= 0:
            for name, host in dev.store.tensors.items():
                assert torch.equal(dev.slots[name][slot], host[expert]), f"slot {slot} {name} vs expert {expert}"


COUNTED = ("steps", "tokens", "padding_tokens", "hits", "misses", "page_ins", "bytes_paged", "waves", "multi_wave_steps",
           "union_sum", "union_max", "union_last")


def counts(stats) -> dict:
    return {name: getattr(stats, name) for name in COUNTED}


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("num_slots", [TOP_K, 3, E])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("inner", ["grouped_mm", "batched_mm"])
def test_device_step_equals_host_pager_and_unpaged(inner, dtype, num_slots, policy, threads):
    module = synthetic_experts(dtype)
    host, dev = host_and_device(module, num_slots, inner, policy)
    for n, routing in enumerate(routings(num_slots, 10)):
        hidden, ids, weights = step_inputs(routing, dtype, seed=n)
        want = unpaged(module, inner, hidden, ids, weights)
        assert_same(host.step(module, hidden, ids, weights), want, f"step {n} host pager")
        assert_same(dev.step(module, hidden, ids, weights), want, f"step {n} device pager (T={len(routing)})")
        assert dev.residency.resident() == host.residency.resident(), f"step {n} slot map"
        assert_slots_hold_host_rows(dev)
    assert counts(dev.stats) == counts(host.stats)
    if num_slots < 2 * TOP_K:
        assert dev.stats.multi_wave_steps > 0


def test_counters_equal_a_hand_count():
    """test_store_pager's scripted LRU sequence, counted by hand there, on the device pager."""
    module = synthetic_experts(torch.float32)
    _, dev = host_and_device(module, 3, "grouped_mm", "lru")
    for n, (routing, _, resident) in enumerate(SCRIPT):
        hidden, ids, weights = step_inputs(routing, torch.float32, seed=n)
        dev.step(module, hidden, ids, weights)
        assert dev.residency.resident() == resident, f"step {n + 1}"
    eb = dev.store.expert_bytes
    assert counts(dev.stats) == dict(steps=5, tokens=9, padding_tokens=0, hits=5, misses=8, page_ins=8, bytes_paged=8 * eb,
                                     waves=6, multi_wave_steps=1, union_sum=13, union_max=4, union_last=2)


def test_padding_rows_and_reset_count_as_on_the_host():
    """Padding rows (the recording hook's 0-dim count) leave ``tokens`` as on the host pager;
    ``stats = LayerStats()`` (the runtime's reset) zeroes the device counters."""
    module = synthetic_experts(torch.float32)
    host, dev = host_and_device(module, 3, "grouped_mm", "lfu")
    for n, routing in enumerate(routings(2, 6)):
        hidden, ids, weights = step_inputs(routing, torch.float32, seed=n)
        for pager in (host, dev):  # the dispatcher hands the step its padding rows (the contract)
            pager.step(module, hidden, ids, weights, torch.tensor(n % 2))
    assert counts(dev.stats) == counts(host.stats) and dev.stats.padding_tokens == 3
    dev.stats = LayerStats()
    assert counts(dev.stats) == counts(LayerStats())
    with pytest.raises(ValueError, match="reset"):
        dev.stats = host.stats


def test_grouped_layout_is_the_host_layout():
    """Per wave, the device layout's first n_w rows and its offsets are the host layout's."""
    module = synthetic_experts(torch.float32)
    host, dev = host_and_device(module, 3, "grouped_mm", "lfu")
    for n, routing in enumerate(routings(7, 8)):
        hidden, ids, _ = step_inputs(routing, torch.float32, seed=n)
        plan = host.residency.plan(ids.reshape(-1).tolist())
        shape = dev.residency.decide(ids)
        work = dev.body.begin(module, hidden, ids, DeviceRouting(shape.entry_slot, shape.entry_wave))
        ref = host.body.begin(module, hidden, ids, HostRouting(ids.numpy(), plan.waves))
        for w, wave in enumerate(plan.waves):
            pos, offsets, _, _ = device_grouped.grouped_layout(work, w, 3)
            want_pos, want_offsets, _ = host_grouped._layout(ref, wave, 0, 3)
            assert pos[: int(offsets[-1])].tolist() == want_pos.tolist(), f"step {n} wave {w}"
            assert offsets.tolist() == want_offsets.tolist(), f"step {n} wave {w}"


def fp8_layer(dtype=torch.bfloat16, block=(16, 16)):
    """(experts module with the dequantized weights, store of the packed FP8 rows, layout)."""
    module = synthetic_experts(dtype)
    fmt = Fp8BlockFormat(block=block)
    tensors, packed = [], {}
    for name in ("gate_up_proj", "down_proj"):
        dense = getattr(module, name).detach()
        q, s = zip(*(quantize_fp8_block(dense[e].float(), block) for e in range(E)))
        packed[name], packed[name + "_scale_inv"] = torch.stack(q), torch.stack(s)
        spec = TensorSpec(name, tuple(dense.shape[1:]), dtype)
        tensors.append(QuantizedTensor(spec, fmt.pack(spec, sources=1, transposed=False)))
        with torch.no_grad():
            getattr(module, name).copy_(fp8_block_dense(packed[name], packed[name + "_scale_inv"], dtype))
    layout = ExpertLayout(fmt, tuple(tensors))
    store = HostExpertStore(list(layout.packed_specs), E, pin=False)
    for spec in layout.packed_specs:
        store.tensors[spec.name].copy_(packed[spec.name])
    return module, store, layout


def dequantizing(layout, store, num_slots: int) -> DequantizingSlots:
    """Packed slots like the store's tensors, dequantized each wave into a scratch of their own."""
    return DequantizingSlots(layout, allocate(store.specs, num_slots, "cpu"), allocate(layout.dense_specs, num_slots, "cpu"))


@pytest.mark.parametrize("inner", ["grouped_mm", "batched_mm"])
def test_packed_fp8_slots_equal_host_pager_and_unpaged(inner, threads):
    module, store, layout = fp8_layer()
    for num_slots in (3, E):
        host = HostExecutor(layer=0, store=store, num_slots=num_slots, device="cpu", inner=inner,
                            policy=LFUPolicy(num_slots), setup=SlotSetup(dequantizing(layout, store, num_slots)))
        dev = DeviceExecutor(layer=0, store=store, num_slots=num_slots, device="cpu", inner=inner, policy="lfu",
                             setup=SlotSetup(dequantizing(layout, store, num_slots)))
        for n, routing in enumerate(routings(3, 8)):
            hidden, ids, weights = step_inputs(routing, torch.bfloat16, seed=n)
            want = unpaged(module, inner, hidden, ids, weights)
            assert_same(host.step(module, hidden, ids, weights), want, f"K={num_slots} step {n} host")
            assert_same(dev.step(module, hidden, ids, weights), want, f"K={num_slots} step {n} device")
        assert_slots_hold_host_rows(dev)
        assert counts(dev.stats) == counts(host.stats)


def test_bundled_model_experts(threads):
    """The bundled tiny Qwen3-MoE's experts of one layer, its own weights, batch 1 and 6."""
    from transformers import AutoModelForCausalLM

    if not BUNDLED.is_dir():
        pytest.skip(f"bundled model not found at {BUNDLED}")
    model = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    module = model.model.layers[1].mlp.experts
    cfg = model.config
    num_experts, top_k = cfg.num_experts, cfg.num_experts_per_tok
    for num_slots in (top_k, num_experts // 2):
        host, dev = host_and_device(module, num_slots, "grouped_mm", "lfu")
        for n, routing in enumerate(routings(5, 6, num_experts=num_experts, top_k=top_k)):
            gen = torch.Generator().manual_seed(n)
            ids = torch.tensor(routing)
            hidden = torch.randn(ids.shape[0], cfg.hidden_size, generator=gen)
            weights = torch.softmax(torch.randn(ids.shape, generator=gen), dim=-1)
            want = unpaged(module, "grouped_mm", hidden, ids, weights)
            assert_same(host.step(module, hidden, ids, weights), want, f"K={num_slots} step {n} host")
            assert_same(dev.step(module, hidden, ids, weights), want, f"K={num_slots} step {n} device")
        assert counts(dev.stats) == counts(host.stats)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAVE_TRITON, reason="triton not installed (pip install 'pagedexperts[gpu]')"))])
def test_device_step_reads_nothing_back(backend):
    """No host read in a device-planned step, single- and multi-wave (and, for the Triton
    backend under the interpreter, the kernels' outputs still exact)."""
    module = synthetic_experts(torch.float32)
    _, dev = host_and_device(module, 3, "grouped_mm", "lfu", backend=backend)
    for n, routing in enumerate(routings(11, 4)):
        hidden, ids, weights = step_inputs(routing, torch.float32, seed=n)
        with HostReads() as reads:
            out = dev.step(module, hidden, ids, weights)
        assert reads.calls == [], f"step {n}: host reads {reads.calls}"
        assert_same(out, unpaged(module, "grouped_mm", hidden, ids, weights), f"step {n} ({backend})")


def test_device_pager_is_a_paged_executor():
    """The runtime attaches it by the contract; prefetch and tracing (host reads) are refused."""
    from pagedexperts.paging.runner_contract import PagedExecutor

    module = synthetic_experts(torch.float32)
    _, dev = host_and_device(module, 3, "grouped_mm", "lru")
    assert isinstance(dev, PagedExecutor) and dev.num_slots == 3 and dev.num_experts == E
    with pytest.raises(ValueError, match="--prefetch"):
        dev.copy_in([])
    with pytest.raises(ValueError, match="--record-trace"):
        dev.trace_hook = lambda layer, ids, weights: None
    dev.reset_stats()  # the runtime's reset: the counters back to zero
    assert counts(dev.stats) == counts(LayerStats())


def test_unsupported_configurations_are_named():
    module = synthetic_experts(torch.float32)
    store = paged(module, 3).store
    common = dict(layer=0, store=store, num_slots=3, device="cpu")
    with pytest.raises(ValueError, match="--experts-implementation"):
        DeviceExecutor(inner="eager", **common)
    with pytest.raises(ValueError, match="--experts-implementation"):
        DeviceExecutor(inner="grouped_mm", **common).inner = "eager"  # the decode switch's setter
    with pytest.raises(ValueError, match="--policy"):
        DeviceExecutor(inner="grouped_mm", policy="flru", **common)
    with pytest.raises(ValueError, match="--slot-format packed"):
        DeviceExecutor(inner="grouped_mm", setup=SlotSetup(DenseSlots(None, {}, {})), **common)
    with pytest.raises(ValueError, match="--num-resident"):
        DeviceExecutor(layer=0, store=store, num_slots=E + 1, device="cpu", inner="grouped_mm")
    disk_tier = TieredExpertStore(store.specs, E, 3, policy="lru", pin=False, layer=0)
    with pytest.raises(ValueError, match="does not hold every expert in host memory.*--decide host"):
        DeviceExecutor(layer=0, store=disk_tier, num_slots=3, device="cpu", inner="grouped_mm")
