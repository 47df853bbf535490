"""What makes ``bench`` honest: a plain baseline, interleaved rounds, medians with spreads,
and a resident baseline that is only the model's own experts step.

- plain is transformers' own ``from_pretrained`` model: nothing of pagedexperts attached;
- round r runs every mode once, in an order rotated by r, and the order is recorded;
- medians, spreads and per-round ratios are checked against hand counts of recorded samples;
- resident makes no top-k read-back, no host sync and no custom-op call per layer-step
  (counted with ``test_syncs``' instrumentation), and keeps no counters (n/a, not zeros).
"""

from __future__ import annotations

import pytest
import torch

from support.tiny import E, PAD_ID, TOP_K
from pagedexperts import integration
from pagedexperts.paging import baselines
from pagedexperts.tools import bench
from pagedexperts.loading.loader import load_model
from pagedexperts.stats.accounting import LayerStats, ModelStats
from support.reads import DeviceReads


def _sample(wall: float, cpu: float, **total) -> bench.RoundSample:
    return bench.RoundSample(ttft_short_p50_s=wall, ttft_long_p50_s=2 * wall, decode_wall_s_per_token=wall,
                             decode_cpu_s_per_token=cpu, total_tok_s={1: 1 / wall})


def test_plain_mode_is_transformers_own_model(tiny_moe_dir):
    cfg = bench.BenchConfig(model_path=str(tiny_moe_dir), experts_implementation="eager", dtype="float32")
    model = bench.load_plain(cfg)
    assert not hasattr(model, "pagedexperts")
    assert model.config._experts_implementation == "eager" and model.dtype == torch.float32 and not model.training
    assert not any(hasattr(m, integration.RUNNER_ATTR) for m in model.modules())
    assert not model._forward_pre_hooks and "_optimize_model_for_decode" not in vars(model)
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert experts and all(m.gate_up_proj.shape[0] == E for m in experts)  # its own [E, ...] parameters
    assert "plain" in bench.BENCH_MODES and "plain" not in baselines.MODES  # not a loader mode


def test_round_order_rotates_so_every_mode_leads_once():
    jobs = ["plain", "resident", "paged"]
    got = [bench.round_order(jobs, r) for r in range(4)]
    assert got == [["plain", "resident", "paged"], ["resident", "paged", "plain"],
                   ["paged", "plain", "resident"], ["plain", "resident", "paged"]]
    assert all(sorted(g) == sorted(jobs) for g in got)


def test_spread_is_median_and_range_by_hand():
    s = bench.Spread.of([3.0, 1.0, 10.0, 2.0])
    assert (s.median, s.low, s.high) == (2.5, 1.0, 10.0)  # even count: mean of the middle two
    assert bench.Spread.of([4.0]) == bench.Spread(4.0, 4.0, 4.0)
    assert s.text(scale=10, fmt=".0f", unit="x") == "25x [10-100]"
    with pytest.raises(ValueError, match="at least one sample"):
        bench.Spread.of([])


def test_ratios_are_per_round_then_median_and_spread():
    """plain's CPU time per token over 3 rounds is 1, 3, 4 ms (a burst of load in rounds 2-3);
    paged's 2, 3, 2 ms. Per-round ratios 2, 1, 0.5: median 1, spread [0.5, 2]. (The ratio of
    medians, 2 / 3, would be wrong: it compares rounds run under different load.)"""
    plain = bench.summarise("plain", E, [_sample(0.010, 0.001), _sample(0.030, 0.003), _sample(0.040, 0.004)])
    paged = bench.summarise("paged", TOP_K, [_sample(0.020, 0.002), _sample(0.030, 0.003), _sample(0.020, 0.002)])
    bench.ratios_vs_plain([plain, paged])
    cpu = paged.ratio_cpu_vs_plain
    assert (cpu.median, cpu.low, cpu.high) == pytest.approx((1.0, 0.5, 2.0))
    assert paged.ratio_wall_vs_plain.median == pytest.approx(1.0)
    assert plain.ratio_cpu_vs_plain == bench.Spread(1.0, 1.0, 1.0)
    assert paged.decode_cpu_s_per_token == bench.Spread(0.002, 0.002, 0.003)
    assert paged.decode_tok_s == pytest.approx(1 / 0.020) and paged.ttft_long_p50_s == pytest.approx(0.040)
    assert paged.total_tok_s == {1: pytest.approx(50.0)}  # median of 50, 33.3, 50
    alone = bench.summarise("paged", TOP_K, paged.samples)
    bench.ratios_vs_plain([alone])
    assert alone.ratio_cpu_vs_plain is None  # no plain row: no ratio, not a made-up one


class _Runtime:
    """A runtime whose stats() are the next of the given ModelStats."""

    def __init__(self, *snapshots) -> None:
        self.snapshots = list(snapshots)

    def stats(self) -> ModelStats:
        return self.snapshots.pop(0)


def _layer(steps, hits, misses, tokens, bytes_paged=0, waves=None) -> LayerStats:
    return LayerStats(steps=steps, hits=hits, misses=misses, tokens=tokens, bytes_paged=bytes_paged,
                      waves=steps if waves is None else waves)


def test_decode_counters_by_hand_and_na_when_nothing_counted():
    """Layer 0 pages (decode: 3 steps, 5 hits, 1 miss, 3 tokens, 100 bytes); layer 1 is
    resident and records nothing. Per token: 100 bytes x 1 counting layer / 3 tokens."""
    before = ModelStats(layers={0: _layer(1, 2, 2, 8, 200), 1: LayerStats()})
    after = ModelStats(layers={0: _layer(4, 7, 3, 11, 300, waves=5), 1: LayerStats()})
    counters = bench.DecodeCounters(_Runtime(before, after))
    counters.begin()
    counters.end()
    res = bench.ModeResult(mode="paged", num_resident=E)
    counters.fill(res)
    assert res.hit_rate == pytest.approx(5 / 6) and res.bytes_per_token == pytest.approx(100 / 3)
    assert res.waves_per_step == pytest.approx(4 / 3) and counters.layers == {0}
    cpu = bench.ModeResult(mode="cpu-experts", num_resident=E)  # pages nothing: n/a, as the README says
    counters.fill(cpu)
    assert (cpu.hit_rate, cpu.bytes_per_token) == (None, None) and cpu.waves_per_step == pytest.approx(4 / 3)
    idle = bench.DecodeCounters(_Runtime(ModelStats(layers={1: LayerStats()}), ModelStats(layers={1: LayerStats()})))
    idle.begin()
    idle.end()
    res = bench.ModeResult(mode="resident", num_resident=E)
    idle.fill(res)
    assert (res.hit_rate, res.bytes_per_token, res.waves_per_step, res.plan_us_per_layer_step) == (None,) * 4


@pytest.fixture
def resident_reads(monkeypatch):
    """test_syncs' DeviceReads, plus counts of read_back and of the opaque custom op."""
    mode = DeviceReads()
    mode.ops = 0
    real_read_step, real_op = baselines.read_step, integration.experts_step

    def read_step(*args, **kwargs):
        mode.read_backs += 1
        return real_read_step(*args, **kwargs)

    def op(*args):
        mode.ops += 1
        return real_op(*args)

    monkeypatch.setattr(baselines, "read_step", read_step)
    monkeypatch.setattr(integration, "experts_step", op)
    return mode


@pytest.mark.parametrize("batch", [1, 3])
def test_resident_step_has_no_read_back_sync_or_op(tiny_moe_dir, reference_model, resident_reads, monkeypatch, batch):
    """Generate with a padded batch: resident's layer-steps run the model's experts function
    with no read-back, no syncing call from pagedexperts code and no custom-op call, and give
    the unpaged model's logits; its stats stay empty (n/a), not zeros of a measurement."""
    model, _ = load_model(tiny_moe_dir, mode="resident")
    ref = reference_model()
    steps = []
    real_call = baselines.ResidentRunner.step
    monkeypatch.setattr(baselines.ResidentRunner, "step",
                        lambda self, *a: steps.append(self.layer) or real_call(self, *a))
    for runner in model.pagedexperts.runners.values():
        resident_reads.mark(*runner.tensors.values())
    ids = torch.randint(2, 100, (batch, 7), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :3], mask[1, :3] = PAD_ID, 0
    resident_reads.mark(ids, mask, *model.parameters(), *model.buffers())
    kw = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=PAD_ID,
              output_logits=True, return_dict_in_generate=True)
    with resident_reads, torch.no_grad():
        got = model.generate(ids, **kw)
    with torch.no_grad():
        want = ref.generate(ids, **kw)
    layers = len(model.pagedexperts.runners)
    assert len(steps) == 4 * layers  # the runner ran: prefill + 3 decode steps, every MoE layer
    assert resident_reads.reads == [] and resident_reads.read_backs == 0 and resident_reads.ops == 0
    assert torch.equal(torch.stack(got.logits), torch.stack(want.logits))
    assert model.pagedexperts.stats().total().steps == 0
    assert all(r.inline and r.capture_problem(model.dtype, model.device) is None for r in model.pagedexperts.runners.values())


def test_the_terminal_shows_a_compact_table_and_the_file_the_full_one(tmp_path):
    """`bench` printed the ~330-character markdown table to the terminal; it prints a few columns
    (each row under 100 characters) and the full table goes to bench.md, unchanged."""
    from pagedexperts.tools.bench_results import markdown_table, terminal_table, write_results

    spread = bench.Spread
    plain = bench.ModeResult(mode="plain", num_resident=E, ttft_short_p50_s=0.0123, decode_tok_s=45.2,
                             decode_wall_s_per_token=spread(0.022, 0.02, 0.025), decode_cpu_s_per_token=spread(0.02, 0.02, 0.03),
                             ratio_wall_vs_plain=spread(1, 1, 1), ratio_cpu_vs_plain=spread(1, 1, 1), total_tok_s={1: 45, 4: 120.3})
    paged = bench.ModeResult(mode="paged", num_resident=8, ttft_short_p50_s=0.0153, decode_tok_s=35.2,
                             decode_wall_s_per_token=spread(0.028, 0.02, 0.035), decode_cpu_s_per_token=spread(0.03, 0.02, 0.04),
                             ratio_wall_vs_plain=spread(1.2, 1.1, 1.3), ratio_cpu_vs_plain=spread(1.25, 1.12, 1.41),
                             total_tok_s={1: 35, 4: 100.3}, hit_rate=0.7312, bytes_per_token=1.2e6, waves_per_step=1.0,
                             plan_us_per_layer_step=35)
    report = bench.BenchRun(results=[plain, paged], order=[["plain", "paged K=8"], ["paged K=8", "plain"]])
    lines = terminal_table(report, (1, 4)).splitlines()
    assert max(len(line) for line in lines) < 100 and "|" not in "".join(lines)
    assert lines[0].split() == ["mode", "decode", "tok/s", "CPU/token", "vs", "plain", "TTFT", "ms", "tok/s", "@4",
                                "hit", "rate", "MB/token"]
    assert lines[1].split() == ["plain", "45.2", "1.00x", "[1.00-1.00]", "12", "120.3", "n/a", "n/a"]
    assert lines[2].split() == ["paged", "K=8", "35.2", "1.25x", "[1.12-1.41]", "15", "100.3", "73.1%", "1.200"]
    full = markdown_table(report, (1, 4))
    assert max(len(line) for line in full.splitlines()) > 200  # the file keeps every column
    cfg = bench.BenchConfig(model_path=None, modes=("plain", "paged"), num_resident=(8,), concurrency=(1, 4))
    write_results(report, cfg, tmp_path, "pagedexperts bench")
    assert full in (tmp_path / "bench.md").read_text()
