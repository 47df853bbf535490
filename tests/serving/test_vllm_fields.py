"""Request fields vLLM's and SGLang's clients send, served with their published meaning.

Chat template options (vLLM's ``ChatCompletionRequest``): ``chat_template_kwargs`` (the template's
own variables, e.g. Qwen3's ``enable_thinking``), ``add_generation_prompt``, ``continue_final_message``,
``reasoning_effort`` (passed to the template); OpenAI's informational ``store`` / ``metadata`` /
``service_tier`` (accepted, nothing stored, a note logged); vLLM's ``stream_options.continuous_usage_stats``;
the Responses API's ``include: ["message.output_text.logprobs"]`` with ``top_logprobs``, and ``seed``.

Oracles are computed apart from the server: the tokenizer's own ``apply_chat_template`` with the
same arguments and a hand-written greedy loop (one full forward per token) on a second model copy;
the logprobs are the log-softmax of one teacher-forced forward.
"""

from __future__ import annotations

import json
import logging

import pytest

from support.serving_fixtures import (HAVE_MODEL, MODEL_PATH, NAME, httpx, one_thread, openai, ref,  # noqa: F401
                                      server, torch)
from support.serving_fixtures import client as openai_client

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")
USER = [{"role": "user", "content": "Who is Romeo?"}]
THINKING_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %}"
                     " <no-think>{% endif %}{% if reasoning_effort is defined %} effort={{ reasoning_effort }}{% endif %}"
                     "{% endif %}")


def _greedy_from(model, tokenizer, prompt: str, n: int) -> str:
    """The text of ``n`` greedy tokens after ``prompt`` (a full forward per token; stops at EOS)."""
    ids, out = tokenizer(prompt)["input_ids"], []
    while len(out) < n:
        with torch.no_grad():
            out.append(int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax()))
        if out[-1] == tokenizer.eos_token_id:
            break
    return tokenizer.decode(out, skip_special_tokens=True)


def _chat(url, **fields):
    return httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": USER, "temperature": 0,
                                                           "max_tokens": 6, **fields}, timeout=60)


# ---- the chat template's arguments ----

@pytest.fixture(scope="module")
def thinking_tokenizer(ref):
    """The served model's tokenizer with a template that reads enable_thinking and reasoning_effort."""
    import copy

    tok = copy.deepcopy(ref[1])
    tok.chat_template = THINKING_TEMPLATE
    return tok


@pytest.mark.parametrize("fields, kwargs", [
    ({}, {}),
    ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
    ({"reasoning_effort": "none"}, {"enable_thinking": False, "reasoning_effort": "none"}),
    ({"reasoning_effort": "high"}, {"enable_thinking": True, "reasoning_effort": "high"}),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}},
     {"enable_thinking": False, "reasoning_effort": "low"}),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, {}),  # the top-level field (default true) wins
])
def test_template_arguments_reach_the_template(thinking_tokenizer, fields, kwargs):
    from pagedexperts.serving import validation
    from pagedexperts.serving.protocol import ChatCompletionRequest

    prepared = validation.prepare(ChatCompletionRequest(model=NAME, messages=USER, **fields), thinking_tokenizer,
                                  context_length=256, vocab_size=len(thinking_tokenizer))
    want = thinking_tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, **kwargs)
    assert prepared.prompt_texts == [want]
    assert ("<no-think>" in want) == (kwargs.get("enable_thinking") is False)


def test_enable_thinking_over_http_is_served(server, ref):
    """The bundled model's template reads no enable_thinking: the answer is the plain one (vLLM drops
    a key the template does not read)."""
    plain = _chat(server[0]).json()["choices"][0]["message"]["content"]
    r = _chat(server[0], chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain


def test_no_generation_prompt_and_a_continued_final_message(server, ref):
    model, tok = ref
    turns = USER + [{"role": "assistant", "content": "Romeo is"}]
    for fields, messages, kwargs in (
            ({"add_generation_prompt": False}, USER, {"add_generation_prompt": False}),
            ({"continue_final_message": True}, turns, {"continue_final_message": True, "add_generation_prompt": False}),
            ({"continue_final_message": True, "add_generation_prompt": False}, turns,
             {"continue_final_message": True, "add_generation_prompt": False})):
        prompt = tok.apply_chat_template(messages, tokenize=False, **kwargs)
        r = _chat(server[0], messages=messages, **fields)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == _greedy_from(model, tok, prompt, 6), fields
        assert r.json()["usage"]["prompt_tokens"] == len(tok(prompt)["input_ids"])
    assert prompt.endswith("Assistant: Romeo is")  # continued: no end of turn after it


@pytest.mark.parametrize("fields, param", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, "chat_template_kwargs.chat_template"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": {"tools": [{"type": "function"}]}}, "chat_template_kwargs.tools"),
    ({"chat_template_kwargs": {"return_dict": True}}, "chat_template_kwargs.return_dict"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"service_tier": "gold"}, "service_tier"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"store": "yes"}, "store"),
])
def test_bad_values_are_refused_naming_the_field(server, fields, param):
    r = _chat(server[0], **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- informational fields ----

@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_informational_fields_are_accepted_and_noted(server, endpoint, caplog):
    body = {"model": NAME, "max_tokens": 4, "temperature": 0, "store": True, "metadata": {"user": "a"},
            "service_tier": "flex", **({"messages": USER} if endpoint.startswith("chat") else {"prompt": "ROMEO:"})}
    plain = {k: v for k, v in body.items() if k not in ("store", "metadata", "service_tier")}
    with caplog.at_level(logging.WARNING, logger="pagedexperts.serving.validation"):
        r = httpx.post(server[0] + f"/v1/{endpoint}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    notes = [x.getMessage() for x in caplog.records if "accepted and ignored" in x.getMessage()]
    assert len(notes) == 1 and "'store': True" in notes[0] and "'service_tier': 'flex'" in notes[0], notes
    want = httpx.post(server[0] + f"/v1/{endpoint}", json=plain, timeout=60).json()["choices"][0]
    assert r.json()["choices"][0] == want  # the same output
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedexperts.serving.validation"):
        httpx.post(server[0] + f"/v1/{endpoint}", json={**plain, "store": False, "service_tier": "auto"}, timeout=60)
    assert not [x for x in caplog.records if "accepted and ignored" in x.getMessage()]  # defaults: nothing to note


def test_reasoning_effort_through_the_openai_client(server):
    got = openai_client(server[0]).chat.completions.create(model=NAME, messages=USER, max_tokens=4, temperature=0,
                                                           reasoning_effort="low", store=False)
    assert got.choices[0].finish_reason in ("stop", "length")


# ---- continuous usage ----

def _stream(url, stream_options):
    body = {"model": NAME, "messages": USER, "temperature": 0, "max_tokens": 5, "stream": True, "n": 2,
            "stream_options": stream_options}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_continuous_usage_stats(server, ref):
    prompt_tokens = len(ref[1].apply_chat_template(USER, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"])
    chunks = _stream(server[0], {"include_usage": True, "continuous_usage_stats": True})
    *deltas, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10  # n = 2 choices x 5
    seen = {0: 0, 1: 0}
    for c in deltas:
        (choice,) = c["choices"]
        u = c["usage"]
        assert u["prompt_tokens"] == prompt_tokens and u["total_tokens"] == prompt_tokens + u["completion_tokens"]
        assert u["completion_tokens"] >= seen[choice["index"]]  # its own choice's tokens so far
        seen[choice["index"]] = u["completion_tokens"]
    assert seen == {0: 5, 1: 5}
    assert [c["usage"] for c in _stream(server[0], {"include_usage": True})[:-1]] == [None] * len(deltas)
    assert all(c["usage"] is not None for c in _stream(server[0], {"continuous_usage_stats": True}))  # vLLM's default
    assert all("usage" not in c for c in _stream(server[0], {"include_usage": False, "continuous_usage_stats": True}))


# ---- /v1/responses: logprobs and seed ----

def test_responses_logprobs_when_included(server, ref):
    model, tok = ref
    client = openai_client(server[0])
    resp = client.responses.create(model=NAME, input="Who is Romeo?", max_output_tokens=5, temperature=0,
                                   include=["message.output_text.logprobs"], top_logprobs=3)
    part = resp.output[0].content[0]
    assert resp.top_logprobs == 3 and len(part.logprobs) == resp.usage.output_tokens == 5
    prompt = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    out = tok(part.text)["input_ids"]
    with torch.no_grad():  # teacher-forced: position j predicts output token j
        lp = torch.log_softmax(model(input_ids=torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float(), -1)
    for j, entry in enumerate(part.logprobs):
        assert entry.token == tok.decode([out[j]]) and entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob == pytest.approx(lp[j, out[j]].item(), abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(lp[j].topk(3).values.tolist(), abs=1e-4)
    events = list(client.responses.create(model=NAME, input="Who is Romeo?", max_output_tokens=5, temperature=0,
                                          include=["message.output_text.logprobs"], top_logprobs=3, stream=True))
    streamed = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in part.logprobs]
    (done,) = [ev for ev in events if ev.type == "response.output_text.done"]
    assert [e.token for e in done.logprobs] == [e.token for e in part.logprobs]
    plain = client.responses.create(model=NAME, input="Who is Romeo?", max_output_tokens=5, temperature=0,
                                    top_logprobs=3)  # top_logprobs without the include: nothing (vLLM's reading)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == part.text


def test_responses_seed_is_the_chat_seed(server):
    client = openai_client(server[0])
    texts = [client.responses.create(model=NAME, input="ROMEO:", max_output_tokens=8, temperature=1.0,
                                     extra_body={"seed": seed}).output_text for seed in (7, 7, 8)]
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "ROMEO:"}], max_tokens=8,
                                          temperature=1.0, seed=7).choices[0].message.content
    assert texts[0] == texts[1] == chat and texts[2] != texts[0]
