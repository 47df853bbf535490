"""``bench/real_disk.py`` runs cold (every file the disk tier may read leaves the page cache first)
and compares top-1 round by round.

A checkpoint written by ``pagedexperts quantize`` carries its experts in the CPU kernels' layout
in its own ``kernel-layout/`` directory, and the packed disk tier reads that, not the shards: a
bench that dropped only the shards (and a stored-layout cache directory) measured the stored
layout warm.
"""

from __future__ import annotations

import sys

from support.paths import ROOT


def _real_disk():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import real_disk
        return real_disk
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_cold_files_are_the_shards_the_checkpoints_stored_layout_and_the_cache(tmp_path):
    ckpt, cache = tmp_path / "ckpt", tmp_path / "cache"
    (ckpt / "kernel-layout").mkdir(parents=True)
    (cache / "ckpt-0123").mkdir(parents=True)
    made = [ckpt / "model-00001-of-00002.safetensors", ckpt / "model-00002-of-00002.safetensors",
            ckpt / "kernel-layout" / "experts-avx2-bfloat16.pxkl", cache / "ckpt-0123" / "experts-avx2-float32.pxkl"]
    for f in made + [ckpt / "config.json", ckpt / "tokenizer.json"]:
        f.write_bytes(b"x")
    got = _real_disk().cold_files(ckpt, cache)
    assert sorted(got) == sorted(made)


def test_cold_files_without_a_stored_layout_are_the_shards(tmp_path):
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(b"x")
    (tmp_path / "config.json").write_bytes(b"{}")
    assert _real_disk().cold_files(tmp_path, tmp_path / "no-cache-here") == [shard]


def test_top1_agreement_is_per_round_against_the_same_round_of_the_reference():
    reference = [{"argmax": [1, 2, 3, 4]}, {"argmax": [5, 6, 7, 8]}, {"argmax": [9, 9, 9, 9]}]
    results = [{"argmax": [1, 2, 0, 4]},   # round 0: 3 of 4
               {"argmax": [1, 2, 3, 4]},   # round 1: equal to round 0's reference, not round 1's: 0 of 4
               {"failed": "exit -9 (killed: SIGKILL, the cgroup's OOM killer)"}]  # left out
    assert _real_disk().top1_agreement(results, reference) == [0.75, 0.0]


def test_the_table_from_a_log_counts_refusals_and_kills_and_compares_top1_with_the_first_row_that_decoded():
    rd = _real_disk()
    log = "\n".join([
        'a, default {"refused": "MemoryError: the model needs ..."}',
        'b, packed {"wall_s_per_token": 0.2, "cpu_s_per_token": 0.1, "argmax": [1, 2]}',
        'c, llama {"failed": "exit -9 (killed: SIGKILL, the cgroup\'s OOM killer)"}',
        'a, default {"refused": "MemoryError: the model needs ..."}',
        'b, packed {"wall_s_per_token": 0.4, "cpu_s_per_token": 0.3, "argmax": [1, 2]}',
        'c, llama {"wall_s_per_token": 0.5, "cpu_s_per_token": 0.5, "argmax": [1, 3]}',
        "",
        "| an earlier table's row | is not a run |",
    ])
    rows = rd.rows_from_log(log)
    assert list(rows) == ["a, default", "b, packed", "c, llama"] and [len(v) for v in rows.values()] == [2, 2, 2]
    lines = rd.larger_than_ram_table(rows, 2490, 2).splitlines()
    assert "top-1 = b, packed" in lines[0]
    assert lines[2].endswith("| 0 of 2 (2 refused at start-up) | - |")
    assert "| b, packed | 0.300 [0.200-0.400] | 0.200 [0.100-0.300] |" in lines[3] and lines[3].endswith("| 1.00 [1.00-1.00] |")
    # round 0 of c was OOM-killed: only round 1 compares, 1 of 2 steps equal
    assert "| c, llama | 0.500 | 0.500 |" in lines[4] and lines[4].endswith("| 1 of 2 | 0.50 |")
