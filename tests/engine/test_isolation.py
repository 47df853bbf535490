"""Fault isolation: one bad request fails itself alone; its batch-mates produce the tokens they
would have produced without it (the oracle: the same requests run without the bad one).

Faults are injected where the scheduler works per request: preparing (a prompt id equal to
the vocabulary size), sampling (a logit_bias id equal to the vocabulary size, the field bug:
IndexError on the scheduler thread failed every request of its forward; and a sampler that
raises), detokenizing, stopping, and the client's event callback. Over HTTP: four co-batched
requests, streaming and not, one of them poisoned; and a 200-request fuzz that sends every malformed body.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from support.serving_fixtures import (CONTEXT, HAVE_MODEL, MODEL_PATH, NAME, PROMPTS, httpx, one_thread, ref,  # noqa: F401
                              serve)
from pagedexperts.serving.handlers import ServeConfig
from pagedexperts.engine.sampling import SamplingParams
from pagedexperts.engine.scheduler import BatchScheduler
from pagedexperts.engine.scheduler_config import SchedulerConfig

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")
MAX_NEW = 8
POINTS = ["prepare", "sample-index", "sample-raises", "detokenize", "stop", "event"]


@dataclasses.dataclass(frozen=True)
class Exploding(SamplingParams):
    """Sampling options whose logit processing raises: a fault inside ``sample``."""

    @property
    def adjusts_logits(self) -> bool:
        raise RuntimeError("injected sampling fault")


class RaisingText:
    def update(self, text, complete):
        raise RuntimeError("injected stop-string fault")


class Tokenizer:
    """The model's tokenizer, but decoding the bad request's output list raises."""

    def __init__(self, inner):
        self.inner, self.poisoned = inner, None

    def decode(self, ids, **kw):
        if ids is self.poisoned:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return self.inner.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _run(model, tokenizer, prompts, *, bad=None, point=None, chunked=True, speculative=None, budget=None):
    """Greedy outputs and final events of ``prompts`` queued together (one forward each step);
    ``bad`` (an index) gets the fault ``point``; ``budget``: --max-prefill-tokens."""
    tok = Tokenizer(tokenizer)
    config = SchedulerConfig(4, CONTEXT, chunked_prefill=chunked, **({"max_prefill_tokens": budget} if budget else {}))
    sched = BatchScheduler(model, tok, config, speculative=speculative)
    finals, reqs = {}, []
    for i, p in enumerate(prompts):
        ids = tokenizer(p)["input_ids"]
        params = SamplingParams(max_new_tokens=MAX_NEW)
        if i == bad and point == "prepare":
            ids = ids + [sched.vocab_size]
        if i == bad and point == "sample-raises":
            params = Exploding(max_new_tokens=MAX_NEW)

        def on_event(e, i=i):
            if i == bad and point == "event" and e.finish_reason is None:
                raise RuntimeError("injected client callback fault")
            if e.finish_reason is not None:
                finals[i] = e
        reqs.append(sched.submit(ids, params, on_event))
    sched.step()  # admitted, prefilled, first tokens: the faults below strike while decoding
    if bad is not None:
        r = reqs[bad]
        if point == "sample-index":  # past validation, as the off-by-one let it through
            r.sampling = dataclasses.replace(r.sampling, logit_bias=((sched.vocab_size, 5.0),))
        elif point == "detokenize":
            tok.poisoned = r.output_ids
        elif point == "stop":
            r.text = RaisingText()
    steps = 1
    while (sched.num_running or sched.num_waiting) and steps < 100:
        sched.step()
        steps += 1
    return [r.output_ids for r in reqs], finals, sched.stats


@pytest.mark.parametrize("point", POINTS)
def test_a_fault_in_one_of_four_cobatched_requests_fails_it_alone(ref, point):
    model, tokenizer = ref
    prompts = PROMPTS[:4]
    alone, _, _ = _run(model, tokenizer, prompts[:1] + prompts[2:])
    out, finals, stats = _run(model, tokenizer, prompts, bad=1, point=point)
    want = {"prepare": "outside the vocabulary", "sample-index": "out of bounds"}.get(point, "injected")
    assert finals[1].finish_reason == "error" and want in finals[1].error, finals[1].error
    assert [out[0], out[2], out[3]] == alone, f"fault at {point} changed another request's tokens"
    assert all(finals[i].finish_reason in ("stop", "length") for i in (0, 2, 3))
    assert (stats.failed, stats.finished) == (1, 3)


@pytest.mark.parametrize("point", ["prepare", "sample-index"])
def test_isolation_without_chunked_prefill(ref, point):
    model, tokenizer = ref
    prompts = PROMPTS[:4]
    alone, _, _ = _run(model, tokenizer, prompts[1:], chunked=False)
    out, finals, stats = _run(model, tokenizer, prompts, bad=0, point=point, chunked=False)
    assert finals[0].finish_reason == "error" and out[1:] == alone and stats.failed == 1


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("point", ["sample-index", "detokenize", "stop"])
def test_a_fault_in_one_speculative_verification_fails_it_alone(ref, point, chunked):
    """With --speculative ngram the decodes are verification steps (the bad logit_bias id
    strikes inside the acceptance rule): the other three produce plain decoding's tokens.
    Chunked: the budget prefills the first two prompts in step 1, so the fault strikes in a
    step that packs the bad request's verification with the other prompts' chunks."""
    from pagedexperts.engine.speculative.config import speculative_config

    model, tokenizer = ref
    prompts = PROMPTS[:4]
    budget = sum(len(tokenizer(p)["input_ids"]) for p in prompts[:2]) if chunked else None
    alone, _, _ = _run(model, tokenizer, prompts[:1] + prompts[2:])
    spec = speculative_config("ngram", num_speculative_tokens=3)
    out, finals, stats = _run(model, tokenizer, prompts, bad=1, point=point, chunked=chunked, speculative=spec,
                              budget=budget)
    assert (stats.mixed_steps > 0) == chunked
    want = {"sample-index": "out of bounds"}.get(point, "injected")
    assert finals[1].finish_reason == "error" and want in finals[1].error, finals[1].error
    assert [out[0], out[2], out[3]] == alone, f"fault at {point} changed another request's tokens"
    assert (stats.failed, stats.finished) == (1, 3)


# ---- over HTTP ----

@pytest.fixture(scope="module")
def app_server():
    yield from serve(ServeConfig(NAME, 4, CONTEXT))


class Gate:
    """Holds the scheduler's first step until ``n`` sequences are queued, so that they are
    admitted and prefilled in one step and decode in the same forwards."""

    def __init__(self, sched, n):
        self.sched, self.n, self.step = sched, n, sched.step

    def __enter__(self):
        def gated():
            deadline = time.monotonic() + 20
            while self.sched.num_waiting < self.n and not self.sched.num_running and time.monotonic() < deadline:
                time.sleep(0.01)
            self.step()

        self.sched.step = gated
        return self

    def __exit__(self, *exc):
        self.sched.step = self.step


def _poison(serving, marker="poison"):
    """Requests whose ``user`` is ``marker`` get an exploding sampler after validation."""
    admit = serving.admit

    def poisoned(raw, chat):
        prepared = admit(raw, chat)
        if json.loads(raw).get("user") == marker:
            seqs = [Exploding(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)}) for s in prepared.sequences]
            prepared = dataclasses.replace(prepared, sequences=seqs)
        return prepared

    return admit, poisoned


def _ask(url, prompt, *, stream, user=None):
    body = {"model": NAME, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "stream": stream,
            **({"user": user} if user else {})}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        return r.status_code, r.json()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert lines[-1] == "data: [DONE]"
    return r.status_code, chunks


def _text(result, stream):
    status, body = result
    if stream:
        return "".join(c["choices"][0]["text"] for c in body if "choices" in c)
    return body["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_poisoned_request_among_four_over_http(app_server, stream):
    url, app = app_server[0], app_server[1]
    serving, sched = app.state.serving, app.state.scheduler
    prompts = PROMPTS[:4]
    with Gate(sched, 3), ThreadPoolExecutor(3) as pool:
        clean = list(pool.map(lambda p: _ask(url, p, stream=stream), [prompts[0], prompts[2], prompts[3]]))
    admit, poisoned = _poison(serving)
    serving.admit = poisoned
    try:
        with Gate(sched, 4), ThreadPoolExecutor(4) as pool:
            users = [None, "poison", None, None]
            got = list(pool.map(lambda pu: _ask(url, pu[0], stream=stream, user=pu[1]), zip(prompts, users)))
    finally:
        serving.admit = admit
    assert [_text(g, stream) for g in (got[0], got[2], got[3])] == [_text(c, stream) for c in clean]
    status, body = got[1]
    if stream:
        assert status == 200 and "error" in body[-1] and body[-1]["error"]["code"] == "generation_failed"
        assert "injected" in body[-1]["error"]["message"]
    else:
        assert status == 500 and body["error"]["code"] == "generation_failed" and "injected" in body["error"]["message"]
        assert set(body["error"]) == {"message", "type", "param", "code"}


def test_logit_bias_id_equal_to_vocab_size_is_a_400_over_http(app_server):
    url, vocab = app_server[0], app_server[1].state.serving.vocab_size
    ok = httpx.post(url + "/v1/completions", timeout=60, json={"model": NAME, "prompt": "x", "max_tokens": 2,
                                                                "logit_bias": {str(vocab - 1): 100}})
    assert ok.status_code == 200
    bad = httpx.post(url + "/v1/completions", timeout=60, json={"model": NAME, "prompt": "x", "max_tokens": 2,
                                                                 "logit_bias": {str(vocab): 100}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def _malformed(vocab: int) -> list[tuple[str, bytes | dict]]:
    """(endpoint, body) of every malformed request the fuzz sends: bad JSON, types, ranges, ids, fields."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    cases = [
        (c, b"{not json"), (c, b""), (c, b"[]"), (ch, b'{"model": "tiny", "messages": "hi"}'),
        (c, {"model": NAME, "prompt": "x", "logit_bias": {str(vocab): 1}}),
        (c, {"model": NAME, "prompt": "x", "logit_bias": {"-1": 1}}),
        (c, {"model": NAME, "prompt": [vocab]}), (c, {"model": NAME, "prompt": [[1], [-5]]}),
        *((c, {"model": NAME, "prompt": "x", "n": n}) for n in (0, 17, 10**9)),
        (c, {"model": NAME, "prompt": "x", "stop": ["s"] * 17}),
        *((c, {"model": NAME, "prompt": "x", "temperature": t}) for t in (-1, 2.5, "hot")),
        *((c, {"model": NAME, "prompt": "x", "max_tokens": m}) for m in (-1, 0, 10**6)),
        (c, {"model": NAME, "prompt": "x", "logprobs": 21}), (c, {"model": NAME, "prompt": ""}),
        (c, {"model": NAME, "prompt": "x", "top_k": -3}), (c, {"model": "other", "prompt": "x"}),
        (ch, {"model": NAME, "messages": []}),
        (ch, {"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}),
        (ch, {"model": NAME, "messages": [{"role": "assistant", "content": None,
                                          "tool_calls": [{"id": "1", "type": "function"}]}]}),
        (ch, {"model": NAME, "messages": [{"role": "robot", "content": "x"}]}),
        (c, {"model": NAME, "prompt": "x" * (CONTEXT * 40)}),
    ]
    return cases


FUZZ_REQUESTS = 200  # every malformed body at least once, the rest drawn 3:6:1 valid:malformed:poison


@pytest.mark.slow
def test_fuzz_requests_malformed_never_change_another_output(app_server):
    """FUZZ_REQUESTS requests from 8 clients in a seeded shuffled order: valid greedy ones (their
    output is fixed in advance, each run alone), every malformed body (400-class, never 500) and
    poisoned ones (pass validation, then fail in sampling: 500 for that request only). Every
    valid output equals its reference. (It sent 600 drawn at random; 200 with each malformed
    body sent at least once cover every fault kind at a third of the generations.)"""
    url, app = app_server[0], app_server[1]
    serving = app.state.serving
    vocab = serving.vocab_size
    rng = random.Random(0)
    prompts = PROMPTS[:6]
    refs = {p: _text(_ask(url, p, stream=False), False) for p in prompts}
    malformed = _malformed(vocab)
    plan = [("malformed", m) for m in malformed]
    while len(plan) < FUZZ_REQUESTS:
        kind = rng.choices(["valid", "malformed", "poison"], weights=[3, 6, 1])[0]
        plan.append((kind, rng.choice(prompts) if kind != "malformed" else rng.choice(malformed)))
    rng.shuffle(plan)
    admit, poisoned = _poison(serving)
    serving.admit = poisoned

    def send(item):
        kind, what = item
        if kind == "malformed":
            path, body = what
            kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                else {"json": {**body, "max_tokens": body.get("max_tokens", 2)}}
            r = httpx.post(url + path, timeout=60, **kw)
            return kind, what, r.status_code, r.text
        status, body = _ask(url, what, stream=False, user="poison" if kind == "poison" else None)
        return kind, what, status, body

    start = time.monotonic()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(send, plan))
    finally:
        serving.admit = admit
    counts = {k: sum(1 for r in results if r[0] == k) for k in ("valid", "malformed", "poison")}
    assert min(counts.values()) > 0 and {w for k, w in plan if k == "valid"} == set(prompts), counts
    for kind, what, status, body in results:
        if kind == "valid":
            assert status == 200 and body["choices"][0]["text"] == refs[what], (what, body)
        elif kind == "poison":
            assert status == 500 and body["error"]["code"] == "generation_failed"
        else:
            assert 400 <= status < 500, (what, status, body)
    assert httpx.get(url + "/health").json()["running"] == 0
    print(f"\nfuzz: {counts} in {time.monotonic() - start:.1f}s, every valid output equal to its reference")
