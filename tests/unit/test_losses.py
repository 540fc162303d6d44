"""Policy loss, token log-probs and entropy, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from miles.algo.logprobs import token_entropy, token_logprobs
from miles.algo.losses import policy_loss

CLIP = {"clip_low": 0.2, "clip_high": 0.28}


def _leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_clip_at_both_bounds() -> None:
    # ratios [1.5, 0.5] in each row; row 0 has A = +1, row 1 has A = -1.
    logp = _leaf([[math.log(1.5), math.log(0.5)], [math.log(1.5), math.log(0.5)]])
    old = torch.zeros(2, 2, dtype=torch.float64)
    out = policy_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2), **CLIP)
    # per token: max(-A r, -A clip(r, 0.8, 1.28))
    #   A=+1, r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped above)   A=+1, r=0.5 -> max(-0.5, -0.8) = -0.5
    #   A=-1, r=1.5 -> max(1.5, 1.28) = 1.5                         A=-1, r=0.5 -> max(0.5, 0.8) = 0.8 (clipped below)
    assert out.loss.item() == pytest.approx((-1.28 - 0.5 + 1.5 + 0.8) / 4)
    assert out.metrics["pg_loss"].item() == pytest.approx(out.loss.item())
    assert out.metrics["clip_frac"].item() == pytest.approx(0.5)
    assert out.metrics["ppo_kl"].item() == pytest.approx(-2 * math.log(0.75) / 4)
    out.loss.backward()
    # d/dlogp of -A r / N is -A r / N for unclipped tokens, 0 for clipped ones.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5 / 4], [1.5 / 4, 0.0]], dtype=torch.float64))


def test_clip_higher_uses_separate_bounds() -> None:
    logp = torch.full((1, 1), math.log(1.25), dtype=torch.float64)
    old = torch.zeros(1, 1, dtype=torch.float64)
    inside = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.28)
    outside = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.2)
    assert inside.loss.item() == pytest.approx(-1.25) and inside.metrics["clip_frac"].item() == 0.0
    assert outside.loss.item() == pytest.approx(-1.2) and outside.metrics["clip_frac"].item() == 1.0


def test_aggregation_modes_differ() -> None:
    # ratio 1 everywhere, so the per-token loss is -A: row 0 has 3 tokens at -1, row 1 one token at +1.
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    token = policy_loss(logp, logp, adv, mask, aggregation="token", **CLIP)
    sequence = policy_loss(logp, logp, adv, mask, aggregation="sequence", **CLIP)
    assert token.loss.item() == pytest.approx((-3 + 1) / 4)
    assert sequence.loss.item() == pytest.approx((-1 + 1) / 2)


def test_per_token_advantages() -> None:
    logp = torch.zeros(1, 3)
    out = policy_loss(logp, logp, torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 3), **CLIP)
    assert out.loss.item() == pytest.approx(-2.0)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_global_normalisers_make_shards_additive(aggregation: str) -> None:
    g = torch.Generator().manual_seed(0)
    logp, old = -torch.rand(4, 5, generator=g), -torch.rand(4, 5, generator=g)
    ref, entropy = -torch.rand(4, 5, generator=g), torch.rand(4, 5, generator=g)
    adv = torch.randn(4, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 1, 1, 0, 0]], dtype=torch.float32)
    kw = dict(clip_low=0.1, clip_high=0.1, aggregation=aggregation, kl_coef=0.3, entropy_coef=0.01)
    whole = policy_loss(logp, old, adv, mask, ref_logp=ref, entropy=entropy, **kw)  # type: ignore[arg-type]
    halves = [
        policy_loss(
            logp[s],
            old[s],
            adv[s],
            mask[s],
            ref_logp=ref[s],
            entropy=entropy[s],
            num_tokens=mask.sum(),
            num_sequences=4,
            **kw,  # type: ignore[arg-type]
        )
        for s in (slice(0, 2), slice(2, 4))
    ]
    assert (halves[0].loss + halves[1].loss).item() == pytest.approx(whole.loss.item(), rel=1e-6)
    for key, value in whole.metrics.items():
        assert (halves[0].metrics[key] + halves[1].metrics[key]).item() == pytest.approx(value.item(), rel=1e-5), key


def test_k3_kl_to_reference() -> None:
    logp = _leaf([[0.0, 0.0]])
    ref = torch.tensor([[math.log(2.0), 0.0]], dtype=torch.float64)
    out = policy_loss(logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 2), ref_logp=ref, kl_coef=0.5, **CLIP)
    k3 = 2.0 - math.log(2.0) - 1.0  # exp(d) - d - 1 with d = ref - logp = log 2; the second token has d = 0
    assert out.metrics["kl_ref"].item() == pytest.approx(k3 / 2)
    assert out.loss.item() == pytest.approx(0.5 * k3 / 2)  # advantage 0: no policy-gradient term
    out.loss.backward()
    # d k3 / d logp = 1 - exp(d)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5 * (1 - 2.0) / 2, 0.0]], dtype=torch.float64))


def test_kl_is_reported_but_not_trained_when_coef_is_zero() -> None:
    logp = torch.zeros(1, 1)
    out = policy_loss(logp, logp, torch.tensor([1.0]), torch.ones(1, 1), ref_logp=torch.full((1, 1), 1.0), **CLIP)
    assert out.metrics["kl_ref"].item() == pytest.approx(math.e - 2)
    assert out.loss.item() == pytest.approx(-1.0)


def test_entropy_bonus() -> None:
    logp = torch.zeros(1, 2)
    entropy = torch.tensor([[1.0, 3.0]], requires_grad=True)
    out = policy_loss(logp, logp, torch.tensor([1.0]), torch.ones(1, 2), entropy=entropy, entropy_coef=0.1, **CLIP)
    assert out.metrics["entropy"].item() == pytest.approx(2.0)
    assert out.loss.item() == pytest.approx(-1.0 - 0.1 * 2.0)
    out.loss.backward()
    torch.testing.assert_close(entropy.grad, torch.full((1, 2), -0.1 / 2))


def test_token_weights_scale_the_policy_gradient_only() -> None:
    logp = _leaf([[0.0, 0.0]])
    weights = torch.tensor([[2.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[math.log(2.0), math.log(2.0)]], dtype=torch.float64)
    kw = dict(ref_logp=ref, kl_coef=1.0, **CLIP)
    plain = policy_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2), **kw)  # type: ignore[arg-type]
    weighted = policy_loss(
        logp,
        logp.detach(),
        torch.tensor([1.0]),
        torch.ones(1, 2),
        token_weights=weights,
        **kw,  # type: ignore[arg-type]
    )
    assert plain.metrics["pg_loss"].item() == pytest.approx(-1.0)
    assert weighted.metrics["pg_loss"].item() == pytest.approx((-2.0 + 0.0) / 2)
    assert weighted.metrics["kl_ref"].item() == pytest.approx(plain.metrics["kl_ref"].item())
    weighted.loss.backward()
    assert weights.grad is None  # weights are detached
    k3_grad = (1 - 2.0) / 2
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0 / 2 + k3_grad, 0.0 + k3_grad]], dtype=torch.float64))


def test_empty_mask_gives_zero_not_nan() -> None:
    logp = torch.zeros(1, 3, requires_grad=True)
    out = policy_loss(logp, logp.detach(), torch.tensor([1.0]), torch.zeros(1, 3), aggregation="sequence", **CLIP)
    assert out.loss.item() == 0.0
    assert all(math.isfinite(v.item()) for v in out.metrics.values())


def test_missing_inputs_raise() -> None:
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(x, x, torch.ones(1), x + 1, kl_coef=0.1, **CLIP)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(x, x, torch.ones(1), x + 1, entropy_coef=0.1, **CLIP)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(x, x, torch.ones(1), x + 1, aggregation="batch", **CLIP)  # type: ignore[arg-type]


def test_token_logprobs_and_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g)
    targets = torch.randint(0, 7, (2, 3), generator=g)
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, targets, temperature=0.7), expected)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(token_entropy(logits), -(probs * probs.log()).sum(-1))
    torch.testing.assert_close(token_entropy(torch.zeros(1, 1, 5)), torch.full((1, 1), math.log(5)))
    with pytest.raises(ValueError):
        token_logprobs(logits, targets, temperature=0.0)


def scaled_reinforce(
    log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, *, scale: float
) -> torch.Tensor:  # noqa: E501
    """A user's per-token idea in one line: ``-scale * A * r``, no clip."""
    return -scale * adv * torch.exp(log_ratio)


def test_a_users_per_token_surrogate_gets_miles_weights_aggregation_kl_entropy_and_metrics() -> None:
    from miles.algo.config import AlgoConfig
    from miles.algo.losses import LossInputs
    from miles.algo.objective import Objective

    loss_cfg = {"type": "surrogate", "path": f"{__name__}:scaled_reinforce", "params": {"scale": 2.0}}
    objective = Objective(AlgoConfig.model_validate({"loss": loss_cfg, "kl_coef": 0.1, "entropy_coef": 0.01}))
    logp = _leaf([[-1.0, -0.5, -2.0], [-0.3, -0.7, 0.0]])
    base = torch.tensor([[-1.2, -0.5, -1.0], [-0.3, -0.9, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.1, -0.4, -1.5], [-0.5, -0.6, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    weights = torch.tensor([[1.0, 0.5, 1.0], [2.0, 1.0, 1.0]], dtype=torch.float64)  # the correction's
    entropy = torch.tensor([[0.8, 0.6, 0.1], [1.0, 0.2, 0.3]], dtype=torch.float64, requires_grad=True)
    seq_index = torch.tensor([[0, 0, -1], [1, 1, -1]])
    inputs = LossInputs(
        logp, base, adv, mask, seq_index, num_tokens=4.0, num_sequences=2.0, ref_logp=ref, entropy=entropy,
        token_weights=weights, kl_coef=0.1, entropy_coef=0.01,
    )  # fmt: skip
    out = objective.policy_loss(inputs)
    out.loss.backward()
    # By hand, token aggregation over the 4 masked tokens: d/dlogp = m/4 * (-2 A r w + 0.1 (1 - exp(ref - logp))).
    ratio = torch.exp(logp.detach() - base)
    want = mask / 4 * (-2.0 * adv * ratio * weights + 0.1 * (1 - torch.exp(ref - logp.detach())))
    torch.testing.assert_close(logp.grad, want)
    torch.testing.assert_close(entropy.grad, -0.01 * mask / 4)  # the entropy bonus, Miles' own
    pg = (mask * -2.0 * adv * ratio * weights).sum() / 4
    assert out.metrics["pg_loss"].item() == pytest.approx(pg.item())
    assert out.metrics["clip_frac"].item() == 0.0 and out.metrics["kl_ref"].item() > 0


def one_number(log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    return log_ratio.sum()  # a scalar, not a term per token


def test_a_surrogate_of_the_wrong_shape_or_path_is_refused_in_one_line() -> None:
    from pydantic import ValidationError

    from miles.algo.config import AlgoConfig
    from miles.algo.losses import LossInputs
    from miles.algo.objective import Objective

    with pytest.raises(ValidationError, match="trainer.algo.loss.path 'nowhere_xyz:f': cannot import"):
        AlgoConfig.model_validate({"loss": {"type": "surrogate", "path": "nowhere_xyz:f"}})
    cfg = AlgoConfig.model_validate({"loss": {"type": "surrogate", "path": f"{__name__}:one_number"}})
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"returned \(\), not one term per token \(1, 2\)"):
        Objective(cfg).policy_loss(LossInputs(x, x, x, torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long), 2.0, 1.0))
