"""The OpenAI-compatible server: HTTP basics, continuous batching, paging exactness.

Batching exactness is checked on the scheduler itself, where the batch schedule is fixed:
all requests are queued before the first step. Batched prefill and decode pad rows and
change the floating-point reduction order, so a request's tokens alone and in a batch of 8
are compared only while the alone run's top-2 logit margin stays above MARGIN_EPS; past a
near-tie a flip is legitimate and is counted and printed. Paged vs unpaged on the SAME
schedule must be equal token for token.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from support.serving_fixtures import (CONTEXT, MAX_RUNNING, MAX_TOKENS, MODEL_PATH, NAME, PROMPTS, httpx,  # noqa: F401
                              load_model, metric, one_thread, ref, schedule, server, torch)
from support.serving_fixtures import client as openai_client
from pagedexperts.generation.config import SamplingConfig
from pagedexperts.generation.generate import generate_text

MARGIN_EPS = 1e-3  # logits: batching noise in float32 is orders of magnitude below this

pytestmark = pytest.mark.skipif(not (MODEL_PATH / "config.json").exists(), reason=f"no model at {MODEL_PATH}")


# ---- HTTP: the OpenAI surface ----

def test_health_and_models(server):
    url = server[0]
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert [m.id for m in openai_client(url).models.list().data] == [NAME]


def test_models_retrieve_and_an_unknown_id_is_openais_404(server):
    """The openai SDK's ``models.retrieve`` (GET /v1/models/{id}); an unknown id, one holding a
    slash as hub ids do, is 404 ``model_not_found`` in OpenAI's error shape."""
    import openai

    c = openai_client(server[0])
    got = c.models.retrieve(NAME)
    assert (got.id, got.object, got.owned_by) == (NAME, "model", "pagedexperts")
    for unknown in ("gpt-4o", "Qwen/Qwen3-30B-A3B"):
        with pytest.raises(openai.NotFoundError) as e:
            c.models.retrieve(unknown)
        err = e.value.body
        assert (err["code"], err["param"], err["type"]) == ("model_not_found", "model", "invalid_request_error"), err
        assert repr(unknown) in err["message"]


def test_greedy_completion_alone_equals_generate(server, ref):
    model, tokenizer = ref
    got = openai_client(server[0]).completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    want = generate_text(model, tokenizer, PROMPTS[1], SamplingConfig(max_new_tokens=MAX_TOKENS))
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == want.new_tokens
    assert got.choices[0].finish_reason in ("length", "stop")


def test_greedy_chat_alone_equals_generate_chat(server, ref):
    model, tokenizer = ref
    got = openai_client(server[0]).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Who is Romeo?"}], max_tokens=MAX_TOKENS, temperature=0
    )
    want = generate_text(model, tokenizer, "Who is Romeo?", SamplingConfig(max_new_tokens=MAX_TOKENS), chat=True)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"


def test_sampling_extensions_accepted_over_http(server):
    """vLLM's / SGLang's top_k, min_p, repetition_penalty, min_tokens: accepted on completions
    and chat; top_k 1 (and min_p 1) sampled at temperature 1 is the greedy text; their
    defaults change nothing; min_tokens holds EOS back (logit_bias pushes it to the front)."""
    client = openai_client(server[0])
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=8)
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    for extra in ({"top_k": 1}, {"min_p": 1.0}, {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}):
        temperature = 0 if "top_k" in extra and extra["top_k"] == -1 else 1.0
        got = client.completions.create(**kw, temperature=temperature, seed=3, extra_body=extra).choices[0].text
        assert got == greedy, extra
    eos = str(ref_eos(server))
    held = client.completions.create(**kw, temperature=0, logit_bias={eos: 100}, extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0.8, extra_body={"top_k": 3, "repetition_penalty": 1.2})
    assert chat.choices[0].finish_reason in ("length", "stop")


def ref_eos(server) -> int:
    """An end-of-sequence id of the served model."""
    return min(server[1].state.scheduler.eos_ids)


def test_seeded_sampling_repeats(server):
    client = openai_client(server[0])
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0.9, top_p=0.9)
    a, b = (client.completions.create(**kw, seed=7).choices[0].text for _ in range(2))
    assert a == b


def test_stop_string_ends_the_text(server):
    client = openai_client(server[0])
    kw = dict(model=NAME, prompt=PROMPTS[4], max_tokens=MAX_TOKENS, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2:][:3]
    assert stop, f"greedy text too short to pick a stop string: {full!r}"
    got = client.completions.create(**kw, stop=[stop]).choices[0]
    assert (got.text, got.finish_reason) == (full[: full.find(stop)], "stop")
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True))
    assert streamed == got.text


def test_streaming_completion_arrives_incrementally(server):
    client = openai_client(server[0])
    start, times, parts = time.perf_counter(), [], []
    stream = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0, stream=True)
    for chunk in stream:
        times.append(time.perf_counter() - start)
        parts.append(chunk.choices[0].text)
    whole = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0)
    assert "".join(parts) == whole.choices[0].text
    assert sum(1 for p in parts if p) > 1, "expected several text chunks"
    assert times[0] < times[-1], f"chunks arrived all at once at {times[0]:.3f}s"


def test_streaming_chat_raw_sse(server):
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    assert chunks[-1]["usage"]["completion_tokens"] <= 6


C, CH = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        (C, {"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
        (C, {"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens must be > 0"),
        (C, {"model": NAME, "prompt": "x", "max_tokens": -1}, 400, "max_tokens must be > 0"),
        (C, {"model": NAME, "prompt": "x", "max_tokens": 10**6}, 400, "context length"),
        (C, {"model": NAME, "prompt": "hello " * 400}, 400, "context length"),
        (C, {"model": NAME, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        (C, {"model": NAME, "prompt": ""}, 400, "empty"),
        (C, {"model": NAME, "prompt": []}, 400, "prompt must hold"),
        (C, {"model": NAME, "prompt": [5, 10**6]}, 400, "vocabulary"),
        (C, {"model": NAME, "prompt": "x", "n": 17}, 400, "n must be in [1, 16]"),
        (C, {"model": NAME, "prompt": "x", "temperature": -1}, 400, "temperature"),
        (C, {"model": NAME, "prompt": "x", "temperature": 2.5}, 400, "greedily"),
        (C, {"model": NAME, "prompt": "x", "top_p": 0}, 400, "top_p"),
        (C, {"model": NAME, "prompt": "x", "seed": 2**64}, 400, "seed must be in"),
        (C, {"model": NAME, "prompt": "x", "seed": -(2**63) - 1}, 400, "seed must be in"),
        (C, {"model": NAME, "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
        (C, {"model": NAME, "prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
        (C, {"model": NAME, "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias keys"),
        (C, {"model": NAME, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias must be in"),
        (C, {"model": NAME, "prompt": "x", "logprobs": 21}, 400, "logprobs must be in"),
        (C, {"model": NAME, "prompt": "x", "stop": ["a"] * 17}, 400, "stop takes at most 16"),
        (C, {"model": NAME, "prompt": "x", "stop": ["a", ""]}, 400, "non-empty"),
        (C, {"model": NAME, "prompt": "x", "best_of": 3}, 400, "'best_of'"),
        (C, {"model": NAME, "prompt": "x", "suffix": "y"}, 400, "'suffix'"),
        (C, {"model": NAME, "prompt": "x", "top_k": -2}, 400, "top_k must be in [-1"),
        (C, {"model": NAME, "prompt": "x", "min_p": 1.5}, 400, "min_p must be in [0, 1]"),
        (C, {"model": NAME, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty must be in (0"),
        (C, {"model": NAME, "prompt": "x", "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens 4 is more than max_tokens 3"),
        (C, {"model": NAME, "prompt": "x", "no_such_field": 1}, 400, "'no_such_field'"),
        (C, {"model": NAME, "prompt": "x", "stream_options": {"bogus": True}}, 400, "stream_options.bogus"),
        (CH, {"model": NAME, "messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
         "'tools': tool calling"),
        (CH, {"model": NAME, "messages": USER, "tool_choice": "auto"}, 400, "'tool_choice'"),
        (CH, {"model": NAME, "messages": USER, "response_format": {"type": "json_object"}}, 400, "'response_format'"),
        (CH, {"model": NAME, "messages": USER, "top_logprobs": 2}, 400, "needs logprobs"),
        (CH, {"model": NAME, "messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs must be"),
        (CH, {"model": NAME, "messages": USER, "max_tokens": 0}, 400, "max_tokens must be > 0"),
        (CH, {"model": NAME, "messages": []}, 400, "messages must not be empty"),
        (CH, {"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        (CH, {"model": NAME, "messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, 400, "role"),
        (CH, {"model": NAME, "messages": [{"role": "user", "content": None}]}, 400, "null only for role 'assistant'"),
        (CH, {"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         400, "image_url"),
        (CH, {"model": NAME}, 400, "messages"),
    ],
)
def test_bad_request_is_4xx_with_message(server, path, body, status, words):
    """Each refusal: the status, OpenAI's error shape naming the problem, counted in /metrics."""
    url = server[0]
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert metric(url, f'pagedexperts_refused_requests_total{{code="{err["code"]}",status="{status}"}}') >= 1


def test_bad_json_then_still_serving(server):
    r = httpx.post(server[0] + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    ok = httpx.post(server[0] + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_disconnect_frees_the_place(server):
    url = server[0]
    body = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 200, "temperature": 0, "stream": True}
    counter = 'pagedexperts_requests_total{endpoint="completions",outcome="cancelled"}'
    cancelled = metric(url, counter, default=0.0)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(url + "/health").json()["running"] == 0
    assert metric(url, counter) == cancelled + 1


def test_concurrent_requests_batch_queue_and_all_complete(server):
    """8 clients, room for 4: a batch above 1 shows in /metrics, the rest wait, none fails."""
    url, seen = server[0], []
    done = threading.Event()
    timing = [f"pagedexperts_{name}_seconds_{k}" for name in ("request_queue_time", "time_to_first_token")
              for k in ("count", "sum")]
    before = [metric(url, name) for name in timing]

    def poll():
        while not done.is_set():
            seen.append(metric(url, "pagedexperts_running_requests"))
            time.sleep(0.01)

    def ask(prompt):
        body = {"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        return httpx.post(url + "/v1/completions", json=body, timeout=120)

    poller = threading.Thread(target=poll)
    poller.start()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, PROMPTS))
    done.set()
    poller.join()
    assert [a.status_code for a in answers] == [200] * len(PROMPTS)
    assert all(a.json()["choices"][0]["finish_reason"] in ("length", "stop") for a in answers)
    assert max(seen) > 1, f"running batch never above 1 (seen {sorted(set(seen))})"
    assert 1 < metric(url, "pagedexperts_max_decode_batch") <= MAX_RUNNING
    assert metric(url, 'pagedexperts_paging_misses_total{layer="0"}') > 0
    assert metric(url, "pagedexperts_time_to_first_token_seconds_count") >= len(PROMPTS)
    assert metric(url, "pagedexperts_time_per_output_token_seconds_count") >= len(PROMPTS)
    q_count, q_sum, t_count, t_sum = (metric(url, name) - b for name, b in zip(timing, before))
    assert q_count == t_count == len(PROMPTS) and 0 < q_sum < t_sum  # each one's wait for a place, part of its TTFT


def test_zz_shutdown_stops_worker_and_saves_trace(server):
    """What SIGINT / SIGTERM trigger in uvicorn: the app stops, the worker ends, the trace is saved."""
    import numpy as np

    url, app, trace, srv, thread = server
    srv.should_exit = True
    thread.join(30)
    assert not thread.is_alive()
    worker = app.state.scheduler._thread
    assert worker is not None and not worker.is_alive()
    saved = np.load(trace)
    ids = set(saved["request_ids"].tolist()) - {-1}
    assert len(ids) >= len(PROMPTS) and min(ids) >= 1


# ---- the scheduler on a fixed schedule: paging and batching exactness ----

@pytest.fixture(scope="module")
def batch_of_8(ref):
    """8 prompts decoded together on K = top_k: (output ids, scheduler stats, paging stats, E)."""
    model, tokenizer = ref
    model.pagedexperts.reset_stats()
    ids, stats = schedule(model, tokenizer, PROMPTS, max_running=8)
    return ids, stats, model.pagedexperts.stats(), model.pagedexperts.num_experts

def test_paging_changes_nothing_sameschedule(batch_of_8):
    """K = top_k (many misses, multi-wave steps) gives the tokens of K = E, batch of 8, greedy."""
    paged_ids, stats, paged_stats, num_experts = batch_of_8
    model, tokenizer = load_model(MODEL_PATH, num_resident=num_experts)
    full_ids, _ = schedule(model, tokenizer, PROMPTS, max_running=8)
    assert paged_ids == full_ids
    assert stats.max_decode_batch == 8
    tot = paged_stats.total()
    assert tot.misses > 0 and tot.multi_wave_steps > 0, "K = top_k should page and split waves"
    assert model.pagedexperts.stats().total().multi_wave_steps == 0


def test_alone_vs_batch_of_8_until_near_tie(ref, batch_of_8):
    model, tokenizer = ref
    batched = batch_of_8[0]
    compared = flips = 0
    for prompt, in_batch in zip(PROMPTS, batched):
        alone = schedule(model, tokenizer, [prompt], max_running=1)[0][0]
        margins = _top2_margins(model, tokenizer(prompt)["input_ids"], alone)
        for j, (a, b) in enumerate(zip(alone, in_batch)):
            if margins[j] < MARGIN_EPS:
                flips += a != b
                break  # past a near-tie the continuations may legitimately differ
            compared += 1
            assert a == b, f"{prompt!r}: token {j} differs in a batch of 8 at margin {margins[j]:.3g}"
    print(f"\nbatch of 8 vs alone: {compared} tokens equal above margin {MARGIN_EPS}, "
          f"{flips} near-tie flips in {len(PROMPTS)} requests")


def _top2_margins(model, prompt_ids, output_ids) -> list[float]:
    """Top-1 minus top-2 logit at each generated position (teacher-forced, one forward)."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:]
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()
