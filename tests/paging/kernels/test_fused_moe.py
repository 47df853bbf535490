"""The fused MoE kernels against the formats' own dequantization and a plain-torch step (CPU).

The Triton kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (set by conftest before
any kernel is defined) at tiny shapes (``fused_fixtures``: H 64, I 32, every format bound as a
checkpoint binds it, random packed bytes). What each test asserts:

- the in-register dequantization equals ``ExpertFormat.dequantize`` bit for bit, every format;
- a step equals the dense reference (format dequantize + the model's math with the module's own
  activation) within ``TOLERANCE`` of the weights' dtype;
- a step whose experts sit in K slots, in host rows beyond them, or both, equals the same kernel
  with all E experts in one table (torch.equal): K = k, 2k, E/2; batch 1, a batch routing to
  more experts than K holds, a prefill-sized step;
- the alignment by row: hand-computed values, and the Triton kernels equal the torch ops;
- no host read: the whole step under a dispatch mode that fails on any read-back op.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support.fused_fixtures import CASES, E, HIDDEN, INTERMEDIATE, TOP_K, FormatCase, random_store, weight_tensors
from support.fused_reference import TOLERANCE, dense_rows, fused_experts, fused_experts_reference
from pagedexperts.formats.base import TensorSpec
from pagedexperts.formats.dense import DenseFormat
from pagedexperts.formats.gptq.gptq import GptqFormat
from pagedexperts.formats.packing import WeightPacking, g_idx_is_trivial
from pagedexperts.paging.kernels import HAVE_TRITON

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (pip install 'pagedexperts[gpu]')")


def activate(module, proj):
    """The experts module's gate (``_apply_gate``) or plain activation, as its experts function applies it."""
    return module._apply_gate(proj) if module.has_gate else module.act_fn(proj)


def experts_module(transposed: bool, num_experts: int = E):
    """The family's experts module (its ``_apply_gate``): Qwen3-MoE, or gpt-oss (transposed)."""
    if transposed:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        return GptOssExperts(GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=num_experts))
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    return Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=num_experts))


def projection_rows(case: FormatCase, tables: dict) -> dict:
    """{"gate_up_proj": ProjectionRows, "down_proj": ...} over ``tables`` [R, ...]."""
    from pagedexperts.paging.kernels.fused_moe import ProjectionRows

    return {name: ProjectionRows.from_tables(case.fmt.packing(t, transposed=case.transposed), tables,
                                             bias=tables.get(f"{name}_bias"))
            for name, t in weight_tensors(case).items()}


def step_inputs(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int = 1):
    """hidden [T, H], expert ids [T, k] (distinct per token), routing weights [T, k] float32."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    return hidden, ids, torch.rand(num_tokens, TOP_K, generator=gen)


def run_fused(case: FormatCase, rows: dict, hidden, ids, weights, module):
    return fused_experts(hidden, ids, weights, rows["gate_up_proj"], rows["down_proj"],
                         activation=lambda p: activate(module, p))


@needs_triton
class TestDequantize:
    @pytest.mark.parametrize("name", list(CASES))
    def test_kernel_dequantize_equals_format_dequantize(self, name):
        from pagedexperts.paging.kernels.fused_moe import dequantize_rows

        case = CASES[name]
        store = random_store(case, 3)
        rows = projection_rows(case, store)
        for proj, tensor in weight_tensors(case).items():
            got = dequantize_rows(rows[proj], torch.tensor([2, 0, 1]))
            want = dense_rows(case.fmt, tensor, store)[[2, 0, 1]]
            want = want.transpose(-1, -2) if case.transposed else want
            assert got.dtype == want.dtype == tensor.dense.dtype, proj
            assert torch.equal(got, want), f"{name} {proj}: max diff {(got.float() - want.float()).abs().max()}"


@needs_triton
class TestStepAgainstReference:
    @pytest.mark.parametrize("name", list(CASES))
    def test_step_within_tolerance_of_dense_reference(self, name):
        case = CASES[name]
        store = random_store(case, 4)
        module = experts_module(case.transposed, 4)
        hidden, ids, weights = step_inputs(3, 4, case.dtype)
        ids[1, 1] = -1  # an entry not computed here adds nothing
        got = run_fused(case, projection_rows(case, store), hidden, ids, weights, module)
        dense = {n: dense_rows(case.fmt, t, store) for n, t in weight_tensors(case).items()}
        want = fused_experts_reference(hidden, ids, weights, dense["gate_up_proj"], dense["down_proj"],
                                       activation=lambda p: activate(module, p), transposed=case.transposed,
                                       gate_up_bias=store.get("gate_up_proj_bias"), down_bias=store.get("down_proj_bias"))
        assert got.dtype == hidden.dtype and got.shape == hidden.shape
        err = (got.float() - want.float()).abs().max() / want.float().abs().max()
        assert err <= TOLERANCE[dense["down_proj"].dtype], f"{name}: relative error {err:.3g}"


def paged_tables(store: dict, experts_in_slots: list[int], num_slots: int) -> dict:
    """Slot tensors [K, ...] (zeros where empty) holding ``experts_in_slots[s]`` in slot s: a
    separate allocation from the host store, as on a device."""
    slots = {name: torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype) for name, t in store.items()}
    for slot, expert in enumerate(experts_in_slots):
        for name, t in store.items():
            slots[name][slot] = t[expert]
    return slots


def placement(ids: torch.Tensor, num_slots: int, seed: int) -> list[int]:
    """Experts in slots 0..K-1: the routed union first (as paging places them) while it fits,
    then other experts, in a seeded random slot order."""
    routed = list(dict.fromkeys(ids.flatten().tolist()))
    others = [e for e in torch.randperm(E, generator=torch.Generator().manual_seed(seed)).tolist() if e not in routed]
    chosen = (routed + others)[:num_slots]
    order = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    return [chosen[i] for i in order]


@needs_triton
class TestSlotsEqualAllResident:
    """Same kernel, same step: experts in K slots + host rows == all E experts in one table."""

    @pytest.mark.default_threads
    @pytest.mark.parametrize("name", ["dense-fp32", "dense-bf16", "gptq-v1", "mxfp4-gpt-oss"])
    @pytest.mark.parametrize("num_slots,num_tokens", [(TOP_K, 1), (2 * TOP_K, 5), pytest.param(E // 2, 24, marks=pytest.mark.slow)])
    def test_paged_rows_equal_all_resident(self, name, num_slots, num_tokens):
        from pagedexperts.paging.kernels.fused_moe import ProjectionRows

        case = CASES[name]
        store = random_store(case, E)
        module = experts_module(case.transposed)
        hidden, ids, weights = step_inputs(num_tokens, E, case.dtype, seed=num_tokens)
        resident = run_fused(case, projection_rows(case, store), hidden, ids, weights, module)

        in_slots = placement(ids, num_slots, seed=num_slots)
        host = {name: t.clone() for name, t in store.items()}  # the host store: another allocation
        slot_rows, host_rows = projection_rows(case, paged_tables(store, in_slots, num_slots)), projection_rows(case, host)
        rows = {p: ProjectionRows.join(slot_rows[p], host_rows[p]) for p in slot_rows}
        slot_of = {e: s for s, e in enumerate(in_slots)}
        row_ids = ids.clone().apply_(lambda e: slot_of.get(e, num_slots + e))  # slot, else host row K + e
        union = len(set(ids.flatten().tolist()))
        assert (row_ids >= num_slots).any() == (union > num_slots), "host rows exactly when the union exceeds K"
        paged = run_fused(case, rows, hidden, row_ids, weights, module)
        assert torch.equal(paged, resident), f"max diff {(paged.float() - resident.float()).abs().max()}"

    @pytest.mark.slow
    @pytest.mark.default_threads
    def test_prefill_sized_step_equal(self):
        """S >= 1024 entries: BLOCK_M 64 tiles; half the experts in slots, half in host rows."""
        from pagedexperts.paging.kernels.fused_moe import ProjectionRows, block_m_for

        case = CASES["dense-bf16"]
        store = random_store(case, E)
        module = experts_module(False)
        hidden, ids, weights = step_inputs(512, E, case.dtype)
        assert block_m_for(ids.numel()) == 64
        resident = run_fused(case, projection_rows(case, store), hidden, ids, weights, module)
        in_slots = list(range(0, E, 2))
        slots = projection_rows(case, paged_tables(store, in_slots, E // 2))
        host = projection_rows(case, {n: t.clone() for n, t in store.items()})
        rows = {p: ProjectionRows.join(slots[p], host[p]) for p in slots}
        row_ids = torch.where(ids % 2 == 0, ids // 2, E // 2 + ids)
        assert torch.equal(run_fused(case, rows, hidden, row_ids, weights, module), resident)


@needs_triton
class TestAlign:
    def test_hand_computed_alignment(self):
        from pagedexperts.paging.kernels.fused_align import align_torch, align_triton

        # entries 0..5 -> rows 2, 0, 2, (left out), 0, 2; R = 3, BLOCK_M = 2
        ids = torch.tensor([[2, 0], [2, -1], [0, 2]])
        for align in (align_torch, align_triton):
            a = align(ids, 3, 2)
            assert a.sorted_entry.shape == (10,) and a.block_row.shape == (5,)  # P = 6 + 3 * 1 -> 10
            assert a.num_padded.tolist() == [6]
            assert a.sorted_entry[:6].tolist() == [1, 4, 0, 2, 5, 6], align.__name__
            assert a.block_row[:3].tolist() == [0, 2, 2], align.__name__

    @pytest.mark.parametrize("num_tokens,num_rows,block_m", [(1, 4, 16), (7, 5, 4), (40, 24, 16), (3, 40, 2)])
    def test_triton_equals_reference(self, num_tokens, num_rows, block_m):
        from pagedexperts.paging.kernels.fused_align import align_torch, align_triton

        gen = torch.Generator().manual_seed(num_tokens)
        ids = torch.randint(-1, num_rows, (num_tokens, 4), generator=gen)
        want, got = align_torch(ids, num_rows, block_m), align_triton(ids, num_rows, block_m)
        used = int(want.num_padded)
        assert torch.equal(got.num_padded, want.num_padded)
        assert torch.equal(got.sorted_entry[:used], want.sorted_entry[:used])
        assert torch.equal(got.block_row[: used // block_m], want.block_row[: used // block_m])
        counts = torch.bincount(ids[ids >= 0], minlength=num_rows)
        assert used == int(((counts + block_m - 1) // block_m * block_m).sum())


FORBIDDEN = ("_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
             "masked_select", "bincount", "argwhere", "lift_fresh")


class NoHostReads(TorchDispatchMode):
    """Fails on any op that reads device values back to the host or builds a tensor from host
    data (``.item()``, ``nonzero``, ``unique``, a boolean-mask select, ``torch.tensor(...)``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        boolean_index = name.startswith("index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 and
                                                                              isinstance(args[1], (list, tuple)) else ()))
        if name in FORBIDDEN or boolean_index:
            raise AssertionError(f"host read in the fused step: {func}")
        return func(*args, **(kwargs or {}))


def test_no_host_reads_mode_catches_reads():
    x = torch.arange(4)
    for read in (lambda: x.sum().item(), lambda: torch.nonzero(x), lambda: torch.unique(x), lambda: x[x > 1],
                 lambda: torch.tensor([1, 2])):
        with pytest.raises(AssertionError, match="host read"), NoHostReads():
            read()


@needs_triton
def test_step_reads_nothing_back():
    """The paged step's launches, prepared and run: no host read."""
    case = CASES["gptq-v1"]
    rows = projection_rows(case, random_store(case, E))
    hidden, ids, weights = step_inputs(3, E, case.dtype)
    module = experts_module(False)
    with NoHostReads():
        out = run_fused(case, rows, hidden, ids, weights, module)
    assert out.shape == hidden.shape


def test_the_torch_alignment_reads_nothing_back():
    """The align kernels' torch reference keeps their promise too."""
    from pagedexperts.paging.kernels.fused_align import align_torch

    ids = torch.randint(-1, 6, (5, 2), generator=torch.Generator().manual_seed(0))
    with NoHostReads():
        align_torch(ids, 6, 4)


def test_packing_of_gptq_and_awq_say_their_layouts():
    gptq, awq = CASES["gptq-v1"], CASES["awq"]
    p = gptq.fmt.packing(weight_tensors(gptq)["gate_up_proj"])
    assert (p.codes, p.bits, p.packed_dim, p.transposed, p.zero_offset, p.per_word) == ("int", 4, "in", True, 1, 8)
    assert (p.out_features, p.in_features, p.source_rows, p.group_size) == (2 * INTERMEDIATE, HIDDEN, INTERMEDIATE, 16)
    assert p.spec("g_idx") is None and p.row_strides("weight") == (1, 2 * INTERMEDIATE)  # qweight [K/8, N]
    q = awq.fmt.packing(weight_tensors(awq)["down_proj"])
    assert (q.packed_dim, q.interleaved, q.value_offset, q.row_strides("zero")) == ("out", True, 0, (1, HIDDEN // 8))


def test_packing_bytes_count_what_the_kernel_reads():
    case = CASES["nvfp4"]
    layout = case.layout()
    packings = [case.fmt.packing(t) for t in weight_tensors(case).values()]
    # every packed tensor but the unused input_global_scale rows: [1] float32 per source
    assert sum(p.expert_bytes for p in packings) == layout.expert_bytes - (2 + 1) * 4


def test_base_format_without_packing_names_itself():
    from pagedexperts.formats.base import ExpertFormat, QuantizedTensor

    class Plain(ExpertFormat):
        name = "plain"

    spec = TensorSpec("w", (2, 2), torch.float32)
    with pytest.raises(NotImplementedError, match="'plain'"):
        Plain().packing(QuantizedTensor(spec, (spec,)))


def test_weight_packing_refuses_what_it_cannot_describe():
    spec = TensorSpec("w", (4, 4), torch.float32)
    with pytest.raises(ValueError, match="codes='int8'"):
        WeightPacking(4, 4, torch.float32, (("weight", spec),), codes="int8")
    with pytest.raises(ValueError, match="scale='group'"):
        WeightPacking(4, 4, torch.float32, (("weight", spec),), scale="group")


def test_g_idx_is_trivial():
    assert g_idx_is_trivial(torch.arange(64).repeat(2) // 16, in_features=64, group_size=16)
    assert not g_idx_is_trivial(torch.arange(64).flip(0) // 16, in_features=64, group_size=16)


def test_dense_packing_reads_gpt_oss_orientation():
    t = DenseFormat().layout((TensorSpec("down_proj", (32, 64), torch.bfloat16),), transposed=True).tensors[0]
    p = DenseFormat().packing(t, transposed=True)
    assert (p.out_features, p.in_features, p.row_strides("weight")) == (64, 32, (1, 64))
    assert GptqFormat(group_size=16, desc_act=False, zero_offset=1).name == "gptq"


@needs_triton
def test_bad_inputs_are_refused_before_work():
    """The paged fused step refuses a hidden size its rows do not read, and launches over
    projections whose row counts differ, before any kernel runs."""
    from pagedexperts.paging.device_executor import DeviceExecutor
    from pagedexperts.paging.steps.fused import FusedLaunches
    from support.synthetic_layer import paged, step_inputs as layer_inputs, synthetic_experts

    module = synthetic_experts(torch.float32)
    dev = DeviceExecutor(layer=0, store=paged(module, 4).store, num_slots=4, device="cpu", inner="fused", policy="lru")
    hidden, ids, weights = layer_inputs([[0, 1], [2, 3]], torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"hidden \(2, 16\) on cpu: the fused rows read 32"):
        dev.step(module, hidden[:, :16], ids, weights)
    case = CASES["dense-fp32"]
    four, five = projection_rows(case, random_store(case, 4)), projection_rows(case, random_store(case, 5))
    with pytest.raises(ValueError, match="gate_up has 4 rows, down 5"):
        FusedLaunches.of(four["gate_up_proj"], five["down_proj"], num_entries=4, top_k=2)


def test_decode_bytes_at_qwen3_30b_a3b_shapes():
    """GPTQ group 128 at H 2048, I 768, k 8, K 40, bfloat16: counts by hand from the layouts."""
    from pagedexperts.analysis.fused_bytes import decode_bytes

    gptq = FormatCase("gptq", GptqFormat(group_size=128, desc_act=False, zero_offset=1), torch.bfloat16,
                      hidden=2048, intermediate=768)
    b = decode_bytes(gptq.layout(), num_slots=40, top_k=8)
    gate_up = 256 * 1536 * 4 + 16 * 192 * 4 + 16 * 1536 * 2  # qweight [H/8, 2I], qzeros [G, 2I/8], fp16 scales
    down = 96 * 2048 * 4 + 6 * 256 * 4 + 6 * 2048 * 2
    assert b.fused == 8 * (gate_up + down) == 19_611_648  # g_idx not read without desc_act
    g_idx, dense = (2 * 2048 + 768) * 4, 3 * 2048 * 768 * 2
    assert b.dequantize_minimum == 40 * (gate_up + down + g_idx + dense) + 8 * dense
    assert b.dequantize_ops > 8 * b.dequantize_minimum  # int32 fields and temporaries of every slot
    assert b.dequantize_routed == 8 * (gate_up + down + g_idx + 2 * dense)  # routed slots only: read, write, read
    plain = FormatCase("dense", DenseFormat(), torch.bfloat16, hidden=2048, intermediate=768)
    assert decode_bytes(plain.layout(), num_slots=40, top_k=8).dequantize_ops == 8 * dense  # nothing to dequantize
    with pytest.raises(ValueError, match="num_slots 4 is below top_k 8"):
        decode_bytes(plain.layout(), num_slots=4, top_k=8)
