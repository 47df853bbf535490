"""``generate``'s sampling flags mean what serve's request fields of the same names mean: one rule,
``engine.sampling``, reached through ``engine.logits_processor.SamplingProcessor`` (issue 36 part
3.5); ``generate`` without ``--prompt`` on a terminal says that it reads stdin; prompt and stop
text that is not UTF-8 is refused naming where it came from."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from pagedexperts.cli import main
from pagedexperts.engine.logits_processor import SamplingProcessor
from pagedexperts.engine.sampling import SamplingParams

V = 50


@pytest.mark.parametrize("params", [
    dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3, min_tokens=4, eos_ids=(7,)),
    dict(temperature=1.3, top_p=0.5),
    dict(temperature=0.9, min_p=0.2, repetition_penalty=0.8),
])
def test_processor_distribution_is_transformers_processors_in_their_order(params):
    """The oracle: transformers' own processors, in the order engine.sampling documents
    (repetition penalty, min new tokens, temperature, top-k, top-p, min-p)."""
    p = SamplingParams(max_new_tokens=16, **params)
    prompt = torch.tensor([[3, 9, 12]])
    proc = SamplingProcessor(p)
    proc(prompt, torch.zeros(1, V))  # the first call fixes the prompt length
    ids = torch.tensor([[3, 9, 12, 7, 20]])  # two tokens generated
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0)) * 3
    ours = torch.softmax(proc(ids, logits.clone()), dim=-1)
    expected = logits.clone()
    oracle = [RepetitionPenaltyLogitsProcessor(p.repetition_penalty)] if p.repetition_penalty != 1.0 else []
    if p.min_tokens:
        oracle.append(MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=3, min_new_tokens=p.min_tokens,
                                                        eos_token_id=list(p.eos_ids)))
    oracle.append(TemperatureLogitsWarper(p.temperature))
    oracle += [TopKLogitsWarper(p.top_k)] if p.top_k else []
    oracle += [TopPLogitsWarper(p.top_p)] if p.top_p < 1 else []
    oracle += [MinPLogitsWarper(p.min_p)] if p.min_p else []
    for processor in oracle:
        expected = processor(ids, expected)
    expected = torch.softmax(expected, dim=-1)
    assert torch.equal(ours == 0, expected == 0), "a different set of tokens is ruled out"
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-7)
    if p.min_tokens:
        assert ours[0, 7] == 0  # the end-of-sequence id is held back: 2 of 4 tokens generated


def _generate(capsys, *flags) -> tuple[str, dict]:
    stats = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pe-sampling-{os.getpid()}.json")
    assert main(["generate", "--prompt", "ROMEO:", "--threads", "1", "--quiet", "--stats-json", stats, *flags]) == 0
    with open(stats) as f:
        return capsys.readouterr().out, json.load(f)


def test_top_k_1_samples_the_greedy_text(capsys):
    greedy, _ = _generate(capsys, "--max-new-tokens", "24")
    sampled, _ = _generate(capsys, "--max-new-tokens", "24", "--temperature", "5", "--top-k", "1", "--seed", "3")
    hot, _ = _generate(capsys, "--max-new-tokens", "24", "--temperature", "5", "--seed", "3")
    assert sampled == greedy and hot != greedy  # temperature 5 alone wanders off


def test_repetition_penalty_and_min_tokens_give_serve_s_tokens(capsys, bundled_model):
    """Greedy, penalty 1.5: generate's text is the engine scheduler's (serve's path) for the same
    SamplingParams, token for token; --min-tokens 20 holds EOS back past where it came (8 tokens)."""
    from pagedexperts.engine.scheduler import BatchScheduler
    from pagedexperts.engine.scheduler_config import SchedulerConfig

    text, stats = _generate(capsys, "--max-new-tokens", "32", "--repetition-penalty", "1.5")
    longer, longer_stats = _generate(capsys, "--max-new-tokens", "32", "--repetition-penalty", "1.5", "--min-tokens", "20")
    assert stats["new_tokens"] < 20 <= longer_stats["new_tokens"] and longer.startswith(text.rstrip("\n"))
    model, tokenizer = bundled_model
    for min_tokens, want in ((0, text), (20, longer)):
        sched = BatchScheduler(model, tokenizer, SchedulerConfig(1, 512, chunked_prefill=False))
        ids = tokenizer("ROMEO:")["input_ids"]
        params = SamplingParams(max_new_tokens=32, repetition_penalty=1.5, prompt_ids=tuple(ids), min_tokens=min_tokens,
                                eos_ids=tuple(sorted(sched.eos_ids)))
        events = []
        sched.submit(ids, params, events.append)
        while sched.num_running or not events or events[-1].finish_reason is None:
            sched.step()
        assert "".join(e.text for e in events) + "\n" == want


def test_min_tokens_holds_stop_strings_back_as_serve(capsys, bundled_model):
    """--min-tokens 6 --stop I: the "I" in the first 6 tokens' text is text, the next one stops
    (serve's min_tokens, vLLM's). Oracle: transformers' own greedy generate, cut by string search;
    the same through the scheduler (serve's path) and through the static decode (CUDA graphs' path)."""
    from pagedexperts.engine.logits_processor import SamplingProcessor
    from pagedexperts.generation.generate import generate_text
    from pagedexperts.loading.loader import load_model

    model, tok = bundled_model
    ids = tok("ROMEO:")["input_ids"]
    with torch.no_grad():
        new = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0)[0, len(ids):]
    full, held = tok.decode(new, skip_special_tokens=True), tok.decode(new[:6], skip_special_tokens=True)
    assert 0 <= full.find("I") < len(held), "the stop must occur within the held tokens' text"
    want = full[:full.find("I", len(held))]
    text, stats = _generate(capsys, "--max-new-tokens", "24", "--stop", "I", "--min-tokens", "6")
    assert text == want + "\n" and stats["finish_reason"] == "stop"
    params = SamplingParams(max_new_tokens=24, stop=("I",), min_tokens=6, eos_ids=(0,))
    static, _ = load_model(num_resident=16, cuda_graphs="eager")
    got = generate_text(static, tok, "ROMEO:", params, logits_processor=SamplingProcessor(params), min_tokens=6)
    assert got.text == want and got.finish_reason == "stop"


@pytest.fixture(scope="module")
def bundled_model():
    from pagedexperts.loading.loader import load_model

    return load_model(num_resident=16)


@pytest.mark.parametrize("flags,needle", [
    (["--top-k", "-1"], "--top-k -1 must be >= 0 (0: all tokens)"),
    (["--min-p", "1.5"], "--min-p 1.5 must be in [0, 1]"),
    (["--repetition-penalty", "0"], "--repetition-penalty 0.0 must be > 0 (1: none)"),
    (["--repetition-penalty", "nan"], "--repetition-penalty nan must be > 0"),
    (["--min-tokens", "65"], "--min-tokens 65 must be in [0, --max-new-tokens 64]"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be > 0, got -5"),  # it named --min-tokens 0
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),  # it ran, 1 token, exit 0
    (["--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
])
def test_bad_sampling_flags_are_refused_naming_the_flag(flags, needle, capsys):
    assert main(["generate", "--prompt", "x", *flags]) == 2
    assert needle in capsys.readouterr().err


def _generate_reading_a_terminal() -> str:
    """stderr of ``generate`` whose stdin is a pseudo-terminal given a line and Ctrl-D."""
    argv = [sys.executable, "-m", "pagedexperts.cli", "generate", "--max-new-tokens", "2", "--threads", "1", "--quiet"]
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(slave)
    os.write(master, b"ROMEO:\n\x04")  # a line, then Ctrl-D: end of input on a terminal
    out, err = proc.communicate(timeout=300)
    os.close(master)
    assert proc.returncode == 0 and out.strip() and not out.startswith(b"ROMEO:"), err  # --quiet: generated text only
    return err.decode()


class _Stdin:
    def __init__(self, terminal: bool):
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal

    def read(self) -> str:
        return "ROMEO:"


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_generate_without_prompt_says_it_reads_stdin_on_a_terminal(terminal, capsys, monkeypatch):
    """It waited silently on a terminal; a pipe needs no word (and gets none: stderr stays the report's)."""
    monkeypatch.setattr(sys, "stdin", _Stdin(terminal))
    assert main(["generate", "--max-new-tokens", "2", "--threads", "1", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and not out.startswith("ROMEO:")  # --quiet: the generated text only
    said = "generate: reading the prompt from stdin; end it with Ctrl-D (or give --prompt TEXT)\n"
    assert err == (said if terminal else "")


@pytest.mark.slow
def test_generate_reading_a_real_terminal_says_so():
    assert "generate: reading the prompt from stdin; end it with Ctrl-D" in _generate_reading_a_terminal()


def test_a_prompt_that_is_not_utf8_is_one_line_before_anything_is_printed():
    """Bytes that are not UTF-8 on stdin reach Python as lone surrogates (surrogateescape); the
    tokenizer raised a TypeError traceback after the model loaded and the prompt was printed."""
    done = subprocess.run([sys.executable, "-m", "pagedexperts.cli", "generate", "--max-new-tokens", "2"],
                          input=b"ROMEO \xff:", capture_output=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, b"")
    assert done.stderr.decode() == ("pagedexperts generate: error: the prompt on stdin is not valid UTF-8 (byte 0xff "
                                    "at character 6); give UTF-8 text\n")


@pytest.mark.parametrize("argv,flag", [
    (["generate", "--prompt", "caf\udce9"], "--prompt"),  # argv's bytes, as Python decodes them
    (["generate", "--prompt", "x", "--stop", "\udce9"], "--stop"),
    (["check", "--prompt", "caf\udce9"], "--prompt"),
])
def test_argv_text_that_is_not_utf8_names_the_flag(argv, flag, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {flag} is not valid UTF-8 (byte 0xe9 at character" in err and err.count("\n") == 1


def test_quiet_prints_only_the_generated_text(capsys, bundled_model):
    """--quiet: stdout is the generated text (transformers' own greedy tokens, decoded) and a
    newline, stderr nothing; it printed the prompt too."""
    model, tok = bundled_model
    ids = tok("ROMEO:")["input_ids"]
    with torch.no_grad():
        new = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(ids):]
    assert main(["generate", "--prompt", "ROMEO:", "--max-new-tokens", "8", "--threads", "1", "--quiet"]) == 0
    assert capsys.readouterr() == (tok.decode(new, skip_special_tokens=True) + "\n", "")


@pytest.mark.parametrize("speculative", [[], ["--speculative", "ngram"]], ids=["generate", "speculative"])
def test_a_prompt_longer_than_the_context_is_not_echoed_and_says_by_how_much(speculative, capsys):
    """The bundled model has 512 positions: a prompt of n >= 512 tokens leaves none for a new one.
    It was printed in full, then the error advised "lower --max-new-tokens (at most 0 here)"."""
    from pagedexperts.loading.bundled import bundled_model_path
    from tokenizers import Tokenizer

    prompt = "ROMEO: " * 300
    n = len(Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json")).encode(prompt).ids)
    assert n >= 512
    assert main(["generate", "--prompt", prompt, "--max-new-tokens", "4", "--threads", "1", *speculative]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert (f"the prompt is too long: {n} tokens, {n - 511} more than the 511 the model's max_position_embeddings 512 "
            f"leaves with room for one new token; shorten the prompt by at least {n - 511} tokens") in err
    assert "--max-new-tokens" not in err.splitlines()[-1]


@pytest.mark.parametrize("speculative", [[], ["--speculative", "ngram"]], ids=["generate", "speculative"])
def test_prompt_and_new_tokens_past_the_model_s_positions_are_refused(speculative, capsys):
    """The bundled model has 512 positions: transformers' generate warned and went on past them
    (generate --speculative and serve refused); both paths now refuse with the same line."""
    prompt = "ROMEO: " * 20
    from pagedexperts.loading.bundled import bundled_model_path
    from tokenizers import Tokenizer

    n = len(Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json")).encode(prompt).ids)
    assert main(["generate", "--prompt", prompt, "--max-new-tokens", str(513 - n), "--threads", "1", *speculative]) == 2
    assert (f"prompt {n} tokens + --max-new-tokens {513 - n} exceeds the model's max_position_embeddings 512; lower "
            f"--max-new-tokens (at most {512 - n} here)") in capsys.readouterr().err


def test_the_report_says_why_generation_ended(tmp_path, capsys):
    """The README's command asks for 80 tokens and prints 30: the report said "new 30" and not why.
    finish_reason is OpenAI's (serve's): "length" at --max-new-tokens, "stop" at a stop string or
    an end-of-sequence token (here the greedy first token, made the model's eos id)."""
    from pagedexperts.generation.config import SamplingConfig
    from pagedexperts.generation.generate import generate_text
    from pagedexperts.loading.loader import load_model

    stats = tmp_path / "stats.json"
    runs = {}
    for name, flags in [("length", ["--max-new-tokens", "3"]), ("stop", ["--max-new-tokens", "24", "--stop", "\n"])]:
        assert main(["generate", "--prompt", "ROMEO:", "--threads", "1", "--stats-json", str(stats), *flags]) == 0
        runs[name] = (json.loads(stats.read_text()), capsys.readouterr().err)
    assert runs["length"][0]["finish_reason"] == "length" and runs["length"][0]["new_tokens"] == 3
    assert "stopped early" not in runs["length"][1]
    assert runs["stop"][0]["finish_reason"] == "stop" and runs["stop"][0]["new_tokens"] < 24  # greedy text has "\n"
    assert "new {} (stopped early: an end-of-sequence token or a --stop string)".format(
        runs["stop"][0]["new_tokens"]) in runs["stop"][1]
    model, tok = load_model(num_resident=16)
    first = generate_text(model, tok, "ROMEO:", SamplingConfig(max_new_tokens=1))
    assert first.finish_reason == "length"
    model.generation_config.eos_token_id = tok(first.text, add_special_tokens=False)["input_ids"][0]
    ended = generate_text(model, tok, "ROMEO:", SamplingConfig(max_new_tokens=5))
    assert (ended.new_tokens, ended.finish_reason) == (1, "stop")
