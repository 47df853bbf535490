"""Benchmarks of paging against what users would run instead, on one model and machine.

Owns: the prompt-file readers (JSON lines with ``prompt``, ``turns`` or ``question``;
ShareGPT-style JSON), the measurement of one execution mode (TTFT on short and long prompts,
single-stream decode tok/s, total tok/s at each concurrency, decode paging counters), and the
results table (markdown, JSON, PNG). Modes are the loader's (``paging.baselines``): resident, paged at
each K, offload, cpu-experts. Concurrency c is c prompts decoded together in one batch.
Does not: define the modes (``paging.baselines``) or the server's scheduling (``serving``).

Units: seconds, tok/s, bytes. Timings are wall clock on this machine; compare ratios measured
in one run (paged vs resident), not absolute numbers across machines.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagedexperts.generation.config import GREEDY
from pagedexperts.residency.policies import DEFAULT_POLICY

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    """What to run. ``num_resident``: the K values of the paged rows."""

    model_path: str | None = None
    modes: tuple[str, ...] = ("resident", "paged", "offload", "cpu-experts")
    num_resident: tuple[int, ...] = ()
    cpu_expert_layers: int = 0  # 0 = half the MoE layers
    output_tokens: int = 32
    concurrency: tuple[int, ...] = (1, 4)
    num_prompts: int = 4
    long_prompt_tokens: int = 256
    device: str = "cpu"
    dtype: str | None = None
    experts_implementation: str = "grouped_mm"
    policy: str = DEFAULT_POLICY
    decide: str = "auto"  # --decide of the paged rows (loading.config.DECIDE_CHOICES)


@dataclass
class ModeResult:
    """One row of the table. Times in seconds, speeds in tok/s; paging counters of decode."""

    mode: str
    num_resident: int
    ttft_short_p50_s: float = 0.0
    ttft_long_p50_s: float = 0.0
    decode_tok_s: float = 0.0
    total_tok_s: dict = field(default_factory=dict)  # concurrency -> tok/s
    hit_rate: float = 0.0
    bytes_per_token: float = 0.0
    waves_per_step: float = 0.0
    multi_wave_steps: int = 0
    plan_us_per_layer_step: float = 0.0
    ratio_time_per_token_vs_resident: float | None = None


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompts from a JSON-lines file (``prompt``, ``turns`` [first turn] or ``question``) or a
    ShareGPT-style JSON list (first human turn of ``conversations``).

    Raises:
        FileNotFoundError: no such file. ValueError: no prompt found (names the fields tried).
    """
    path = Path(path)
    text = path.read_text()
    prompts: list[str] = []
    if text.lstrip().startswith("["):
        for item in json.loads(text):
            turns = item.get("conversations") or []
            human = [t.get("value", "") for t in turns if t.get("from") in ("human", "user")]
            if human:
                prompts.append(human[0])
    else:
        for line in text.splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            p = row.get("prompt") or (row.get("turns") or [None])[0] or row.get("question")
            if p:
                prompts.append(p)
    if not prompts:
        raise ValueError(f"{path}: no prompts found (want JSON lines with prompt/turns/question, or ShareGPT JSON)")
    return prompts[:limit] if limit else prompts


def long_prompts(tokenizer, prompts: list[str], tokens: int, count: int) -> list[str]:
    """``count`` prompts of about ``tokens`` tokens each, made by joining consecutive prompts."""
    out, i = [], 0
    pool = prompts * (1 + tokens)  # enough text to fill
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < tokens:
            ids += tokenizer(pool[i % len(pool)] + "\n")["input_ids"]
            i += 1
        out.append(tokenizer.decode(ids[:tokens]))
    return out


def _generate(model, tokenizer, prompts: list[str], new_tokens: int, on_first_token=None) -> tuple[float, list[float]]:
    """Greedy-generate exactly ``new_tokens`` for a batch; (start time, token timestamps).

    ``on_first_token()`` runs when the first new token arrives, i.e. right after the prefill.
    """
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    times: list[float] = []

    class _Clock:
        def put(self, value):
            times.append(time.perf_counter())
            if len(times) == 2 and on_first_token is not None:  # the first put() is the prompt
                on_first_token()

        def end(self):
            pass

    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            **batch,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            **GREEDY,
            pad_token_id=tokenizer.pad_token_id,
            streamer=_Clock(),
        )
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return start, times[1:]  # the first put() is the prompt


def measure_mode(model, tokenizer, prompts: list[str], longs: list[str], cfg: BenchConfig) -> ModeResult:
    """Measure one loaded model (a mode at a K): one warm-up call first, excluded."""
    rt = model.pagedexperts
    res = ModeResult(mode=rt.config.mode, num_resident=rt.num_resident)
    _generate(model, tokenizer, prompts[:1], 2)  # warm-up
    ttft = []
    for p in prompts:
        start, times = _generate(model, tokenizer, [p], 1)
        ttft.append(times[0] - start)
    res.ttft_short_p50_s = statistics.median(ttft)
    ttft = []
    for p in longs:
        start, times = _generate(model, tokenizer, [p], 1)
        ttft.append(times[0] - start)
    res.ttft_long_p50_s = statistics.median(ttft)
    rates, decode = [], None
    for p in prompts:
        snapshot = []  # decode counters start after the prefill step
        _, times = _generate(model, tokenizer, [p], cfg.output_tokens,
                             on_first_token=lambda: snapshot.append(rt.stats().total()))
        before = snapshot[0]
        rates.append((len(times) - 1) / (times[-1] - times[0]))
        after = rt.stats().total()
        decode = _accumulate(decode, before, after)
    res.decode_tok_s = statistics.median(rates)
    _fill_paging(res, decode, len(rt.pagers))
    for c in cfg.concurrency:
        batch = [prompts[i % len(prompts)] for i in range(c)]
        start, times = _generate(model, tokenizer, batch, cfg.output_tokens)
        res.total_tok_s[c] = c * len(times) / (times[-1] - start)
    return res


def _accumulate(acc, before, after) -> dict:
    keys = ("hits", "misses", "bytes_paged", "waves", "steps", "multi_wave_steps", "plan_s", "tokens")
    acc = acc or {k: 0 for k in keys}
    for k in keys:
        acc[k] += getattr(after, k) - getattr(before, k)
    return acc


def _fill_paging(res: ModeResult, d: dict, num_layers: int) -> None:
    """Decode-phase counters. ``d["tokens"]`` is summed over MoE layers, so the model's
    tokens are d["tokens"] / num_layers."""
    total = d["hits"] + d["misses"]
    res.hit_rate = d["hits"] / total if total else 0.0
    res.bytes_per_token = d["bytes_paged"] * num_layers / d["tokens"] if d["tokens"] else 0.0
    res.waves_per_step = d["waves"] / d["steps"] if d["steps"] else 0.0
    res.multi_wave_steps = d["multi_wave_steps"]
    res.plan_us_per_layer_step = 1e6 * d["plan_s"] / d["steps"] if d["steps"] else 0.0


def run_bench(cfg: BenchConfig, prompts: list[str], *, progress: bool = True) -> list[ModeResult]:
    """Every mode (paged once per K) on the same prompts; ratios against resident filled in.

    The checkpoint is loaded once, for the first (mode, K); every later row re-attaches
    fresh runners over the same host stores (``loading.runners.repage``: empty slots, zeroed stats).
    """
    from tqdm import tqdm

    from pagedexperts.loading.loader import load_model
    from pagedexperts.loading.runners import repage

    jobs = []
    for mode in cfg.modes:
        for k in (cfg.num_resident or (None,)) if mode == "paged" else (None,):
            jobs.append((mode, k))
    (mode0, k0), results = jobs[0], []
    model, tok = load_model(
        cfg.model_path, num_resident=k0, device=cfg.device, dtype=cfg.dtype,
        experts_implementation=cfg.experts_implementation, policy=cfg.policy, mode=mode0, decide=cfg.decide,
        cpu_expert_layers=_cpu_layers(cfg) if "cpu-experts" in cfg.modes else 0,
    )
    longs = long_prompts(tok, prompts, cfg.long_prompt_tokens, max(1, len(prompts) // 2))
    for i, (mode, k) in enumerate(tqdm(jobs, desc="bench", disable=not progress)):
        if i:
            repage(model, mode=mode, num_resident=k)
        results.append(measure_mode(model, tok, prompts, longs, cfg))
    base = next((r for r in results if r.mode == "resident"), None)
    for r in results:
        if base is not None and r.decode_tok_s:
            r.ratio_time_per_token_vs_resident = base.decode_tok_s / r.decode_tok_s
    return results


def _cpu_layers(cfg: BenchConfig) -> int:
    """--cpu-expert-layers, or half the model's MoE layers (at least 1) when 0."""
    return cfg.cpu_expert_layers or max(1, len(_moe_layers(cfg.model_path)) // 2)


def _moe_layers(model_path) -> list[int]:
    from transformers import AutoConfig

    from pagedexperts.loading.loader import bundled_model_path
    from pagedexperts.models.config import moe_layer_indices

    return moe_layer_indices(AutoConfig.from_pretrained(model_path or bundled_model_path()))


def markdown_table(results: list[ModeResult], concurrency) -> str:
    """The results as a markdown table (one row per mode / K)."""
    head = ["mode", "K", "TTFT short p50 ms", "TTFT long p50 ms", "decode tok/s"]
    head += [f"total tok/s @{c}" for c in concurrency]
    head += ["hit rate", "MB paged/token", "waves/step", "plan us/layer-step", "time/token vs resident"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        ratio = f"{r.ratio_time_per_token_vs_resident:.2f}x" if r.ratio_time_per_token_vs_resident else "-"
        cells = [r.mode, str(r.num_resident), f"{1e3 * r.ttft_short_p50_s:.1f}", f"{1e3 * r.ttft_long_p50_s:.1f}", f"{r.decode_tok_s:.1f}"]
        cells += [f"{r.total_tok_s.get(c, 0):.1f}" for c in concurrency]
        cells += [f"{r.hit_rate:.1%}", f"{r.bytes_per_token / 1e6:.3f}", f"{r.waves_per_step:.2f}", f"{r.plan_us_per_layer_step:.0f}", ratio]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(results: list[ModeResult], cfg: BenchConfig, out_dir: Path, command: str) -> Path:
    """bench.md, bench.json, bench.png (if matplotlib is installed) and command.txt."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "command.txt").write_text(command + "\n")
    table = markdown_table(results, cfg.concurrency)
    (out_dir / "bench.md").write_text(f"```\n{command}\n```\n\n{table}\n")
    payload = {"config": asdict(cfg), "results": [asdict(r) for r in results], "command": command}
    (out_dir / "bench.json").write_text(json.dumps(payload, indent=2, default=str))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no bench.png (pip install 'pagedexperts[plots]')")
        return out_dir
    labels = [r.mode if r.mode != "paged" else f"paged K={r.num_resident}" for r in results]
    fig, ax = plt.subplots(figsize=(max(6, len(results) * 1.3), 4))
    ax.bar(labels, [r.decode_tok_s for r in results], color="tab:blue")
    ax.set_ylabel("single-stream decode tok/s")
    ax.set_title("pagedexperts bench")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=100)
    plt.close(fig)
    return out_dir
