"""Experts beyond K read in place (``--beyond-k in-place``): one fused launch per layer-step, exact.

Three device-planned executors of one layer run the same steps (``paging.device_executor``,
the decide / page-in / remap as their torch references, the fused kernels under
``TRITON_INTERPRET=1``; tiny shapes from ``fused_fixtures``): in-place at K slots, waves at K
slots, and the oracle, all E experts resident (K = E: one wave, every expert in a slot). Each
step's output must be ``torch.equal`` across the three (an entry's bits depend only on its
token, its expert's bytes and the step's entry count: ``paging.steps.fused``), batches 1 to 64,
unions below and above K, every format the fused kernels take. Counted: the body runs one wave
a step with in-place reads (two GEMM launches: gate-up and down) whatever the union, the
waves executor ceil(union / K), and the counters split misses into page-ins and rows read in
place (their bytes).

Legend: E experts, k top_k, K slots, T tokens of a step.
"""

from __future__ import annotations

import pytest
import torch

from support.fused_fixtures import CASES, HIDDEN, INTERMEDIATE, random_store
from pagedexperts.paging.kernels import HAVE_TRITON

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (pip install 'pagedexperts[gpu]')")


def experts_module(transposed: bool, num_experts: int):
    """The family's experts module (its ``_apply_gate``): Qwen3-MoE, or gpt-oss (transposed)."""
    if transposed:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        return GptOssExperts(GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                          num_local_experts=num_experts))
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    return Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE,
                                          num_experts=num_experts))


def executor(case, store_rows: dict, num_slots: int, beyond_k: str, admit=None):
    """A device-planned fused executor of one layer over a host store holding ``store_rows``."""
    from pagedexperts.paging.device_executor import DeviceExecutor
    from pagedexperts.paging.steps.contract import SlotSetup
    from pagedexperts.storage.host_store import HostExpertStore

    layout = case.layout()
    num_experts = next(iter(store_rows.values())).shape[0]
    store = HostExpertStore(list(layout.packed_specs), num_experts, pin=False)
    for name, table in store.tensors.items():
        table.copy_(store_rows[name])
    return DeviceExecutor(layer=0, store=store, num_slots=num_slots, device="cpu", inner="fused", policy="lru",
                          backend="torch", setup=SlotSetup(layout=layout), beyond_k=beyond_k, admit_per_step=admit)


class Launches:
    """Counts a body's waves and its fused GEMM launches (``paging.steps.fused._gemm``: one per
    projection a wave) while patched in (pytest's monkeypatch)."""

    def __init__(self, body, monkeypatch):
        from pagedexperts.paging.steps import fused

        self.waves = self.gemms = 0
        run_wave, gemm = body.run_wave, fused._gemm

        self.active = False

        def counted_wave(*args, **kw):
            self.waves += 1
            self.active = True
            try:
                return run_wave(*args, **kw)
            finally:
                self.active = False

        def counted_gemm(*args, **kw):  # only this body's (the module function serves every body)
            self.gemms += self.active
            return gemm(*args, **kw)

        monkeypatch.setattr(body, "run_wave", counted_wave)
        monkeypatch.setattr(fused, "_gemm", counted_gemm)


def disjoint_steps(num_experts: int, top_k: int, batches, seed: int = 0):
    """Per batch size T: ids [T, k], each token's experts distinct, tokens drawn from a shuffled
    deck so that a batch's union is as large as T k allows (up to E)."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for t in batches:
        deck = torch.cat([torch.randperm(num_experts, generator=gen) for _ in range(-(-t * top_k // num_experts))])
        steps.append(deck[: t * top_k].view(t, top_k))
    return steps


def run_all(case, steps, *, num_experts: int, num_slots: int, admit=None, monkeypatch=None):
    """(outputs of in-place at K, waves at K, all E resident) per step, and the in-place executor."""
    store = random_store(case, num_experts)
    module = experts_module(case.transposed, num_experts)
    runs = {"in-place": executor(case, store, num_slots, "in-place", admit),
            "waves": executor(case, store, num_slots, "waves"),
            "resident": executor(case, store, num_experts, "waves")}
    gen = torch.Generator().manual_seed(1)
    outs = {name: [] for name in runs}
    for ids in steps:
        hidden = torch.randn(ids.shape[0], HIDDEN, generator=gen).to(case.dtype)
        weights = torch.rand(ids.shape, generator=gen)
        for name, ex in runs.items():
            outs[name].append(ex.step(module, hidden, ids, weights))
    return outs, runs


def assert_equal_runs(outs, label):
    for i, (a, b, c) in enumerate(zip(outs["in-place"], outs["waves"], outs["resident"])):
        assert torch.equal(a, c), f"{label} step {i}: in-place != all resident, max diff {(a - c).abs().max()}"
        assert torch.equal(b, c), f"{label} step {i}: waves != all resident"


QUICK_FORMATS = ("gptq-v1", "mxfp4-gpt-oss")  # packed int4 words; gpt-oss's transposed e2m1 with biases
slow = pytest.mark.slow


@pytest.mark.default_threads
@pytest.mark.parametrize("name", [n if n in QUICK_FORMATS else pytest.param(n, marks=slow) for n in CASES])
def test_every_format_in_place_equals_waves_and_all_resident(name):
    """Every format: a union below K, one above it (host rows), one again below (slots churned)."""
    case = CASES[name]
    steps = [torch.tensor([[0, 1]]), torch.tensor([[2, 3], [4, 5], [1, 6]]), torch.tensor([[6, 2]])]
    outs, runs = run_all(case, steps, num_experts=8, num_slots=2)
    assert_equal_runs(outs, name)
    stats = runs["in-place"].stats
    assert stats.in_place_rows > 0 and stats.multi_wave_steps == 0 and runs["waves"].stats.multi_wave_steps > 0


@pytest.mark.default_threads
@pytest.mark.parametrize("name", [pytest.param("dense-bf16", marks=slow), pytest.param("gptq-v1", marks=slow),
                                  pytest.param("fp8-block", marks=slow), pytest.param("mxfp4-gpt-oss", marks=slow)])
def test_batches_1_to_64_equal(name, monkeypatch):
    """Decode-like steps of T = 1, 2, 5, 16, 33, 64 tokens at E = 16, k = 2, K = 4 (unions 2 ..
    16: below and above K); admission 1 a step; one wave and two GEMM launches a step."""
    case = CASES[name]
    batches = (1, 2, 5, 16, 33, 64)
    steps = disjoint_steps(16, 2, batches)
    outs, runs = run_all(case, steps[:1], num_experts=16, num_slots=4, admit=1)
    launches = Launches(runs["in-place"].body, monkeypatch)
    for ids in steps[1:]:
        hidden = torch.randn(ids.shape[0], HIDDEN, generator=torch.Generator().manual_seed(ids.shape[0])).to(case.dtype)
        weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(7))
        module = experts_module(case.transposed, 16)
        for key, ex in runs.items():
            outs[key].append(ex.step(module, hidden, ids, weights))
    assert_equal_runs(outs, name)
    assert launches.waves == len(batches) - 1 and launches.gemms == 2 * launches.waves
    stats = runs["in-place"].stats
    assert stats.steps == len(batches) and stats.waves == len(batches) and stats.multi_wave_steps == 0
    assert stats.page_ins <= len(batches) and stats.page_ins + stats.in_place_rows == stats.misses
    assert stats.in_place_bytes == stats.in_place_rows * runs["in-place"].store.expert_bytes > 0
    assert stats.bytes_paged == stats.page_ins * runs["in-place"].store.expert_bytes


@pytest.mark.default_threads
@pytest.mark.parametrize("num_experts,num_slots,top_k,batch", [
    (32, 4, 4, 8),  # the same shape of problem, a quarter the size (the interpreter runs each program in Python)
    pytest.param(128, 8, 4, 32, marks=slow),  # issue 39's numbers
])
def test_done_case_disjoint_requests_one_launch(num_experts, num_slots, top_k, batch, monkeypatch):
    """Issue 39's done case: 32 requests with disjoint experts at K = 8, top_k = 4 (union 128 >
    K) decode in one fused launch per layer-step (one wave: a gate-up and a down GEMM), equal to
    waves (16 waves) and to all 128 experts resident; after a first step that filled the slots."""
    from support.fused_fixtures import FormatCase
    from pagedexperts.formats.dense import DenseFormat

    case = FormatCase("dense-bf16", DenseFormat(), torch.bfloat16)
    union = batch * top_k
    assert union == num_experts > num_slots
    # a first step of one token fills top_k slots; the second routes to every expert
    steps = [torch.arange(top_k).view(1, top_k), torch.arange(num_experts).roll(num_slots // 2).view(batch, top_k)]
    outs, runs = run_all(case, steps[:1], num_experts=num_experts, num_slots=num_slots)
    launches = Launches(runs["in-place"].body, monkeypatch)
    module = experts_module(False, num_experts)
    hidden = torch.randn(batch, HIDDEN, generator=torch.Generator().manual_seed(3)).to(case.dtype)
    weights = torch.rand(batch, top_k, generator=torch.Generator().manual_seed(4))
    for key, ex in runs.items():
        outs[key].append(ex.step(module, hidden, steps[1], weights))
    assert launches.waves == 1 and launches.gemms == 2
    assert_equal_runs(outs, "done case")
    inplace, waves = runs["in-place"].stats, runs["waves"].stats
    assert inplace.waves == 2 and inplace.multi_wave_steps == 0
    assert waves.waves == 1 + union // num_slots and waves.multi_wave_steps == 1
    # step 2: top_k hits (the first step's experts), K - top_k admitted, the rest read in place
    assert inplace.union_max == union and inplace.page_ins == top_k + (num_slots - top_k)
    assert inplace.in_place_rows == union - num_slots and inplace.hits == top_k
