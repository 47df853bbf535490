"""``check`` refuses what its paged load or its prompts would refuse before any model loads.

Found by a fresh user: ``check --host-memory-gb X`` with X below the least that fits was refused
only at the paged load, after the unpaged reference had loaded and run; ``check --max-new-tokens N``
past the model's max_position_embeddings was not refused at all. Oracle for the budget: the
message ``load_model`` itself raises with the same options; for the positions: the tokenizer's
own count of the longest prompt against config.json's max_position_embeddings.
"""

from __future__ import annotations

import json

import pytest

import pagedexperts.loading.loader
import pagedexperts.tools.check
from pagedexperts.cli import main
from pagedexperts.loading.bundled import bundled_model_path
from pagedexperts.loading.loader import load_model, load_tokenizer
from pagedexperts.tools.check import DEFAULT_PROMPTS
from pagedexperts.tools.check_runs import CheckRequest, check_checkpoint

OPTIONS = dict(device="cpu", dtype="float32", experts_implementation="auto")


@pytest.fixture
def nothing_loads(monkeypatch):
    """The reference and the paged model fail the test if loaded."""
    def fail(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(pagedexperts.tools.check, "load_reference_with_choice", fail)
    monkeypatch.setattr(pagedexperts.loading.loader, "load_model", fail)


def _paged_load_refusal(budget_gb: float, k: int) -> str:
    with pytest.raises(ValueError) as refused:
        load_model(None, num_resident=k, host_memory_gb=budget_gb, **OPTIONS)
    return str(refused.value)


def test_a_host_memory_budget_below_the_least_is_refused_with_the_paged_loads_message(nothing_loads):
    want = _paged_load_refusal(0.001, 8)  # before the fixture's patch: the real loader, the real plan
    assert "--host-memory-gb 0.001 is below the minimum for the disk tier" in want and "raise --host-memory-gb" in want
    request = CheckRequest(None, {**OPTIONS, "host_memory_gb": 0.001}, check_resident=(8, 32))
    with pytest.raises(ValueError) as got:
        check_checkpoint(request)
    assert str(got.value) == want


def test_the_cli_refuses_it_before_the_reference_loads(capsys, nothing_loads):
    want = _paged_load_refusal(0.001, 4)
    assert main(["check", "--dtype", "float32", "--check-resident", "4", "--host-memory-gb", "0.001"]) == 2
    err = capsys.readouterr().err
    assert err == f"pagedexperts check: error: {want}\n"  # no "loading the unpaged reference" line before it


def _longest_prompt_tokens() -> tuple[int, int]:
    """(tokens of the longest built-in prompt, max_position_embeddings) of the bundled model."""
    path = bundled_model_path()
    tokenizer = load_tokenizer(path)
    limit = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    return max(len(tokenizer(p)["input_ids"]) for p in DEFAULT_PROMPTS), limit


def test_prompt_plus_new_tokens_past_the_positions_is_refused_naming_value_limit_and_flag(nothing_loads):
    longest, limit = _longest_prompt_tokens()
    fits = limit - longest
    request = CheckRequest(None, OPTIONS, check_resident=(4,), max_new_tokens=fits + 1)
    with pytest.raises(ValueError) as got:
        check_checkpoint(request)
    message = str(got.value)
    assert (f"prompt {longest} tokens + --max-new-tokens {fits + 1} exceeds the model's max_position_embeddings "
            f"{limit}; lower --max-new-tokens (at most {fits} here)") in message, message


def test_the_cli_refuses_a_prompt_that_leaves_no_position(capsys, nothing_loads):
    _, limit = _longest_prompt_tokens()
    prompt = "a " * limit  # one token a character at least: longer than the positions alone
    assert main(["check", "--prompt", prompt, "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "the prompt is too long" in err and f"max_position_embeddings {limit}" in err, err
