"""Per-sequence sampling of the server: the stop cut, tiny temperatures, penalties, logprobs,
and vLLM's / SGLang's extensions (top_k, min_p, repetition_penalty, min_tokens) by hand, against
transformers' logits processors, and per request in one batch of the scheduler.

The stop-cut tables feed ``IncrementalText`` the decode of every prefix of a byte string
(what the scheduler sees after each byte-level token) and check, after EVERY step, that the
text shown so far is a prefix of the expected answer: no byte of a stop string ever reaches
a client, streaming (deltas after each token) or not (the joined deltas at the end).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedexperts.engine.sampling import (GREEDY_BELOW, SamplingParams, adjusted_logits, sample, token_logprobs,
                                           warped_probs)
from pagedexperts.generation.stop_text import IncrementalText, stop_cut

CASES = [  # (full text, stop strings, what the client must get, stopped?)
    ("say 世界 😀 ok then", ("界 😀",), "say 世", True),  # issue 11's example
    ("say 世界 😀 ok then", ("😀",), "say 世界 ", True),
    ("say 世界 😀 ok then", ("世界 😀 ok then!",), "say 世界 😀 ok then", False),  # never completed
    ("hello abc world", ("abc",), "hello ", True),
    ("hello abc world", ("xyz", "c w", "abd"), "hello ab", True),
    ("hello abc world", ("world", "lo a"), "hel", True),
    ("aaab", ("aab",), "a", True),
    ("ab ab abc", ("abc",), "ab ab ", True),
    ("no stop here", ("zz", "q"), "no stop here", False),
    ("ends with st", ("stop",), "ends with st", False),  # released when the text is complete
    ("ü€😀x", ("€😀",), "ü", True),
    ("ü€😀x", ("😀x",), "ü€", True),
    ("\U0001F600\U0001F601", ("\U0001F601",), "\U0001F600", True),
]


def _decodes(text: str) -> list[str]:
    """The decode after each byte: what a byte-level tokenizer yields token by token."""
    raw = text.encode("utf-8")
    return [raw[:n].decode("utf-8", errors="replace") for n in range(1, len(raw) + 1)]


def _run(steps: list[str], stops) -> tuple[list[str], bool]:
    """Deltas of ``IncrementalText`` over successive decodes; stops at a stop string."""
    inc, deltas = IncrementalText(tuple(stops)), []
    for i, text in enumerate(steps):
        delta, stopped = inc.update(text, complete=i == len(steps) - 1)
        deltas.append(delta)
        if stopped:
            return deltas, True
    return deltas, False


@pytest.mark.parametrize("text, stops, want, stops_it", CASES)
def test_stream_never_shows_a_byte_of_a_stop_string(text, stops, want, stops_it):
    deltas, stopped = _run(_decodes(text), stops)
    shown = ""
    for delta in deltas:
        shown += delta
        assert want.startswith(shown), f"stream showed {shown!r}, beyond {want!r}"
    assert (shown, stopped) == (want, stops_it)


@pytest.mark.parametrize("text, stops, want, stops_it", CASES)
def test_every_prefix_length_is_cut_right(text, stops, want, stops_it):
    """stop_cut alone on every prefix: shown text is a prefix of the answer, never past it."""
    for prefix in _decodes(text):
        shown, stopped = stop_cut(prefix, tuple(stops))
        assert want.startswith(shown), f"{prefix!r}: showed {shown!r}, beyond {want!r}"
        if stopped:
            assert shown == want


@pytest.mark.parametrize("text, stops, want, stops_it", CASES)
def test_not_streaming_gets_the_same_text(text, stops, want, stops_it):
    """A whole decode at once (one token, or a non-streaming client's joined deltas)."""
    delta, stopped = IncrementalText(tuple(stops)).update(text, complete=True)
    assert (delta, stopped) == (want, stops_it)
    assert "".join(_run(_decodes(text), stops)[0]) == want


def test_real_tokenizer_multibyte_stop():
    """The bundled byte-level tokenizer, token by token, the issue's example."""
    from pagedexperts import bundled_model_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    ids = tok("say 世界 😀 ok then")["input_ids"]
    steps = [tok.decode(ids[:n], skip_special_tokens=True) for n in range(1, len(ids) + 1)]
    assert steps[-1] == "say 世界 😀 ok then"
    deltas, stopped = _run(steps, ("界 😀",))
    shown = ""
    for delta in deltas:
        shown += delta
        assert "say 世".startswith(shown), shown
    assert (shown, stopped) == ("say 世", True)


def test_tiny_temperature_is_greedy():
    logits = torch.tensor([0.5, 3.0, 2.9, -1.0])
    for t in (0.0, 1e-40, GREEDY_BELOW / 2):
        assert SamplingParams(temperature=t).greedy
        assert sample(logits, SamplingParams(temperature=t), [], None) == 1
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    gen = torch.Generator().manual_seed(0)
    got = {sample(logits, SamplingParams(temperature=GREEDY_BELOW), [], gen) for _ in range(20)}
    assert got == {1}  # a point mass to float32 precision, and no inf / nan


def test_penalties_and_logit_bias_follow_openai_formula():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((0, 10.0), (3, -1.5)))
    out = adjusted_logits(logits, params, [3, 3, 2])
    # counts: token 2 once, token 3 twice; logit -= 0.25 * count + 0.5 * (count > 0); bias added
    want = torch.tensor([1.0 + 10, 2.0, 3.0 - 0.25 - 0.5, 4.0 - 1.5 - 0.5 - 0.5])
    assert torch.equal(out, want)
    assert sample(logits, params, [3, 3, 2], None) == 0
    assert adjusted_logits(logits, SamplingParams(), [1]) is logits  # nothing to do: untouched


def test_token_logprobs_are_log_softmax_with_top_alternatives():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    out = token_logprobs(logits, [0, 1], 2, lambda i: "abc"[i])
    for row, entry in zip(logits, out):
        z = math.log(sum(math.exp(x) for x in row.tolist()))
        assert entry.logprob == pytest.approx(row[entry.token_id].item() - z, abs=1e-6)
    assert [t for t, _, _ in out[0].top] == ["c", "b"]
    assert [t for t, _, _ in out[1].top] == ["a", "b"] or [t for t, _, _ in out[1].top] == ["a", "c"]
    assert out[0].token == "a"


def test_top_k_and_min_p_by_hand():
    """top_k keeps the logits >= the k-th largest (ties kept, as TopKLogitsWarper); min_p keeps
    p >= min_p x max p (MinPLogitsWarper), i.e. logit >= max + log(min_p)."""
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0, -1.0])
    e = [math.exp(2.0), math.exp(1.0), math.exp(1.0)]
    want = torch.tensor([e[0], e[1], e[2], 0.0, 0.0]) / sum(e)
    assert torch.allclose(warped_probs(logits, 1.0, 1.0, top_k=2), want)  # the tie at 1.0 stays
    assert torch.allclose(warped_probs(logits, 1.0, 1.0, min_p=0.3), want)  # e^-1 = 0.37 >= 0.3 > e^-2
    assert torch.equal(warped_probs(logits, 1.0, 1.0, min_p=0.4), torch.tensor([1.0, 0, 0, 0, 0]))
    assert torch.equal(warped_probs(logits, 1.0, 1.0, top_k=1), torch.tensor([1.0, 0, 0, 0, 0]))
    halved = torch.tensor([math.exp(4.0), math.exp(2.0), math.exp(2.0), 1.0, math.exp(-2.0)])
    assert torch.allclose(warped_probs(logits, 0.5, 1.0, top_k=0), halved / halved.sum())  # 0: every token


def test_repetition_penalty_and_min_tokens_by_hand():
    """repetition_penalty divides positive and multiplies negative logits of prompt and output
    tokens, once per token (RepetitionPenaltyLogitsProcessor); min_tokens masks EOS while fewer
    tokens are generated (MinNewTokensLengthLogitsProcessor)."""
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    params = SamplingParams(repetition_penalty=2.0, prompt_ids=(0, 0), min_tokens=2, eos_ids=(3,))
    assert torch.equal(adjusted_logits(logits, params, [1]), torch.tensor([1.0, -2.0, 0.5, float("-inf")]))
    assert torch.equal(adjusted_logits(logits, params, [1, 1]), torch.tensor([1.0, -2.0, 0.5, 3.0]))
    assert sample(logits, params, [1], None) == 0  # EOS (the raw argmax) held back
    assert sample(logits, params, [1, 1], None) == 3


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [(1.0, 5, 1.0, 0.0), (0.7, 0, 0.9, 0.0),
                                                               (1.3, 0, 1.0, 0.1), (0.8, 8, 0.95, 0.05)])
def test_warping_equals_transformers_processors(temperature, top_k, top_p, min_p):
    """The distribution ``sample`` draws from equals transformers' warpers applied in their
    order (temperature, top_k, top_p, min_p) then softmax, on random logits."""
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    gen = torch.Generator().manual_seed(top_k + int(100 * temperature))
    logits = torch.randn(64, generator=gen) * 3
    seen = torch.tensor([[3, 7, 7, 40]])
    scores = RepetitionPenaltyLogitsProcessor(1.3)(seen, logits[None].clone())
    for warper in (TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k) if top_k else None,
                   TopPLogitsWarper(top_p) if top_p < 1 else None, MinPLogitsWarper(min_p) if min_p else None):
        scores = warper(seen, scores) if warper is not None else scores
    want = torch.softmax(scores[0], -1)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=1.3,
                            prompt_ids=(3, 7))
    from pagedexperts.engine.sampling import sampling_probs

    got = sampling_probs(adjusted_logits(logits, params, [7, 40]), params)
    assert torch.equal(got > 0, want > 0), "different tokens kept"
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


def _teacher_forced(model, ids: list[int]) -> torch.Tensor:
    """The model's next-token logits [V] on ``ids``, one direct forward, float32."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def _choice(scores: torch.Tensor, token: int, tie: float = 1e-3) -> bool:
    """Whether ``token`` is the argmax of ``scores`` (or within ``tie`` of it: batching noise)."""
    return scores[token] >= scores.max() - tie


def test_extensions_apply_per_request_in_one_batch():
    """Four requests decoded together, each with its own extension: repetition_penalty (greedy),
    top_k 1 and min_p 1 (sampled: both leave only the argmax), min_tokens with EOS pushed by
    +100. Each chosen token is checked against the model run directly on prompt + output
    (teacher forcing) with transformers' RepetitionPenaltyLogitsProcessor."""
    from support.serving_fixtures import CONTEXT, HAVE_MODEL, MODEL_PATH, PROMPTS, _top_k

    if not HAVE_MODEL:
        pytest.skip(f"no model at {MODEL_PATH}")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from pagedexperts import load_model
    from pagedexperts.engine.scheduler import BatchScheduler
    from pagedexperts.engine.scheduler_config import SchedulerConfig
    from pagedexperts.engine.sequence import eos_ids

    model, tok = load_model(MODEL_PATH, num_resident=_top_k())
    eos = tuple(sorted(eos_ids(model, tok)))
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:4]]
    params = [SamplingParams(max_new_tokens=10, temperature=0, repetition_penalty=3.0, prompt_ids=tuple(prompts[0])),
              SamplingParams(max_new_tokens=10, temperature=1.0, top_k=1, seed=5),
              SamplingParams(max_new_tokens=10, temperature=0, min_tokens=6, eos_ids=eos, logit_bias=((eos[0], 100.0),)),
              SamplingParams(max_new_tokens=10, temperature=1.0, min_p=1.0, seed=7)]
    sched = BatchScheduler(model, tok, SchedulerConfig(4, CONTEXT))
    reqs = [sched.submit(p, s, lambda e: None) for p, s in zip(prompts, params)]
    while sched.num_running or sched.num_waiting:
        sched.step()
    assert sched.stats.max_decode_batch >= 3
    out = [r.output_ids for r in reqs]
    assert len(out[2]) == 7 and out[2][-1] in eos and not set(out[2][:-1]) & set(eos), out[2]
    penalty, changed = RepetitionPenaltyLogitsProcessor(3.0), 0
    for t, token in enumerate(out[0]):
        ids = prompts[0] + out[0][:t]
        raw = _teacher_forced(model, ids)
        scores = penalty(torch.tensor([ids]), raw[None].clone())[0]
        assert _choice(scores, token), f"step {t}: {token}, transformers' processor picks {int(scores.argmax())}"
        changed += int(scores.argmax()) != int(raw.argmax())
    assert changed, "the penalty never changed a choice: the test would not see it ignored"
    for i in (1, 3):
        for t, token in enumerate(out[i]):
            assert _choice(_teacher_forced(model, prompts[i] + out[i][:t]), token), (i, t)
