"""The tiny random Qwen3-MoE of the tests (conftest's ``tiny_moe_*`` checkpoints) and what
builds, runs and compares it.

Every model is seeded and tiny (vocab 128, hidden 32, E=16 routed experts, top_k=2,
moe_intermediate 16) so the whole suite runs on CPU in seconds. tests/data/llmc's older
qwen3_moe / deepseek_v3 fixtures (``*-fp8*``, ``*-w8a16``, ``*-w4a16_mixed``) have these shapes too.

Legend: E routed experts, k top_k, K resident slots, I expert intermediate, H hidden.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

E = 16  # routed experts per layer
TOP_K = 2
HIDDEN = 32
MOE_INTERMEDIATE = 16
VOCAB = 128
PAD_ID = 0

DEFAULT_THREADS = torch.get_num_threads()


def tiny_config(**overrides):
    """The tiny Qwen3-MoE config of these tests; ``overrides`` replace any field."""
    from transformers import Qwen3MoeConfig

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        moe_intermediate_size=MOE_INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=E,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        max_position_embeddings=256,
        initializer_range=0.1,  # larger than default so routing and logits are decisive
        pad_token_id=PAD_ID,
        bos_token_id=1,
        eos_token_id=None,  # greedy decode always runs its full length
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


def tiny_model(seed: int = 0, **overrides):
    """A random-init Qwen3MoeForCausalLM in float32, eval mode."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_config(**overrides))
    return model.eval()


def prompt(length: int, seed: int) -> torch.Tensor:
    """[length] int64 token ids drawn from [2, VOCAB) by a generator seeded with ``seed``
    (ids 0 and 1 are PAD_ID and bos)."""
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy_logits(model, ids: torch.Tensor, mask: torch.Tensor | None = None, steps: int = 6) -> torch.Tensor:
    """Every step's logits [steps, B, V] of a greedy ``generate`` of exactly ``steps`` new tokens
    from ids [B, T] (mask [B, T], all ones when None), in the model's dtype. Two runs give
    torch.equal logits iff every prefill and decode step computed the same bits."""
    mask = torch.ones_like(ids) if mask is None else mask
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=steps,
                         min_new_tokens=steps, output_logits=True, return_dict_in_generate=True, pad_token_id=PAD_ID)
    return torch.stack(out.logits)


def host_budget_gb(path, rows: int, **options) -> float:
    """--host-memory-gb that leaves ``rows`` host rows per layer to ``path`` loaded with ``options``
    (``tier_budget_gb`` of the model loaded with all experts in host memory)."""
    from pagedexperts import load_model

    return tier_budget_gb(load_model(path, **options)[0], rows)


def tier_budget_gb(full_model, rows: int) -> float:
    """--host-memory-gb that leaves ``rows`` host rows per layer to ``full_model``'s checkpoint and
    options: what the loader counts besides the store (the slots on the host, as allocated: a full
    store's plan counts none where packed slots read its rows in place, the disk tier's counts them;
    non-expert weights, KV estimate and runtime allowance) + rows x layers + 2 x top_k experts of
    staging, plus half an expert against rounding (G is given in GB)."""
    rt = full_model.pagedexperts
    slots = rt.host_memory.slot_bytes_on_host or sum(  # the packed slots' own rows, which the tier's plan counts
        t.nbytes for r in rt.runners.values() for t in getattr(r, "slots", {}).values() if t.device.type == "cpu")
    fixed = rt.host_memory.fixed_bytes - rt.host_memory.slot_bytes_on_host + slots
    experts = rows * len(rt.stores) + 2 * rt.top_k
    return (fixed + experts * rt.expert_bytes + rt.expert_bytes // 2) / 1e9


def copy_dir(src: Path, dst: Path) -> Path:
    """A writable copy of a checkpoint directory (tests that damage a checkpoint use one)."""
    shutil.copytree(src, dst)
    return dst


def rewrite_expert_bytes(shard: Path) -> str:
    """Invert (XOR 0xFF) the bytes of the first routed expert tensor of the safetensors ``shard``
    in place: the same header, size and shapes, other weights. Returns the tensor's name."""
    with open(shard, "r+b") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
        name = next(k for k in sorted(header) if ".experts." in k)
        begin, end = header[name]["data_offsets"]
        f.seek(8 + length + begin)
        data = bytes(b ^ 0xFF for b in f.read(end - begin))
        f.seek(8 + length + begin)
        f.write(data)
    return name


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """torch.equal, and on mismatch a message with the max and mean |difference|."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if not torch.equal(actual, expected):
        diff = (actual.float() - expected.float()).abs()
        raise AssertionError(
            f"{what} differs: max |diff| {diff.max().item():.3e}, mean |diff| {diff.mean().item():.3e}, "
            f"{int((diff > 0).sum())} of {diff.numel()} elements"
        )


def tensor_attributes(model) -> dict[str, tuple]:
    """name -> (shape, dtype, requires_grad, contiguous, device type) of every parameter and buffer."""
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return {n: (tuple(t.shape), t.dtype, t.requires_grad, t.is_contiguous(), t.device.type) for n, t in named}


def assert_same_attributes(paged, reference, what: str) -> None:
    """Every tensor of the paged model as under from_pretrained; the reference's only extras are
    the routed experts' [E, ...] tensors, whose slots and store rows keep their dtype."""
    got, want = tensor_attributes(paged), tensor_attributes(reference)
    experts = {n for n in want if ".experts." in n and n.rsplit(".", 1)[1] in _expert_tensor_names(paged)}
    assert set(got) == set(want) - experts, f"{what}: tensor names differ"
    for name, attrs in got.items():
        assert attrs == want[name], f"{what}: {name} is {attrs}, from_pretrained gives {want[name]}"
    for pager in paged.pagedexperts.runners.values():
        for tname, slot in pager.slots.items():
            ref = dict(reference.named_parameters())[f"{_experts_name(reference, pager.layer)}.{tname}"]
            assert slot.dtype == pager.store.tensors[tname].dtype == ref.dtype, f"{what}: {tname} dtype"
            assert slot.is_contiguous() and pager.store.tensors[tname].is_contiguous()


def _expert_tensor_names(paged) -> set[str]:
    return {n for p in paged.pagedexperts.runners.values() for n in p.slots}


def _experts_name(model, layer: int) -> str:
    return next(n for n, _ in model.named_modules() if n.endswith(f"layers.{layer}.mlp.experts"))


def count_int4_packs(monkeypatch) -> list:
    """Calls of torch's int4 pack (a conversion to the CPU kernel's layout) from now on, one item each."""
    calls = []
    original = torch.ops.aten._convert_weight_to_int4pack_for_cpu

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", counted)
    return calls
