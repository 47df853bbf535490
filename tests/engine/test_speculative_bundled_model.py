"""Speculative decoding on the bundled model: greedy identity, KV rollback, paged exactness.

Oracles: plain decoding (the scheduler without speculation, itself tested against
``model.generate`` and teacher forcing) for the greedy output, token for token, at batch 1
and 4 with requests joining and leaving; teacher forcing for every logits row the
speculative scheduler samples from (a rollback that kept a rejected proposal's keys and
values, or dropped an accepted one, moves them by whole units); the unpaged model
(``check.load_reference``, all experts resident) for the verification forward, torch.equal.
A draft equal to the target must have every proposal accepted. The shipped draft
(``pagedexperts/data/tiny-qwen3-draft``) must load with the target's tokenizer, keep greedy
output plain greedy's, and have more proposals accepted than the untrained early exit.
"""

from __future__ import annotations

import pytest

from support.serving_fixtures import (CONTEXT, HAVE_MODEL, MODEL_PATH, PROMPTS, one_thread, ref, torch)  # noqa: F401
from pagedexperts.generation.config import SamplingConfig
from pagedexperts.generation.generate import generate_text
from pagedexperts.engine.generate_one import speculative_generate_text
from pagedexperts.serving.metrics import Metrics
from pagedexperts.engine.scheduler import BatchScheduler
from pagedexperts.engine.scheduler_config import SchedulerConfig
from pagedexperts.engine.speculative.config import speculative_config
from pagedexperts.engine.batching import forward_rows
from pagedexperts.engine.speculative.draft import DraftState, load_draft, model_forward, save_truncated_draft

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")

TOKENS = 24
SHIPPED_DRAFT = MODEL_PATH.parent / "tiny-qwen3-draft"  # distilled from the bundled model (scripts/train_draft.py)
LOGIT_ATOL = 1e-3  # float32 batching noise (as test_server_scheduler)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """The bundled model's first 2 layers: a crude draft with the same tokenizer."""
    return save_truncated_draft(MODEL_PATH, tmp_path_factory.mktemp("draft"), num_layers=2)


def configs(draft_dir):
    return {"ngram": speculative_config("ngram", num_speculative_tokens=4),
            "draft": speculative_config("draft", draft_model_path=str(draft_dir), num_speculative_tokens=3),
            "self-draft": speculative_config("draft", draft_model_path=str(MODEL_PATH), num_speculative_tokens=4)}


class RecordingScheduler(BatchScheduler):
    """Keeps every logits row a token was taken from, per request id."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits: dict[int, list[torch.Tensor]] = {}

    def _accept(self, req, logits, token=None):
        self.logits.setdefault(req.request_id, []).append(logits.clone())
        super()._accept(req, logits, token)


def run(model, tokenizer, prompts, *, max_running, speculative=None, sampling=None, cls=BatchScheduler, chunked=True):
    sched = cls(model, tokenizer, SchedulerConfig(max_running, CONTEXT, chunked_prefill=chunked), speculative=speculative)
    sampling = sampling or SamplingConfig(max_new_tokens=TOKENS)
    reqs = [sched.submit(tokenizer(p)["input_ids"], sampling, lambda e: None) for p in prompts]
    while sched.num_running or sched.num_waiting:
        sched.step()
    return [r.output_ids for r in reqs], sched


@pytest.fixture(scope="module")
def plain(ref):
    model, tokenizer = ref
    return {n: run(model, tokenizer, PROMPTS[:n], max_running=min(n, 4))[0] for n in (1, 8)}


@pytest.mark.parametrize("chunked", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["chunked", "unchunked"])
@pytest.mark.parametrize("method", ["ngram", "draft", "self-draft"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_is_plain_decoding_token_for_token(ref, plain, draft_dir, method, batch, chunked):
    """Batch 1: one prompt; batch 4: 8 prompts through 4 places (joining and leaving). With
    chunked prefill the joining prompts' chunks share forwards with verification steps."""
    model, tokenizer = ref
    n = 1 if batch == 1 else 8
    out, sched = run(model, tokenizer, PROMPTS[:n], max_running=batch, speculative=configs(draft_dir)[method],
                     chunked=chunked)
    assert out == plain[n]
    s = sched.speculative.stats
    assert s.proposed > 0 and s.emitted >= n * (TOKENS - 1)
    # every forward that decodes verifies (mixed chunked-prefill steps too): no plain decode slips in
    assert sched.stats.decode_steps == s.forwards < n * (TOKENS - 1) // batch + n  # fewer forwards than tokens
    if not chunked or batch == 1:
        assert sched.stats.mixed_steps == 0
    elif method != "self-draft":  # a self-draft finishes its 4 together: the next 4 join with no decode running
        assert sched.stats.mixed_steps > 0, "no prompt chunk shared a forward with a verification step"
    if method == "self-draft":  # the draft is the target (unpaged): every proposal is its argmax
        assert s.accepted == s.proposed, s.as_dict()
    print(f"\n{method} batch {batch}: {s.as_dict()}")


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_logits_row_matches_teacher_forcing(ref, draft_dir, method, temperature):
    """Greedy and sampled, batch 4: the rows tokens were taken from == a direct forward."""
    model, tokenizer = ref
    sampling = SamplingConfig(max_new_tokens=TOKENS, temperature=temperature, seed=7)
    out, sched = run(model, tokenizer, PROMPTS[:6], max_running=4, speculative=configs(draft_dir)[method],
                     sampling=sampling, cls=RecordingScheduler)
    assert sched.speculative.stats.accepted > 0
    for k, (prompt, ids) in enumerate(zip(PROMPTS, out)):
        prompt_ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            direct = model(input_ids=torch.tensor([prompt_ids + ids[:-1]])).logits[0, len(prompt_ids) - 1:]
        got = torch.stack(sched.logits[k + 1])
        assert got.shape == direct.shape
        diff = (got - direct).abs().max().item()
        assert diff < LOGIT_ATOL, f"{prompt!r}: max |logit diff| {diff:.3g}"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_generate_with_speculation_equals_plain_generate(ref, draft_dir, method):
    model, tokenizer = ref
    sampling = SamplingConfig(max_new_tokens=TOKENS)
    plain_result = generate_text(model, tokenizer, "ROMEO:", sampling)
    result = speculative_generate_text(model, tokenizer, "ROMEO:", sampling, configs(draft_dir)[method])
    assert result.text == plain_result.text and result.new_tokens == plain_result.new_tokens == TOKENS
    s = result.speculative
    assert s["steps"] + s["accepted"] == TOKENS - 1  # each decode step: its accepted + one token
    assert s["misses_per_generated_token"] == result.decode["misses"] / (TOKENS - 1)
    assert result.prefill["tokens"] == len(tokenizer("ROMEO:")["input_ids"])


@pytest.mark.default_threads
def test_verification_forward_paged_equals_unpaged():
    """Two requests' caches, then one verification forward of 4 and 2 tokens (left-padded
    caches, right-padded queries): logits and written keys / values torch.equal."""
    from pagedexperts import load_model
    from pagedexperts.tools.check import load_reference

    reference = load_reference(MODEL_PATH, device="cpu", dtype=None, experts_implementation="grouped_mm")
    paged, _ = load_model(MODEL_PATH, num_resident=reference.config.num_experts_per_tok)
    prompts, verify = [[5, 17, 300, 41, 9, 77, 12], [8, 2000, 33]], [[19, 4, 250, 6], [60, 61]]
    results = []
    for model in (paged, reference):
        forward = model_forward(model)
        states = [new_state(model, 16) for _ in prompts]
        with torch.no_grad():
            for state, p in zip(states, prompts):
                forward_rows(forward, [state], [p], pad_id=0, device="cpu")
            logits = forward_rows(forward, states, verify, pad_id=0, device="cpu")
        results.append((logits, states))
    (lp, sp), (lr, sr) = results
    assert torch.equal(lp, lr), f"max |diff| {(lp - lr).abs().max():.3g}"
    assert [s.length for s in sp] == [s.length for s in sr] == [len(p) + len(v) for p, v in zip(prompts, verify)]
    for a, b in zip(sp, sr):
        for x, y in zip(a.keys + a.values, b.keys + b.values):
            assert torch.equal(x[:, : a.length], y[:, : b.length])


def new_state(model, capacity: int) -> DraftState:
    cfg = model.config
    state = DraftState()
    for _ in range(cfg.num_hidden_layers):
        for buffers in (state.keys, state.values):
            buffers.append(torch.zeros((cfg.num_key_value_heads, capacity, cfg.head_dim)))
    return state


def test_metrics_export_the_acceptance_counters(ref, draft_dir):
    model, tokenizer = ref
    _, sched = run(model, tokenizer, PROMPTS[:2], max_running=2, speculative=configs(draft_dir)["ngram"])
    text = Metrics(sched, model.pagedexperts).render().decode()
    s = sched.speculative.stats
    assert f"pagedexperts_spec_decode_num_accepted_tokens_total {float(s.accepted)}" in text
    assert f"pagedexperts_spec_decode_num_draft_tokens_total {float(s.proposed)}" in text
    assert f"pagedexperts_spec_decode_acceptance_rate {s.accepted / s.proposed}" in text


def test_a_draft_with_another_vocabulary_is_refused(ref, tiny_moe_dir):
    model, tokenizer = ref
    with pytest.raises(ValueError, match="--draft-model-path .*vocab_size 128 but the target's is 4096"):
        load_draft(str(tiny_moe_dir), target=model, tokenizer=tokenizer)


def test_served_with_speculation_answers_as_plain_decoding(ref):
    """The server with --speculative ngram: a greedy completion equals the plain scheduler's,
    and /metrics counts the verification steps."""
    from support.serving_fixtures import NAME, client, metric, serve
    from pagedexperts.serving.handlers import ServeConfig

    model, tokenizer = ref
    expected, _ = run(model, tokenizer, PROMPTS[:1], max_running=1)
    config = ServeConfig(NAME, 4, CONTEXT, speculative=speculative_config("ngram"))
    gen = serve(config)
    url = next(gen)[0]
    try:
        answer = client(url).completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0)
        assert answer.choices[0].text == tokenizer.decode(expected[0], skip_special_tokens=True)
        assert metric(url, "pagedexperts_spec_decode_num_drafts_total") > 0
        assert 0 < metric(url, "pagedexperts_spec_decode_acceptance_rate") <= 1
    finally:
        next(gen, None)


needs_shipped_draft = pytest.mark.skipif(
    not (SHIPPED_DRAFT / "config.json").exists() or MODEL_PATH.name != "tiny-qwen3-moe",
    reason=f"the shipped draft {SHIPPED_DRAFT} drafts for the bundled model only")


@needs_shipped_draft
def test_shipped_draft_loads_with_the_targets_tokenizer(ref):
    """The shipped draft: fewer layers and a quarter of the target's bytes, the target's tokenizer."""
    from transformers import AutoTokenizer

    model, tokenizer = ref
    draft = load_draft(str(SHIPPED_DRAFT), target=model, tokenizer=tokenizer)
    assert AutoTokenizer.from_pretrained(SHIPPED_DRAFT).get_vocab() == tokenizer.get_vocab()
    assert draft.config.vocab_size == model.config.vocab_size
    assert (draft.dtype, draft.device) == (model.dtype, model.device)
    assert draft.config.num_hidden_layers < model.config.num_hidden_layers
    sizes = [(d / "model.safetensors").stat().st_size for d in (SHIPPED_DRAFT, MODEL_PATH)]
    assert sizes[0] < sizes[1] / 4, sizes  # the paged model's parameters leave out its experts: compare files


@needs_shipped_draft
@pytest.mark.parametrize("batch", [1, 4])
def test_shipped_draft_greedy_output_is_plain_decoding(ref, plain, draft_dir, batch):
    """Batch 1: one prompt; batch 4: 8 prompts through 4 places. At batch 4 it also has more
    proposals accepted than the untrained early exit (the target's first 2 layers) on the
    same prompts and proposal count."""
    model, tokenizer = ref
    n = 1 if batch == 1 else 8
    shipped = speculative_config("draft", draft_model_path=str(SHIPPED_DRAFT), num_speculative_tokens=4)
    out, sched = run(model, tokenizer, PROMPTS[:n], max_running=batch, speculative=shipped)
    assert out == plain[n]
    s = sched.speculative.stats
    assert s.proposed > 0 and s.emitted >= n * (TOKENS - 1)
    print(f"\nshipped draft batch {batch}: {s.as_dict()}")
    if batch == 4:
        early = speculative_config("draft", draft_model_path=str(draft_dir), num_speculative_tokens=4)
        out_early, sched_early = run(model, tokenizer, PROMPTS[:n], max_running=batch, speculative=early)
        assert out_early == plain[n]
        e = sched_early.speculative.stats
        assert s.acceptance_rate > e.acceptance_rate, (s.as_dict(), e.as_dict())
