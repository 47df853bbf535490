"""CUDA-only checks: the copy stream, pinned store and exactness on the device, host and
device-planned.

Run by ``bench/gpu_check.sh`` (``pytest -m cuda``); the GPU tests are in ``TestCuda``, behind
``skipif`` where torch sees no CUDA device (tests/project/test_gpu_guards.py checks that every test
here is collected). The reference is the same directory loaded with plain ``from_pretrained``
on the device. ``--decide auto`` on CUDA with triton is the device-planned step, so each
exactness case runs both ways, named.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from support.tiny import E, TOP_K
from pagedexperts.formats.base import TensorSpec
from pagedexperts.loading.loader import load_model
from pagedexperts.paging.kernels import HAVE_TRITON
from pagedexperts.storage import host_store
from support.device import expert_tensors_on_device

pytestmark = pytest.mark.cuda
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda)")
DECIDES = ["host", pytest.param("device", marks=pytest.mark.skipif(not HAVE_TRITON, reason="needs triton"))]


def _reference(path, impl, dtype, device="cuda"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl, dtype=dtype).to(device).eval()


def _diff(a, b) -> str:
    d = (a.float() - b.float()).abs()
    return f"max |diff| {d.max().item():.3g}, mean {d.mean().item():.3g}"


def _syncs_from_package(run) -> list[str]:
    """Synchronizing CUDA calls made from pagedexperts code while ``run()`` runs (each a
    warning under ``set_sync_debug_mode("warn")``), as "file:line: message"."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if "/pagedexperts/" in w.filename and "synchroniz" in str(w.message).lower()]


@requires_cuda
class TestCuda:
    @pytest.mark.parametrize("decide", DECIDES)
    @pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("k_slots", [TOP_K, E // 2])
    def test_paged_equals_unpaged_on_cuda(self, tiny_moe_dir, impl, dtype, k_slots, decide):
        ref = _reference(tiny_moe_dir, impl, dtype)
        name = str(dtype).replace("torch.", "")
        model, _ = load_model(tiny_moe_dir, num_resident=k_slots, device="cuda", dtype=name, experts_implementation=impl,
                              decide=decide)
        assert model.pagedexperts.decide == decide
        ids = torch.randint(2, 100, (4, 24), generator=torch.Generator().manual_seed(0)).cuda()
        with torch.no_grad(), grouped_rows() as rows:
            want = ref(ids).logits
            ref_rows, rows[:] = list(rows), []
            got = model(ids).logits
        assert torch.equal(got, want), _diff(got, want)
        if impl == "grouped_mm":  # CUDA picks its tile config from the row count: the reference's S = T * k
            assert set(rows) == set(ref_rows) == {ids.numel() * TOP_K}, (sorted(set(rows)), sorted(set(ref_rows)))
        stats = model.pagedexperts.stats().total()
        assert stats.misses > 0
        if k_slots == TOP_K:
            assert stats.multi_wave_steps > 0
        if decide == "host":
            assert stats.page_in_s > 0  # copy-stream events were timed
        else:
            assert stats.page_in_s == 0  # the device-planned step counts on the device and times nothing

    def test_store_is_pinned_and_slots_on_device(self, tiny_moe_dir):
        model, _ = load_model(tiny_moe_dir, num_resident=TOP_K, device="cuda")
        assert model.pagedexperts.decide == ("device" if HAVE_TRITON else "host")  # auto on CUDA
        for pager in model.pagedexperts.runners.values():
            assert pager.store.pinned and pager.store.fallback is None
            assert all(t.is_pinned() for t in pager.store.tensors.values())
            assert all(t.is_cuda and t.shape[0] == TOP_K for t in pager.slots.values())
        assert expert_tensors_on_device(model) == []

    @pytest.mark.parametrize("decide", DECIDES)
    def test_greedy_decode_with_slot_reuse(self, tiny_moe_dir, decide):
        """32 decode steps at K = top_k: every step evicts; the copy (the copy stream, or the
        device page-in on the compute stream) must follow the compute that last read a slot,
        or the tokens drift from the reference."""
        ref = _reference(tiny_moe_dir, "grouped_mm", torch.float32)
        model, _ = load_model(tiny_moe_dir, num_resident=TOP_K, device="cuda", decide=decide)
        ids = torch.tensor([[5, 9, 17, 33]], device="cuda")
        kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0,
                  output_logits=True, return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
        with torch.no_grad():
            a, b = ref.generate(ids, **kw), model.generate(ids, **kw)
        assert torch.equal(a.sequences, b.sequences)
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))

    def test_no_sync_from_the_package_but_the_read_back(self, tiny_moe_dir):
        """CUDA's sync debug mode warns on every synchronizing call; during prefill and decode
        with prefetch at K = top_k (host-planned: prefetch plans on the host), none may come
        from pagedexperts code except the one read-back per layer-step (tests/paging/test_syncs.py
        counts the same on CPU)."""
        from pagedexperts.loading.runners import install_prefetch
        from pagedexperts.paging import transfer

        model, _ = load_model(tiny_moe_dir, num_resident=TOP_K, device="cuda", decide="host")
        install_prefetch(model)
        ids = torch.randint(2, 100, (2, 12), generator=torch.Generator().manual_seed(2)).cuda()
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        ours = _syncs_from_package(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=4,
                                                           min_new_tokens=4, do_sample=False, pad_token_id=0))
        source = open(transfer.__file__).read().splitlines()
        allowed = 1 + next(i for i, line in enumerate(source) if "current_stream(flat.device).synchronize()" in line)
        assert [s for s in ours if not s.startswith(f"{transfer.__file__}:{allowed}:")] == []

    @pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
    def test_device_planned_steps_make_no_sync(self, tiny_moe_dir):
        """The device-planned step reads nothing back: no synchronizing call from
        pagedexperts code in prefill and decode at K = top_k (multi-wave, every step evicts)."""
        model, _ = load_model(tiny_moe_dir, num_resident=TOP_K, device="cuda", decide="device")
        ids = torch.randint(2, 100, (2, 12), generator=torch.Generator().manual_seed(2)).cuda()
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up: Triton compiles
        assert _syncs_from_package(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                                           min_new_tokens=4, do_sample=False, pad_token_id=0)) == []
        assert model.pagedexperts.stats().total().misses > 0

    def test_failed_page_lock_leaves_no_pending_cuda_error(self, monkeypatch):
        """Review item 9: a failed cudaHostRegister leaves its error pending in the runtime,
        and torch raised it at the next unrelated launch. Here the store's registration fails
        for real (the tensor is registered first: cudaErrorHostMemoryAlreadyRegistered)."""
        real, held = host_store.host_register, []

        def register_twice(t):
            assert real(t) == 0
            held.append(t.data_ptr())
            return real(t)

        monkeypatch.setattr(host_store, "host_register", register_twice)
        store = host_store.HostExpertStore([TensorSpec("w", (64,), torch.float32)], 4, pin=True)
        for ptr in held:
            assert host_store.host_unregister(ptr) == 0
        assert not store.pinned and "CUDA error" in store.fallback
        torch.ones(4, device="cuda").add_(1)  # the pending error would surface here
        torch.cuda.synchronize()
        assert host_store.clear_pending_cuda_error() is None

    @pytest.mark.skipif(torch.cuda.device_count() < 2 or not HAVE_TRITON, reason="needs 2 GPUs and triton")
    def test_device_planned_on_the_second_gpu(self, tiny_moe_dir):
        """Review item 10: ``--device cuda:1`` while cuda:0 is current: Triton launches on the
        current device, so the step enters the tensors' device."""
        torch.cuda.set_device(0)
        ref = _reference(tiny_moe_dir, "batched_mm", torch.float32, device="cuda:1")
        model, _ = load_model(tiny_moe_dir, num_resident=TOP_K, device="cuda:1", decide="device",
                              experts_implementation="batched_mm")
        ids = torch.randint(2, 100, (2, 12), generator=torch.Generator().manual_seed(3)).to("cuda:1")
        with torch.no_grad():
            want, got = ref(ids).logits, model(ids).logits
        assert torch.equal(got, want), _diff(got, want)

    @pytest.mark.parametrize("mode", ["offload", "cpu-experts", "resident"])
    def test_baseline_modes_on_cuda(self, tiny_moe_dir, mode):
        """offload and resident run the same kernels as the reference (exact); cpu-experts
        computes layer 0 on the CPU, so it is compared within a tolerance (1e-4, float32)."""
        ref = _reference(tiny_moe_dir, "grouped_mm", torch.float32)
        model, _ = load_model(tiny_moe_dir, device="cuda", mode=mode, cpu_expert_layers=1)
        ids = torch.randint(2, 100, (2, 16), generator=torch.Generator().manual_seed(1)).cuda()
        with torch.no_grad():
            want, got = ref(ids).logits, model(ids).logits
        if mode == "cpu-experts":
            assert torch.allclose(got, want, atol=1e-4, rtol=0), _diff(got, want)
        else:
            assert torch.equal(got, want), _diff(got, want)


@contextmanager
def grouped_rows():
    """The row count of every ``_grouped_linear`` call (reference and paged) made inside."""
    from transformers.integrations import moe

    rows, inner = [], moe._grouped_linear

    def spy(x, *args, **kwargs):
        rows.append(x.shape[0])
        return inner(x, *args, **kwargs)

    moe._grouped_linear = spy
    try:
        yield rows
    finally:
        moe._grouped_linear = inner


def test_grouped_mm_rows_padded_to_the_reference_count_on_cpu(tiny_moe_dir):
    """The same row-count check on CPU, where the output cannot show it (the CPU kernel never
    reads past the last offset): every wave's grouped GEMM sees the reference's S rows."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, experts_implementation="grouped_mm").eval()
    model, _ = load_model(tiny_moe_dir, num_resident=TOP_K, experts_implementation="grouped_mm")
    ids = torch.randint(2, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), grouped_rows() as rows:
        ref(ids)
        ref_rows, rows[:] = list(rows), []
        model(ids)
    assert model.pagedexperts.stats().total().multi_wave_steps > 0  # several waves, each a smaller group
    assert set(rows) == set(ref_rows) == {ids.numel() * TOP_K}, (sorted(set(rows)), sorted(set(ref_rows)))


