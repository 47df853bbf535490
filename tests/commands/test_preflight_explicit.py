"""``preflight`` from a model's architecture as its card and config.json give it (issue 36 part
3.2): expert and KV bytes equal what ``--model-path`` reads off the same checkpoint's headers
(tool-written quantized checkpoints as the oracle for the packed formats), the non-expert
weights estimated and said so."""

from __future__ import annotations

import json

import pytest

from pagedexperts.cli import main
from support.paths import DATA



def _json(capsys, argv) -> dict:
    assert main(["preflight", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _architecture(config: dict) -> list[str]:
    """The explicit flags of a config.json, as a user copies them off a model card."""
    argv = ["--layers", str(config["num_hidden_layers"]), "--experts", str(config.get("num_experts") or config["num_local_experts"]),
            "--top-k", str(config["num_experts_per_tok"]), "--hidden-size", str(config["hidden_size"]),
            "--moe-intermediate-size", str(config["moe_intermediate_size"]),
            "--num-attention-heads", str(config["num_attention_heads"]),
            "--num-key-value-heads", str(config["num_key_value_heads"]),
            "--dtype", config.get("dtype") or config["torch_dtype"]]
    return argv + (["--head-dim", str(config["head_dim"])] if config.get("head_dim") else [])


def test_the_bundled_model_by_its_numbers_is_the_bundled_model_by_its_files(capsys):
    from pagedexperts.loading.bundled import bundled_model_path

    config = json.loads((bundled_model_path() / "config.json").read_text())
    files = _json(capsys, ["--model-path", "bundled"])
    numbers = _json(capsys, _architecture(config) + ["--vocab-size", "4096", "--tie-word-embeddings"])
    for key in ("expert_bytes", "dense_expert_bytes", "kv_bytes_per_token", "slot_bytes", "num_resident", "dtype"):
        assert numbers[key] == files[key], key
    # the checkpoint also holds Qwen3's per-head q and k norms: 6 layers x 2 x head dim 32 x 4 bytes
    assert files["non_expert_bytes"] - numbers["non_expert_bytes"] == 6 * 2 * 32 * 4
    assert numbers["non_expert_source"] == "estimated: attention, routers, norms, embeddings"


@pytest.mark.parametrize("fixture,fmt,group", [
    ("llmc/qwen3_moe-w8a16", "w8a16", 16),          # llm-compressor W8A16 group 16, float32
    ("llmc/qwen3_moe-NVFP4A16", "nvfp4", 16),       # llm-compressor NVFP4A16
    ("gptqmodel/qwen3_moe-gptq-experts", "gptq", 128),  # GPTQModel, a group wider than the row: one group
    ("autoround/qwen3_moe-auto_awq-experts", "awq", 32),  # AutoRound's AWQ export, float16
])
def test_packed_expert_bytes_equal_the_tool_written_checkpoint_s(capsys, fixture, fmt, group):
    path = DATA / fixture
    config = json.loads((path / "config.json").read_text())
    files = _json(capsys, ["--model-path", str(path)])
    numbers = _json(capsys, _architecture(config) + ["--expert-format", fmt, "--group-size", str(group)])
    assert numbers["expert_bytes"] == files["expert_bytes"] and numbers["kv_bytes_per_token"] == files["kv_bytes_per_token"]
    assert numbers["dense_expert_bytes"] == files["dense_expert_bytes"]


def test_block_fp8_expert_bytes_equal_quantize_s_checkpoint(capsys, tmp_path):
    from pagedexperts.loading.bundled import bundled_model_path

    assert main(["quantize", "--format", "fp8-block", "--model-path", "bundled", "--output", str(tmp_path / "fp8")]) == 0
    capsys.readouterr()
    config = json.loads((bundled_model_path() / "config.json").read_text())
    files = _json(capsys, ["--model-path", str(tmp_path / "fp8")])
    numbers = _json(capsys, _architecture(config) + ["--expert-format", "fp8-block"])
    assert numbers["expert_bytes"] == files["expert_bytes"]


def test_qwen3_30b_a3b_from_its_card(capsys):
    """48 layers, 128 experts, top-8, H 2048, I 768, 32 query / 4 KV heads of 128, vocab 151,936,
    bf16: expert 3 x 2048 x 768 x 2 B; KV 48 x 2 x 4 x 128 x 2 B; block FP8 adds one float32
    scale per 128 x 128 block: 2 x 6 x 16 + 16 x 6 = 288 blocks."""
    card = ["--layers", "48", "--experts", "128", "--top-k", "8", "--hidden-size", "2048", "--moe-intermediate-size", "768",
            "--num-attention-heads", "32", "--num-key-value-heads", "4", "--head-dim", "128", "--vocab-size", "151936"]
    r = _json(capsys, card)
    assert (r["expert_bytes"], r["kv_bytes_per_token"], r["dtype"]) == (3 * 2048 * 768 * 2, 98_304, "bfloat16")
    attention = 2048 * 32 * 128 * 2 + 2 * 2048 * 4 * 128 + 2 * 2048
    assert r["non_expert_bytes"] == (48 * attention + 48 * 2048 * 128 + 2 * 151936 * 2048 + 2048) * 2
    fp8 = _json(capsys, card + ["--expert-format", "fp8-block"])
    assert fp8["expert_bytes"] == 3 * 2048 * 768 + 288 * 4


def test_the_report_says_how_the_non_expert_weights_were_counted(capsys):
    base = ["preflight", "--layers", "4", "--experts", "8", "--top-k", "2", "--expert-mb", "1", "--kv-bytes-per-token", "1024"]
    assert main(base) == 0
    assert "non-expert weights    0 B on the device (not counted: give --non-expert-gb" in capsys.readouterr().out
    assert main(base + ["--non-expert-gb", "2"]) == 0
    assert "non-expert weights    2.00 GB on the device (--non-expert-gb)" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["--layers", "4", "--experts", "8", "--top-k", "2"],
     "missing: --expert-mb (or hidden-size and moe-intermediate-size), --kv-bytes-per-token (or num-attention-heads"),
    (["--layers", "4", "--experts", "8", "--top-k", "2", "--expert-mb", "1", "--expert-format", "w4a16",
      "--kv-bytes-per-token", "8"], "--expert-mb is the expert's bytes already; drop --expert-format"),
    (["--layers", "4", "--experts", "8", "--top-k", "2", "--hidden-size", "64", "--moe-intermediate-size", "48",
      "--num-attention-heads", "4", "--expert-format", "w4a16", "--group-size", "32"],
     "--expert-format w4a16 --group-size 32 at --hidden-size 64, --moe-intermediate-size 48: expert in_features 48"),
    (["--layers", "4", "--experts", "8", "--top-k", "2", "--expert-mb", "1", "--num-attention-heads", "4"],
     "--num-attention-heads needs --head-dim or --hidden-size"),
    (["--layers", "4", "--experts", "8", "--top-k", "2", "--expert-mb", "1", "--kv-bytes-per-token", "8",
      "--hidden-size", "0"], "--hidden-size 0 must be > 0"),
    (["--layers", "4", "--experts", "8", "--top-k", "2", "--hidden-size", "64", "--moe-intermediate-size", "48",
      "--num-attention-heads", "4", "--expert-format", "w4a16", "--group-size", "0"],
     "--group-size 0 must be >= 1"),  # a ZeroDivisionError traceback
])
def test_explicit_mode_refuses_naming_the_flags(argv, needle, capsys):
    assert main(["preflight", *argv]) == 2
    assert needle in capsys.readouterr().err
