"""``check`` refuses what its paged load or its prompts would refuse before any model loads.

Found by a fresh user: ``check --host-memory-gb X`` with X below the least that fits was refused
only at the paged load, after the unpaged reference had loaded and run; ``check --max-new-tokens N``
past the model's max_position_embeddings was not refused at all. Oracle for the budget: the
message ``load_model`` itself raises with the same options while the process holds the reference
(transformers' model, its parameters' bytes counted from the loaded model), as check's paged load
plans; for the positions: the tokenizer's own count of the longest prompt against config.json's
max_position_embeddings.
"""

from __future__ import annotations

import json
import re
import weakref

import pytest
import torch

import pagedexperts.loading.loader
import pagedexperts.tools.check
from pagedexperts.cli import main
from pagedexperts.loading.bundled import bundled_model_path
from pagedexperts.loading.loader import load_model, load_tokenizer
from pagedexperts.storage import host_memory
from pagedexperts.tools.check import DEFAULT_PROMPTS, transformers_model
from pagedexperts.tools.check_runs import CheckRequest, check_checkpoint

OPTIONS = dict(device="cpu", dtype="float32", experts_implementation="auto")


@pytest.fixture
def nothing_loads(monkeypatch):
    """The reference and the paged model fail the test if loaded."""
    def fail(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(pagedexperts.tools.check, "load_reference_with_choice", fail)
    monkeypatch.setattr(pagedexperts.loading.loader, "load_model", fail)


def _for_check(message: str, k: int) -> str:
    """The paged load's refusal as check says it: the K refused, and check's flag for K."""
    assert "lower --num-resident" in message
    return f"at K = {k} (--check-resident): " + message.replace("lower --num-resident", "lower --check-resident")


def _paged_load_refusal(budget_gb: float, k: int) -> str:
    with pytest.raises(ValueError) as refused:
        load_model(None, num_resident=k, host_memory_gb=budget_gb, **OPTIONS)
    return str(refused.value)


@pytest.fixture
def reference_bytes() -> int:
    """Bytes of the parameters of check's unpaged reference of the bundled model: transformers' own
    model at float32."""
    model = transformers_model(bundled_model_path(), dtype=torch.float32)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture
def held(monkeypatch):
    """held(extra): the process's anonymous memory (conftest's constant) + ``extra`` bytes from now on."""
    fixed = host_memory.process_anon_bytes()

    def hold(extra: int) -> None:
        monkeypatch.setattr(host_memory, "process_anon_bytes", lambda: fixed + extra)

    return hold


def test_a_host_memory_budget_below_the_least_is_refused_with_the_paged_loads_message(reference_bytes, held,
                                                                                      nothing_loads):
    """The message check's paged load gives, the reference held by then, before the reference loads."""
    held(reference_bytes)
    want = _paged_load_refusal(0.001, 8)  # the real loader (imported before the fixture's patch), the real plan
    assert "--host-memory-gb 0.001 is below the minimum for the disk tier" in want and "raise --host-memory-gb" in want
    held(0)
    request = CheckRequest(None, {**OPTIONS, "host_memory_gb": 0.001}, check_resident=(8, 32))
    with pytest.raises(ValueError) as got:
        check_checkpoint(request)
    assert str(got.value) == _for_check(want, 8)


def test_a_budget_the_paged_model_fits_alone_but_not_beside_the_reference_is_refused_first(reference_bytes,
                                                                                           nothing_loads):
    """Above the least of the paged model alone by half the reference's bytes: generate would run; check's
    paged load, made with the reference held, would refuse it after the reference loaded."""
    least = int(re.search(r"minimum for the disk tier: ([\d,]+) bytes", _paged_load_refusal(0.001, 8)).group(1)
                .replace(",", ""))
    budget_gb = (least + reference_bytes // 2) / 1e9
    load_model(None, num_resident=8, host_memory_gb=budget_gb, **OPTIONS)  # alone: it loads
    with pytest.raises(ValueError) as got:
        check_checkpoint(CheckRequest(None, {**OPTIONS, "host_memory_gb": budget_gb}, check_resident=(8,)))
    assert (f"--host-memory-gb {budget_gb:.4g} is below the minimum for the disk tier: {least + reference_bytes:,} "
            "bytes") in str(got.value), str(got.value)


def test_the_cli_refuses_it_before_the_reference_loads(capsys, reference_bytes, held, nothing_loads):
    held(reference_bytes)
    want = _paged_load_refusal(0.001, 4)
    held(0)
    capsys.readouterr()  # the fixture's load (transformers' progress bar)
    assert main(["check", "--dtype", "float32", "--check-resident", "4", "--host-memory-gb", "0.001"]) == 2
    err = capsys.readouterr().err
    assert err == f"pagedexperts check: error: {_for_check(want, 4)}\n"  # no "loading the reference" line before it


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


def test_each_ks_paged_model_is_released_before_the_next_k_loads(monkeypatch, capsys):
    """The next K's load plans its host memory without the last K's model (its modules hold cycles: it
    outlived its name until a collection, and the plan counted it as held)."""
    real, refs, alive_at_load = pagedexperts.loading.loader.load_model, [], []

    def tracking(*args, **kwargs):
        alive_at_load.append([ref() is not None for ref in refs])
        model, tokenizer = real(*args, **kwargs)
        refs.append(weakref.ref(model))
        return model, tokenizer

    monkeypatch.setattr(pagedexperts.loading.loader, "load_model", tracking)
    request = CheckRequest(None, OPTIONS, check_resident=(4, 8, 16), prompts=("ROMEO:",), max_new_tokens=1)
    assert check_checkpoint(request) == 0
    assert alive_at_load == [[], [False], [False, False]]


@pytest.mark.parametrize("past", ["by-one", "alone"])
def test_the_advice_is_only_what_can_be_done(past):
    """Shortening the prompt is offered only when that alone would fit: --max-new-tokens larger than
    the positions by itself is told to lower --max-new-tokens, not to cut more tokens than the prompt has."""
    from pagedexperts.generation.config import check_context

    prompt, limit = 28, 512
    new = limit - prompt + 1 if past == "by-one" else 100_000
    with pytest.raises(ValueError) as got:
        check_context(prompt, new, limit)
    message = str(got.value)
    assert f"lower --max-new-tokens (at most {limit - prompt} here)" in message
    assert ("shorten the prompt by 1 tokens" in message) == (past == "by-one"), message
