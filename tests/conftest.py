"""Shared fixtures: tiny random Qwen3-MoE checkpoints on disk, in every layout the loader reads.

Every model is seeded and tiny (vocab 128, hidden 32, E=16 routed experts, top_k=2,
moe_intermediate 16) so the whole suite runs on CPU in seconds. The directories are built
once per session:

- ``tiny_moe_dir``: ``save_pretrained`` output, one tensor per expert
  (``model.layers.N.mlp.experts.{j}.gate_proj.weight`` ...), the layout hub checkpoints use.
- ``tiny_moe_stacked_dir``: the same weights re-saved from ``model.state_dict()``, stacked
  (``model.layers.N.mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]).
- ``tiny_moe_sharded_dir``: the same weights, ``save_pretrained(max_shard_size=...)`` with a
  ``model.safetensors.index.json``.
- ``tiny_moe_dense_dir``: a 3-layer model whose layer 1 is dense (``mlp_only_layers=[1]``).

Legend: E routed experts, k top_k, K resident slots, I expert intermediate, H hidden.

Threads. A CPU GEMM row's bits can depend on the thread count, so exactness tests (marked
``default_threads``, or using the ``threads`` fixture) run at torch's default thread count, as
users run, and through ``threads`` at 1 thread as well. Every other test runs at 1 thread: the
models are tiny, and threads only add waiting.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning (read when torch loads its OpenMP runtime). It
# decides nothing about the numbers: the thread count and each kernel's split of the work stay
# torch's defaults. On a shared 2-core machine spinning threads starve the working ones (a tiny
# model's forward at 2 threads took 30x longer than at 1 with the default policy).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the device-planned step's Triton kernels run under the Triton interpreter, which
# must be set before any kernel is defined (at the first import of pagedexperts.loading or
# pagedexperts.paging.kernels, whichever test module imports it first); it also allows
# --decide device on a CPU (loading.config). Tests of the refusal without it patch the flag.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

E = 16  # routed experts per layer
TOP_K = 2
HIDDEN = 32
MOE_INTERMEDIATE = 16
VOCAB = 128
PAD_ID = 0

DEFAULT_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _thread_count(request):
    """1 thread, except for exactness tests (module docstring); restored afterwards."""
    users = "threads" in request.fixturenames or request.node.get_closest_marker("default_threads")
    torch.set_num_threads(DEFAULT_THREADS if users else 1)
    yield
    torch.set_num_threads(DEFAULT_THREADS)


@pytest.fixture(params=["default", 1], ids=["default-threads", "1-thread"])
def threads(request):
    """Run the test at the default thread count and at 1 thread (restored afterwards)."""
    n = DEFAULT_THREADS if request.param == "default" else request.param
    torch.set_num_threads(n)
    yield n
    torch.set_num_threads(DEFAULT_THREADS)


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


@pytest.fixture(scope="session")
def reference_model(tiny_moe_dir):
    """get(path=tiny_moe_dir, dtype="float32", impl="grouped_mm") -> transformers' own unpaged
    model of a checkpoint (``from_pretrained``, all experts resident, eval mode), loaded once per
    (path, dtype, implementation) for the session. Shared: a test must not modify it (it holds
    no paging state; forward and generate leave it as it was)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(path=None, dtype: str = "float32", impl: str = "grouped_mm"):
        key = (str(path or tiny_moe_dir), dtype, impl)
        if key not in cache:
            cache[key] = AutoModelForCausalLM.from_pretrained(
                key[0], experts_implementation=impl, dtype=getattr(torch, dtype)).eval()
        return cache[key]

    return get


def host_budget_gb(path, rows: int, **options) -> float:
    """--host-memory-gb that leaves ``rows`` host rows per layer to ``path`` loaded with ``options``:
    what the loader counts besides the store (its full-store plan's slots on the host, non-expert
    weights, KV estimate and runtime allowance) + rows x layers + 2 x top_k experts of staging,
    plus half an expert against rounding (G is given in GB)."""
    from pagedexperts import load_model

    full, _ = load_model(path, **options)
    rt = full.pagedexperts
    experts = rows * len(rt.stores) + 2 * rt.top_k
    return (rt.host_memory.fixed_bytes + experts * rt.expert_bytes + rt.expert_bytes // 2) / 1e9


def copy_dir(src: Path, dst: Path) -> Path:
    """A writable copy of a checkpoint directory (tests that damage a checkpoint use one)."""
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="session")
def tiny_moe_model():
    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory, tiny_moe_model) -> Path:
    path = tmp_path_factory.mktemp("tiny_moe_per_expert")
    tiny_moe_model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_moe_stacked_dir(tmp_path_factory, tiny_moe_dir, tiny_moe_model) -> Path:
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("tiny_moe_stacked")
    shutil.copy(tiny_moe_dir / "config.json", path / "config.json")
    state = {k: v.contiguous() for k, v in tiny_moe_model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def tiny_moe_sharded_dir(tmp_path_factory, tiny_moe_model) -> Path:
    path = tmp_path_factory.mktemp("tiny_moe_sharded")
    tiny_moe_model.save_pretrained(path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) >= 2
    return path


@pytest.fixture(scope="session")
def tiny_moe_dense_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_moe_dense_layer")
    tiny_model(seed=1, num_hidden_layers=3, mlp_only_layers=[1]).save_pretrained(path)
    return path


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
