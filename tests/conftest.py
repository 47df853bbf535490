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

The tiny model's constants and builders are ``support.tiny``'s (tests/support/: what test modules
share; no test module imports another). Shared fixtures beside these: ``device_reads`` (the
syncing-call counter of the paging tests), ``quantized_dirs`` (block-FP8 / MXFP4 family checkpoints).

Legend: E routed experts, k top_k, K resident slots, I expert intermediate, H hidden.

Threads. A CPU GEMM row's bits can depend on the thread count, so exactness tests (marked
``default_threads``, or using the ``threads`` fixture) run at torch's default thread count, as
users run, and through ``threads`` at 1 thread as well (that case marked slow). Every other test runs at 1 thread: the
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

from support.tiny import DEFAULT_THREADS, tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def _transformers_tables_restored():
    """transformers' checkpoint conversion tables as the test found them: a library that replaces
    one process-wide while it loads its own checkpoint (auto-round's loader) leaves the next
    test transformers as it ships (``loading.checkpoint.shipped_conversion_mapping``)."""
    import sys

    cm = sys.modules.get("transformers.conversion_mapping")
    before = {t: cm.get_checkpoint_conversion_mapping(t) for t in getattr(cm, "USER_REGISTERED_MAPPINGS", ())}
    yield
    cm = sys.modules.get("transformers.conversion_mapping")
    for model_type in set(getattr(cm, "USER_REGISTERED_MAPPINGS", ())) - set(before):
        shipped = cm._build_checkpoint_conversion_mapping().get(model_type)
        if shipped is not None:
            cm.register_checkpoint_conversion_mapping(model_type, shipped, overwrite=True)
        cm.USER_REGISTERED_MAPPINGS.discard(model_type)
    for model_type, mapping in before.items():
        cm.register_checkpoint_conversion_mapping(model_type, mapping, overwrite=True)


@pytest.fixture(scope="session")
def stored_layout_cache(tmp_path_factory) -> Path:
    """The session's cache of stored kernel layouts (``loading.stored_layout``), never ~/.cache."""
    return tmp_path_factory.mktemp("kernel-layouts")


@pytest.fixture(autouse=True)
def _stored_layouts_in_tmp(stored_layout_cache, monkeypatch):
    """Stored kernel layouts that a test's load writes go to the session's temporary cache."""
    from pagedexperts.loading import stored_layout

    monkeypatch.setattr(stored_layout, "default_cache_dir", lambda: stored_layout_cache)


@pytest.fixture(autouse=True)
def _runtime_allowance_fixed(monkeypatch):
    """The host-memory plan's runtime part as a constant (RUNTIME_ALLOWANCE_BYTES' CPU value): a
    test process holds the models of earlier tests, so the measured one (``storage.host_memory
    .process_anon_bytes``) would make budgets depend on test order. tests/storage/test_host_memory.py
    checks the measurement itself."""
    from pagedexperts.storage import host_memory

    fixed = host_memory.RUNTIME_ALLOWANCE_BYTES["cpu"] - host_memory.STEP_MARGIN_BYTES
    monkeypatch.setattr(host_memory, "process_anon_bytes", lambda: fixed)


@pytest.fixture(autouse=True)
def _thread_count(request):
    """1 thread, except for exactness tests (module docstring); restored afterwards."""
    users = "threads" in request.fixturenames or request.node.get_closest_marker("default_threads")
    torch.set_num_threads(DEFAULT_THREADS if users else 1)
    yield
    torch.set_num_threads(DEFAULT_THREADS)


@pytest.fixture(params=["default", pytest.param(1, marks=pytest.mark.slow)], ids=["default-threads", "1-thread"])
def threads(request):
    """Run the test at the default thread count (as users run) and, marked slow, at 1 thread
    (restored afterwards)."""
    n = DEFAULT_THREADS if request.param == "default" else request.param
    torch.set_num_threads(n)
    yield n
    torch.set_num_threads(DEFAULT_THREADS)


@pytest.fixture(scope="session")
def reference_model(tiny_moe_dir):
    """get(path=tiny_moe_dir, dtype="float32", impl="grouped_mm") -> transformers' own unpaged
    model of a checkpoint (``from_pretrained``, all experts resident, eval mode), loaded once per
    (path, dtype, implementation) for the session, on transformers' local path
    (``tools.check.transformers_model``: no kernel fetched from the Hub). Shared: a test must not
    modify it (it holds no paging state; forward and generate leave it as it was)."""
    from pagedexperts.tools.check import transformers_model

    cache = {}

    def get(path=None, dtype: str = "float32", impl: str = "grouped_mm"):
        key = (str(path or tiny_moe_dir), dtype, impl)
        if key not in cache:
            cache[key] = transformers_model(key[0], experts_implementation=impl, dtype=getattr(torch, dtype)).eval()
        return cache[key]

    return get


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


@pytest.fixture
def device_reads(monkeypatch):
    """Install the counter: executor steps mark their inputs and slots; read_back and upload are
    wrapped (read_back's result is host memory, upload's is device memory)."""
    from pagedexperts.paging import host_executor, transfer
    from pagedexperts.paging.steps import host_batched, host_eager, host_grouped
    from support.reads import DeviceReads

    mode = DeviceReads()
    original_read_back, original_upload = transfer.read_back, transfer.upload
    original_step = host_executor.HostExecutor.step

    def read_back(parts):
        mode.read_backs += 1
        mode.paused = True
        try:
            return original_read_back(parts)
        finally:
            mode.paused = False

    def upload(values, device):
        out = original_upload(values, device)
        mode.mark(out)
        return out

    def step(self, module, hidden, ids, weights, padding_count=None):
        mode.mark(hidden, ids, weights, padding_count, *self.slots.values())
        mode.layer_steps += 1
        return original_step(self, module, hidden, ids, weights, padding_count)

    mode.layer_steps = 0
    monkeypatch.setattr(transfer, "read_back", read_back)
    for target in (transfer, host_grouped, host_batched, host_eager):  # every module that uploads
        monkeypatch.setattr(target, "upload", upload)
    monkeypatch.setattr(host_executor.HostExecutor, "step", step)
    return mode


@pytest.fixture(scope="session")
def quantized_dirs(tmp_path_factory):
    """name -> quantized checkpoint directory, built on first use."""
    from support.families import build_model, save_char_tokenizer
    from support.quantized_dirs import QUANTIZED, UNQUANTIZED, write_fp8_block, write_mxfp4

    built = {}

    def get(name: str):
        if name not in built:
            family, fmt, block, overrides = {**QUANTIZED, **UNQUANTIZED}[name]
            src = tmp_path_factory.mktemp(f"src_{name}")
            model = build_model(family, **overrides)
            with torch.no_grad():  # gpt-oss initialises its expert biases to zero: make them count
                for pname, p in model.named_parameters():
                    if pname.endswith("_bias") and ".experts." in pname:
                        p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(pname)))
            model.save_pretrained(src)
            save_char_tokenizer(src)
            if fmt == "dense":
                built[name] = src
            else:
                dst = tmp_path_factory.mktemp(f"q_{name}")
                built[name] = write_fp8_block(src, dst, block) if fmt == "fp8" else write_mxfp4(src, dst)
        return built[name]

    return get
