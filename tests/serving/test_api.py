"""The OpenAI surface beyond plain generation: logprobs, echo, penalties, logit_bias, n,
token-id prompts, stop lists, chat content forms, framework errors, invalid Unicode,
disconnects. References are computed independently on a second model copy (teacher-forced
forwards and a hand-written greedy loop), never by the server's own code path.
"""

from __future__ import annotations

import time

import pytest

from support.serving_fixtures import (HAVE_MODEL, MODEL_PATH, NAME, PROMPTS, httpx, metric, one_thread, ref,  # noqa: F401
                              server, torch)
from support.serving_fixtures import client as openai_client

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")
LP_ATOL = 1e-4


def _post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=60, **kw)


def _log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)


def _greedy_reference(model, prompt_ids, steps, *, presence=0.0, frequency=0.0, bias=()):
    """Greedy with OpenAI's penalties, re-implemented here: one full forward per token."""
    out = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt_ids + out])).logits[0, -1].float()
        for t, b in bias:
            logits[t] += b
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        out.append(int(logits.argmax()))
    return out


def test_echo_max_tokens_0_scores_the_prompt(server, ref):
    """What lm-eval's loglikelihood sends: echo, logprobs, max_tokens 0 (and 1)."""
    model, tokenizer = ref
    ids = tokenizer(PROMPTS[2])["input_ids"]
    lp = _log_softmax(model, ids)
    for max_tokens in (0, 1):
        body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": max_tokens, "echo": True, "logprobs": 1,
                "temperature": 0}
        choice = _post(server[0], "/v1/completions", body).json()["choices"][0]
        got = choice["logprobs"]
        assert choice["text"].startswith(PROMPTS[2])
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        want = [lp[j - 1, ids[j]].item() for j in range(1, len(ids))]
        assert got["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=LP_ATOL)
        assert len(got["tokens"]) == len(ids) + max_tokens
        for j in range(1, len(ids)):  # the top-1 alternative is the argmax (lm-eval's is_greedy)
            assert max(got["top_logprobs"][j].values()) == pytest.approx(lp[j - 1].max().item(), abs=LP_ATOL)
        assert got["text_offset"][0] == 0 and got["text_offset"] == sorted(got["text_offset"])


def test_openai_client_logprobs_and_token_id_prompts(server, ref):
    model, tokenizer = ref
    c = openai_client(server[0])
    ids = tokenizer(PROMPTS[1])["input_ids"]
    by_text = c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=3)
    for prompt in (ids, [ids]):  # a list of ints, a list of one list (lm-eval's tokenized requests)
        by_ids = c.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0, logprobs=3)
        assert by_ids.choices[0].text == by_text.choices[0].text
    lps = by_text.choices[0].logprobs
    first = _log_softmax(model, ids)[-1]
    assert len(lps.token_logprobs) == 5 and all(len(t) >= 3 for t in lps.top_logprobs)
    assert lps.token_logprobs[0] == pytest.approx(first.max().item(), abs=LP_ATOL)  # greedy = the argmax
    assert sorted(lps.top_logprobs[0].values(), reverse=True)[:3] == pytest.approx(
        first.topk(3).values.tolist(), abs=LP_ATOL)


def test_chat_logprobs_top_logprobs(server, ref):
    model, tokenizer = ref
    c = openai_client(server[0])
    msgs = [{"role": "user", "content": "Who is Romeo?"}]
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=LP_ATOL)  # greedy picks the top
        assert entry.bytes == list(entry.token.encode("utf-8"))
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content[:1])


def test_penalties_and_logit_bias_match_a_hand_loop(server, ref):
    model, tokenizer = ref
    ids = tokenizer(PROMPTS[0])["input_ids"]
    steps = 8
    plain = _greedy_reference(model, ids, steps)
    cases = [dict(presence=1.5), dict(frequency=2.0), dict(bias=((plain[0], -100.0),)),
             dict(presence=0.5, frequency=1.0, bias=((7, 5.0),))]
    for case in cases:
        want = _greedy_reference(model, ids, steps, **case)
        body = {"model": NAME, "prompt": ids, "max_tokens": steps, "temperature": 0, "logprobs": 0,
                "presence_penalty": case.get("presence", 0), "frequency_penalty": case.get("frequency", 0),
                "logit_bias": {str(t): b for t, b in case.get("bias", ())}}
        got = _post(server[0], "/v1/completions", body).json()["choices"][0]
        assert got["text"] == tokenizer.decode(want, skip_special_tokens=True), case
    assert _greedy_reference(model, ids, steps, bias=((plain[0], -100.0),)) != plain


def test_n_choices_and_seeds(server):
    c = openai_client(server[0])
    kw = dict(model=NAME, prompt=PROMPTS[3], max_tokens=6, temperature=1.0, seed=11)
    many = c.completions.create(n=3, **kw)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert many.choices[0].text == c.completions.create(**kw).choices[0].text  # sequence 0 uses the seed itself
    assert len({ch.text for ch in many.choices}) > 1
    assert many.usage.prompt_tokens == c.completions.create(**kw).usage.prompt_tokens
    two = c.completions.create(model=NAME, prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=3, temperature=0, n=2)
    assert [ch.index for ch in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text  # greedy
    streamed = {}
    for chunk in c.completions.create(n=2, stream=True, **kw):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == {0: many.choices[0].text, 1: many.choices[1].text}


def test_stop_list_of_five(server):
    c = openai_client(server[0])
    kw = dict(model=NAME, prompt=PROMPTS[4], max_tokens=12, temperature=0)
    full = c.completions.create(**kw).choices[0].text
    stops = ["\n\n\n", "Question:", "</s>", "<|im_end|>", full[3:5]]
    got = c.completions.create(stop=stops, **kw).choices[0]
    assert (got.text, got.finish_reason) == (full[: full.find(full[3:5])], "stop")


def test_chat_text_parts_developer_and_null_assistant(server, ref):
    c = openai_client(server[0])
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
             {"role": "assistant", "content": ""}, {"role": "user", "content": "Who?"}]
    forms = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": None}, {"role": "user", "content": "Who?"}]
    a, b = (c.chat.completions.create(model=NAME, messages=m, max_tokens=5, temperature=0) for m in (plain, forms))
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_tiny_temperature_and_huge_seed_are_not_500(server):
    url = server[0]
    greedy = _post(url, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0})
    tiny = _post(url, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 1e-40})
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    for seed in (2**64 - 1, -(2**63)):
        r = _post(url, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2, "seed": seed})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw, words", [
    (b'{"model": "tiny", "prompt": "a\\ud800b"}', "escape"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', "surrogate"),
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "JSON"),
    (b'{"model": "tiny", "prompt": "x", "stop": ["\\ud800"]}', "escape"),
])
def test_invalid_unicode_is_400(server, raw, words):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = httpx.post(server[0] + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                                  ("DELETE", "/v1/models", 405)])
def test_framework_errors_in_openai_shape(server, method, path, status):
    r = httpx.request(method, server[0] + path, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and path in err["message"]


def test_refusal_is_logged_with_its_reason(server, caplog):
    with caplog.at_level("WARNING", logger="pagedexperts.serving"):
        _post(server[0], "/v1/completions", {"model": NAME, "prompt": "x", "temperature": 9})
    assert any("400" in r.getMessage() and "temperature must be in" in r.getMessage() for r in caplog.records)


def test_non_streaming_client_leaving_is_freed_within_a_second(server):
    url = server[0]
    counter = 'pagedexperts_requests_total{endpoint="completions",outcome="cancelled"}'
    before = metric(url, counter, default=0.0)
    body = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 240, "temperature": 0,
            "logit_bias": {"0": -100}}  # no end of sequence: it would run all 240 tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    left_s = time.monotonic()
    while httpx.get(url + "/health").json()["running"] and time.monotonic() - left_s < 5:
        time.sleep(0.02)
    freed_s = time.monotonic() - left_s
    assert httpx.get(url + "/health").json()["running"] == 0
    assert freed_s < 1.0, f"freed after {freed_s:.2f}s"
    assert metric(url, counter) == before + 1


ROOM = 24  # tokens a near-full context leaves: more than the completions default, few enough to be quick


def _near_full(url, path: str, body, room: int = ROOM) -> str:
    """A text of repeated words whose prompt (``body(text)``, as the server counts it from one
    probe) leaves ``room`` tokens of the context: a default of "what the context leaves" ends fast."""
    from support.serving_fixtures import CONTEXT

    text = " Romeo" * 100
    probe = _post(url, path, body(text) | {"max_tokens": 1}).json()["usage"]
    used = probe.get("prompt_tokens", probe.get("input_tokens"))
    return text + " Romeo" * (CONTEXT - room - used)


def test_default_max_tokens_are_openais(server):
    """Without max_tokens, completions end at 16 tokens (OpenAI's and vLLM's default) and chat at
    what the context leaves after the prompt (OpenAI's and vLLM's), end of sequence held off."""
    from support.serving_fixtures import CONTEXT
    from pagedexperts.serving.validation import DEFAULT_COMPLETION_MAX_TOKENS

    url, no_eos = server[0], {str(t): -100 for t in server[1].state.scheduler.eos_ids}
    r = _post(url, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0], "temperature": 0, "logit_bias": no_eos})
    assert DEFAULT_COMPLETION_MAX_TOKENS == 16
    assert (r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]) == (16, "length")

    def chat(text):
        return {"model": NAME, "messages": [{"role": "user", "content": text}], "temperature": 0, "logit_bias": no_eos}

    r = _post(url, "/v1/chat/completions", chat(_near_full(url, "/v1/chat/completions", chat)))
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT and usage["completion_tokens"] == ROOM, usage
    assert r.json()["choices"][0]["finish_reason"] == "length"
    from pagedexperts.serving.validation import default_max_tokens

    assert default_max_tokens(10, 4096, chat=True) == 4086 and default_max_tokens(10, 4096, chat=False) == 16
    assert default_max_tokens(4090, 4096, chat=False) == 6  # capped by what the context leaves
