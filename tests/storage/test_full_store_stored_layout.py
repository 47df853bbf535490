"""A full packed host store is read from a valid stored kernel layout at load, never converted.

The store (every expert in host memory, no disk tier) of packed experts holds them in torch's CPU
kernel layouts. With a valid stored layout (the checkpoint's own kernel-layout/ written by
``pagedexperts quantize``, or the cache) the load reads it into the store; without one it
converts each expert and writes the cache for the next start. Oracles: the rows converted at load
(``--no-stored-layout``) and their logits with all E resident, torch.equal, batch 2, float32 and
bfloat16, default threads; "nothing converted": torch's int4 pack is never called during the load
(without the start-up independence check, which converts its sampled experts from the checkpoint).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from pagedexperts.commands.common import print_host_memory
from pagedexperts.loading import stored_layout
from pagedexperts.loading.loader import load_model
from pagedexperts.storage.kernel_layout_file import StoredLayoutError
from pagedexperts.storage.safetensors_files import checkpoint_files
from support.paths import DATA
from support.tiny import copy_dir, count_int4_packs, greedy_logits

INT4 = DATA / "autoround/qwen3_moe-auto_round-experts"


def _ids() -> torch.Tensor:
    return torch.randint(2, 100, (2, 6), generator=torch.Generator().manual_seed(3))


def _load(path: Path, cache: Path, *, num_resident: int = 2, dtype: str = "float32", **options):
    where = {"stored_layout_dir": str(cache)} if options.get("stored_layout", True) else {}  # both: refused
    model, _ = load_model(path, num_resident=num_resident, dtype=dtype, experts_implementation="packed",
                          **where, **options)
    assert not model.pagedexperts.host_memory.disk_tier
    return model.eval()



@pytest.mark.default_threads
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_valid_stored_layout_is_read_into_the_store_not_converted(tmp_path, monkeypatch, dtype):
    cache = tmp_path / "cache"
    converted = _load(INT4, cache, dtype=dtype, stored_layout=False)  # the oracle's rows: converted at load
    resident = _load(INT4, cache, num_resident=8, dtype=dtype, stored_layout=False)
    want = greedy_logits(resident, _ids(), steps=4)
    first = _load(INT4, cache, dtype=dtype)  # none stored yet: converted, and the cache written
    written = first.pagedexperts.resolved
    assert written.reasons["stored_layout"] == "converted at load; written now to the cache (--stored-layout-dir)"
    assert Path(written.stored_layout).parent.parent == cache
    assert torch.equal(greedy_logits(first, _ids(), steps=4), want)

    packs = count_int4_packs(monkeypatch)
    again = _load(INT4, cache, dtype=dtype, check_independence=False)  # the check converts its samples itself
    assert packs == []  # nothing converted at load
    rt = again.pagedexperts
    assert (rt.resolved.stored_layout, rt.resolved.reasons["stored_layout"]) == (
        written.stored_layout, "read at load from the cache (--stored-layout-dir)")
    for name, store in rt.stores.items():
        assert store.rows_from == written.stored_layout
        want_rows = converted.pagedexperts.stores[name].tensors
        assert store.tensors.keys() == want_rows.keys()
        assert all(torch.equal(store.tensors[t], want_rows[t]) for t in want_rows), name
    got = greedy_logits(again, _ids(), steps=4)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    assert rt.stats().fallbacks == []
    stored_resident = _load(INT4, cache, num_resident=8, dtype=dtype)
    assert stored_resident.pagedexperts.resolved.stored_layout == written.stored_layout
    assert torch.equal(greedy_logits(stored_resident, _ids(), steps=4), want)


def test_the_checkpoints_own_kernel_layout_is_read_first(tmp_path, monkeypatch, capsys):
    """What ``pagedexperts quantize`` writes (the checkpoint's kernel-layout/) is read; no layout is
    written to the cache; the start-up line says which layout the store was read from."""
    path = copy_dir(INT4, tmp_path / "model")
    model, _ = load_model(path, dtype="float32", experts_implementation="packed", stored_layout=False,
                          check_independence=False)
    own = stored_layout.write_checkpoint_layout(model, path, [*checkpoint_files(path), path / "config.json"])
    packs = count_int4_packs(monkeypatch)
    again = _load(path, tmp_path / "cache", check_independence=False)
    assert packs == []
    resolved = again.pagedexperts.resolved
    assert resolved.stored_layout == str(own.path)
    why = "read at load from the checkpoint's own kernel-layout/ (pagedexperts quantize)"
    assert resolved.reasons["stored_layout"] == why and resolved.as_dict()["reasons"]["stored_layout"] == why
    assert not list((tmp_path / "cache").rglob("*.pxkl"))  # no layout written there (the digest memo may be)
    print_host_memory(again)
    assert f"host store: stored kernel layout {own.path} ({why})" in capsys.readouterr().err


@pytest.mark.default_threads
def test_a_truncated_stored_layout_is_not_read_but_rewritten(tmp_path, caplog):
    cache = tmp_path / "cache"
    stored = Path(_load(INT4, cache).pagedexperts.stored_layout)
    os.truncate(stored, stored.stat().st_size - 4096)
    with caplog.at_level(logging.WARNING, logger="pagedexperts"):
        model = _load(INT4, cache)
    assert any("truncated" in r.getMessage() and "rebuilding it" in r.getMessage() for r in caplog.records), caplog.text
    assert model.pagedexperts.resolved.reasons["stored_layout"].startswith("converted at load; written now")
    assert all(store.rows_from is None for store in model.pagedexperts.stores.values())
    want = greedy_logits(_load(INT4, cache, num_resident=8, stored_layout=False), _ids(), steps=3)
    assert torch.equal(greedy_logits(model, _ids(), steps=3), want)
    assert torch.equal(greedy_logits(_load(INT4, cache), _ids(), steps=3), want)  # the rewritten one, read


def test_a_cache_that_cannot_be_written_is_a_warning_and_a_stats_fallback(tmp_path, monkeypatch, caplog):
    def full_disk(path, *args, **kwargs):
        raise StoredLayoutError(28, f"writing the stored kernel layout {path} failed: No space left on device")

    monkeypatch.setattr(stored_layout, "write_stored_layout", full_disk)
    with caplog.at_level(logging.WARNING, logger="pagedexperts"):
        model = _load(INT4, tmp_path / "cache")
    rt = model.pagedexperts
    assert rt.stored_layout is None and rt.resolved.reasons["stored_layout"].startswith("not written")
    assert any("next start converts each expert at load again" in f for f in rt.stats().fallbacks)
    assert any(r.levelno == logging.WARNING and "No space left" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("flag", ["--no-stored-layout", "--stored-layout-dir"])
def test_a_stored_layout_flag_without_packed_experts_warns_that_it_has_no_effect(tmp_path, caplog, flag):
    options = {"stored_layout": False} if flag == "--no-stored-layout" else {"stored_layout_dir": str(tmp_path)}
    with caplog.at_level(logging.WARNING, logger="pagedexperts"):
        model, _ = load_model(INT4, num_resident=2, experts_implementation="grouped_mm", **options)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "no effect" in r.getMessage()]
    assert warned == [f"{flag} has no effect: a stored kernel layout serves only experts run packed on the CPU "
                      "(--experts-implementation packed), and here the experts run grouped_mm "
                      "(--experts-implementation grouped_mm)"], caplog.text
    assert "stored_layout" not in model.pagedexperts.resolved.reasons
    assert list(tmp_path.iterdir()) == []
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedexperts"):
        load_model(INT4, num_resident=2, experts_implementation="packed", **options)  # packed: it has its effect
    assert not [r for r in caplog.records if "no effect" in r.getMessage()], caplog.text


def test_a_stored_layout_holding_nan_is_refused_naming_the_file(tmp_path):
    """The rows read from a stored layout are checked for NaN as the fill checks the checkpoint's
    (a layout is keyed on its source's stats, not on its own bytes)."""
    from pagedexperts.loading.fill import NonFiniteWeights
    from pagedexperts.storage.kernel_layout_file import _read_key

    cache = tmp_path / "cache"
    stored = Path(_load(INT4, cache).pagedexperts.resolved.stored_layout)
    key, data_start = _read_key(stored)
    name, scales = next((s.name, s) for s in key.tensor_specs if s.dtype.is_floating_point)
    at = data_start + sum(s.row_bytes for s in key.tensor_specs[: key.tensor_specs.index(scales)])
    with open(stored, "r+b") as f:  # expert 0 of layer 0: its first scale NaN
        f.seek(at)
        f.write(torch.tensor([float("nan")], dtype=scales.dtype).view(torch.uint8).numpy().tobytes())
    with pytest.raises(NonFiniteWeights, match=str(stored)):
        _load(INT4, cache)


def test_no_read_ahead_without_the_disk_tier_warns_that_it_has_no_effect(caplog):
    with caplog.at_level(logging.WARNING, logger="pagedexperts"):
        load_model(INT4, num_resident=2, read_ahead=False)
    warned = [r.getMessage() for r in caplog.records if "--no-read-ahead has no effect" in r.getMessage()]
    assert len(warned) == 1 and "every expert is in host memory (the available memory)" in warned[0], caplog.text
