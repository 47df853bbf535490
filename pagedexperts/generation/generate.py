"""Text generation on a paged model, with timing and the paging report.

Owns: one prompt -> streamed text through transformers' ``generate`` (sampling and stopping at
a stop string are transformers'; the text shown is cut before the stop string by
``stop_text``, as the server does), the TTFT / decode tok/s measurement, the split of paging
counters into prefill and decode, and the human-readable report. Does not: load
models (``loading``), batch requests (``engine``), or page (``paging``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from pagedexperts.generation.config import GREEDY, SamplingConfig, check_context
from pagedexperts.generation.graphs import decode_graphs_for
from pagedexperts.generation.static_decode import DecodeOptions, static_generate
from pagedexperts.generation.stop_text import REPLACEMENT_CHAR, IncrementalText
from pagedexperts.stats.accounting import ModelStats


@dataclass
class GenerationResult:
    """One generation: text, token counts, timings (seconds, tok/s) and paging counters: ``paging``
    the whole call's ``ModelStats.as_dict()``, ``prefill`` / ``decode`` each phase's totals;
    ``speculative`` the acceptance counters (empty without --speculative); ``cuda_graphs`` how decode
    steps ran; ``finish_reason`` OpenAI's "stop" or "length".
    """

    text: str
    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    decode_tok_s: float
    total_s: float
    paging: dict = field(default_factory=dict)
    prefill: dict = field(default_factory=dict)
    decode: dict = field(default_factory=dict)
    speculative: dict = field(default_factory=dict)
    cuda_graphs: dict = field(default_factory=dict)
    finish_reason: str = ""


class _TimingStreamer:
    """A transformers streamer (``put`` the prompt, then each new token; ``end``) that timestamps
    tokens, snapshots paging stats after prefill, and forwards the text a reader may see to
    ``on_text``: the decode of every new token so far through ``stop_text.IncrementalText``, the
    server's rule (a stop string is never shown, not even in part; with ``min_tokens``, one that
    ends in the text of the first min_tokens tokens does not count). ``text`` is the final text."""

    def __init__(self, tokenizer, on_text: Callable[[str], None] | None, snapshot: Callable[[], dict],
                 stops: tuple[str, ...], min_tokens: int = 0):
        self._tokenizer = tokenizer
        self._on_text = on_text
        self._snapshot = snapshot
        self._shown = IncrementalText(stops)
        self._min_tokens = min_tokens
        self._prompt_seen = False
        self._ids: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string ended the text
        self.token_times: list[float] = []
        self.after_prefill: dict | None = None

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # transformers puts the prompt first
            self._prompt_seen = True
            return
        self.token_times.append(time.perf_counter())
        if self.after_prefill is None:
            self.after_prefill = self._snapshot()
        self._ids += value.reshape(-1).tolist()
        self._show(complete=False)

    def end(self) -> None:
        self._show(complete=True)

    def _show(self, *, complete: bool) -> None:
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if len(self._ids) <= self._min_tokens:  # the server's rule (engine.scheduler): their text holds no stop
            self._shown.stop_from = len(text.rstrip(REPLACEMENT_CHAR))
        delta, stopped = self._shown.update(text, complete)
        self.stopped |= stopped
        self.text += delta
        if self._on_text is not None and delta:
            self._on_text(delta)


class HeldStopStrings(StoppingCriteria):
    """transformers' ``StopStringCriteria`` over ``stops``, counted only once more than ``min_tokens``
    tokens follow the ``prompt_tokens``: a stop string ends generation only where it ends in the text
    of a token after the first min_tokens (serve's ``min_tokens``, vLLM's)."""

    def __init__(self, tokenizer, stops: tuple[str, ...], *, prompt_tokens: int, min_tokens: int) -> None:
        from transformers.generation.stopping_criteria import StopStringCriteria

        self.inner = StopStringCriteria(tokenizer=tokenizer, stop_strings=list(stops))
        self.after = prompt_tokens + min_tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.inner(input_ids, scores, **kwargs) & (input_ids.shape[1] > self.after)


def _totals(stats: ModelStats, *, times: bool = True) -> dict:
    d = stats.as_dict(times=times)
    d.pop("layers")
    return d


def _difference(after: dict, before: dict) -> dict:
    keys = ("tokens", "hits", "misses", "bytes_paged", "waves", "multi_wave_steps", "page_in_s", "plan_s", "sync_s",
            "host_hits", "host_misses", "disk_reads", "disk_bytes_read", "disk_read_s", "host_syncs", "page_ins",
            "in_place_rows", "in_place_bytes", "zero_copy_page_ins")
    out = {k: after[k] - before[k] for k in keys}
    total = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / total if total else 0.0
    host_total = out["host_hits"] + out["host_misses"]
    out["host_hit_rate"] = out["host_hits"] / host_total if host_total else 0.0
    out["disk_bytes_per_token"] = out["disk_bytes_read"] / out["tokens"] if out["tokens"] else 0.0
    out["misses_per_token"] = out["misses"] / out["tokens"] if out["tokens"] else 0.0
    out["bytes_per_token"] = out["bytes_paged"] / out["tokens"] if out["tokens"] else 0.0
    out["host_syncs_per_token"] = out["host_syncs"] / out["tokens"] if out["tokens"] else 0.0
    out["in_place_rows_per_token"] = out["in_place_rows"] / out["tokens"] if out["tokens"] else 0.0
    out["in_place_bytes_per_token"] = out["in_place_bytes"] / out["tokens"] if out["tokens"] else 0.0
    return out


def build_prompt(tokenizer, prompt: str, *, chat: bool) -> str:
    """The prompt text, through the tokenizer's chat template when ``chat`` is set.

    Raises:
        ValueError: ``chat`` but the tokenizer has no chat template (drop --chat).
    """
    if not chat:
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; drop --chat")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def prompt_inputs(model, tokenizer, prompt: str, max_new_tokens: int, *, chat: bool = False):
    """The tokenized prompt (``build_prompt``; a BatchEncoding on the model's device), checked to
    leave ``max_new_tokens`` positions (``config.check_context``).

    Raises:
        ValueError: --chat without a chat template; a prompt too long for the model's positions.
    """
    inputs = tokenizer(build_prompt(tokenizer, prompt, chat=chat), return_tensors="pt").to(model.device)
    check_context(inputs["input_ids"].shape[1], max_new_tokens,
                  int(getattr(model.config, "max_position_embeddings", 0) or 0))
    return inputs


def generate_text(
    model,
    tokenizer,
    prompt: str,
    sampling: SamplingConfig,
    *,
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
    logits_processor: Callable | None = None,
    min_tokens: int = 0,
) -> GenerationResult:
    """Generate from ``prompt`` on a model from ``load_model``, streaming text to ``on_text``. TTFT:
    seconds from the call to the first new token; decode tok/s: (new tokens - 1) / seconds from the
    first to the last. ``logits_processor``: (ids [1, t], logits [1, V]) -> scores [1, V] to choose
    from, in place of transformers' warpers and the checkpoint's sampling knobs; ``min_tokens``: a
    stop string counts only where it ends after the first min_tokens tokens' text.

    Raises:
        ValueError: bad sampling options, empty prompt, --chat without a chat template, or prompt +
            --max-new-tokens over max_position_embeddings (``config.check_context``).
    """
    sampling.validate()
    if not prompt:
        raise ValueError("empty prompt; give --prompt TEXT or text on stdin")
    if tokenizer is None:
        raise ValueError("the model directory has no tokenizer (tokenizer.json / tokenizer_config.json); add one")
    runtime = model.pagedexperts
    inputs = prompt_inputs(model, tokenizer, prompt, sampling.max_new_tokens, chat=chat)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    runtime.reset_stats()
    streamer = _TimingStreamer(tokenizer, on_text, lambda: _totals(runtime.stats(), times=False), tuple(sampling.stop),
                               min_tokens)
    kwargs = dict(max_new_tokens=sampling.max_new_tokens, streamer=streamer, pad_token_id=tokenizer.pad_token_id)
    if logits_processor is not None:  # it owns every knob: transformers' own are cleared
        kwargs.update(GREEDY, do_sample=sampling.temperature > 0, min_p=None, repetition_penalty=None,
                      logits_processor=LogitsProcessorList([logits_processor]))
    elif sampling.temperature > 0:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p)
    else:
        kwargs.update(GREEDY)
    if sampling.stop and min_tokens:
        kwargs.update(stopping_criteria=StoppingCriteriaList([HeldStopStrings(
            tokenizer, tuple(sampling.stop), prompt_tokens=inputs["input_ids"].shape[1], min_tokens=min_tokens)]))
    elif sampling.stop:
        kwargs.update(stop_strings=list(sampling.stop), tokenizer=tokenizer)
    graphs = decode_graphs_for(model)
    start = time.perf_counter()
    if graphs is None:
        with torch.no_grad():
            out = model.generate(**inputs, **kwargs)
    else:  # decode steps replayed from CUDA graphs over a static cache (prefill eager)
        opts = DecodeOptions(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                             top_p=sampling.top_p, stop_strings=tuple(sampling.stop), tokenizer=tokenizer,
                             pad_token_id=tokenizer.pad_token_id, logits_processor=logits_processor,
                             min_tokens=min_tokens)
        out = static_generate(model, graphs, inputs["input_ids"], inputs["attention_mask"], opts, streamer=streamer)
    end = time.perf_counter()
    new = out[0, inputs["input_ids"].shape[1]:]
    times = streamer.token_times
    total = _totals(runtime.stats())
    before = streamer.after_prefill or total
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    return GenerationResult(
        text=streamer.text,
        prompt_tokens=int(inputs["input_ids"].shape[1]),
        new_tokens=int(new.shape[0]),
        ttft_s=(times[0] - start) if times else end - start,
        decode_tok_s=(len(times) - 1) / decode_s if decode_s > 0 else 0.0,
        total_s=end - start,
        paging=runtime.stats().as_dict(),
        prefill=before,
        decode=_difference(total, before),
        cuda_graphs=graphs_field(runtime, graphs),
        finish_reason="stop" if streamer.stopped or _ends_sequence(model, new) else "length",
    )


def _ends_sequence(model, new: torch.Tensor) -> bool:
    """Whether the last new token is one of the model's end-of-sequence ids (generation_config)."""
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, (list, tuple)) else {eos} - {None}
    return bool(new.numel()) and int(new[-1]) in eos


def graphs_field(runtime, graphs) -> dict:
    """The stats field of decode graphs: enabled, backend, counters (``DecodeGraphs.summary``)
    or the reason they were off."""
    if graphs is None:
        return dict(enabled=False, reason=runtime.resolved.reasons["cuda_graphs"])
    return dict(enabled=True, **graphs.summary())


def _p50_p99(name: str, summary: dict) -> str:
    if not summary["count"]:
        return f"{name} -"
    return f"{name} {1e6 * summary['p50']:.0f}/{1e6 * summary['p99']:.0f} us"


def format_report(result: GenerationResult, *, num_resident: int, num_experts: int, top_k: int,
                  decide: str = "host") -> str:
    """A short human-readable paging report of one generation (``decide``: where the paged
    steps were planned, ``model.pagedexperts.decide``)."""
    p, d, s = result.paging, result.decode, result.speculative
    layers = len(p["layers"])
    if s:  # one decode figure: per token generated (a verification also routes the rejected proposals)
        misses = (f"  misses/token {p['misses_per_token']:.2f} overall; in decode {s['misses_per_generated_token']:.2f} "
                  "per generated token (rejected proposals' routing included)")
        paged = (f"  bytes paged/token {p['bytes_per_token'] / 1e6:.3f} MB overall; in decode "
                 f"{s['bytes_per_generated_token'] / 1e6:.3f} MB per generated token")
    else:
        misses = (f"  misses/token {p['misses_per_token']:.2f} overall, {d['misses_per_token']:.2f} in decode"
                  f" (all layers; all-miss bound {layers * top_k})")
        paged = f"  bytes paged/token {p['bytes_per_token'] / 1e6:.3f} MB overall, {d['bytes_per_token'] / 1e6:.3f} MB in decode"
    if p.get("in_place_rows"):  # --beyond-k in-place: the misses read from the host store, not paged in
        paged += (f"; read in place (--beyond-k in-place) {p['in_place_bytes_per_token'] / 1e6:.3f} MB/token "
                  f"({p['in_place_rows_per_token']:.2f} rows) overall, {d['in_place_bytes_per_token'] / 1e6:.3f} MB "
                  f"({d['in_place_rows_per_token']:.2f} rows) in decode; page-ins {p['page_ins']}")
    if p.get("zero_copy_page_ins"):  # slots in the CPU kernels' layout reading host rows in place
        paged += (f"; {p['zero_copy_page_ins'] / p['page_ins']:.0%} of page-ins overall, "
                  f"{d['zero_copy_page_ins'] / max(1, d['misses']):.0%} in decode read the host row in place (no copy)")
    lines = [
        f"paging: K={num_resident} of E={num_experts} experts resident per layer, top_k={top_k}, "
        f"{layers} MoE layers, {decide}-planned steps",
        f"  tokens: prompt {result.prompt_tokens}, new {result.new_tokens}"
        + (" (stopped early: an end-of-sequence token or a --stop string)" if result.finish_reason == "stop" else ""),
        f"  hit rate {p['hit_rate']:.1%} overall, {d['hit_rate']:.1%} in decode",
        misses,
        paged,
        f"  waves {p['waves']} ({p['multi_wave_steps']} layer-steps needed more than one), "
        f"union size mean {p['union_mean']:.1f} max {p['union_max']}",
        f"  host planning {1e6 * p['plan_s'] / max(1, p['layer_steps']):.0f} us per layer-step, "
        f"top-k read-back {1e6 * p['sync_s'] / max(1, p['layer_steps']):.0f} us (means); host syncs/token "
        f"{p['host_syncs_per_token']:.2f} overall, {d['host_syncs_per_token']:.2f} in decode",
        "  per layer-step p50/p99: " + ", ".join(_p50_p99(name, p["times"][key]) for key, name in
                                                 (("plan_s", "plan"), ("sync_s", "read-back"), ("page_in_s", "page-in"))),
        f"  TTFT {result.ttft_s * 1e3:.0f} ms, decode {result.decode_tok_s:.1f} tok/s",
    ]
    if s:
        lines.append(
            f"  speculative {s['method']} n={s['num_speculative_tokens']}: acceptance {s['acceptance_rate']:.1%} "
            f"({s['accepted']} of {s['proposed']} proposed), {s['mean_accepted_per_step']:.2f} accepted per "
            f"verification step ({s['steps']} steps)"
        )
    if p.get("disk_tier"):
        lines.append(
            f"  disk tier: device hit rate {d['hit_rate']:.1%}, host hit rate {d['host_hit_rate']:.1%} in decode; "
            f"disk reads {p['disk_reads']}, {d['disk_bytes_per_token'] / 1e6:.3f} MB/token in decode, "
            f"read p50 {p['disk_read_p50_s'] * 1e3:.2f} ms p99 {p['disk_read_p99_s'] * 1e3:.2f} ms; read-ahead "
            f"{p['read_ahead_used']} of {p['read_ahead_issued']} used ({p['read_ahead_bytes_used'] / 1e6:.1f} MB), "
            f"{p['read_ahead_wasted']} wasted ({p['read_ahead_bytes_wasted'] / 1e6:.1f} MB), {p['read_ahead_held']} held"
        )
    g = result.cuda_graphs
    if g.get("enabled"):
        lines.append(f"  CUDA graphs ({g['backend']}): {g['captures']} captures, {g['replays']} replays, "
                     f"{g['eager_steps']} eager decode steps, {g['invalidations']} invalidations"
                     + (f"; WARNING fell back: {'; '.join(g['fallbacks'])}" if g["fallbacks"] else ""))
    elif g:
        lines.append(f"  CUDA graphs off: {g.get('reason')}")
    if p.get("fallbacks"):
        lines.append("  WARNING fallbacks: " + "; ".join(p["fallbacks"]))
    return "\n".join(lines)
