"""Prometheus metrics of one server, in its own registry (no process-global state).

Owns: request outcomes, refusals by status and OpenAI error code, token counters, TTFT / queue
time / TPOT histograms (observed as requests finish), and scrape-time values read from the
scheduler and every MoE layer's ``LayerStats``: each numeric field once as
``pagedexperts_paging_<field>`` (counters get ``_total``; ``*_last``, ``*_max``, ``*_mean``,
``*_p50``, ``*_p99_s`` are gauges), the host-time distributions as histograms
(``paging_time_histograms``), the disk tier's counters, speculative decoding's
(``speculative_metrics``) and decode steps by how they ran (``decode_metrics``). Does not:
decide anything.
"""

from __future__ import annotations

import re

from pagedexperts.engine.forwards import HOWS
from pagedexperts.engine.speculative.config import SpeculativeStats

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
PREFIX = "pagedexperts_"
GAUGE_NAME = re.compile(r"^max_|(_last|_max|_min|_mean|_p\d+)(_[a-z]+)?$")  # a level, not a running sum
PAGING_HELP = {"hits": "Routed experts found resident", "misses": "Routed experts paged in",  # LayerStats field -> help
               "bytes_paged": "Bytes of experts paged into slots (copied, or read in place: zero_copy_page_ins)",
               "zero_copy_page_ins": "Page-ins a CPU slot serves by reading the host row in place (no copy)",
               "waves": "Waves computed",
               "multi_wave_steps": "Layer steps that needed more than one wave", "steps": "Steps through the layer",
               "union_sum": "Sum over steps of distinct experts routed to",
               "union_last": "Distinct experts routed to in the last step",
               "union_max": "Distinct experts routed to, max over steps"}


class Metrics:
    """The server's metrics; ``render()`` is the /metrics body.

    ``scheduler``: a BatchScheduler (counts and ``stats`` read at scrape time); ``runtime``:
    the model's pagedexperts runtime (``runners`` with ``.stats``, ``num_resident``, ``top_k``).
    """

    def __init__(self, scheduler, runtime) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=r)
        self.refused = Counter(PREFIX + "refused_requests", "Requests refused, by HTTP status and error code",
                               ["status", "code"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from arrival to first token",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "Time from arrival to admission (part of TTFT)",
                               buckets=TTFT_BUCKETS_S, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Mean time per token after the first",
                              buckets=TPOT_BUCKETS_S, registry=r)
        r.register(_LiveCollector(scheduler, runtime))

    def observe_finish(self, event) -> None:
        """Count a finished sequence's tokens and timing (its last scheduler Event)."""
        self.generation_tokens.inc(event.completion_tokens)
        if event.ttft_s is not None:
            self.ttft.observe(event.ttft_s)
        if event.queue_s is not None:
            self.queue.observe(event.queue_s)
        if event.tpot_s is not None:
            self.tpot.observe(event.tpot_s)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _numeric_fields(stats) -> list[str]:
    """Names of the int / float attributes of a stats object (a dataclass or any object), in order."""
    return [name for name, value in vars(stats).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not name.startswith("_")]


class _LiveCollector:
    """Scrape-time gauges and counters: batch state and every MoE layer's paging counters."""

    def __init__(self, scheduler, runtime) -> None:
        self.scheduler, self.runtime = scheduler, runtime

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s, rt = self.scheduler, self.runtime
        yield GaugeMetricFamily(PREFIX + "running_requests", "Sequences in the decode batch", value=s.num_running)
        yield GaugeMetricFamily(PREFIX + "waiting_requests", "Sequences queued for a place", value=s.num_waiting)
        yield GaugeMetricFamily(PREFIX + "max_running_requests", "--max-running-requests",
                                value=s.config.max_running_requests)
        yield GaugeMetricFamily(PREFIX + "single_wave_cap", "K // top_k: decode batch always one wave",
                                value=rt.num_resident // rt.top_k)
        for name in _numeric_fields(s.stats):
            if name == "decode_steps":  # by how they ran: decode_metrics (the labels sum to it)
                continue
            kind = GaugeMetricFamily if GAUGE_NAME.search(name) else CounterMetricFamily
            yield kind(PREFIX + name, f"Scheduler: {name.replace('_', ' ')}", value=getattr(s.stats, name))
        yield from decode_metrics(s.forwards.summary(), PREFIX)
        if s.speculative is not None:
            yield from speculative_metrics(s.speculative.stats, PREFIX)
        layers = sorted((i, runner.stats) for i, runner in rt.runners.items())
        if not layers:
            return
        from pagedexperts.stats.accounting import ModelStats

        yield from paging_time_histograms(ModelStats.collect(layers), PREFIX)
        for name in _numeric_fields(layers[0][1]):
            kind = GaugeMetricFamily if GAUGE_NAME.search(name) else CounterMetricFamily
            doc = PAGING_HELP.get(name, f"Per MoE layer: {name.replace('_', ' ')}")
            fam = kind(PREFIX + "paging_" + name, doc, labels=["layer"])
            for i, ls in layers:
                fam.add_metric([str(i)], getattr(ls, name))
            yield fam
        yield from _tier_metrics(rt)


def _tier_metrics(runtime):
    """Per layer host and disk tier counters (``pagedexperts_host_hits``, ``..._disk_reads``,
    ``..._disk_bytes_read``, ``..._disk_read_s``; hit rate, read p50/p99 and read-aheads held as gauges) of
    layers whose store is a disk tier (``--host-memory-gb``); nothing otherwise."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    found = ((i, getattr(getattr(r, "store", None), "tier_stats", None)) for i, r in runtime.runners.items())
    tiers = sorted((i, t.as_dict()) for i, t in found if t is not None)
    if not tiers:
        return
    for name in tiers[0][1]:
        gauge = name.endswith(("_rate", "_p50_s", "_p99_s", "_held"))
        fam = (GaugeMetricFamily if gauge else CounterMetricFamily)(
            PREFIX + name, f"Per MoE layer, disk tier: {name.replace('_', ' ')}", labels=["layer"])
        for i, d in tiers:
            fam.add_metric([str(i)], d[name])
        yield fam


def paging_time_histograms(stats, prefix: str = PREFIX):
    """Prometheus histograms of the host times per MoE layer-step, all layers together:
    ``<prefix>plan_seconds``, ``<prefix>topk_readback_seconds``, ``<prefix>page_in_seconds``
    (buckets ``stats.accounting.TIME_BUCKETS_S``, cumulative since the start). ``stats``: a ModelStats."""
    from prometheus_client.core import HistogramMetricFamily

    from pagedexperts.stats.accounting import TIMED

    names = {"plan_s": "plan_seconds", "sync_s": "topk_readback_seconds", "page_in_s": "page_in_seconds"}
    for kind, dist in stats.time_histograms().items():
        yield HistogramMetricFamily(prefix + names[kind], f"Time of {TIMED[kind]} per MoE layer-step",
                                    buckets=dist.cumulative(), sum_value=dist.sum_s)


def speculative_metrics(stats: SpeculativeStats, prefix: str):
    """Prometheus families of ``stats`` (names after vLLM's ``spec_decode_*``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield CounterMetricFamily(prefix + "spec_decode_num_drafts", "Verification steps (one per request per forward)",
                              value=stats.steps)
    yield CounterMetricFamily(prefix + "spec_decode_num_draft_tokens", "Tokens proposed", value=stats.proposed)
    yield CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens", "Proposals accepted", value=stats.accepted)
    yield CounterMetricFamily(prefix + "spec_decode_num_emitted_tokens", "Tokens produced by verification steps",
                              value=stats.emitted)
    yield CounterMetricFamily(prefix + "spec_decode_num_padded_tokens", "Query positions padding a verification batch",
                              value=stats.padded)
    yield GaugeMetricFamily(prefix + "spec_decode_acceptance_rate", "Accepted / proposed since the start",
                            value=stats.acceptance_rate)
    yield GaugeMetricFamily(prefix + "spec_decode_mean_accepted_per_step", "Accepted proposals per verification step",
                            value=stats.mean_accepted_per_step)


def decode_metrics(summary: dict, prefix: str):
    """Families of the scheduler's forwards (``engine.forwards.StepForwards.summary``): decode
    steps by how they ran (``engine.forwards.HOWS``), rebuilds of built steps by reason, and
    the decode steps' backend with the reason when they are not captured (an info gauge = 1)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    counts = summary["decode_steps"]
    steps = CounterMetricFamily(prefix + "decode_steps", "Decode-carrying forwards by how they ran", labels=["how"])
    for how in HOWS:
        steps.add_metric([how], counts[how])
    yield steps
    again = CounterMetricFamily(prefix + "decode_recaptures", "Built decode steps rebuilt, by reason", labels=["reason"])
    for reason, n in sorted(counts["recaptures"].items()):
        again.add_metric([reason], n)
    yield again
    info = GaugeMetricFamily(prefix + "decode_backend", "How decode steps run (1 = this one), with why not captured",
                             labels=["kv_layout", "backend", "reason"])
    info.add_metric([summary["kv_layout"], summary["steps"]["backend"], summary["steps"]["reason"] or ""], 1)
    yield info
