"""CUDA-only: ``--beyond-k in-place`` reads the page-locked, mapped host store inside the fused GEMMs.

Run by ``bench/gpu_check.sh`` (``pytest -m cuda``, phase cuda_tests); skipped where torch sees no
CUDA device or triton is missing. On the tiny model (conftest: E = 16, top_k = 2) at K = 2 in
bfloat16, a batch of 8 prompts (unions beyond K): logits ``torch.equal`` to waves and to all E
resident; rows were read in place and no layer-step ran more than one wave; no synchronizing
CUDA call from the package during a forward; a decode step captured in a CUDA graph at batch 8
(> K // top_k) replays equal to the same step run eagerly. The CPU twins are
tests/paging/kernels/test_fused_beyond_k.py and tests/paging/test_beyond_k_runtime.py (interpreter).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from support.tiny import E
from pagedexperts.loading.loader import load_model
from pagedexperts.paging.kernels import HAVE_TRITON

pytestmark = pytest.mark.cuda
requires_cuda_and_triton = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON),
                                              reason="needs an NVIDIA GPU (torch.cuda) and triton")
K = 2


def fused(path, k: int, beyond_k: str, **kw):
    return load_model(path, num_resident=k, device="cuda", dtype="bfloat16", experts_implementation="fused",
                      beyond_k=beyond_k, check_independence=False, **kw)[0]


def package_syncs(run) -> list[str]:
    """Synchronizing CUDA calls made from pagedexperts code while ``run()`` runs."""
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


@requires_cuda_and_triton
def test_in_place_equals_waves_and_all_resident_on_cuda(tiny_moe_dir):
    models = {"in-place": fused(tiny_moe_dir, K, "in-place"), "waves": fused(tiny_moe_dir, K, "waves"),
              "resident": fused(tiny_moe_dir, E, "waves")}
    assert all(m.pagedexperts.decide == "device" for m in models.values())
    assert all(r.store.pinned for r in models["in-place"].pagedexperts.runners.values())
    ids = torch.randint(2, 100, (8, 12), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        logits = {name: m(ids).logits for name, m in models.items()}
    assert torch.equal(logits["in-place"], logits["resident"])
    assert torch.equal(logits["waves"], logits["resident"])
    stats = models["in-place"].pagedexperts.stats().total()
    assert stats.in_place_rows > 0 and stats.multi_wave_steps == 0
    assert package_syncs(lambda: models["in-place"](ids[:, :1])) == []


@requires_cuda_and_triton
def test_captured_decode_beyond_k_equals_eager(tiny_moe_dir):
    """Batch 8 > K // top_k = 1: one captured step (one wave per layer), replayed == eager."""
    from pagedexperts.generation.capture_checks import decode_waves
    from pagedexperts.generation.graphs import DecodeGraphs

    model = fused(tiny_moe_dir, K, "in-place", cuda_graphs="on", cuda_graph_max_batch=8)
    assert decode_waves(model, 8) == 1
    ids = torch.randint(2, 100, (8, 4), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(ids)
    tokens = torch.randint(2, 100, (8, 3), generator=torch.Generator().manual_seed(2)).cuda()
    out = {}
    for backend in ("eager", "cuda"):
        model.pagedexperts.reset_stats()
        graphs = DecodeGraphs(model, backend=backend, max_batch=8)
        st = graphs.step_for(8, 4 + 4)
        with torch.no_grad():
            out[backend] = [st.prefill(ids, mask)] + [graphs.decode(st, tokens[:, i], 4 + i).clone() for i in range(3)]
        assert graphs.summary()["fallbacks"] == [], backend
    assert all(torch.equal(a, b) for a, b in zip(out["cuda"], out["eager"]))
