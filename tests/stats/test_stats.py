"""Time distributions of the paging stats: p50/p99 over a window beside the sums, cumulative
histogram buckets, their place in the stats JSON and the /metrics histograms.

Expected values are hand counts on made-up samples (no timing is measured here).
"""

from __future__ import annotations

import math

import pytest

from pagedexperts.stats.accounting import LayerStats, ModelStats
from pagedexperts.stats.accounting import TIME_BUCKETS_S, WINDOW, TimeDistribution


def test_p50_p99_nearest_rank_by_hand():
    dist = TimeDistribution()
    for i in range(100, 0, -1):  # 1..100 us, in any order
        dist.observe(i * 1e-6)
    p50, p99 = dist.quantiles(0.5, 0.99)
    assert p50 == pytest.approx(50e-6) and p99 == pytest.approx(99e-6)
    assert dist.count == 100 and dist.sum_s == pytest.approx(5050e-6)


def test_window_keeps_the_latest_samples_but_buckets_count_all():
    dist = TimeDistribution()
    for _ in range(WINDOW):
        dist.observe(1.0)  # old and slow
    for _ in range(WINDOW):
        dist.observe(1e-6)  # recent and fast
    assert dist.quantiles(0.99) == [1e-6]
    assert dist.count == 2 * WINDOW
    cumulative = dict(dist.cumulative())
    assert cumulative["1e-06"] == WINDOW and cumulative["1.0"] == 2 * WINDOW and cumulative["+Inf"] == 2 * WINDOW


def test_buckets_are_upper_inclusive_and_overflow_goes_to_inf():
    dist = TimeDistribution()
    for seconds in (TIME_BUCKETS_S[0], TIME_BUCKETS_S[0] * 1.01, 2.0):
        dist.observe(seconds)
    cumulative = dist.cumulative()
    assert cumulative[0] == ("1e-06", 1)
    assert cumulative[1] == ("2.5e-06", 2)
    assert cumulative[-2] == ("1.0", 2) and cumulative[-1] == ("+Inf", 3)


def test_empty_distribution_has_nan_quantiles():
    assert all(math.isnan(q) for q in TimeDistribution().quantiles(0.5, 0.99))


def _layer(plan_us, sync_us, page_in_us):
    stats = LayerStats()
    for p, s, g in zip(plan_us, sync_us, page_in_us):
        stats.record_step(hits=1, misses=int(g > 0), waves=1, tokens=1, expert_bytes=8,
                          plan_s=p * 1e-6, sync_s=s * 1e-6, page_in_s=g * 1e-6)
    return stats


def test_record_step_keeps_distributions_beside_sums():
    stats = _layer([10, 20, 30], [5, 5, 7], [0, 100, 0])
    assert stats.plan_s == pytest.approx(60e-6)
    summary = stats.time_summary()
    assert summary["plan_s"]["p50"] == pytest.approx(20e-6) and summary["plan_s"]["count"] == 3
    assert summary["sync_s"]["p99"] == pytest.approx(7e-6)
    assert summary["page_in_s"]["count"] == 1, "a step without page-ins has no page-in time"


def test_untimed_steps_like_the_simulators_are_not_sampled():
    stats = LayerStats()
    stats.record_step(hits=1, misses=1, waves=1, tokens=1, expert_bytes=8)
    assert all(d.count == 0 for d in stats.times.values())


def test_cuda_page_in_times_added_later_count_in_sum_and_distribution():
    stats = _layer([10], [5], [0])
    stats.add_page_in_s([1e-3, 3e-3])
    assert stats.page_in_s == pytest.approx(4e-3)
    assert stats.times["page_in_s"].count == 2


def test_model_stats_json_has_p50_p99_over_all_layers():
    model = ModelStats(layers={0: _layer([10, 10, 10], [1, 1, 1], [0, 0, 0]),
                               1: _layer([40, 40, 40], [1, 1, 1], [0, 0, 0])})
    d = model.as_dict()
    assert d["times"]["plan_s"]["count"] == 6
    assert d["times"]["plan_s"]["p50"] == pytest.approx(10e-6) and d["times"]["plan_s"]["p99"] == pytest.approx(40e-6)
    assert d["layers"]["1"]["times"]["plan_s"]["p50"] == pytest.approx(40e-6)
    assert d["plan_s"] == pytest.approx(150e-6), "the sums stay"
    assert "times" not in model.as_dict(times=False)
    assert model.layers[0].times["plan_s"].count == 3, "totals do not change the layers"


def test_metrics_histograms_in_prometheus_text():
    prometheus_client = pytest.importorskip("prometheus_client")
    from pagedexperts.serving.metrics import paging_time_histograms

    model = ModelStats(layers={0: _layer([3, 30], [1, 1], [0, 200]), 1: _layer([3], [1], [0])})

    class Collector:
        def collect(self):
            return paging_time_histograms(model, "pagedexperts_")

    registry = prometheus_client.CollectorRegistry()
    registry.register(Collector())
    text = prometheus_client.generate_latest(registry).decode()
    assert "# TYPE pagedexperts_plan_seconds histogram" in text
    assert 'pagedexperts_plan_seconds_bucket{le="5e-06"} 2.0' in text
    assert 'pagedexperts_plan_seconds_bucket{le="+Inf"} 3.0' in text
    assert "pagedexperts_plan_seconds_count 3.0" in text
    assert 'pagedexperts_page_in_seconds_bucket{le="0.00025"} 1.0' in text
    assert "pagedexperts_topk_readback_seconds_count 3.0" in text
