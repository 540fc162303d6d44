"""sample_tokens: per-row temperature, top-p and greedy in one call; inversion draws the right distribution."""

from __future__ import annotations

import math

import pytest
import torch

from miles.engines.sampling import sample_tokens

PROBS = [0.5, 0.3, 0.15, 0.05]


def draw(top_p: float, temperature: float = 1.0, n: int = 10_000) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of the same distribution, with uniforms evenly spread over (0, 1]."""
    logits = torch.log(torch.tensor(PROBS)).expand(n, -1)  # (n, 4)
    uniforms = torch.arange(1, n + 1, dtype=torch.float64) / n  # (n,)
    return sample_tokens(logits, torch.full((n,), temperature), torch.full((n,), top_p), uniforms)


def test_inversion_draws_the_distribution_and_the_behaviour_logprob() -> None:
    tokens, logprobs = draw(top_p=1.0)
    freq = torch.bincount(tokens, minlength=4).double() / tokens.numel()
    assert freq.tolist() == pytest.approx(PROBS, abs=1e-3)
    assert logprobs.tolist() == pytest.approx([math.log(PROBS[t]) for t in tokens.tolist()], abs=1e-6)


def test_top_p_keeps_the_nucleus_and_logprobs_stay_untruncated() -> None:
    tokens, logprobs = draw(top_p=0.8)  # mass before token 2 is 0.8: the nucleus is {0, 1}
    freq = torch.bincount(tokens, minlength=4).double() / tokens.numel()
    assert freq.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=1e-3)
    assert logprobs.tolist() == pytest.approx([math.log(PROBS[t]) for t in tokens.tolist()], abs=1e-6)
    tiny, _ = draw(top_p=1e-6)
    assert set(tiny.tolist()) == {0}


def test_rows_keep_their_own_parameters() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]] * 3)  # (3, 3)
    temperature = torch.tensor([0.0, 0.5, 2.0])
    top_p = torch.tensor([1.0, 1.0, 0.3])
    tokens, logprobs = sample_tokens(logits, temperature, top_p, torch.tensor([1.0, 1.0, 1.0]))
    assert tokens[0] == 1 and tokens[2] == 1  # greedy; a nucleus of the top token only
    assert tokens[1] == 2  # uniform 1: the last token with mass
    expected = [
        torch.log_softmax(logits[0], -1)[1],  # greedy: T = 1
        torch.log_softmax(logits[1] / 0.5, -1)[2],
        torch.log_softmax(logits[2] / 2.0, -1)[1],
    ]
    assert logprobs.tolist() == pytest.approx([float(e) for e in expected], abs=1e-6)


def test_a_zero_probability_token_is_never_drawn() -> None:
    logits = torch.tensor([[0.0, -float("inf"), 0.0, -float("inf")]] * 3)
    uniforms = torch.tensor([1e-12, 0.5, 1.0], dtype=torch.float64)
    tokens, _ = sample_tokens(logits, torch.ones(3), torch.ones(3), uniforms)
    assert tokens.tolist() == [0, 0, 2]
