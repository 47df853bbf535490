"""vLLM's request options with vLLM's meaning: ``min_tokens`` (alone, and holding stop strings back),
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``.

The meaning is vLLM's V1 engine's (``vllm/v1/engine/detokenizer.py``, ``vllm/sampling_params.py``):
min_tokens masks the end-of-sequence ids and stop_token_ids and counts a stop string only where it
ends after the text of the first min_tokens tokens; the token (EOS or one of stop_token_ids) that
ends a sequence is left out of the text unless include_stop_str_in_output, which also keeps a stop
string; skip_special_tokens (default true) leaves special tokens out of the text.

Oracle: the reference model's own greedy ``generate`` (transformers; ``min_new_tokens`` for
min_tokens: ``MinNewTokensLengthLogitsProcessor``), decoded by the tokenizer and cut by plain
string search. Each case runs over HTTP alone (the openai SDK and raw httpx), then all cases
queued together into the scheduler through the same validation (one batch, each its own options).
The bundled model answers "Exeunt.\\n\\n" with its end-of-sequence token (id 0, special) first.
"""

from __future__ import annotations

import json

import pytest

from support.serving_fixtures import (CONTEXT, HAVE_MODEL, MODEL_PATH, NAME, httpx, one_thread, ref, server,  # noqa: F401
                              torch)
from support.serving_fixtures import client as openai_client
from pagedexperts.generation.stop_text import IncrementalText, stop_cut

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")
EOS = 0  # the bundled model's end-of-sequence id ("<|endoftext|>", special)
ENDING = "Exeunt.\n\n"  # greedy: EOS first
ROMEO = "ROMEO:"  # greedy: no EOS within 16 tokens; "I" is the 2nd token's text


# ---- the text rule, pure ----

def test_stop_cut_counts_only_stops_ending_after_start():
    assert stop_cut("\nI am I.", ("I",), start=2) == ("\nI am ", True)  # the "I" within the first 2 chars is text
    assert stop_cut("xab", ("ab",), start=2) == ("x", True)  # may start before, must end after: vLLM's window
    assert stop_cut("xab", ("ab",), start=3) == ("xab", False)
    assert stop_cut("hello world", ("lo", "wor"), include=True) == ("hello", True)
    assert stop_cut("hel", ("lo",), include=True) == ("hel", False)  # nothing held back when the stop is kept
    assert stop_cut("hel", ("lo",)) == ("he", False)


def test_incremental_text_keeps_the_stop_string_and_shows_a_prefix():
    shown, text = "", IncrementalText(("lo",), include=True)
    for piece in ("he", "hel", "hell", "hello", "hello w"):
        delta, stopped = text.update(piece, complete=False)
        shown += delta
        if stopped:
            break
    assert (shown, stopped) == ("hello", True)


# ---- the cases and their oracle ----

def _generate(model, tokenizer, prompt: str, n: int, **kw) -> list[int]:
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=EOS, **kw)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def cases(ref):
    """name -> (request fields, (text, finish_reason, completion tokens or None)) from the oracle."""
    model, tok = ref

    def text(ids, skip=True):
        return tok.decode(ids, skip_special_tokens=skip)

    g = _generate(model, tok, ROMEO, 16, eos_token_id=None)
    assert EOS not in g, g
    full = text(g)
    stop_at = g.index(g[3])  # the first token equal to the 4th
    held = text(g[:10])  # min_tokens 10 protects the text of 10 tokens
    assert 0 <= full.find("I") < len(held), "the stop must occur early for min_tokens to matter"
    after = full.find("I", len(held))
    kept = full[len(full) // 2:][:3]
    ignored = _generate(model, tok, ENDING, 6, eos_token_id=None)
    assert ignored[0] == EOS, ignored
    least = _generate(model, tok, ENDING, 12, eos_token_id=EOS, min_new_tokens=5)
    ended = least[-1] == EOS
    romeo, ending = {"prompt": ROMEO, "max_tokens": 16}, {"prompt": ENDING, "max_tokens": 6}
    return {
        "min_tokens alone": ({"prompt": ENDING, "max_tokens": 12, "min_tokens": 5},
                             (text(least[:-1] if ended else least), "stop" if ended else "length", len(least))),
        "eos ends": (ending, ("", "stop", 1)),
        "eos kept": ({**ending, "include_stop_str_in_output": True, "skip_special_tokens": False},
                     ("<|endoftext|>", "stop", 1)),
        "ignore_eos": ({**ending, "ignore_eos": True}, (text(ignored), "length", 6)),
        "special shown": ({**ending, "ignore_eos": True, "skip_special_tokens": False},
                          (text(ignored, skip=False), "length", 6)),
        "stop_token_ids": ({**romeo, "stop_token_ids": [g[3]]}, (text(g[:stop_at]), "stop", stop_at + 1)),
        "stop token kept": ({**romeo, "stop_token_ids": [g[3]], "include_stop_str_in_output": True},
                            (text(g[:stop_at + 1]), "stop", stop_at + 1)),
        "stop string kept": ({**romeo, "stop": [kept], "include_stop_str_in_output": True},
                             (full[: full.find(kept) + len(kept)], "stop", None)),
        "min_tokens holds stop": ({**romeo, "stop": ["I"], "min_tokens": 10},
                                  (full[:after], "stop", None) if after >= 0 else (full, "length", 16)),
    }


def _outcome(choice, usage, tokens_known: bool) -> tuple:
    return choice["text"], choice["finish_reason"], usage["completion_tokens"] if tokens_known else None


def test_each_option_over_http(server, cases):
    url = server[0]
    for name, (fields, want) in cases.items():
        r = httpx.post(url + "/v1/completions", json={"model": NAME, "temperature": 0, **fields}, timeout=60)
        assert r.status_code == 200, (name, r.text)
        got = _outcome(r.json()["choices"][0], r.json()["usage"], want[2] is not None)
        assert got == want, name


def _stop_reason(fields: dict, finish: str):
    """vLLM's stop_reason of a case: the stop token id or stop string that ended it, None for the
    end-of-sequence token and for the length limit."""
    if finish != "stop":
        return None
    if fields.get("stop_token_ids"):
        return fields["stop_token_ids"][0]
    return fields["stop"][0] if fields.get("stop") else None


def test_stop_reason_is_vllms(server, cases):
    """Each choice says which stop ended it (vLLM's ``stop_reason``), whole and on the streamed
    chunk that carries its finish_reason, on completions and chat."""
    url = server[0]
    for name, (fields, want) in cases.items():
        reason = _stop_reason(fields, want[1])
        body = {"model": NAME, "temperature": 0, **fields}
        choice = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == (want[1], reason), name
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        (last,) = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"] is not None]
        assert last["stop_reason"] == reason, name
    chat = {"model": NAME, "temperature": 0, "messages": [{"role": "user", "content": ROMEO}], "max_tokens": 16}
    first = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    stop = first["message"]["content"][2:5]
    got = httpx.post(url + "/v1/chat/completions", json={**chat, "stop": [stop]}, timeout=60).json()["choices"][0]
    assert (got["finish_reason"], got["stop_reason"]) == ("stop", stop)
    assert first["stop_reason"] is None  # a length or end-of-sequence finish


def test_the_openai_sdk_sends_them_as_extra_body(server, cases):
    fields, want = cases["min_tokens holds stop"]
    extra = {"min_tokens": fields["min_tokens"]}
    got = openai_client(server[0]).completions.create(model=NAME, prompt=ROMEO, max_tokens=16, temperature=0,
                                                      stop=["I"], extra_body=extra)
    assert (got.choices[0].text, got.choices[0].finish_reason) == want[:2]
    streamed = openai_client(server[0]).completions.create(model=NAME, prompt=ROMEO, max_tokens=16, temperature=0,
                                                           stop=["I"], extra_body=extra, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want[0]


def test_all_options_in_one_batch(ref, cases):
    """Every case queued before the first step (the scheduler on a fixed schedule), each request
    through the server's validation: one batch, each sequence its own options."""
    from pagedexperts.engine.scheduler import BatchScheduler
    from pagedexperts.engine.scheduler_config import SchedulerConfig
    from pagedexperts.serving import validation
    from pagedexperts.serving.protocol import CompletionRequest

    model, tok = ref
    sched = BatchScheduler(model, tok, SchedulerConfig(len(cases), CONTEXT))
    finals, reqs = {}, {}
    for name, (fields, _) in cases.items():
        prepared = validation.prepare(CompletionRequest(model=NAME, temperature=0, **fields), tok,
                                      context_length=CONTEXT, vocab_size=len(tok))
        texts = []

        def on_event(e, name=name, texts=texts):
            texts.append(e.text)
            if e.finish_reason is not None:
                finals[name] = ("".join(texts), e.finish_reason, e.completion_tokens)

        reqs[name] = sched.submit(prepared.prompt_ids[0], prepared.sequences[0], on_event)
    while sched.num_running or sched.num_waiting:
        sched.step()
    assert sched.stats.max_decode_batch >= len(cases) - 2  # the two that end at their first token leave
    for name, (_, want) in cases.items():
        got = finals[name] if want[2] is not None else finals[name][:2] + (None,)
        assert got == want, name


def test_stop_token_ids_at_the_vocabulary_boundary(server, ref):
    """V (the vocabulary size) is no token id: 400; V - 1 is the last one: served."""
    v = ref[0].config.vocab_size
    body = {"model": NAME, "prompt": ROMEO, "max_tokens": 2, "temperature": 0}
    r = httpx.post(server[0] + "/v1/completions", json={**body, "stop_token_ids": [v]}, timeout=60)
    assert r.status_code == 400 and f"in [0, {v}) (the vocabulary), got {v}" in r.json()["error"]["message"], r.text
    r = httpx.post(server[0] + "/v1/completions", json={**body, "stop_token_ids": [v - 1]}, timeout=60)
    assert r.status_code == 200, r.text


def test_min_tokens_holds_stop_token_ids_back(server, ref):
    """A stop id the greedy text reaches at its 2nd token, with min_tokens 6: it can neither end the
    request nor appear within the first 6 tokens. Oracle: transformers' greedy generate with
    min_new_tokens 6 and every end-of-sequence id (EOS and the stop id)."""
    model, tok = ref
    g = _generate(model, tok, ROMEO, 16, eos_token_id=None)
    stop = g[1]
    want = _generate(model, tok, ROMEO, 16, eos_token_id=[EOS, stop], min_new_tokens=6)
    assert stop not in want[:6] and want[:6] != g[:6]  # the oracle itself holds it back, so the text changes
    ended = want[-1] in (EOS, stop)
    r = httpx.post(server[0] + "/v1/completions", json={"model": NAME, "prompt": ROMEO, "max_tokens": 16,
                                                        "temperature": 0, "stop_token_ids": [stop], "min_tokens": 6},
                   timeout=60)
    choice = r.json()["choices"][0]
    assert choice["text"] == tok.decode(want[:-1] if ended else want, skip_special_tokens=True)
    assert choice["finish_reason"] == ("stop" if ended else "length")
    assert r.json()["usage"]["completion_tokens"] == len(want)


def test_bad_stop_token_ids_are_refused(server):
    url = server[0]
    for value, match in ((["x"], "stop_token_ids"), ([10**9], "stop_token_ids must be token ids in"),
                         (list(range(300)), "at most 256")):
        r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x", "stop_token_ids": value})
        assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
