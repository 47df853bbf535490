"""The device-planned step in the product: ``load_model(decide=...)``, ``--decide`` and its checks.

Oracles: the host-planned executor on the same greedy run (hits, misses and waves of every
layer, prefill and decode: the device decide makes the residency's decisions), the unpaged
model (logits torch.equal, ``tools.check``), and for host syncs the instrument of
``tests/paging/test_syncs.py`` (a read-back counted where it happens, not by the runtime) against the
runtime's own ``host_syncs``. On CPU the Triton kernels run under ``TRITON_INTERPRET=1``
(conftest sets it); the torch reference kernels (``device_kernels="torch"``) where the
interpreter is slow.

Legend: E experts, k top_k, K slots, T tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from support.tiny import PAD_ID, TOP_K, greedy_logits
from pagedexperts import load_model
from pagedexperts.cli import main
from pagedexperts.loading import config as loading_config
from pagedexperts.loading.config import ConfigError, PagingConfig, check_config
from pagedexperts.paging.device_executor import DeviceExecutor
from pagedexperts.paging.host_executor import HostExecutor
from pagedexperts.paging.kernels import HAVE_TRITON
from support.reads import HostReads, _run  # noqa: E402

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (pip install 'pagedexperts[gpu]')")
PER_LAYER = ("hits", "misses", "waves", "multi_wave_steps", "steps", "tokens", "bytes_paged")


def per_layer(model) -> dict:
    return {i: {f: getattr(s, f) for f in PER_LAYER} for i, s in model.pagedexperts.stats().layers.items()}


def batch(rows: int, seed: int = 0):
    ids = torch.randint(2, 100, (rows, 7), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if rows > 1:
        ids[1, :3], mask[1, :3] = PAD_ID, 0  # left padding: padding rows counted as on the host
    return ids, mask


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("rows", [1, 4], ids=["batch1", "batch4-multiwave"])
@pytest.mark.default_threads
def test_device_and_host_count_the_same_per_layer(tiny_moe_dir, policy, rows):
    """One greedy run each way: identical hits, misses and waves per layer (prefill and every
    decode step), identical logits. Batch 4 x k = 8 routed entries > K = 4: multi-wave."""
    ids, mask = batch(rows)
    runs = {}
    for decide in ("host", "device"):
        model, _ = load_model(tiny_moe_dir, num_resident=4, policy=policy, decide=decide, device_kernels="torch")
        runner = next(iter(model.pagedexperts.runners.values()))
        assert isinstance(runner, DeviceExecutor if decide == "device" else HostExecutor)
        assert model.pagedexperts.decide == decide
        runs[decide] = (greedy_logits(model, ids, mask), per_layer(model))
    (out_h, count_h), (out_d, count_d) = runs["host"], runs["device"]
    assert count_d == count_h
    assert torch.equal(out_d, out_h)
    total = lambda f: sum(c[f] for c in count_h.values())  # noqa: E731
    assert total("misses") > 0
    layers = len(count_h)  # prefill: one layer-step per layer (7 x k entries > K: multi-wave)
    if rows * TOP_K > 4:
        assert total("multi_wave_steps") > layers, "no multi-wave decode step"
    else:
        assert total("multi_wave_steps") <= layers, "a batch-1 decode step (k <= K) was multi-wave"


@needs_triton
@pytest.mark.default_threads
def test_generate_under_triton_kernels_equals_host(tiny_moe_dir):
    """The Triton kernels (interpreted on CPU) through the whole model: same counts and logits."""
    ids, mask = batch(2, seed=3)
    host, _ = load_model(tiny_moe_dir, num_resident=TOP_K, policy="lru", decide="host")
    dev, _ = load_model(tiny_moe_dir, num_resident=TOP_K, policy="lru", decide="device")
    assert dev.pagedexperts.runners[0].residency.backend == "triton"
    out_h, out_d = greedy_logits(host, ids, mask, steps=3), greedy_logits(dev, ids, mask, steps=3)
    assert per_layer(dev) == per_layer(host)
    assert torch.equal(out_d, out_h)


def test_host_syncs_are_the_runtime_s_own_count(tiny_moe_dir, device_reads):
    """Host-planned: the runtime's host_syncs = the read-backs the instrument counted where they
    happen (``transfer.read_back``) = layer-steps; device-planned: 0, and the instrument sees
    no read-back and no syncing call from pagedexperts code on a would-be device tensor."""
    ids, mask = batch(3)
    host, _ = load_model(tiny_moe_dir, num_resident=4, decide="host")
    _run(host, device_reads, ids, mask)
    total = host.pagedexperts.stats().as_dict()
    assert total["host_syncs"] == device_reads.read_backs == total["layer_steps"] > 0
    assert total["host_syncs_per_token"] == total["host_syncs"] / total["tokens"]
    dev, _ = load_model(tiny_moe_dir, num_resident=4, decide="device", device_kernels="torch")
    seen = device_reads.read_backs
    # On a CPU every tensor is a host tensor, so a device-to-device copy_ and a read-back look
    # alike to DeviceReads; HostReads records the calls that sync on a GPU (.item, .tolist,
    # .cpu, nonzero, ...) made from pagedexperts.paging code, whatever tensor they touch.
    reads = HostReads()
    with reads, torch.no_grad():
        dev.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=PAD_ID)
    assert reads.calls == [] and device_reads.read_backs == seen
    total = dev.pagedexperts.stats().as_dict()
    assert total["layer_steps"] > 0 and total["host_syncs"] == 0 and total["host_syncs_per_token"] == 0.0


@needs_triton
@pytest.mark.slow
def test_stats_json_of_a_decode_run_carries_host_syncs_per_token(tmp_path, capsys):
    """``generate --stats-json`` on the bundled model: host-planned one read-back per MoE layer
    per decode step (6 layers, batch 1: 6 per token), device-planned 0 in decode."""
    got = {}
    for decide in ("host", "device"):
        out = tmp_path / f"{decide}.json"
        rc = main(["generate", "--prompt", "ROMEO:", "--max-new-tokens", "4", "--num-resident", "16", "--policy",
                   "lru", "--decide", decide, "--quiet", "--stats-json", str(out)])
        assert rc == 0
        got[decide] = json.loads(out.read_text())
    layers = len(got["host"]["paging"]["layers"])
    assert got["host"]["decide"] == "host" and got["device"]["decide"] == "device"
    assert got["host"]["decode"]["host_syncs_per_token"] == layers  # one per layer-step, T = 1
    assert got["device"]["decode"]["host_syncs_per_token"] == 0.0
    assert got["device"]["paging"]["host_syncs"] == 0
    for key in ("hits", "misses", "waves"):
        assert got["device"]["decode"][key] == got["host"]["decode"][key], key
    assert got["device"]["text"] == got["host"]["text"]


@needs_triton
@pytest.mark.slow
def test_check_passes_device_planned(capsys):
    """``TRITON_INTERPRET=1 pagedexperts check --decide device`` on the bundled model (one short
    prompt: the interpreter is slow), K = 4 and 8."""
    rc = main(["check", "--decide", "device", "--check-resident", "4,8", "--prompt", "ROMEO:", "--max-new-tokens",
               "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("(device-planned)") == 2 and "PASS (bit-identical)" in out


def test_auto_is_host_on_cpu(tiny_moe_dir):
    model, _ = load_model(tiny_moe_dir, num_resident=4)
    assert model.pagedexperts.decide == "host"
    assert isinstance(model.pagedexperts.runners[0], HostExecutor)


def test_device_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(loading_config, "INTERPRETED", False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1") as err:
        check_config(PagingConfig(decide="device"))
    assert "--decide" in str(err.value)
    check_config(PagingConfig(decide="auto"))  # auto on CPU: host, no problem
    check_config(PagingConfig(decide="host"))


def test_device_without_triton_names_the_extra(monkeypatch):
    monkeypatch.setattr(loading_config, "HAVE_TRITON", False)
    with pytest.raises(ConfigError, match=r"--decide device needs triton, from the 'gpu' extra: pip install -e '\.\[gpu\]'"):
        check_config(PagingConfig(decide="device"))
    with pytest.raises(ConfigError, match=r"--experts-implementation fused needs triton, from the 'gpu' extra"):
        check_config(PagingConfig(experts_implementation="fused"))
    check_config(PagingConfig(decide="device", device_kernels="torch"))  # the references need no triton


def test_every_option_the_device_cannot_serve_is_named_at_once():
    cfg = PagingConfig(decide="device", policy="flru", prefetch=True, experts_implementation="eager",
                       device_kernels="torch")
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    problems = err.value.problems
    assert len(problems) == 3, problems
    for flag in ("--policy", "--prefetch", "--experts-implementation"):
        assert any(flag in p and "--decide" in p for p in problems), flag
    with pytest.raises(ConfigError, match="--decide"):
        check_config(PagingConfig(decide="sometimes"))


def test_cli_refusals_name_both_flags(tiny_moe_dir, capsys):
    rc = main(["generate", "--model-path", str(tiny_moe_dir), "--prompt", "x", "--decide", "device", "--policy",
               "adaptive"])
    err = capsys.readouterr().err
    assert rc == 2 and "--decide device" in err and "--policy" in err
    rc = main(["generate", "--model-path", str(tiny_moe_dir), "--prompt", "x", "--decide", "device",
               "--record-trace", "/tmp/x.npz"])
    err = capsys.readouterr().err
    assert rc == 2 and "--record-trace" in err and "--decide" in err


def test_disk_tier_is_refused_before_any_weight_is_read(tiny_moe_dir):
    """A budget of 2 host rows per layer: the disk tier."""
    from support.tiny import host_budget_gb

    gb = host_budget_gb(tiny_moe_dir, 2, num_resident=4)
    with pytest.raises(ValueError, match="--host-memory-gb") as err:
        load_model(tiny_moe_dir, num_resident=4, decide="device", host_memory_gb=gb, device_kernels="torch")
    assert "--decide" in str(err.value) and "disk tier" in str(err.value)
    model, _ = load_model(tiny_moe_dir, num_resident=4, decide="auto", host_memory_gb=gb)
    assert model.pagedexperts.decide == "host"


@pytest.mark.parametrize("command", ["generate", "check", "serve", "bench"])
def test_every_model_command_takes_decide(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--decide {auto,host,device}" in capsys.readouterr().out


def test_repage_keeps_the_decide(tiny_moe_dir):
    """``repage`` (bench's mode and K switch) re-attaches device-planned executors for paged
    rows and baselines for the others, over the same stores; the K=8 step still equals host."""
    from pagedexperts.loading.runners import repage
    from pagedexperts.paging.baselines import ResidentRunner

    model, _ = load_model(tiny_moe_dir, num_resident=4, decide="device", device_kernels="torch")
    repage(model, mode="resident")
    assert all(isinstance(r, ResidentRunner) for r in model.pagedexperts.runners.values())
    repage(model, mode="paged", num_resident=8)
    runners = list(model.pagedexperts.runners.values())
    assert all(isinstance(r, DeviceExecutor) and r.num_slots == 8 for r in runners)
    host, _ = load_model(tiny_moe_dir, num_resident=8, decide="host")
    ids, mask = batch(2, seed=5)
    out_d, out_h = greedy_logits(model, ids, mask, steps=3), greedy_logits(host, ids, mask, steps=3)
    assert per_layer(model) == per_layer(host)
    assert torch.equal(out_d, out_h)


# (slot format, checkpoint quantized, device) -> what --decide auto resolves to; a hand table
# (review item 3: auto + --slot-format dense + a quantized checkpoint resolved to "device",
# whose pager then refused the dense slots at load)
AUTO_DECIDE = {
    (fmt, quantized, device): "host" if device == "cpu" or (quantized and fmt == "dense") else "device"
    for fmt in ("auto", "packed", "dense") for quantized in (False, True) for device in ("cpu", "cuda")
}


@pytest.mark.parametrize("slot_format,quantized,device", sorted(AUTO_DECIDE))
def test_resolve_decide_for_every_slot_format_checkpoint_and_device(monkeypatch, caplog, slot_format, quantized,
                                                                     device):
    monkeypatch.setattr(loading_config, "HAVE_TRITON", True)  # auto on CUDA needs triton installed
    cfg = PagingConfig(device=device, slot_format=slot_format)
    with caplog.at_level("WARNING", logger=loading_config.__name__):
        got = loading_config.resolve_decide(cfg, disk_tier=False, pinned=True, quantized=quantized)
    assert got == AUTO_DECIDE[slot_format, quantized, device]
    warned = [r.getMessage() for r in caplog.records]
    if device == "cuda" and got == "host":
        assert len(warned) == 1 and "--slot-format dense" in warned[0]
    else:
        assert warned == []
    for decide in ("host", "device"):  # an explicit choice is the user's (checked elsewhere)
        cfg = PagingConfig(device=device, slot_format=slot_format, decide=decide)
        assert loading_config.resolve_decide(cfg, disk_tier=False, pinned=True, quantized=quantized) == decide


def test_resolve_decide_on_cuda_names_every_reason(monkeypatch, caplog):
    monkeypatch.setattr(loading_config, "HAVE_TRITON", True)
    cfg = PagingConfig(device="cuda", slot_format="dense", policy="flru")
    with caplog.at_level("WARNING", logger=loading_config.__name__):
        got = loading_config.resolve_decide(cfg, disk_tier=True, pinned=False, quantized=True)
    assert got == "host"
    (message,) = [r.getMessage() for r in caplog.records]
    for reason in ("--policy", "disk tier", "not page-locked", "--slot-format dense"):
        assert reason in message, reason
    assert loading_config.resolve_decide(PagingConfig(device="cuda", mode="resident"), disk_tier=False,
                                         pinned=True, quantized=True) == "host"  # a baseline plans nothing
