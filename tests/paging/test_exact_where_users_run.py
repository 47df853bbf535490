"""Exact where users run: default threads and 1 thread, every CPU capability, top_k 2, 4 and 8,
batched greedy generate, long multi-wave prefills; and the paged model's parameters carry the
attributes ``from_pretrained`` gives them.

Why each part exists (each guards a bug that once passed every other test):
- thread count: on CPU with more than one thread a GEMM row's bits depend on its index in its
  expert's group, and ``grouped_mm``'s unstable sort of slot ids ordered rows differently from
  its sort of expert ids (the suite used to pin 1 thread and could not see it);
- CPU capability: the activation's vectorised body and scalar tail differ in the last bit, and
  the vector width comes from ``ATEN_CPU_CAPABILITY`` (one subprocess per value the CPU has);
- top_k 4 and 8: eager's combine order (ascending expert id) equals top-k order at top_k 2;
- batched generate: ``requires_grad`` on ``lm_head`` changes ATen's matmul path for the
  non-contiguous [B, 1, H] slice of a B > 1 decode step.

Oracle: the same checkpoint under plain ``from_pretrained`` (all experts resident) with the same
experts implementation and dtype; every step's logits torch.equal, greedy tokens equal.
Legend: E routed experts, k top_k, K resident slots, B batch, T prompt tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pagedexperts
from support.tiny import E, PAD_ID, VOCAB, assert_same, assert_same_attributes, tiny_model
from support.exact_probe import probe
from pagedexperts.tools.check import compare, left_padded
from support.paths import ROOT

pytestmark = pytest.mark.default_threads

IMPLS = ["grouped_mm", "batched_mm", "eager"]


def rows(lengths, seed: int = 0) -> list[torch.Tensor]:
    return [torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed + n)) for n in lengths]


def assert_run_exact(run, what: str) -> None:
    assert run.exact and run.tokens_equal, f"{what}: {run.prompt}: max |logit diff| {run.max_abs_diff:.3e}, tokens equal {run.tokens_equal}"


@pytest.fixture(scope="module")
def top_k_dirs(tmp_path_factory):
    """top_k -> a tiny E=16 checkpoint routing each token to top_k experts."""
    built = {}

    def get(top_k: int) -> Path:
        if top_k not in built:
            path = tmp_path_factory.mktemp(f"tiny_top{top_k}")
            tiny_model(seed=top_k, num_experts_per_tok=top_k).save_pretrained(path)
            built[top_k] = path
        return built[top_k]

    return get


@pytest.mark.parametrize("top_k", [2, 4, 8])
@pytest.mark.parametrize("impl", IMPLS)
def test_every_top_k_every_implementation(top_k_dirs, reference_model, impl, top_k, threads):
    """K = top_k (every prefill step multi-wave): a padded batch forward and a batched greedy run."""
    path = top_k_dirs(top_k)
    ref = reference_model(path, "float32", impl)
    paged, _ = pagedexperts.load_model(path, num_resident=top_k, experts_implementation=impl, dtype="float32")
    ids, mask = left_padded(rows([12, 5, 9]), PAD_ID)
    with torch.no_grad():
        got, want = paged(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits
        assert_same(got, want, f"{impl} top_k={top_k} padded batch at {threads} threads")
        assert_run_exact(compare(paged, ref, ids, 4, "batched greedy", mask), f"{impl} top_k={top_k}")
    assert paged.pagedexperts.stats().total().multi_wave_steps > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_batched_greedy_generate_left_padded(tiny_moe_dir, reference_model, impl, dtype, threads):
    """B = 4 left-padded prompts, 8 greedy steps: every decode step is a [4, 1] batch."""
    ref = reference_model(tiny_moe_dir, dtype, impl)
    for k in (2, E // 2):
        paged, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=k, experts_implementation=impl, dtype=dtype)
        ids, mask = left_padded(rows([12, 3, 9, 6], seed=5), PAD_ID)
        with torch.no_grad():
            assert_run_exact(compare(paged, ref, ids, 8, "B=4 greedy", mask), f"{impl} {dtype} K={k}")


# The bundled model (E=64, k=4): a 224-token prefill at K=4 runs 16 waves per MoE layer, and
# its S x I activation buffer is above ATen's grain size, so two threads split it.
BUNDLED_CASES = [
    ("grouped_mm", "float32", 4), ("grouped_mm", "bfloat16", 4), ("grouped_mm", "float32", 64),
    ("batched_mm", "float32", 4), ("eager", "float32", 4),
]
# A representative capability matrix (the native capability runs every case above in-process).
CAPABILITY_DTYPES = {"default": ["float32"], "avx2": ["float32", "bfloat16"], "avx512": ["bfloat16"]}


@pytest.fixture(scope="module")
def bundled_references():
    from pagedexperts.tools.check import load_reference

    cache = {}

    def get(impl, dtype):
        if (impl, dtype) not in cache:
            cache[impl, dtype] = load_reference(None, device="cpu", dtype=dtype, experts_implementation=impl)
        return cache[impl, dtype]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("impl,dtype,num_resident", BUNDLED_CASES)
def test_bundled_model_long_prefill_and_batch(bundled_references, impl, dtype, num_resident, threads):
    if threads == 1 and (impl, dtype) != ("grouped_mm", "float32"):
        pytest.skip("1 thread: grouped_mm float32 is the representative (the rest run at the default count)")
    result = probe(impl=impl, dtype=dtype, num_resident=num_resident, reference=bundled_references(impl, dtype))
    for run in result["runs"]:
        assert run["exact"] and run["tokens_equal"], f"{impl} {dtype} K={num_resident} at {threads} threads: {run}"
    if num_resident == 4:
        assert result["multi_wave_steps"] > 0


def cpu_capabilities() -> list[str]:
    """ATEN_CPU_CAPABILITY values this CPU runs: default always, then up to its best."""
    best = torch.backends.cpu.get_cpu_capability().lower()
    order = ["default", "avx2", "avx512"]
    return order[: order.index(best) + 1] if best in order else ["default"]


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_every_cpu_capability_in_a_subprocess(capability):
    if capability not in cpu_capabilities():
        pytest.skip(f"this CPU does not run {capability} (best: {torch.backends.cpu.get_cpu_capability()})")
    if capability == torch.backends.cpu.get_cpu_capability().lower():
        # this process's own capability: test_bundled_model_long_prefill_and_batch runs each of
        # its dtypes (grouped_mm, K=4, default threads) in-process, with a longer greedy run
        assert all(("grouped_mm", d, 4) in BUNDLED_CASES for d in CAPABILITY_DTYPES[capability])
        pytest.skip(f"{capability} is this process's capability: covered in-process")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop("OMP_NUM_THREADS", None)  # the default thread count, as users run
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "exact_probe.py"), "--dtype", *CAPABILITY_DTYPES[capability],
         "--num-resident", "4", "--new-tokens", "2"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["dtype"] for r in results] == CAPABILITY_DTYPES[capability]
    for r in results:
        assert r["capability"].lower() == capability and r["multi_wave_steps"] > 0
        # torch's own SDPA may refuse bfloat16 only at a capability forced below an AMX CPU (the probe
        # then runs both models with eager attention); any other refusal is a failure
        assert r["sdpa_refused"] is None or "pack_vnni2" in r["sdpa_refused"], r["sdpa_refused"]
        assert r["attention"] == ("sdpa" if r["sdpa_refused"] is None else "eager")
        for run in r["runs"]:
            assert run["exact"] and run["tokens_equal"], f"{capability} {r['dtype']} at {r['threads']} threads: {run}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bundled_model_tensor_attributes_match_from_pretrained(bundled_references, dtype):
    paged, _ = pagedexperts.load_model(None, num_resident=4, dtype=dtype)
    assert_same_attributes(paged, bundled_references("grouped_mm", dtype), f"bundled {dtype}")
