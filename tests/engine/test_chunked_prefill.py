"""Chunked prefill: prompt chunks packed with running decodes in one forward, no padding.

Oracles: a hand-written mask; the unpaged transformers model on the SAME packed batch
(torch.equal, at 1 thread and at torch's default count); greedy tokens of unchunked serving
(one prompt per forward); the prompt's log_softmax from a direct forward (scoring).
"""

from __future__ import annotations

import math

import pytest

from support.serving_fixtures import (CONTEXT, HAVE_MODEL, MODEL_PATH, PROMPTS, load_model, one_thread,  # noqa: F401
                              ref, run_schedule, schedule, torch)
from support.serving_fixtures import assert_scored_prompt
from pagedexperts.engine.chunked_prefill import Segment, keep_new_kv, pack, packed_mask, plan_chunks
from pagedexperts.engine.sampling import SamplingParams
from pagedexperts.engine.scheduler import BatchScheduler
from pagedexperts.engine.scheduler_config import SchedulerConfig

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")

LONG = " ".join(PROMPTS)  # ~60 tokens: several chunks at a budget of 8


def test_plan_chunks_first_come_first_served_under_the_budget():
    assert plan_chunks([5, 5, 5], 12) == [5, 5, 2]
    assert plan_chunks([20, 3], 8) == [8, 0]
    assert plan_chunks([1, 1], 1) == [1, 0]


def test_packed_mask_by_hand():
    """Segment 0: 2 cached + 1 new (a decode); segment 1: 0 cached + 2 new (a first chunk);
    segment 2: 1 cached + 2 new. Keys: the 3 cached, then the 5 new."""
    m = packed_mask([2, 0, 1], [1, 2, 2], form="sdpa", dtype=torch.float32)
    assert m.shape == (1, 1, 5, 8) and m.dtype == torch.bool
    assert m[0, 0].int().tolist() == [[1, 1, 0, 1, 0, 0, 0, 0],
                                      [0, 0, 0, 0, 1, 0, 0, 0],
                                      [0, 0, 0, 0, 1, 1, 0, 0],
                                      [0, 0, 1, 0, 0, 0, 1, 0],
                                      [0, 0, 1, 0, 0, 0, 1, 1]]
    eager = packed_mask([2, 0, 1], [1, 2, 2], form="eager", dtype=torch.float32)[0, 0]
    assert torch.equal(eager == 0, m[0, 0]) and bool((eager[~m[0, 0]] == torch.finfo(torch.float32).min).all())
    with pytest.raises(ValueError, match="--no-chunked-prefill"):
        packed_mask([1], [1], form="flash_attention_2", dtype=torch.float32)


def _mid_prefill_requests(model, tokenizer, budget=8, *, static_kv=False):
    """A scheduler stepped until the long prompt is half prefilled while the others decode
    (per-request KV buffers, ``pack``'s input, unless ``static_kv``)."""
    sched = BatchScheduler(model, tokenizer, SchedulerConfig(4, CONTEXT, max_prefill_tokens=budget, static_kv=static_kv))
    for p in PROMPTS[:3]:
        sched.submit(tokenizer(p)["input_ids"], SamplingParams(max_new_tokens=20), lambda e: None)
    sched.step()  # the short prompts prefill (two steps at this budget), then decode
    sched.step()
    sched.submit(tokenizer(LONG)["input_ids"], SamplingParams(max_new_tokens=4), lambda e: None)
    sched.step()
    sched.step()
    running = list(sched._running)
    assert any(r.output_ids for r in running) and any(0 < r.length < len(r.prompt_ids) for r in running)
    return sched, running


@pytest.mark.parametrize("threads", [1, 0])
def test_paged_equals_unpaged_on_the_same_packed_batch(ref, threads):
    """Decodes and a prompt chunk in one packed forward: the paged model (K = top_k, several
    waves) gives the unpaged transformers model's logits, bit for bit."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = ref
    unpaged = AutoModelForCausalLM.from_pretrained(MODEL_PATH, experts_implementation="grouped_mm").eval()
    sched, running = _mid_prefill_requests(model, tokenizer)
    segments = [Segment(r, (r.output_ids[-1],)) if r.output_ids else Segment(r, tuple(r.prompt_ids[r.length:][:8]), "all")
                for r in running]
    before = torch.get_num_threads()
    torch.set_num_threads(threads or _default_threads())  # 0: torch's default (the cores)
    try:
        got = []
        for m in (model, unpaged):
            b = pack(segments, form=sched._mask_form, dtype=torch.float32, device="cpu")
            assert b.input_ids.shape[0] == 1 and b.attention_mask.shape[-2] == b.input_ids.shape[1]  # packed, no pad
            with torch.no_grad():
                got.append(m(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                             **{sched.forwards._cache_kwarg: b.cache}, use_cache=True, logits_to_keep=b.keep).logits)
    finally:
        torch.set_num_threads(before)
    d = (got[0] - got[1]).abs()
    assert torch.equal(got[0], got[1]), f"max |diff| {d.max():.3g}, mean {d.mean():.3g}"
    assert model.pagedexperts.stats().total().multi_wave_steps > 0


def _default_threads() -> int:
    import os

    return len(os.sched_getaffinity(0))


def test_packed_forward_equals_the_model_run_alone(ref):
    """Each segment's kept logits in a packed step == the model on that request alone (its
    cached prefix + the new tokens, no cache), to float32 batching noise; and the new keys /
    values land in each request's own buffer (the next step reads them)."""
    model, tokenizer = ref
    sched, running = _mid_prefill_requests(model, tokenizer)
    segments = [Segment(r, (r.output_ids[-1],)) if r.output_ids else Segment(r, tuple(r.prompt_ids[r.length:][:8]), "all")
                for r in running]
    seqs = [list(s.request.prompt_ids + s.request.output_ids)[: s.start] + list(s.token_ids) for s in segments]
    b = pack(segments, form=sched._mask_form, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                       **{sched.forwards._cache_kwarg: b.cache}, use_cache=True, logits_to_keep=b.keep).logits[0]
        keep_new_kv(b)
        for seg, rows, ids in zip(segments, b.rows, seqs):
            direct = model(input_ids=torch.tensor([ids])).logits[0, -len(seg.token_ids):]
            want = direct[-1:] if seg.keep == "last" else direct
            assert (logits[rows] - want).abs().max() < 1e-3
            assert seg.request.length == len(ids)


def test_greedy_tokens_equal_unchunked_serving(ref):
    """A budget of 3 prompt tokens per step: prompts take several steps, sharing forwards with
    decodes; the greedy tokens equal one prompt per forward, unchunked."""
    model, tokenizer = ref
    prompts = PROMPTS + [LONG]
    chunked, s1 = schedule(model, tokenizer, prompts, max_running=4, max_prefill_tokens=3)
    apart, _ = schedule(model, tokenizer, prompts, max_running=4, max_prefill_tokens=1, chunked_prefill=False)
    assert chunked == apart
    assert s1.mixed_steps > 0 and s1.prefill_tokens == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert s1.prefill_steps >= math.ceil(s1.prefill_tokens / 3)


def test_paged_equals_unpaged_under_chunked_serving(ref):
    model, tokenizer = ref
    paged, _ = schedule(model, tokenizer, PROMPTS + [LONG], max_running=4, max_prefill_tokens=5)
    full_model, _ = load_model(MODEL_PATH, num_resident=model.pagedexperts.num_experts)
    full, _ = schedule(full_model, tokenizer, PROMPTS + [LONG], max_running=4, max_prefill_tokens=5)
    assert paged == full


def test_a_long_prompt_is_prefilled_over_steps_while_others_decode(ref):
    model, tokenizer = ref
    sched = BatchScheduler(model, tokenizer, SchedulerConfig(2, CONTEXT, max_prefill_tokens=8))
    short = sched.submit(tokenizer(PROMPTS[0])["input_ids"], SamplingParams(max_new_tokens=30), lambda e: None)
    sched.step()
    assert len(short.output_ids) == 1
    long_ids = tokenizer(LONG)["input_ids"]
    long = sched.submit(long_ids, SamplingParams(max_new_tokens=2), lambda e: None)
    steps = math.ceil(len(long_ids) / 8)
    for i in range(steps):
        assert long.length == 8 * i and not long.output_ids
        sched.step()
        assert len(short.output_ids) == 2 + i  # the running stream moved every step
    assert long.length == len(long_ids) and len(long.output_ids) == 1
    assert sched.stats.mixed_steps == steps


def test_scoring_is_chunked_and_equals_a_direct_forward(ref):
    """echo + logprobs (max_tokens 0) over a long prompt at a budget of 8: several steps, a
    decode moving in each, and the prompt's log_softmax of one direct forward."""
    model, tokenizer = ref
    sched = BatchScheduler(model, tokenizer, SchedulerConfig(4, CONTEXT, max_prefill_tokens=8))
    events, other = [], []
    prompt = tokenizer(LONG)["input_ids"]
    sched.submit(tokenizer(PROMPTS[0])["input_ids"], SamplingParams(max_new_tokens=40), other.append)
    sched.step()
    sched.submit(prompt, SamplingParams(max_new_tokens=0, logprobs=2, prompt_logprobs=True), events.append)
    steps = 0
    while not events:
        sched.step()
        steps += 1
    assert steps == math.ceil(len(prompt) / 8) and len(other) >= steps  # the stream got a token each step
    assert_scored_prompt(model, events, prompt, top=2)
