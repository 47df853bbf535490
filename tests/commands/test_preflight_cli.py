"""``pagedexperts preflight`` through ``cli.main``: printed digits, JSON, model dirs, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from pagedexperts.cli import main

QWEN3 = ["preflight", "--layers", "48", "--experts", "128", "--top-k", "8", "--kv-bytes-per-token", "98304"]


def _run(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(
    "expert_mb,k,link,tok_s,expected",
    [
        ("2.43", "92", "50", "205.6", ["117 MB (~1,187 KV tokens", "batch cap             11 ", "uniform miss rate     28%",
                                       "max miss allowed      26%", "inconclusive"]),
        ("4.72", "40", "50", "87.7", ["227 MB (~2,305 KV tokens", "batch cap             5 ", "uniform miss rate     69%",
                                      "max miss allowed      31%", "reuse implied"]),
        ("2.43", "26", "15.75", "32.6", ["batch cap             3 ", "uniform miss rate     80%",
                                         "max miss allowed      52%", "reuse implied"]),
    ],
)
def test_published_analysis_prints_exact_digits(capsys, expert_mb, k, link, tok_s, expected):
    rc, out, _ = _run(capsys, QWEN3 + ["--expert-mb", expert_mb, "--num-resident", k, "--link-gbps", link,
                                       "--tok-s", tok_s])
    assert rc == 0
    for text in expected:
        assert text in out, f"{text!r} not in:\n{out}"


def test_a_speed_the_link_allows_at_any_miss_rate_says_so(capsys):
    """`--tok-s 15 --link-gbps 50`: 100% misses need 48 x 8 x 2.43 MB x 15/s = 14.0 GB/s, under the
    link (50 / 14.0 = 3.57x); it printed "max miss allowed above 100% (3.57x ...)" and a verdict."""
    rc, out, _ = _run(capsys, QWEN3 + ["--expert-mb", "2.43", "--num-resident", "92", "--link-gbps", "50",
                                       "--tok-s", "15"])
    line = next(ln for ln in out.splitlines() if ln.startswith("max miss allowed"))
    assert rc == 0 and line.startswith("max miss allowed      any: at 15 tok/s even 100% misses page only 14.0 GB/s")
    assert "(3.57x)" in line and "above 100%" not in out and "inconclusive" not in line


def test_json_output(capsys):
    rc, out, _ = _run(capsys, QWEN3 + ["--expert-mb", "2.43", "--num-resident", "92", "--link-gbps", "50",
                                       "--tok-s", "205.6", "--json"])
    r = json.loads(out)
    assert rc == 0
    assert r["slot_bytes"] == 116_640_000 and r["single_wave_batch_cap"] == 11
    assert r["verdict"] == "inconclusive"
    assert r["prefill_page_in_bytes"] == 36 * 116_640_000


def test_auto_k_from_device_memory(capsys):
    rc, out, _ = _run(capsys, QWEN3 + ["--expert-mb", "2.43", "--device-memory-gb", "16", "--non-expert-gb", "3",
                                       "--runtime-reserve-gb", "1", "--context-length", "4096", "--json"])
    r = json.loads(out)
    # (16e9 - 3e9 - 4096 x 98304 - 1e9) / 116.64e6 = 99.4 -> 99
    assert rc == 0 and r["num_resident"] == 99 and r["num_resident_source"] == "auto" and r["fits"]


def test_fp8_kv_halves_explicit_kv(capsys):
    _, out, _ = _run(capsys, QWEN3 + ["--expert-mb", "2.43", "--num-resident", "92", "--kv-dtype", "fp8", "--json"])
    assert json.loads(out)["kv_bytes_per_token"] == 49_152


def test_model_path(tmp_path, capsys):
    cfg = dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, num_attention_heads=2,
               num_key_value_heads=1, hidden_size=8, torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t = {f"model.layers.{ly}.mlp.experts.{j}.w": np.zeros((5, 8), np.float16) for ly in range(2) for j in range(4)}
    t["lm_head.weight"] = np.zeros((3, 8), np.float32)
    save_file(t, str(tmp_path / "model.safetensors"))
    rc, out, _ = _run(capsys, ["preflight", "--model-path", str(tmp_path), "--num-resident", "2", "--json"])
    r = json.loads(out)
    assert rc == 0
    assert (r["expert_bytes"], r["moe_layers"], r["num_experts"], r["top_k"]) == (80, 2, 4, 2)
    # load_model runs the config's dtype (bfloat16): the fp32 lm_head [3, 8] takes 2 bytes a value
    assert r["dtype"] == "bfloat16" and r["non_expert_bytes"] == 48 and r["kv_bytes_per_token"] == 2 * 2 * 1 * 4 * 2
    rc, out, _ = _run(capsys, ["preflight", "--model-path", str(tmp_path), "--num-resident", "2", "--dtype", "float32",
                               "--json"])
    r = json.loads(out)
    assert (r["expert_bytes"], r["non_expert_bytes"], r["kv_bytes_per_token"]) == (160, 96, 2 * 2 * 1 * 4 * 4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_k_is_what_the_loader_accepts_and_allocates(tiny_moe_dir, dtype, capsys):
    """preflight --dtype on a float32 checkpoint: slot, non-expert and KV bytes equal what
    load_model(dtype=...) allocates, so the auto K fits the budget and K + 1 would not."""
    from pagedexperts.loading.loader import load_model

    base = ["preflight", "--model-path", str(tiny_moe_dir), "--dtype", dtype, "--json", "--runtime-reserve-gb", "0",
            "--context-length", "64"]
    sized = json.loads(_run(capsys, base + ["--num-resident", "2"])[1])
    budget = sized["non_expert_bytes"] + 64 * sized["kv_bytes_per_token"] + 5.5 * sized["slot_bytes"]
    r = json.loads(_run(capsys, base + ["--device-memory-gb", str(budget / 1e9)])[1])
    assert r["num_resident"] == 5 and r["num_resident_source"] == "auto" and r["fits"]
    model, _ = load_model(tiny_moe_dir, num_resident=r["num_resident"], dtype=dtype)
    pagers = model.pagedexperts.runners.values()
    assert sum(t.nbytes for p in pagers for t in p.slots.values()) == r["device_slot_bytes"]
    assert sum(p.nbytes for p in model.parameters()) == r["non_expert_bytes"]
    ids = torch.arange(2, 66).unsqueeze(0)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert kv == 64 * r["kv_bytes_per_token"]
    assert r["memory_needed_bytes"] + r["slot_bytes"] > budget, "K + 1 would not fit: auto K is the largest"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--expert-mb", "2.43", "--num-resident", "200"], "--num-resident 200 must be in [top_k=8, E=128]"),
        (["--expert-mb", "2.43", "--num-resident", "0"], "--num-resident 0 must be in [top_k=8, E=128]"),
        (["--expert-mb", "2.43", "--num-resident", "7"], "--num-resident 7 must be in [top_k=8, E=128]"),
        (["--expert-mb", "-1", "--num-resident", "8"], "--expert-mb -1.0 must be > 0"),
        (["--expert-mb", "2.43", "--num-resident", "8", "--link-gbps", "0"], "--link-gbps 0.0 must be > 0"),
        # the disk tier's flags without the tier were ignored (an out-of-range --miss-rate 2 too)
        (["--expert-mb", "2.43", "--miss-rate", "2"], "--miss-rate sizes the disk tier, which --host-memory-gb G"),
        (["--expert-mb", "2.43", "--disk-gbps", "3", "--host-miss-rate", "0.5"],
         "--disk-gbps, --host-miss-rate size the disk tier"),
    ],
)
def test_bad_input_names_value_limit_and_flag(capsys, extra, message):
    rc, _, err = _run(capsys, QWEN3 + extra)
    assert rc == 2 and message in err


def test_missing_model_flags_and_dir_without_safetensors(tmp_path, capsys):
    rc, _, err = _run(capsys, ["preflight", "--layers", "48", "--num-resident", "8"])
    assert rc == 2 and "--experts" in err and "--model-path" in err
    (tmp_path / "config.json").write_text(json.dumps(dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2)))
    rc, _, err = _run(capsys, ["preflight", "--model-path", str(tmp_path), "--num-resident", "2"])
    assert rc == 2 and "no *.safetensors" in err


# ---- defaults, units, verdicts, fit (issue 33 item 9) ----------------------------------------


def _bundled_shape() -> tuple[int, int, int, int, int]:
    """(L, E, top_k, H, I) of the bundled model, from its config.json."""
    from pagedexperts.loading.bundled import bundled_model_path

    c = json.loads((bundled_model_path() / "config.json").read_text())
    return (c["num_hidden_layers"], c["num_local_experts"], c["num_experts_per_tok"], c["hidden_size"],
            c["moe_intermediate_size"])


def test_preflight_alone_sizes_the_bundled_model_at_the_default_k(capsys):
    layers, e, k, h, i = _bundled_shape()
    rc, out, _ = _run(capsys, ["preflight", "--json"])
    r = json.loads(out)
    assert rc == 0 and r["model"] == "tiny-qwen3-moe"
    assert (r["num_resident"], r["num_resident_source"]) == (max(k, e // 4), "default")  # generate's default K
    assert r["expert_bytes"] == 3 * h * i * 4  # gate, up, down in float32
    assert json.loads(_run(capsys, ["preflight", "--json", "--model-path", "bundled"])[1]) == r
    # explicit numbers without K: the same default rule, E/4 at least top_k
    r = json.loads(_run(capsys, QWEN3 + ["--expert-mb", "2.43", "--json"])[1])
    assert (r["num_resident"], r["num_resident_source"]) == (128 // 4, "default")


@pytest.mark.slow
def test_preflight_takes_the_bundled_quantized_variants(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDEXPERTS_CACHE", str(tmp_path))
    layers, e, k, h, i = _bundled_shape()
    r = json.loads(_run(capsys, ["preflight", "--json", "--model-path", "bundled:fp8-block"])[1])
    # one FP8 byte per weight + a float32 scale per 128 x 128 block (here one block per matrix)
    assert r["model"].startswith("tiny-qwen3-moe-fp8-block") and r["expert_bytes"] == 3 * h * i + 3 * 4


@pytest.mark.parametrize("num_bytes,shown", [
    (0, "0 B"), (512, "512 B"), (1000, "1.00 kB"), (98_304, "98.3 kB"), (589_824, "590 kB"),
    (9_437_184, "9.44 MB"), (116_640_000, "117 MB"), (1_030_000_000, "1.03 GB"), (2.5e12, "2.50 TB"),
])
def test_format_bytes_scales_the_unit_down(num_bytes, shown):
    from pagedexperts.analysis.sizing import format_bytes

    assert format_bytes(num_bytes) == shown


def test_bundled_report_prints_small_sizes_in_small_units(capsys):
    layers, e, k, h, i = _bundled_shape()
    rc, out, _ = _run(capsys, ["preflight", "--num-resident", "16"])
    expert = 3 * h * i * 4  # 98,304 B
    assert rc == 0 and f"expert                {expert / 1e3:.1f} kB" in out
    assert f"slot (expert x L)     {expert * layers / 1e3:.0f} kB" in out
    assert f"host store (slot x E) {expert * layers * e / 1e6:.1f} MB" in out
    assert f"16 of {e} (given), {16 * expert * layers / 1e6:.2f} MB on the device" in out
    assert " 0 MB" not in out and "0.00 GB" not in out and "0.00 MB" not in out


def test_each_verdict_says_what_it_means(capsys):
    out = _run(capsys, QWEN3 + ["--expert-mb", "2.43", "--num-resident", "92", "--link-gbps", "50", "--tok-s", "205.6"])[1]
    assert ("inconclusive (at that speed the link could page a miss rate of 80% of the uniform 28% or more, "
            "so the speed does not show whether the router reuses experts") in out
    out = _run(capsys, QWEN3 + ["--expert-mb", "4.72", "--num-resident", "40", "--link-gbps", "50", "--tok-s", "87.7"])[1]
    assert "reuse implied (at that speed the link pages a miss rate below 80% of the uniform 69%" in out


def test_does_not_fit_exits_1_names_the_parts_and_a_change_that_fits(capsys):
    layers, e, k, h, i = _bundled_shape()
    base = ["preflight", "--num-resident", "16", "--device-memory-gb", "0.5"]
    r = json.loads(_run(capsys, base + ["--json"])[1])
    needed = r["non_expert_bytes"] + 4096 * r["kv_bytes_per_token"] + 1e9 + 16 * r["slot_bytes"]
    assert r["memory_needed_bytes"] == needed and r["fits"] is False
    reserve = int((1 - (needed - 0.5e9) / 1e9) * 100) / 100  # the 1 GB runtime reserve is what does not fit
    assert r["fit_changes"] == {"--runtime-reserve-gb": reserve}
    rc, out, _ = _run(capsys, base)
    assert rc == 1
    assert f"DOES NOT FIT, over by {(needed - 0.5e9) / 1e6:.0f} MB" in out
    assert "parts, largest first: runtime reserve 1 GB (--runtime-reserve-gb), KV reserve" in out
    assert f"fits with any one of: --runtime-reserve-gb {reserve:g}" in out
    rc, out, _ = _run(capsys, base + ["--runtime-reserve-gb", f"{reserve:g}"])
    assert rc == 0 and "(fits)" in out
    assert "Exit status: 0, or 1 when --device-memory-gb is given and the run DOES NOT FIT" in _help(capsys)


def _help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["preflight", "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_does_not_fit_suggests_the_largest_k_and_context_that_fit(capsys):
    base = QWEN3 + ["--expert-mb", "2.43", "--num-resident", "92", "--non-expert-gb", "3", "--device-memory-gb",
                    "15.2", "--context-length", "16384"]
    slot, kv = 48 * 2.43e6, 98304
    free_for_slots = 15.2e9 - 3e9 - 16384 * kv - 1e9
    free_for_kv = 15.2e9 - 3e9 - 1e9 - 92 * slot
    expected = {"--num-resident": int(free_for_slots // slot), "--context-length": int(free_for_kv // kv)}
    r = json.loads(_run(capsys, base + ["--json"])[1])
    assert r["fit_changes"] == expected == {"--num-resident": 82, "--context-length": 4772}
    for flag, value in expected.items():  # each fits alone, and one step further would not
        argv = [a for a in base]
        argv[argv.index(flag) + 1] = str(value)
        assert _run(capsys, argv)[0] == 0
        argv[argv.index(flag) + 1] = str(value + 1)
        assert _run(capsys, argv)[0] == 1


# ---- linkbench ----------------------------------------------------------------------------


def test_linkbench_without_accelerator_says_so_and_exits_0(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, out, _ = _run(capsys, ["linkbench", "--sizes-mb", "1"])
    assert rc == 0 and "no accelerator" in out and "GB/s" not in out
    rc, out, _ = _run(capsys, ["linkbench", "--json"])
    assert rc == 0 and json.loads(out) == {"accelerator": None, "results": []}


def test_linkbench_bad_repeats(capsys):
    rc, _, err = _run(capsys, ["linkbench", "--repeats", "0"])
    assert rc == 2 and "--repeats 0 must be >= 1" in err


@pytest.mark.parametrize("sizes,message", [
    ("1,,2", "--sizes-mb '1,,2' has an empty item: want comma-separated numbers > 0, e.g. 1,4,16"),  # was skipped
    ("1,", "--sizes-mb '1,' has an empty item"), ("", "--sizes-mb '' is empty"),
    ("1,x", "--sizes-mb '1,x': want comma-separated numbers > 0"),
    ("1,0", "--sizes-mb '1,0': ['0'] not a finite number > 0"), ("nan", "['nan'] not a finite number > 0"),
    ("4,4", "--sizes-mb names [4.0] more than once"),
])
def test_linkbench_refuses_a_bad_size_list_by_name(capsys, monkeypatch, sizes, message):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # refused before anything is measured
    rc, _, err = _run(capsys, ["linkbench", "--sizes-mb", sizes])
    assert rc == 2 and message in err, err


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda(), reason="needs an NVIDIA GPU")
class TestLinkbenchCuda:
    def test_measures_pinned_and_pageable(self, capsys):
        rc, out, _ = _run(capsys, ["linkbench", "--sizes-mb", "1,8", "--repeats", "3", "--json"])
        r = json.loads(out)
        assert rc == 0 and r["accelerator"]
        assert {(x["label"], x["memory"]) for x in r["results"]} == {
            ("1 MB", "pinned"), ("1 MB", "pageable"), ("8 MB", "pinned"), ("8 MB", "pageable")}
        assert all(x["gbps"] > 0 for x in r["results"])


@pytest.mark.parametrize("fmt", ["fp8-block", "w4a16"])
def test_quantized_dense_slots_and_weights_are_sized_at_the_run_dtype(tiny_moe_dir, tmp_path, fmt, capsys):
    """A float32 checkpoint quantized, run as bfloat16 with dense slots: preflight's dense slot
    and non-expert bytes are what load_model allocates (non-expert weights at the run dtype;
    dequantized experts too for fp8-block, in the float32 scales' dtype for w4a16, as
    transformers keeps them)."""
    from pagedexperts.loading.loader import load_model
    from pagedexperts.tools.quantize import QuantizeOptions, quantize_checkpoint

    quantize_checkpoint(model_path=tiny_moe_dir, output=tmp_path,
                        options=QuantizeOptions(fmt, group_size=16, block=(16, 16)))
    r = json.loads(_run(capsys, ["preflight", "--model-path", str(tmp_path), "--dtype", "bfloat16", "--json",
                                 "--num-resident", "4", "--slot-format", "dense"])[1])
    model, _ = load_model(tmp_path, num_resident=4, dtype="bfloat16", slot_format="dense")
    pagers = model.pagedexperts.runners.values()
    assert sum(t.nbytes for p in pagers for t in p.slots.values()) == r["device_slot_bytes"]
    assert sum(p.nbytes for p in model.parameters()) == r["non_expert_bytes"]
