"""POST /v1/responses with the official client (``client.responses.create``, streaming and not).

References are computed independently on a second model copy: the chat template applied by
the tokenizer itself and a hand-written greedy loop (one full forward per token), never the
server's own code path. The streamed events are checked against the published order and
openai's own event types (the client parses each ``type`` into its class).
"""

from __future__ import annotations

import json
import time

import pytest

from support.serving_fixtures import (HAVE_MODEL, MODEL_PATH, NAME, httpx, metric, one_thread, openai, ref,  # noqa: F401
                              server, torch)
from support.serving_fixtures import client as openai_client

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")

ORDER_HEAD = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
ORDER_TAIL = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
QUESTION = "Who is Romeo?"
INSTRUCTIONS = "Answer as a Shakespeare character."


def _greedy(model, tokenizer, messages, max_new_tokens):
    """(prompt ids, generated ids, text): the chat template, then argmax of a full forward per token."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    out = []
    while len(out) < max_new_tokens:
        with torch.no_grad():
            out.append(int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax()))
        if out[-1] in eos:
            break
    return ids, out, tokenizer.decode(out, skip_special_tokens=True)


def test_text_input_with_instructions_whole(server, ref):
    model, tokenizer = ref
    ids, out, text = _greedy(model, tokenizer, [{"role": "system", "content": INSTRUCTIONS},
                                                {"role": "user", "content": QUESTION}], 6)
    resp = openai_client(server[0]).responses.create(model=NAME, input=QUESTION, instructions=INSTRUCTIONS,
                                                     max_output_tokens=6, temperature=0)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == NAME
    assert resp.output_text == text and resp.instructions == INSTRUCTIONS and resp.max_output_tokens == 6
    assert resp.usage.input_tokens == len(ids) and resp.usage.output_tokens == len(out) == 6
    assert resp.usage.total_tokens == len(ids) + 6
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert [p.type for p in item.content] == ["output_text"] and item.content[0].text == text


def test_message_list_input_streamed_in_the_published_order(server, ref):
    model, tokenizer = ref
    messages = [{"role": "developer", "content": INSTRUCTIONS}, {"role": "user", "content": "ROMEO:"},
                {"role": "assistant", "content": [{"type": "output_text", "text": "O, she doth teach", "annotations": []}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "JULIET:"},
                                                                 {"type": "input_text", "text": "Go on."}]}]
    as_chat = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "ROMEO:"},
               {"role": "assistant", "content": "O, she doth teach"}, {"role": "user", "content": "JULIET:\nGo on."}]
    ids, out, text = _greedy(model, tokenizer, as_chat, 40)
    events = list(openai_client(server[0]).responses.create(model=NAME, input=messages, max_output_tokens=40,
                                                            temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    final = "response.completed" if len(out) < 40 else "response.incomplete"
    assert kinds == ORDER_HEAD + ["response.output_text.delta"] * len(deltas) + ORDER_TAIL + [final]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert deltas and "".join(d.delta for d in deltas) == text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2] if hasattr(e, "item_id"))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    assert done.output_text == text and events[-4].text == text and events[-2].item.content[0].text == text
    assert done.usage.input_tokens == len(ids) and done.usage.output_tokens == len(out)


def test_the_limit_applied_is_reported(server):
    """Without max_output_tokens the limit is what the context leaves (chat's default), and the
    Response reports that number, consistent with a status ``incomplete: max_output_tokens``."""
    from support.serving_fixtures import CONTEXT

    url = server[0]
    text = " Romeo" * 100
    probe = httpx.post(url + "/v1/responses", json={"model": NAME, "input": text, "max_output_tokens": 1}, timeout=60)
    text += " Romeo" * (CONTEXT - 24 - probe.json()["usage"]["input_tokens"])  # 24 tokens of room: a quick answer
    resp = openai_client(url).responses.create(model=NAME, input=text, temperature=0)
    assert resp.max_output_tokens == CONTEXT - resp.usage.input_tokens == 24
    ended_by_limit = resp.usage.output_tokens == resp.max_output_tokens
    assert resp.status == ("incomplete" if ended_by_limit else "completed"), (resp.status, resp.usage)
    assert (resp.incomplete_details is not None) == ended_by_limit


def test_stream_helper_accumulates_the_same_response(server):
    """openai's ``responses.stream`` rebuilds the response from the events (its own state
    machine, which checks the response's identity and each item's place)."""
    c = openai_client(server[0])
    whole = c.responses.create(model=NAME, input=QUESTION, max_output_tokens=8, temperature=0)
    with c.responses.stream(model=NAME, input=QUESTION, max_output_tokens=8, temperature=0) as stream:
        events = list(stream)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == deltas[-1].snapshot == whole.output_text
    last = events[-1]  # the token limit ended it: incomplete (get_final_response wants response.completed)
    assert last.type == "response.incomplete" and last.response.output_text == whole.output_text
    assert last.response.usage.output_tokens == whole.usage.output_tokens == 8


def test_top_p_reaches_the_sampler(server, ref):
    """A nucleus of one token (top_p 1e-9) samples the argmax at any temperature: the greedy text."""
    model, tokenizer = ref
    _, _, text = _greedy(model, tokenizer, [{"role": "user", "content": QUESTION}], 8)
    resp = openai_client(server[0]).responses.create(model=NAME, input=QUESTION, max_output_tokens=8,
                                                     temperature=2.0, top_p=1e-9)
    assert resp.output_text == text and resp.temperature == 2.0 and resp.top_p == 1e-9


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, "tools"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                            {"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.1"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input.0.type"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "x" * 10**4}, "input"),
    ({"seed": "1"}, "seed"),
    ({"include": ["file_search_call.results"]}, "include.0"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
])
def test_unsupported_or_bad_fields_refused_naming_the_field(server, extra, param):
    body = {"model": NAME, "input": QUESTION, **extra}
    r = httpx.post(server[0] + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param.split(".")[0] in err["message"]


def test_client_sees_a_refusal_as_bad_request(server):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(server[0]).responses.create(model=NAME, input=QUESTION, tools=[
            {"type": "function", "name": "f", "parameters": {"type": "object"}}])
    assert info.value.body["param"] == "tools" and "tool calling" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        openai_client(server[0]).responses.create(model="other", input=QUESTION)


def test_router_forwarded_defaults_accepted(server):
    """The body sglang-router forwards for a plain request (watched on loopback): its defaults pass,
    and so do other top_k / repetition_penalty values; stored responses are a 400 saying so."""
    body = {"input": QUESTION, "max_output_tokens": 3, "model": NAME, "store": True, "stream": None,
            "temperature": 1.0, "top_p": 1.0, "priority": 0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    r = httpx.post(server[0] + "/v1/responses", content=json.dumps(body), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] <= 3
    for name, value in (("top_k", 5), ("repetition_penalty", 1.1), ("min_p", 0.05)):
        r = httpx.post(server[0] + "/v1/responses", json={**body, name: value}, timeout=60)
        assert r.status_code == 200, r.text
    r = httpx.post(server[0] + "/v1/responses", json={**body, "previous_response_id": "resp_1"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert "stored responses" in r.json()["error"]["message"]


def test_stream_closed_by_the_client_frees_its_place(server):
    """A client that closes a response stream after its first delta: the sequence is cancelled
    at the next step (counted as outcome "cancelled"), not generated to max_output_tokens."""
    url = server[0]
    counter = 'pagedexperts_requests_total{endpoint="responses",outcome="cancelled"}'
    before = metric(url, counter, default=0.0)
    stream = openai_client(url).responses.create(model=NAME, input=QUESTION, instructions=INSTRUCTIONS,
                                                 max_output_tokens=200, temperature=0, stream=True)
    for e in stream:
        if e.type == "response.output_text.delta":
            break
    stream.close()
    deadline = time.monotonic() + 10
    while metric(url, counter, default=0.0) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(url, counter, default=0.0) == before + 1
    assert httpx.get(url + "/health").json()["running"] == 0


def test_raw_bodies_validate_against_the_sdk_types(server):
    """The client builds its objects without validating them; here every body and event is
    validated strictly by openai's own pydantic types (a required field missing fails), and
    each event's ``event:`` line names its ``type``."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": NAME, "input": QUESTION, "max_output_tokens": 4, "temperature": 0, "metadata": {"k": "v"}}
    whole = httpx.post(server[0] + "/v1/responses", json=body, timeout=60).json()
    assert Response.model_validate(whole).metadata == {"k": "v"}
    adapter = TypeAdapter(ResponseStreamEvent)
    with httpx.stream("POST", server[0] + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        blocks = r.read().decode().strip().split("\n\n")
    for block in blocks:
        name_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        adapter.validate_python(data)
    last = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))["response"]
    assert last["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]


def test_failed_generation_is_response_failed(server):
    """A model step that raises: a stream ends with ``response.failed`` carrying the error (and
    nothing after it), a whole answer is a 500 ``generation_failed``; the server keeps serving."""
    scheduler = server[1].state.scheduler

    def broken(*args, **kwargs):
        raise RuntimeError("injected step failure")

    forwards = scheduler.forwards
    forwards.packed = forwards.decodes = broken  # instance attributes shadow the methods until deleted
    try:
        events = list(openai_client(server[0]).responses.create(model=NAME, input=QUESTION, max_output_tokens=4,
                                                                stream=True))
        r = httpx.post(server[0] + "/v1/responses", json={"model": NAME, "input": QUESTION}, timeout=60)
    finally:
        del forwards.packed, forwards.decodes
    assert [e.type for e in events] == ORDER_HEAD + ["response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and "injected step failure" in failed.error.message and failed.output == []
    assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed"
    ok = openai_client(server[0]).responses.create(model=NAME, input=QUESTION, max_output_tokens=2)
    assert ok.usage.output_tokens == 2
