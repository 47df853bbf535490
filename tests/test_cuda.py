"""CUDA-only checks: the copy stream, pinned store and exactness on the device.

Run by ``bench/gpu_check.sh`` (``pytest -m cuda``); skipped where torch sees no CUDA device.
The reference is the same directory loaded with plain ``from_pretrained`` on the device.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from conftest import E, TOP_K
from pagedexperts.loading.loader import load_model

pytestmark = pytest.mark.cuda
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda)")


def _reference(path, impl, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl, dtype=dtype).to("cuda").eval()


def _diff(a, b) -> str:
    d = (a.float() - b.float()).abs()
    return f"max |diff| {d.max().item():.3g}, mean {d.mean().item():.3g}"


@requires_cuda
class TestCuda:
    @pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("k_slots", [TOP_K, E // 2])
    def test_paged_equals_unpaged_on_cuda(self, tiny_moe_dir, impl, dtype, k_slots):
        ref = _reference(tiny_moe_dir, impl, dtype)
        name = str(dtype).replace("torch.", "")
        model, _ = load_model(tiny_moe_dir, num_resident=k_slots, device="cuda", dtype=name, experts_implementation=impl)
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
        assert stats.page_in_s > 0  # copy-stream events were timed

    def test_store_is_pinned_and_slots_on_device(self, tiny_moe_dir):
        model, _ = load_model(tiny_moe_dir, num_resident=TOP_K, device="cuda")
        for pager in model.pagedexperts.runners.values():
            assert pager.store.pinned and pager.store.fallback is None
            assert all(t.is_pinned() for t in pager.store.tensors.values())
            assert all(t.is_cuda and t.shape[0] == TOP_K for t in pager.slots.values())
        assert expert_tensors_on_device(model) == []


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


def expert_tensors_on_device(model) -> list[str]:
    """Names of per-expert tensors that an experts module still holds ([E, ...] leading dim;
    the router and k/v projections may be [E, H] too, and are not expert tensors)."""
    held = []
    for site in model.pagedexperts.sites:
        own = dict(site.module.named_parameters(recurse=False)) | dict(site.module.named_buffers(recurse=False))
        held += [f"{site.name}.{n}" for n, t in own.items()
                 if n in {s.name for s in site.specs} or (t.dim() and t.shape[0] == site.num_experts)]
    return held

    def test_greedy_decode_with_slot_reuse(self, tiny_moe_dir):
        """32 decode steps at K = top_k: every step evicts; the copy stream must wait for the
        compute that last read a slot, or the tokens drift from the reference."""
        ref = _reference(tiny_moe_dir, "grouped_mm", torch.float32)
        model, _ = load_model(tiny_moe_dir, num_resident=TOP_K, device="cuda")
        ids = torch.tensor([[5, 9, 17, 33]], device="cuda")
        kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0,
                  output_logits=True, return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
        with torch.no_grad():
            a, b = ref.generate(ids, **kw), model.generate(ids, **kw)
        assert torch.equal(a.sequences, b.sequences)
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))

    def test_no_sync_from_the_package_but_the_read_back(self, tiny_moe_dir):
        """CUDA's sync debug mode warns on every synchronizing call; during prefill and decode
        with prefetch at K = top_k, none may come from pagedexperts code except the one
        read-back per layer-step (tests/test_syncs.py counts the same on CPU)."""
        import warnings

        from pagedexperts.loading.runners import install_prefetch

        model, _ = load_model(tiny_moe_dir, num_resident=TOP_K, device="cuda")
        install_prefetch(model)
        ids = torch.randint(2, 100, (2, 12), generator=torch.Generator().manual_seed(2)).cuda()
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                               do_sample=False, pad_token_id=0)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        from pagedexperts.paging import transfer

        source = open(transfer.__file__).read().splitlines()
        allowed = 1 + next(i for i, line in enumerate(source) if "current_stream(flat.device).synchronize()" in line)
        ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                if "/pagedexperts/" in w.filename and "synchroniz" in str(w.message).lower()
                and not (w.filename == transfer.__file__ and w.lineno == allowed)]
        assert ours == []

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
