"""The scheduler on fixed schedules: its logits against the model run directly, the masks,
batched prefill, scoring a prompt (max_tokens 0), and the bounded queue.

Teacher forcing is the oracle: each request's per-step logits inside a batch (batched
prefill, then batched decode with left padding and a 2D mask) must match the model run
directly, alone and unpadded, on prompt + the tokens the scheduler generated, to float32
batching noise (``LOGIT_ATOL``). A mask that hides or adds one position moves logits by
whole units, far above it.
"""

from __future__ import annotations

import time

import pytest

from support.serving_fixtures import (CONTEXT, HAVE_MODEL, MAX_TOKENS, MODEL_PATH, PROMPTS, load_model, one_thread,  # noqa: F401
                              ref, run_schedule, schedule, torch)
from support.serving_fixtures import assert_scored_prompt
from pagedexperts.engine.sampling import SamplingParams
from pagedexperts.engine.batching import decode_mask, prefill_batches, prefill_inputs
from pagedexperts.engine.scheduler import BatchScheduler
from pagedexperts.engine.scheduler_config import QueueFull, SchedulerConfig, SchedulerStopped

LOGIT_ATOL = 1e-3

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")


class RecordingScheduler(BatchScheduler):
    """Keeps every logits row the scheduler samples from, per request id."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits: dict[int, list[torch.Tensor]] = {}

    def _accept(self, req, logits):
        self.logits.setdefault(req.request_id, []).append(logits.clone())
        super()._accept(req, logits)


# ---- pure parts ----

def test_decode_mask_rows():
    mask = decode_mask([3, 5, 1], 5)
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1],
                             [1, 1, 1, 1, 1, 1],
                             [0, 0, 0, 0, 1, 1]]
    for row, n in zip(mask, [3, 5, 1]):
        assert int(row.sum()) == n + 1 and int(row[-1]) == 1


def test_prefill_inputs_left_pad_and_positions():
    ids, mask, pos = prefill_inputs([[7, 8, 9], [5]], pad_id=0)
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_prefill_batches_respect_the_token_budget():
    assert prefill_batches([3, 3, 3], 9) == [[0, 1, 2]]
    assert prefill_batches([3, 3, 3], 8) == [[0, 1], [2]]
    assert prefill_batches([2, 10, 2], 20) == [[0, 1], [2]]
    assert prefill_batches([4, 4], 1) == [[0], [1]]  # 1 = one prompt per forward


# ---- the model ----

@pytest.mark.parametrize("max_running,chunked", [(1, True), (8, True), (8, False)])
def test_per_step_logits_match_teacher_forcing(ref, max_running, chunked):
    """Every prompt, every step: scheduler logits == a direct forward on prompt + generated."""
    model, tokenizer = ref
    sched = RecordingScheduler(model, tokenizer, SchedulerConfig(max_running, CONTEXT, chunked_prefill=chunked))
    ids, stats = run_schedule(sched, tokenizer, PROMPTS), sched.stats
    sched_logits = sched.logits
    if max_running == 8:
        assert (stats.prefill_steps, stats.max_decode_batch) == (1, 8)
    worst = 0.0
    for k, (prompt, out) in enumerate(zip(PROMPTS, ids)):
        prompt_ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            direct = model(input_ids=torch.tensor([prompt_ids + out[:-1]])).logits[0, len(prompt_ids) - 1:]
        got = torch.stack(sched_logits[k + 1])
        assert got.shape == direct.shape
        diff = (got - direct).abs().max().item()
        worst = max(worst, diff)
        assert diff < LOGIT_ATOL, f"{prompt!r}: max |logit diff| {diff:.3g} (mean {(got - direct).abs().mean():.3g})"
    print(f"\nmax_running {max_running}: max |logit diff| vs teacher forcing {worst:.3g}")


def test_batched_prefill_one_forward_and_same_tokens_as_one_at_a_time(ref):
    model, tokenizer = ref
    together, s1 = schedule(model, tokenizer, PROMPTS, max_running=8, chunked_prefill=False)
    apart, s2 = schedule(model, tokenizer, PROMPTS, max_running=8, max_prefill_tokens=1, chunked_prefill=False)
    assert (s1.prefill_steps, s1.max_prefill_batch, s1.prefill_rows) == (1, 8, 8)
    assert (s2.prefill_steps, s2.max_prefill_batch) == (8, 1)
    assert together[0] and together == apart


def test_paged_equals_unpaged_with_batched_prefill(ref):
    """K = top_k (paging, several waves per step) and K = E on the same batched schedule."""
    model, tokenizer = ref
    paged, _ = schedule(model, tokenizer, PROMPTS, max_running=8, chunked_prefill=False)
    full_model, _ = load_model(MODEL_PATH, num_resident=model.pagedexperts.num_experts)
    with torch.no_grad():
        full, _ = schedule(full_model, tokenizer, PROMPTS, max_running=8, chunked_prefill=False)
    assert paged == full


def test_score_only_prompt_logprobs(ref):
    """max_new_tokens 0 with prompt logprobs: one prefill, the prompt's log_softmax, no token."""
    model, tokenizer = ref
    sched = BatchScheduler(model, tokenizer, SchedulerConfig(4, CONTEXT))
    events = []
    prompt = tokenizer(PROMPTS[2])["input_ids"]
    params = SamplingParams(max_new_tokens=0, logprobs=2, prompt_logprobs=True)
    sched.submit(prompt, params, events.append)
    sched.submit(tokenizer(PROMPTS[0])["input_ids"], SamplingParams(max_new_tokens=3), lambda e: None)
    while sched.num_running or sched.num_waiting:
        sched.step()
    assert_scored_prompt(model, events, prompt, top=2)


def test_queue_bound_counts_only_what_cannot_be_admitted(ref):
    """--max-queued-requests 2 beside 4 running places: an idle server takes a burst of 6 (4 are
    admitted at the next step, 2 wait) and refuses the 7th; once a place frees, one more fits,
    and a request of 2 sequences that would leave 3 waiting is refused whole."""
    model, tokenizer = ref
    sched = BatchScheduler(model, tokenizer, SchedulerConfig(4, CONTEXT, max_queued_requests=2))
    p = tokenizer("x")["input_ids"]

    def one(n=5):
        return p, SamplingParams(max_new_tokens=n, logit_bias=((0, -100.0),)), lambda e: None

    for n in (1, 5, 5, 5, 5, 5):
        sched.submit(*one(n))
    with pytest.raises(QueueFull, match="4 running places are free.*at most 2 may wait.*--max-queued-requests"):
        sched.submit(*one())
    assert (sched.num_waiting, sched.free_places) == (6, 4)
    sched.step()  # admits 4 and prefills them; the first (1 token) finishes and frees its place
    assert (sched.num_running, sched.num_waiting, sched.free_places) == (3, 2, 1)
    sched.submit(*one())
    with pytest.raises(QueueFull):
        sched.submit_many([one(), one()])
    assert sched.num_waiting == 3
    while sched.num_running or sched.num_waiting:
        sched.step()
    assert sched.free_places == 4 and sched.stats.finished == 7


def test_a_request_cancelled_while_queued_frees_no_place_it_never_held(ref):
    """1 running place, 1 may wait: A runs, B waits and its client leaves. B ends cancelled at the
    next step without touching the running places (a cancelled queued request that gave back a
    place made room for two), so the bound still holds: C waits, D is refused."""
    model, tokenizer = ref
    sched = BatchScheduler(model, tokenizer, SchedulerConfig(1, CONTEXT, max_queued_requests=1))
    p = tokenizer("x")["input_ids"]
    events = {name: [] for name in "ABCD"}

    def one(name):
        return p, SamplingParams(max_new_tokens=20, logit_bias=((0, -100.0),)), events[name].append

    a = sched.submit(*one("A"))
    sched.step()  # A admitted and running
    b = sched.submit(*one("B"))
    assert (sched.num_running, sched.num_waiting, sched.free_places) == (1, 1, 0)
    sched.cancel(b)
    sched.step()  # B leaves the queue, cancelled; A decodes on
    assert events["B"][-1].finish_reason == "cancelled" and a.finished_s is None
    assert (sched.num_running, sched.num_waiting, sched.free_places) == (1, 0, 0)
    sched.submit(*one("C"))
    with pytest.raises(QueueFull, match="0 running places are free"):
        sched.submit(*one("D"))
    sched.step()
    assert sched.num_running == 1 and sched.num_waiting == 1  # C still waits behind A
    while sched.num_running or sched.num_waiting:
        sched.step()
    assert [events[n][-1].finish_reason for n in "AC"] == ["length", "length"] and not events["D"]


def test_stop_ends_unfinished_with_a_final_event(ref):
    model, tokenizer = ref
    sched = BatchScheduler(model, tokenizer, SchedulerConfig(1, CONTEXT))
    events = []
    for prompt in PROMPTS[:2]:
        sched.submit(tokenizer(prompt)["input_ids"], SamplingParams(max_new_tokens=50), events.append)
    sched.step()  # the first is running, the second queued
    sched.stop(reason="test shutdown")
    finals = [e for e in events if e.finish_reason is not None]
    assert [e.finish_reason for e in finals] == ["abort", "abort"]
    assert all(e.error == "test shutdown" for e in finals)
    assert sched.stats.aborted == 2


def test_submit_after_stop_is_refused(ref):
    """Nothing steps a request queued after stop: it is refused, never left waiting forever."""
    model, tokenizer = ref
    sched = BatchScheduler(model, tokenizer, SchedulerConfig(1, CONTEXT))
    sched.stop()
    with pytest.raises(SchedulerStopped, match="shutting down"):
        sched.submit(tokenizer("x")["input_ids"], SamplingParams(max_new_tokens=1), lambda e: None)
    assert sched.num_waiting == 0


def test_a_freed_place_is_refilled_in_the_next_step_and_the_wait_is_reported(ref):
    """Hand-counted plan, cap 2, chunked prefill: step 1 prefills A and B (first tokens);
    step 2 gives A its 2nd and last token (A finishes) and B its 2nd; C, queued since the
    start, is admitted at step 3 and prefilled in that same forward as B's decode (its first
    token at step 3, no step lost). Each final event's ``queue_s`` is its arrival-to-admission
    time: ~0 for A and B, at least the two steps A ran for C."""
    model, tokenizer = ref
    sched = BatchScheduler(model, tokenizer, SchedulerConfig(2, CONTEXT))
    finals = {}
    a, b, c = (sched.submit(tokenizer(p)["input_ids"], SamplingParams(max_new_tokens=n, logit_bias=((0, -100.0),)),
                            lambda e, k=k: finals.setdefault(k, e) if e.finish_reason else None)
               for k, (p, n) in enumerate(zip(PROMPTS[:3], (2, 5, 1))))
    sched.step()
    assert (len(a.output_ids), len(b.output_ids), c.admitted_s) == (1, 1, None)
    sched.step()
    assert a.finished_s is not None and len(b.output_ids) == 2 and c.admitted_s is None and sched.num_waiting == 1
    mixed, step3 = sched.stats.mixed_steps, time.perf_counter()
    sched.step()
    assert step3 <= c.admitted_s < c.first_token_s  # admitted at the step's start, before its forward
    assert c.admitted_s >= a.finished_s and len(c.output_ids) == 1 and len(b.output_ids) == 3
    assert sched.stats.mixed_steps == mixed + 1  # C's prompt rode in B's decode forward
    while sched.num_running:
        sched.step()
    for k, req in enumerate((a, b, c)):
        assert finals[k].queue_s == pytest.approx(req.admitted_s - req.submitted_s)
        assert finals[k].ttft_s > finals[k].queue_s
    assert finals[2].queue_s >= a.finished_s - c.submitted_s > finals[0].queue_s
