"""Per-sequence sampling of the server: the stop cut, tiny temperatures, penalties, logprobs.

The stop-cut tables feed ``IncrementalText`` the decode of every prefix of a byte string
(what the scheduler sees after each byte-level token) and check, after EVERY step, that the
text shown so far is a prefix of the expected answer: no byte of a stop string ever reaches
a client, streaming (deltas after each token) or not (the joined deltas at the end).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedexperts.engine.sampling import GREEDY_BELOW, SamplingParams, adjusted_logits, sample, token_logprobs
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
