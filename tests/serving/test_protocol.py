"""Validation without a model: admission order, byte bound before tokenizing, Unicode, limits."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from pagedexperts.serving import admission, protocol, validation  # noqa: E402
from pagedexperts.serving.protocol import ApiError, ChatCompletionRequest, CompletionRequest  # noqa: E402

CONTEXT = 64


class NoTokenizer:
    """Fails the test if anything is tokenized."""

    chat_template = None

    def __call__(self, *a, **k):
        raise AssertionError("tokenized a prompt that should have been refused before")

    decode = apply_chat_template = __call__


def _prepare(body, tokenizer=None):
    return validation.prepare(body, tokenizer or NoTokenizer(), context_length=CONTEXT, vocab_size=100)


def test_oversized_prompt_refused_before_tokenizing():
    limit = CONTEXT * validation.MAX_PROMPT_BYTES_PER_TOKEN
    with pytest.raises(ApiError, match="bytes, more than any prompt") as e:
        _prepare(CompletionRequest(model="m", prompt="x" * (limit + 1)))
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(ApiError, match="bytes"):  # counted in bytes: 3 per character here
        _prepare(CompletionRequest(model="m", prompt="界" * (limit // 3 + 1)))
    with pytest.raises(ApiError, match="bytes"):
        _prepare(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "y" * (limit + 1)}]))
    with pytest.raises(ApiError, match="tokens; the context length"):  # ids: counted, not decoded
        _prepare(CompletionRequest(model="m", prompt=[1] * CONTEXT))


@pytest.mark.parametrize("body", [
    CompletionRequest(model="m", prompt="a\ud800"),
    CompletionRequest(model="m", prompt="x", stop=["\udc00"]),
    ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "\ud83d"}]),
])
def test_lone_surrogate_is_refused_by_name(body):
    """Strings that reach validation from Python (not via JSON) are checked too."""
    with pytest.raises(ApiError, match="not valid Unicode") as e:
        _prepare(body)
    assert e.value.code == "invalid_unicode"


def test_ranges_checked_before_any_tokenizing():
    for field, value in [("temperature", float("nan")), ("top_p", float("inf")), ("seed", 2**64),
                         ("presence_penalty", -3), ("n", 0)]:
        with pytest.raises(ApiError, match=field):
            _prepare(CompletionRequest(model="m", prompt="x", **{field: value}))


def test_default_body_limit_grows_with_the_context():
    assert admission.default_max_body_bytes(512) == 2**20 + 8 * 512 * validation.MAX_PROMPT_BYTES_PER_TOKEN
    assert 5 * 10**6 > admission.default_max_body_bytes(512)


def test_cli_defaults_match_the_library():
    """commands/serve.py repeats two constants so that --help needs no torch import."""
    from pagedexperts.commands import serve
    from pagedexperts.engine.scheduler_config import DEFAULT_MAX_PREFILL_TOKENS

    assert serve.DEFAULT_MAX_PREFILL_TOKENS == DEFAULT_MAX_PREFILL_TOKENS
    assert serve.MAX_PROMPT_BYTES_PER_TOKEN == validation.MAX_PROMPT_BYTES_PER_TOKEN
    from pagedexperts.serving import connections

    assert serve.DEFAULT_HEADER_TIMEOUT_S == connections.DEFAULT_HEADER_TIMEOUT_S
    assert serve.DEFAULT_BODY_TIMEOUT_S == connections.DEFAULT_BODY_TIMEOUT_S
    assert serve.DEFAULT_BODY_DEADLINE_S == connections.DEFAULT_BODY_DEADLINE_S
    assert serve.DEFAULT_MAX_CONNECTIONS == connections.DEFAULT_MAX_CONNECTIONS


def test_metrics_export_every_numeric_layer_stat():
    """A counter added to LayerStats (e.g. by another module) is exported without a change."""
    pytest.importorskip("prometheus_client")
    from dataclasses import dataclass
    from types import SimpleNamespace

    from pagedexperts.engine.forwards import DecodeCounts
    from pagedexperts.serving.metrics import Metrics
    from pagedexperts.stats.accounting import LayerStats

    @dataclass
    class MoreStats(LayerStats):
        ttft_p99_s: float = 0.25

    layer = MoreStats(hits=3, misses=2, union_max=5)
    store = SimpleNamespace(tier_stats=None)  # the ExpertStore contract: None = no disk tier
    runtime = SimpleNamespace(runners={0: SimpleNamespace(stats=layer, store=store)}, num_resident=8, top_k=2)
    sched = SimpleNamespace(num_running=1, num_waiting=0, config=SimpleNamespace(max_running_requests=4),
                            stats=SimpleNamespace(), speculative=None,
                            forwards=SimpleNamespace(summary=lambda: dict(
                                kv_layout="rows", decode_steps=dict(DecodeCounts(replay=7).as_dict()),
                                steps=dict(backend="cuda", reason=None))))
    text = Metrics(sched, runtime).render().decode()
    assert 'pagedexperts_decode_steps_total{how="replay"} 7.0' in text
    assert 'pagedexperts_decode_backend{backend="cuda",kv_layout="rows",reason=""} 1.0' in text
    for line in ('pagedexperts_paging_ttft_p99_s{layer="0"} 0.25', 'pagedexperts_paging_hits_total{layer="0"} 3.0',
                 'pagedexperts_paging_misses_total{layer="0"} 2.0', 'pagedexperts_paging_union_max{layer="0"} 5.0',
                 "pagedexperts_running_requests 1.0"):
        assert line in text, line


def test_every_paging_counter_is_exported_once():
    """Each LayerStats field, given a value no other has, shows up in exactly one sample of layer 0,
    named pagedexperts_paging_<field> (``_total`` on counters): no second name for one figure."""
    pytest.importorskip("prometheus_client")
    from dataclasses import fields
    from types import SimpleNamespace

    from pagedexperts.engine.forwards import DecodeCounts
    from pagedexperts.serving.metrics import GAUGE_NAME, Metrics
    from pagedexperts.stats.accounting import LayerStats

    numeric = [f.name for f in fields(LayerStats) if f.type in ("int", "float")]
    layer = LayerStats(**{name: 1000 + i for i, name in enumerate(numeric)})
    runtime = SimpleNamespace(runners={0: SimpleNamespace(stats=layer, store=SimpleNamespace(tier_stats=None))},
                              num_resident=8, top_k=2)
    sched = SimpleNamespace(num_running=0, num_waiting=0, config=SimpleNamespace(max_running_requests=4),
                            stats=SimpleNamespace(), speculative=None,
                            forwards=SimpleNamespace(summary=lambda: dict(
                                kv_layout="rows", decode_steps=dict(DecodeCounts().as_dict()),
                                steps=dict(backend="eager", reason=None))))
    samples = [line.rsplit(" ", 1) for line in Metrics(sched, runtime).render().decode().splitlines()
               if line.endswith(tuple(f" {1000 + i}.0" for i in range(len(numeric)))) and 'layer="0"' in line]
    assert len(numeric) > 10
    for i, name in enumerate(numeric):
        named = [s for s, v in samples if float(v) == 1000 + i]
        want = f"pagedexperts_paging_{name}{'' if GAUGE_NAME.search(name) else '_total'}" + '{layer="0"}'
        assert named == [want], (name, named)


@pytest.mark.parametrize("name, gauge", [("max_decode_batch", True), ("union_max", True), ("union_last", True),
                                         ("plan_p99_s", True), ("union_mean", True), ("decode_steps", False),
                                         ("bytes_paged", False), ("page_in_s", False)])
def test_levels_are_gauges_sums_are_counters(name, gauge):
    pytest.importorskip("prometheus_client")
    from pagedexperts.serving.metrics import GAUGE_NAME

    assert bool(GAUGE_NAME.search(name)) == gauge


def test_chat_bound_is_on_all_messages_together():
    """Each message under the byte bound, all of them over it: refused before the template."""
    limit = CONTEXT * validation.MAX_PROMPT_BYTES_PER_TOKEN
    messages = [{"role": "user", "content": "y" * (limit // 4)}] * 5
    with pytest.raises(ApiError, match="bytes, more than any prompt") as e:
        _prepare(ChatCompletionRequest(model="m", messages=messages))
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


def test_stream_options_without_stream_is_refused():
    """As OpenAI and vLLM do: stream_options only with stream: true, never ignored."""
    with pytest.raises(ApiError, match="stream_options") as e:
        _prepare(CompletionRequest(model="m", prompt="x", stream_options={"include_usage": True}))
    assert e.value.param == "stream_options"


def test_chat_message_name_reaches_the_template():
    messages = [protocol.ChatMessage(role="user", content="hi", name="bob"), protocol.ChatMessage(role="user", content="x")]
    assert validation.chat_messages(messages) == [{"role": "user", "content": "hi", "name": "bob"},
                                                {"role": "user", "content": "x"}]


# Bodies sglang-router 0.3.2 (and vllm-router 0.1.17: VLLM_ROUTER_CHAT) forwarded to a replica for plain
# client requests (watched on loopback).
ROUTER_CHAT = (b'{"messages":[{"role":"user","content":"hi"}],"model":"tiny","logprobs":false,"max_completion_tokens":5,'
               b'"stream":false,"no_stop_trim":false,"ignore_eos":false,"continue_final_message":false,'
               b'"skip_special_tokens":true,"separate_reasoning":true,"stream_reasoning":true,"return_hidden_states":false}')
VLLM_ROUTER_CHAT = (b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"stream":false,"max_tokens":5,'
                    b'"logprobs":false,"no_stop_trim":false,"ignore_eos":false,"continue_final_message":false,'
                    b'"skip_special_tokens":true,"separate_reasoning":true,"stream_reasoning":true,'
                    b'"return_hidden_states":false,"include_reasoning":true}')
ROUTER_COMPLETION = (b'{"model":"tiny","prompt":"hi","max_tokens":5,"stream":false,"echo":false,"no_stop_trim":false,'
                     b'"ignore_eos":false,"skip_special_tokens":true,"return_hidden_states":false}')
ROUTER_RESPONSE = (b'{"input":"hi","max_output_tokens":5,"model":"tiny","store":true,"stream":null,"temperature":1.0,'
                   b'"top_p":1.0,"priority":0,"top_k":-1,"min_p":0.0,"repetition_penalty":1.0}')


@pytest.mark.parametrize("raw, cls", [(ROUTER_CHAT, ChatCompletionRequest), (VLLM_ROUTER_CHAT, ChatCompletionRequest),
                                      (ROUTER_COMPLETION, CompletionRequest)])
def test_router_forwarded_defaults_pass_and_other_values_are_refused(raw, cls):
    import json

    validation.check_ranges(protocol.parse_request(raw, cls))
    for name, value in (("no_stop_trim", True), ("return_hidden_states", True)):
        body = protocol.parse_request(json.dumps({**json.loads(raw), name: value}).encode(), cls)
        with pytest.raises(ApiError, match=f"unsupported field '{name}'") as e:
            validation.check_ranges(body)
        assert e.value.param == name
    for name, value in (("ignore_eos", True), ("skip_special_tokens", False)):  # vLLM's options, served
        validation.check_ranges(protocol.parse_request(json.dumps({**json.loads(raw), name: value}).encode(), cls))


def test_responses_request_becomes_the_chat_request():
    from pagedexperts.serving import responses_api

    body = responses_api.parse(ROUTER_RESPONSE)
    chat = responses_api.to_chat(body)
    assert [(m.role, m.content) for m in chat.messages] == [("user", "hi")] and chat.max_completion_tokens == 5
    assert (chat.top_k, chat.min_p, chat.repetition_penalty) == (-1, 0.0, 1.0)
    import json

    sampled = responses_api.to_chat(responses_api.parse(json.dumps(
        {**json.loads(ROUTER_RESPONSE), "top_k": 7, "min_p": 0.1, "repetition_penalty": 1.2}).encode()))
    assert (sampled.top_k, sampled.min_p, sampled.repetition_penalty) == (7, 0.1, 1.2)
    body = responses_api.parse(b'{"model":"m","instructions":"be brief","input":[{"role":"user","content":'
                               b'[{"type":"input_text","text":"a"},{"type":"input_text","text":"b"}]},'
                               b'{"role":"assistant","content":[{"type":"output_text","text":"c","annotations":[]}]}]}')
    assert [(m.role, m.content) for m in responses_api.to_chat(body).messages] == [
        ("system", "be brief"), ("user", "a\nb"), ("assistant", "c")]
    err = responses_api.renamed(ApiError("max_tokens 9 + prompt 3 tokens exceed; messages", param="max_tokens"))
    assert err.param == "max_output_tokens" and err.message == "max_output_tokens 9 + prompt 3 tokens exceed; input"


@pytest.mark.parametrize("chat", [False, True])
def test_max_tokens_zero_names_echo_only_where_the_endpoint_has_it(chat):
    """Completions have echo (max_tokens 0 scores a prompt); chat and responses do not, so their
    refusal must not tell the user to send echo (responses said "max_output_tokens must be > 0
    (0 only with echo, ...)", a field that API does not have)."""
    body = (ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=0) if chat
            else CompletionRequest(model="m", prompt="x", max_tokens=0))
    with pytest.raises(ApiError) as e:
        _prepare(body)
    assert e.value.message.startswith("max_tokens must be > 0") and e.value.param == "max_tokens"
    assert ("echo" in e.value.message) is (not chat)


@pytest.mark.parametrize("stop,needle", [("", "stop[0] has 0"), (["ok", ""], "stop[1] has 0"),
                                         (["x" * (validation.MAX_STOP_CHARS + 1)], f"stop[0] has {validation.MAX_STOP_CHARS + 1}"),
                                         (["a"] * (validation.MAX_STOP_STRINGS + 1), f"got {validation.MAX_STOP_STRINGS + 1}")])
def test_a_bad_stop_string_is_named(stop, needle):
    """The refusal says which stop string is wrong and why (it said 'got 1' for stop: "")."""
    with pytest.raises(ApiError, match=needle.replace("[", r"\[").replace("]", r"\]")) as e:
        _prepare(CompletionRequest(model="m", prompt="x", stop=stop))
    assert e.value.param == "stop"


@pytest.mark.parametrize("field,value", [("stream", "yes"), ("max_tokens", True), ("temperature", "0.5"),
                                         ("max_output_tokens", True), ("n", 1.5)])
def test_a_value_of_the_wrong_type_is_refused_not_coerced(field, value):
    """As OpenAI's API answers ("Invalid type for 'stream'"): JSON types are not coerced
    (pydantic's lax mode read "yes" as true and true as 1)."""
    import json

    from pagedexperts.serving.responses_api import ResponsesRequest

    cls, base = ((ResponsesRequest, {"model": "m", "input": "x"}) if field == "max_output_tokens"
                 else (CompletionRequest, {"model": "m", "prompt": "x"}))
    with pytest.raises(ApiError) as e:
        protocol.parse_request(json.dumps({**base, field: value}).encode(), cls)
    assert e.value.param == field and e.value.status == 400, (e.value.param, e.value.message)


def test_start_up_line_says_whether_speculation_is_on():
    from pagedexperts.engine.speculative.config import SpeculativeConfig
    from pagedexperts.serving.api_server import speculation_note

    assert speculation_note(None) == "speculative decoding off"
    assert speculation_note(SpeculativeConfig("ngram", 3)) == (
        "speculative decoding on: ngram, 3 proposals per request per step "
        "(acceptance in /metrics: pagedexperts_spec_decode_*)")
    assert speculation_note(SpeculativeConfig("draft", 4, draft_model_path="/m/d")).startswith(
        "speculative decoding on: draft /m/d, 4 proposals")
