"""Validation without a model: admission order, byte bound before tokenizing, Unicode, limits."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from pagedexperts.serving import protocol  # noqa: E402
from pagedexperts.serving.protocol import ApiError, ChatCompletionRequest, CompletionRequest  # noqa: E402

CONTEXT = 64


class NoTokenizer:
    """Fails the test if anything is tokenized."""

    chat_template = None

    def __call__(self, *a, **k):
        raise AssertionError("tokenized a prompt that should have been refused before")

    decode = apply_chat_template = __call__


def _prepare(body, tokenizer=None):
    return protocol.prepare(body, tokenizer or NoTokenizer(), context_length=CONTEXT, vocab_size=100)


def test_oversized_prompt_refused_before_tokenizing():
    limit = CONTEXT * protocol.MAX_PROMPT_BYTES_PER_TOKEN
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
    assert protocol.default_max_body_bytes(512) == 2**20 + 8 * 512 * protocol.MAX_PROMPT_BYTES_PER_TOKEN
    assert 5 * 10**6 > protocol.default_max_body_bytes(512)


def test_cli_defaults_match_the_library():
    """commands/serve.py repeats two constants so that --help needs no torch import."""
    from pagedexperts.commands import serve
    from pagedexperts.serving.scheduler import DEFAULT_MAX_PREFILL_TOKENS

    assert serve.DEFAULT_MAX_PREFILL_TOKENS == DEFAULT_MAX_PREFILL_TOKENS
    assert serve.MAX_PROMPT_BYTES_PER_TOKEN == protocol.MAX_PROMPT_BYTES_PER_TOKEN
