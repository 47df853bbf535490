"""Speculative decoding's model-free parts: prompt lookup, the flag checks, greedy acceptance,
and the sampled acceptance rule's output distribution on a small vocabulary.

The distribution oracle is exact: a toy "model" over V = 4 tokens whose next-token
probabilities depend on the previous token (a target table P and a different draft table
Q). Sequences of 3 tokens are produced by repeated speculative steps (the draft proposing 2,
or a fixed n-gram style proposal with q a point mass) and the empirical joint over the 64
outcomes is compared with P's exact joint by Pearson's chi-square. Seeded, so the test is
deterministic; the threshold is the chi-square quantile at 1 - 1e-3 for 63 degrees of freedom
(Wilson-Hilferty: 103.4), so a correct rule fails with probability 1e-3 over seeds, while the
bugs it guards (resampling from p instead of norm(max(0, p - q)), accepting without the
min(1, p/q) test) move chi-square into the thousands at N = 8000.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from pagedexperts.engine.sampling import warped_probs
from pagedexperts.engine.speculative.acceptance import accept_greedy, accept_sampled
from pagedexperts.engine.speculative.config import MAX_NUM_SPECULATIVE_TOKENS, speculative_config
from pagedexperts.engine.speculative.proposers import ngram_propose

V = 4
LENGTH = 3  # tokens per sequence: V**3 = 64 outcomes
N = 8000
START = 0  # the context's last token before the sequence


def table(seed: int, sharpness: float) -> torch.Tensor:
    """[V, V] row-stochastic: row a = next-token probabilities after token a."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn((V, V), generator=g), dim=-1)


P = table(1, 1.5)  # target
Q = table(2, 1.5)  # draft: a different distribution (acceptance well below 1)


def wilson_hilferty(df: int, z: float = 3.0902) -> float:
    """Chi-square quantile for ``df`` degrees of freedom at the normal quantile z (3.0902: 1 - 1e-3)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def run_sequences(draft: bool, n: int, generator: torch.Generator) -> torch.Tensor:
    """N sequences of LENGTH tokens by speculative steps; the outcome counts [V**LENGTH]."""
    counts = torch.zeros(V ** LENGTH)
    for _ in range(N):
        seq = [START]
        while len(seq) <= LENGTH:
            if draft:
                proposals, q_rows = [], []
                for _ in range(n):
                    q = Q[(proposals or seq)[-1]]
                    proposals.append(int(torch.multinomial(q, 1, generator=generator)))
                    q_rows.append(q)
                q = torch.stack(q_rows)
            else:
                proposals, q = [(seq[-1] + 1 + j) % V for j in range(n)], None  # a fixed guess, point mass
            context = seq + proposals
            p = torch.stack([P[context[len(seq) - 1 + j]] for j in range(n + 1)])
            seq += accept_sampled(p, proposals, q, generator).tokens
        outcome = seq[1: LENGTH + 1]
        counts[sum(t * V ** i for i, t in enumerate(reversed(outcome)))] += 1
    return counts


def exact_joint() -> torch.Tensor:
    out = torch.zeros(V ** LENGTH)
    for i, outcome in enumerate(itertools.product(range(V), repeat=LENGTH)):
        prob, prev = 1.0, START
        for t in outcome:
            prob *= float(P[prev, t])
            prev = t
        out[i] = prob
    return out


@pytest.mark.parametrize("draft", [True, False], ids=["draft", "ngram-point-mass"])
def test_sampled_acceptance_keeps_the_target_distribution(draft):
    counts = run_sequences(draft, n=2, generator=torch.Generator().manual_seed(1234))
    expected = exact_joint() * N
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    limit = wilson_hilferty(V ** LENGTH - 1)
    print(f"\nchi-square {chi2:.1f} (limit {limit:.1f}, 63 df, N {N})")
    assert 100 < limit < 107  # the quantile itself (tables: 103.4)
    assert chi2 < limit, f"output distribution differs from the target's: chi-square {chi2:.1f} >= {limit:.1f}"


def test_draft_equal_to_target_accepts_everything():
    g = torch.Generator().manual_seed(0)
    p = torch.stack([P[0], P[1], P[2]])
    verdict = accept_sampled(p, [1, 2], p[:2].clone(), g)
    assert verdict.accepted == 2 and verdict.tokens[:2] == [1, 2] and len(verdict.tokens) == 3


def test_a_proposal_the_target_rules_out_is_always_rejected():
    p = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.25] * 4])
    for seed in range(20):
        verdict = accept_sampled(p, [2], None, torch.Generator().manual_seed(seed))
        assert verdict.accepted == 0 and verdict.tokens == [1]  # the residual is p without token 2


def test_greedy_acceptance_stops_at_the_first_disagreement():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 9]).tokens == [5, 6, 7]
    assert accept_greedy([5, 6, 7, 8], [5, 6, 9]).accepted == 2
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]).tokens == [5, 6, 7, 8]  # all accepted: the bonus token
    assert accept_greedy([4], []).tokens == [4]  # nothing proposed: plain decoding
    assert accept_greedy([1, 2], [3]).tokens == [1]


def test_warped_probs_temperature_and_nucleus():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    assert torch.allclose(warped_probs(logits, 1.0, 1.0), torch.softmax(logits, -1))
    assert torch.allclose(warped_probs(logits, 0.5, 1.0), torch.softmax(logits / 0.5, -1))
    full = torch.softmax(logits, -1)  # 0.644, 0.237, 0.087, 0.032
    nucleus = warped_probs(logits, 1.0, 0.7)  # first two: 0.644 < 0.7, the second is needed
    assert torch.allclose(nucleus, torch.cat([full[:2] / full[:2].sum(), torch.zeros(2)]))


def test_prompt_lookup_takes_the_latest_earlier_occurrence_of_the_longest_suffix():
    assert ngram_propose([1, 2, 9, 1, 2, 7, 1, 2], 3) == [7, 1, 2]  # [7, 1, 2] never recurs; [1, 2] does
    assert ngram_propose([4, 5, 6, 1, 5, 6, 2, 4, 5, 6], 2) == [1, 5]  # [4, 5, 6] at 0 beats [5, 6] at 4
    assert ngram_propose([3, 8, 3], 4) == [8, 3]  # what is left after the match, at most n
    assert ngram_propose([1, 2, 3], 4) == []
    assert ngram_propose([7], 4) == []
    assert ngram_propose([1, 2, 1, 2], 1) == [1]


@pytest.mark.parametrize(
    "method,kwargs,needle",
    [(None, dict(draft_model_path="/x"), "--draft-model-path needs --speculative"),
     (None, dict(num_speculative_tokens=3), "--num-speculative-tokens needs --speculative"),
     ("medusa", {}, "--speculative 'medusa': choose one of ngram, draft"),
     ("ngram", dict(draft_model_path="/x"), "--draft-model-path is for --speculative draft"),
     ("draft", {}, "--speculative draft needs --draft-model-path DIR"),
     ("draft", dict(draft_model_path="/nonexistent"), "--draft-model-path /nonexistent: no config.json there"),
     ("ngram", dict(num_speculative_tokens=0), f"--num-speculative-tokens must be in [1, {MAX_NUM_SPECULATIVE_TOKENS}], got 0"),
     ("ngram", dict(num_speculative_tokens=33), "got 33")],
)
def test_bad_flag_combinations_name_the_flag(method, kwargs, needle):
    with pytest.raises(ValueError, match=None) as exc:
        speculative_config(method, **kwargs)
    assert needle in str(exc.value)


def test_good_flags_give_a_config(tmp_path):
    assert speculative_config(None) is None
    assert speculative_config("ngram").num_speculative_tokens == 4
    (tmp_path / "config.json").write_text("{}")
    cfg = speculative_config("draft", draft_model_path=str(tmp_path), num_speculative_tokens=6)
    assert (cfg.method, cfg.num_speculative_tokens, cfg.draft_model_path) == ("draft", 6, str(tmp_path))


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize(
    "argv,needle",
    [(["--draft-model-path", "/x"], "--draft-model-path needs --speculative"),
     (["--speculative", "draft"], "--speculative draft needs --draft-model-path DIR"),
     (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens must be in [1, 32], got 0")],
)
def test_the_commands_refuse_bad_combinations_before_loading(command, argv, needle, capsys, monkeypatch):
    if command == "serve":
        pytest.importorskip("fastapi")
    import pagedexperts.loading.loader
    from pagedexperts.cli import main

    def fail(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the flags were validated")

    monkeypatch.setattr(pagedexperts.loading.loader, "read_checkpoint_config", fail)  # the first read of --model-path
    extra = ["--prompt", "x"] if command == "generate" else []
    assert main([command, *extra, *argv]) == 2
    assert needle in capsys.readouterr().err
