"""Benchmarks of paging against what users would run instead, on one model and machine.

Owns: the ``bench`` command's work (``bench_checkpoint``: the workload checked against the
checkpoint, the rounds, the results written), the measurement of one mode in one round (TTFT on
short and long prompts, decode wall and CPU time per token, total tok/s at each concurrency c:
c prompts decoded as one batch; decode paging counters), and the rounds' medians and spreads.
Modes: ``plain`` (transformers' own model, nothing attached) and ``paging.baselines``' (resident,
paged at each K, offload, cpu-experts). The method: docs/benchmarks.md. Units: seconds, tok/s,
bytes. Does not: read prompt files (``tools.prompts``), clock a generate (``tools.timed_generate``)
or lay out the tables and files (``tools.bench_results``).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from pagedexperts.paging.baselines import MODES
from pagedexperts.paging.steps.table import transformers_inner
from pagedexperts.residency.policies import DEFAULT_POLICY
from pagedexperts.tools.bench_results import make_results_dir, terminal_table, write_results
from pagedexperts.tools.check import DEFAULT_PROMPTS, fused_expert_targets_quiet, transformers_model
from pagedexperts.tools.timed_generate import long_prompts, timed_generate


PLAIN = "plain"  # transformers' own model, nothing attached
BENCH_MODES = (PLAIN, *MODES)
WARM_UP_TOKENS = 4  # new tokens of each mode's warm-up generate, per round, untimed


@dataclass(frozen=True)
class BenchConfig:
    """What to run. ``num_resident``: the K values of the paged rows; ``rounds``: how many
    times every mode runs (interleaved); ``threads``: torch CPU threads (0 = torch's default)."""

    model_path: str | None = None
    modes: tuple[str, ...] = (PLAIN, "resident", "paged", "offload", "cpu-experts")
    num_resident: tuple[int, ...] = ()
    cpu_expert_layers: int = 0  # 0 = half the MoE layers
    output_tokens: int = 32
    concurrency: tuple[int, ...] = (1, 4)
    num_prompts: int = 3  # the built-in prompts (check.DEFAULT_PROMPTS)
    long_prompt_tokens: int = 256
    rounds: int = 5
    threads: int = 0
    device: str = "cpu"
    dtype: str | None = None
    experts_implementation: str = "grouped_mm"
    policy: str = DEFAULT_POLICY
    decide: str = "auto"  # --decide of the paged rows (loading.config.DECIDE_CHOICES)
    beyond_k: str = "waves"  # --beyond-k of the paged rows (loading.config.PagingConfig.beyond_k)
    admit_per_step: int | None = None  # --admit-per-step


@dataclass(frozen=True)
class Spread:
    """Per-round samples summarised: their median and their range [low, high] over rounds."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Spread":
        """Raises ValueError on an empty ``samples``."""
        if not samples:
            raise ValueError("a spread needs at least one sample")
        return cls(statistics.median(samples), min(samples), max(samples))

    def text(self, scale: float = 1.0, fmt: str = ".2f", unit: str = "") -> str:
        """``median [low-high]`` with each value times ``scale``."""
        m, lo, hi = (format(scale * v, fmt) for v in (self.median, self.low, self.high))
        return f"{m}{unit} [{lo}-{hi}]"


@dataclass
class RoundSample:
    """One mode in one round. Seconds; decode times per decode token (the tokens after each
    prompt's first), summed over the prompts; wall from ``perf_counter``, CPU from
    ``process_time``."""

    ttft_short_p50_s: float
    ttft_long_p50_s: float
    decode_wall_s_per_token: float
    decode_cpu_s_per_token: float
    total_tok_s: dict = field(default_factory=dict)  # concurrency -> tok/s


@dataclass
class ModeResult:
    """One row of the table: medians over rounds (spreads where a ``Spread``), the rounds'
    samples, and the paging counters of decode summed over rounds; None (n/a) where the mode counts
    no routing (plain, resident), and the hit rate and bytes paged of cpu-experts (pages nothing)."""

    mode: str
    num_resident: int
    ttft_short_p50_s: float = 0.0
    ttft_long_p50_s: float = 0.0
    decode_tok_s: float = 0.0  # single stream, 1 / median wall time per decode token
    decode_wall_s_per_token: Spread | None = None
    decode_cpu_s_per_token: Spread | None = None
    ratio_wall_vs_plain: Spread | None = None  # per round: this mode's / plain's time per token
    ratio_cpu_vs_plain: Spread | None = None
    total_tok_s: dict = field(default_factory=dict)  # concurrency -> tok/s
    hit_rate: float | None = None
    bytes_per_token: float | None = None
    waves_per_step: float | None = None
    multi_wave_steps: int | None = None
    plan_us_per_layer_step: float | None = None
    samples: list[RoundSample] = field(default_factory=list)  # one per round, in round order

    @property
    def label(self) -> str:
        return f"paged K={self.num_resident}" if self.mode == "paged" else self.mode


@dataclass
class BenchRun:
    """The rows and the order the modes ran in: ``order[r]`` lists round r's labels."""

    results: list[ModeResult]
    order: list[list[str]]


def measure_round(model, tokenizer, prompts: list[str], longs: list[str], cfg: BenchConfig,
                  counters: "DecodeCounters | None" = None) -> RoundSample:
    """One mode, one round (already warmed up): TTFT p50 of ``prompts`` and ``longs``, decode
    time per token over every prompt (``cfg.output_tokens`` each), total tok/s per concurrency.
    ``counters`` (the paged model's) adds each decode's paging counters."""
    ttft = [[timed_generate(model, tokenizer, [p], 1) for p in group] for group in (prompts, longs)]
    short, long = (statistics.median(t.wall[0] - t.start for t in group) for group in ttft)
    wall = cpu = 0.0
    tokens = 0
    for p in prompts:
        line = timed_generate(model, tokenizer, [p], cfg.output_tokens,
                         on_first_token=counters.begin if counters is not None else None)
        if counters is not None:
            counters.end()
        wall += line.wall[-1] - line.wall[0]
        cpu += line.cpu[-1] - line.cpu[0]
        tokens += len(line.wall) - 1
    total = {}
    for c in cfg.concurrency:
        line = timed_generate(model, tokenizer, [prompts[i % len(prompts)] for i in range(c)], cfg.output_tokens)
        total[c] = c * len(line.wall) / (line.wall[-1] - line.start)
    return RoundSample(short, long, wall / tokens, cpu / tokens, total)


COUNTED = ("hits", "misses", "bytes_paged", "waves", "steps", "multi_wave_steps", "plan_s", "tokens")


class DecodeCounters:
    """Paging counters of decode only, summed over runs: each run's stats at its first new token
    (``begin``) subtracted from those at its end (``end``). Only layers whose runner recorded
    steps count (a resident layer records none), so per-token rates divide by their number."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.sums = dict.fromkeys(COUNTED, 0)
        self.layers: set[int] = set()
        self._before = None

    def begin(self) -> None:
        self._before = {i: copy.copy(s) for i, s in self.runtime.stats().layers.items()}  # live objects

    def end(self) -> None:
        for i, after in self.runtime.stats().layers.items():
            before = self._before[i]
            if after.steps > before.steps:
                self.layers.add(i)
                for k in COUNTED:
                    self.sums[k] += getattr(after, k) - getattr(before, k)

    def fill(self, res: ModeResult) -> None:
        """Decode rates into ``res``; left None (not applicable) when no layer counted."""
        d, n = self.sums, len(self.layers)
        if not d["steps"]:
            return
        if res.mode != "cpu-experts":  # cpu-experts computes where the experts live: nothing paged, n/a
            res.hit_rate = d["hits"] / (d["hits"] + d["misses"]) if d["hits"] + d["misses"] else 0.0
            res.bytes_per_token = d["bytes_paged"] * n / d["tokens"] if d["tokens"] else 0.0
        res.waves_per_step = d["waves"] / d["steps"]
        res.multi_wave_steps = d["multi_wave_steps"]
        res.plan_us_per_layer_step = 1e6 * d["plan_s"] / d["steps"]


def round_order(jobs: list, r: int) -> list:
    """Round ``r``'s order: ``jobs`` rotated left by r (each job leads once every len(jobs) rounds)."""
    r %= len(jobs)
    return jobs[r:] + jobs[:r]


def bench_checkpoint(cfg: BenchConfig, *, cpu_expert_layers: int | None, prompts_path: str | None,
                     num_prompts: int | None, results_dir: Path, command: str, threads_how: str) -> BenchRun:
    """``pagedexperts bench``: ``cfg``'s workload checked against the checkpoint (``checked_workload``),
    the first ``num_prompts`` prompts of ``prompts_path`` (None: the built-in ones), the rounds, the
    results under ``results_dir`` and the terminal table.

    Raises:
        ValueError / FileNotFoundError: a bad value (names the value, the limit and the flag).
    """
    from pagedexperts.tools.prompts import read_prompts

    cfg = checked_workload(cfg, cpu_expert_layers=cpu_expert_layers)
    try:
        prompts = read_prompts(prompts_path) if prompts_path else list(DEFAULT_PROMPTS)
    except ValueError as exc:
        raise ValueError(f"--prompts {exc}") from None
    if num_prompts is not None and num_prompts > len(prompts):
        where = f"--prompts {prompts_path}" if prompts_path else "the built-in prompts (--prompts FILE for more)"
        raise ValueError(f"--num-prompts {num_prompts} exceeds the {len(prompts)} prompts of {where}")
    prompts = prompts[:num_prompts]
    make_results_dir(results_dir)
    cfg = dataclasses.replace(cfg, num_prompts=len(prompts))
    print(f"threads: {cfg.threads} ({threads_how})", file=sys.stderr)
    report = run_bench(cfg, prompts)
    write_results(report, cfg, results_dir, command)
    print(terminal_table(report, cfg.concurrency))
    print(f"\nthe full table (TTFT long, wall and CPU ms per token, every concurrency, waves, planning time): "
          f"{results_dir}/bench.md; per-round samples: {results_dir}/bench.json", file=sys.stderr)
    return report


def checked_workload(cfg: BenchConfig, *, cpu_expert_layers: int | None) -> BenchConfig:
    """``cfg`` with its K values checked in [top_k, E] of ``cfg.model_path``'s checkpoint (none
    given with mode paged: 2k, 4k and E/2, each at most E), and ``cpu_expert_layers`` (None:
    half) in [1, MoE layers] where mode cpu-experts runs.

    Raises:
        ValueError / FileNotFoundError: a bad value (names the value, the limit and the flag).
    """
    from pagedexperts.loading.loader import read_checkpoint_config
    from pagedexperts.models.config import moe_layer_indices, num_routed_experts
    from pagedexperts.residency.planner import check_num_resident

    _, c, _ = read_checkpoint_config(cfg.model_path)
    k, e = int(c.num_experts_per_tok), num_routed_experts(c)
    ks = cfg.num_resident
    if "paged" in cfg.modes and not ks:
        ks = tuple(sorted({min(e, 2 * k), min(e, 4 * k), max(k, e // 2)}))
    for x in ks:
        check_num_resident(x, num_experts=e, min_slots=k)
    num_moe = len(moe_layer_indices(c))  # the loader's limit: its MoE sites follow the family rule
    layers = cpu_expert_layers
    if "cpu-experts" in cfg.modes and layers is not None and not 1 <= layers <= num_moe:
        raise ValueError(f"--cpu-expert-layers {layers} outside [1, {num_moe}] (the model's MoE layers; "
                         "leave it out for half)")
    return dataclasses.replace(cfg, num_resident=ks)


def bench_jobs(cfg: BenchConfig) -> list[tuple[str, int | None]]:
    """(mode, K) per row, each once: paged once per K of ``cfg.num_resident`` (None: the
    loader's default)."""
    jobs = [(mode, k) for mode in cfg.modes for k in ((cfg.num_resident or (None,)) if mode == "paged" else (None,))]
    return list(dict.fromkeys(jobs))


def run_bench(cfg: BenchConfig, prompts: list[str], *, progress: bool = True) -> BenchRun:
    """Every mode (paged once per K) in ``cfg.rounds`` interleaved rounds on the same prompts.

    The paged model is loaded once; each switch re-attaches fresh runners over the same host
    stores (``loading.runners.repage``: empty slots, zeroed stats) and warms the mode up, untimed.
    """
    from tqdm import tqdm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    jobs = bench_jobs(cfg)
    models, tok = _load_models(cfg, jobs)
    longs = long_prompts(tok, prompts, cfg.long_prompt_tokens, max(1, len(prompts) // 2))
    samples: dict = {job: [] for job in jobs}
    counters = {job: DecodeCounters(models["runners"].pagedexperts) for job in jobs if job[0] != PLAIN}
    order, ks = [], {}
    bar = tqdm(total=cfg.rounds * len(jobs), desc="bench", disable=None if progress else True)  # None: on a terminal only
    for r in range(cfg.rounds):
        order.append([])
        for job in round_order(jobs, r):
            model = _switch(models, job)
            timed_generate(model, tok, prompts[:1], WARM_UP_TOKENS)  # warm-up, untimed
            samples[job].append(measure_round(model, tok, prompts, longs, cfg, counters.get(job)))
            ks[job] = _num_resident(model)
            order[-1].append(f"paged K={ks[job]}" if job[0] == "paged" else job[0])
            bar.update()
    bar.close()
    results = [summarise(job[0], ks[job], samples[job]) for job in jobs]
    for job, res in zip(jobs, results):
        if job in counters:
            counters[job].fill(res)
    ratios_vs_plain(results)
    return BenchRun(results=results, order=order)


def _num_resident(model) -> int:
    """K of the paged model's current mode; E (every expert on the device) for plain."""
    from pagedexperts.loading.runtime import runtime_of
    from pagedexperts.models.config import num_routed_experts

    rt = runtime_of(model)
    return rt.num_resident if rt is not None else num_routed_experts(model.config)


def _load_models(cfg: BenchConfig, jobs) -> tuple[dict, object]:
    """({"runners": the paged model, "plain": transformers' model}, tokenizer), each model only
    if a job needs it. The paged model is loaded for its first job's mode and K."""
    from transformers import AutoTokenizer

    from pagedexperts.loading import loader
    from pagedexperts.loading.loader import read_checkpoint_config

    models, tok = {}, None
    paged = [job for job in jobs if job[0] != PLAIN]
    if paged:
        (mode, k) = paged[0]
        models["runners"], tok = loader.load_model(
            cfg.model_path, num_resident=k, device=cfg.device, dtype=cfg.dtype,
            experts_implementation=cfg.experts_implementation, policy=cfg.policy, mode=mode, decide=cfg.decide,
            beyond_k=cfg.beyond_k, admit_per_step=cfg.admit_per_step,
            cpu_expert_layers=_cpu_layers(cfg) if "cpu-experts" in cfg.modes else 0,
        )
    if any(job[0] == PLAIN for job in jobs):
        models[PLAIN] = load_plain(cfg)
    if tok is None and not paged:
        tok = AutoTokenizer.from_pretrained(read_checkpoint_config(cfg.model_path)[0])
    return models, tok


def load_plain(cfg: BenchConfig):
    """Transformers' ``from_pretrained``, same dtype and experts implementation (fused: grouped_mm), on
    ``cfg.device``, eval mode, on transformers' local path (``tools.check.transformers_model``:
    gpt-oss MXFP4 dequantized at load, no kernel fetched from the Hub)."""
    from pagedexperts.loading.config import resolve_dtype
    from pagedexperts.loading.loader import read_checkpoint_config

    path, config, _ = read_checkpoint_config(cfg.model_path)
    with fused_expert_targets_quiet(path):
        model = transformers_model(path, dtype=resolve_dtype(cfg.dtype, config),
                                   experts_implementation=transformers_inner(cfg.experts_implementation))
    return model.to(cfg.device).eval()


def _switch(models: dict, job):
    """The model that runs ``job``, switched to it (the paged model re-attached by ``repage``)."""
    from pagedexperts.loading import runners

    mode, k = job
    if mode == PLAIN:
        return models[PLAIN]
    model = models["runners"]
    runners.repage(model, mode=mode, num_resident=k)
    return model


def summarise(mode: str, num_resident: int, samples: list[RoundSample]) -> ModeResult:
    """A row from one mode's per-round samples: medians over rounds, time spreads."""
    res = ModeResult(mode=mode, num_resident=num_resident, samples=samples)
    res.ttft_short_p50_s = statistics.median(s.ttft_short_p50_s for s in samples)
    res.ttft_long_p50_s = statistics.median(s.ttft_long_p50_s for s in samples)
    res.decode_wall_s_per_token = Spread.of([s.decode_wall_s_per_token for s in samples])
    res.decode_cpu_s_per_token = Spread.of([s.decode_cpu_s_per_token for s in samples])
    res.decode_tok_s = 1.0 / res.decode_wall_s_per_token.median
    res.total_tok_s = {c: statistics.median(s.total_tok_s[c] for s in samples) for c in samples[0].total_tok_s}
    return res


def ratios_vs_plain(results: list[ModeResult]) -> None:
    """Each row's time per decode token over plain's in the same round (samples[r] against
    plain's samples[r]), median and spread over rounds; left None without a plain row."""
    plain = next((r for r in results if r.mode == PLAIN), None)
    if plain is None:
        return
    for r in results:
        pairs = list(zip(r.samples, plain.samples, strict=True))
        r.ratio_wall_vs_plain = Spread.of([a.decode_wall_s_per_token / b.decode_wall_s_per_token for a, b in pairs])
        r.ratio_cpu_vs_plain = Spread.of([a.decode_cpu_s_per_token / b.decode_cpu_s_per_token for a, b in pairs])


def _cpu_layers(cfg: BenchConfig) -> int:
    """--cpu-expert-layers, or half the model's MoE layers (at least 1) when 0."""
    return cfg.cpu_expert_layers or max(1, len(_moe_layers(cfg.model_path)) // 2)


def _moe_layers(model_path) -> list[int]:
    from transformers import AutoConfig

    from pagedexperts.loading.bundled import bundled_model_path
    from pagedexperts.models.config import moe_layer_indices

    return moe_layer_indices(AutoConfig.from_pretrained(model_path or bundled_model_path()))
