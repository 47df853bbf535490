"""Every validation bound at its limit (accepted) and one past it (refused, naming the field),
and the scheduler's own check of the same ids (``isolation.check_inputs``).

An off-by-one in a bound (``<=`` for ``<``) passes a value one past the limit: the "one past"
case of each bound fails then. The vocabulary bound once let id == vocab size through to the
scheduler thread.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from pagedexperts.serving import validation  # noqa: E402
from pagedexperts.engine.isolation import RequestFault, check_inputs  # noqa: E402
from pagedexperts.serving.protocol import ApiError, ChatCompletionRequest, CompletionRequest  # noqa: E402
from pagedexperts.engine.sampling import SamplingParams  # noqa: E402

V = 512  # vocabulary size (more than the 300 logit_bias entries allowed)
CONTEXT = 64


class CharTokenizer:
    """One token per character (id = code point mod V); decode joins chr(id)."""

    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) % V for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, **kwargs):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def _prepare(body):
    return validation.prepare(body, CharTokenizer(), context_length=CONTEXT, vocab_size=V)


def _completion(**kw):
    return CompletionRequest(model="m", **{"prompt": "x", **kw})


def _chat(**kw):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **kw)


M, S = validation.MAX_STOP_STRINGS, validation.MAX_STOP_CHARS
# (param, body at the limit, body one past it)
BOUNDS = [
    ("logit_bias", _completion(logit_bias={str(V - 1): 1}), _completion(logit_bias={str(V): 1})),
    ("logit_bias", _completion(logit_bias={"0": 1}), _completion(logit_bias={"-1": 1})),
    ("logit_bias", _completion(logit_bias={str(i): 1 for i in range(validation.MAX_LOGIT_BIAS_ENTRIES)}),
     _completion(logit_bias={str(i): 1 for i in range(validation.MAX_LOGIT_BIAS_ENTRIES + 1)})),
    ("logit_bias", _completion(logit_bias={"1": 100}), _completion(logit_bias={"1": 100.001})),
    ("logit_bias", _completion(logit_bias={"1": -100}), _completion(logit_bias={"1": -100.001})),
    ("prompt", _completion(prompt=[V - 1, 0]), _completion(prompt=[V, 0])),
    ("prompt", _completion(prompt=[[1], [0]]), _completion(prompt=[[1], [-1]])),
    ("prompt", _completion(prompt=[1] * (CONTEXT - 1), max_tokens=1), _completion(prompt=[1] * CONTEXT)),
    ("prompt", _completion(prompt=["x"] * validation.MAX_SEQUENCES), _completion(prompt=["x"] * (validation.MAX_SEQUENCES + 1))),
    ("stop", _completion(stop=["s"] * M), _completion(stop=["s"] * (M + 1))),
    ("stop", _completion(stop="s" * S), _completion(stop="s" * (S + 1))),
    ("n", _completion(n=validation.MAX_N), _completion(n=validation.MAX_N + 1)),
    ("n", _completion(n=1), _completion(n=0)),
    ("n", _completion(prompt=["x"] * 4, n=16), _completion(prompt=["x"] * 5, n=13)),  # 64, then 65 sequences
    ("top_logprobs", _chat(logprobs=True, top_logprobs=validation.MAX_LOGPROBS),
     _chat(logprobs=True, top_logprobs=validation.MAX_LOGPROBS + 1)),
    ("top_logprobs", _chat(logprobs=True, top_logprobs=0), _chat(logprobs=True, top_logprobs=-1)),
    ("logprobs", _completion(logprobs=validation.MAX_LOGPROBS), _completion(logprobs=validation.MAX_LOGPROBS + 1)),
    ("temperature", _completion(temperature=validation.MAX_TEMPERATURE), _completion(temperature=2.001)),
    ("presence_penalty", _completion(presence_penalty=-2), _completion(presence_penalty=-2.001)),
    ("frequency_penalty", _completion(frequency_penalty=2), _completion(frequency_penalty=2.001)),
    ("max_tokens", _completion(prompt="x" * 10, max_tokens=CONTEXT - 10), _completion(prompt="x" * 10, max_tokens=CONTEXT - 9)),
    ("top_p", _completion(top_p=1.0), _completion(top_p=1.001)),
]


@pytest.mark.parametrize("param, at_limit, past", BOUNDS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BOUNDS)])
def test_bound_at_the_limit_passes_and_one_past_is_refused(param, at_limit, past):
    _prepare(at_limit)
    with pytest.raises(ApiError) as e:
        _prepare(past)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_assistant_tool_calls_empty_is_no_tool_calls():
    """OpenAI clients replay an assistant turn with ``tool_calls: []``: accepted, as none."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "user", "content": "again"}]
    prepared = _prepare(ChatCompletionRequest(model="m", messages=msgs))
    plain = _prepare(ChatCompletionRequest(model="m", messages=[{**m, "tool_calls": None} for m in msgs]))
    assert prepared.prompt_ids == plain.prompt_ids
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with pytest.raises(ApiError, match="tool calling") as e:
        _prepare(ChatCompletionRequest(model="m", messages=[msgs[0], {**msgs[1], "tool_calls": call}]))
    assert e.value.param == "messages.1.tool_calls" and e.value.code == "unsupported_field"


@pytest.mark.parametrize("prompt, bias, max_new, ok", [
    ([V - 1], (), 1, True), ([V], (), 1, False), ([-1], (), 1, False), ([], (), 1, False),
    ([1], ((V - 1, 1.0),), 1, True), ([1], ((V, 1.0),), 1, False),
    ([1] * (CONTEXT - 2), (), 2, True), ([1] * (CONTEXT - 2), (), 3, False),
])
def test_scheduler_input_check_at_the_limit(prompt, bias, max_new, ok):
    params = SamplingParams(max_new_tokens=max_new, logit_bias=bias)
    if ok:
        check_inputs(prompt, params, vocab_size=V, context_length=CONTEXT)
    else:
        with pytest.raises(RequestFault):
            check_inputs(prompt, params, vocab_size=V, context_length=CONTEXT)
