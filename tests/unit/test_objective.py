"""The objective of the algorithm layer against (1) the loss Miles computed before the algorithm layer existed,
on the unpacked layout, and (2) TRL's GRPO/DAPO loss formula, on identical inputs."""

from __future__ import annotations

import pytest
import torch

from miles.algo.losses import policy_loss
from miles.algo.objective import Objective
from miles.backends.base import TokenOutputs, TrainSample
from miles.config import AlgoConfig
from miles.training.packing import pack_micro_batches

F64 = torch.float64
LENGTHS = [(3, 4), (2, 6), (5, 1), (4, 3), (2, 2), (3, 5)]


def _batch(seed: int = 0) -> tuple[list[TrainSample], list[torch.Tensor], list[torch.Tensor]]:
    """Samples plus per-sample proximal and current log-probs (the current ones are leaves, for gradients)."""
    g = torch.Generator().manual_seed(seed)
    samples, prox, current = [], [], []
    for i, (p, o) in enumerate(LENGTHS):
        # float32-representable, as the packed tensors hold them
        behaviour = (-torch.rand(o, generator=g) * 2).double().tolist()
        samples.append(TrainSample([1] * p, [2] * o, [1] * o, behaviour, advantage=(-1.0) ** i * (0.5 + i / 4)))
        prox.append(torch.tensor(behaviour, dtype=F64) + torch.randn(o, generator=g, dtype=F64) * 0.5)
        current.append((prox[-1] + torch.randn(o, generator=g, dtype=F64) * 0.3).requires_grad_(True))
    return samples, prox, current


def _legacy_weights(mode: str, prox: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, clip: float = 2.0):
    """The token weights and ratio base of the pre-algorithm-layer trainer, on a (B, T) batch of rows."""
    log_k = torch.where(mask > 0, prox - behaviour, 0.0)
    k = torch.exp(log_k)
    if mode == "none":
        return None, prox, None
    if mode == "tis":  # the ratio against the behaviour policy, capped
        return None, behaviour, clip
    if mode == "decoupled_ppo":
        return torch.where(mask > 0, k.clamp(max=clip), 0.0), prox, None
    if mode == "masked_is":
        keep = (k >= 0.5) & (k <= 2.0)
        return torch.where((mask > 0) & keep, k, 0.0), prox, None
    seq_k = torch.exp(log_k.sum(dim=1, keepdim=True))  # "sequence"
    return torch.where(mask > 0, seq_k.clamp(max=clip).expand_as(k), 0.0), prox, None


def _rows(values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(v) for v in values)
    out = torch.zeros(len(values), width, dtype=F64)
    mask = torch.zeros(len(values), width, dtype=F64)
    rows = []
    for b, v in enumerate(values):
        pad = torch.zeros(width - len(v), dtype=F64)
        rows.append(torch.cat([v, pad]))
        mask[b, : len(v)] = 1
    out = torch.stack(rows)
    return out, mask


def _packed_loss(algo: AlgoConfig, samples, prox, current):  # type: ignore[no-untyped-def]
    """The objective's loss over a packed micro-batch built from the same samples and log-probs."""
    (mb,) = pack_micro_batches(samples, pad_id=0)
    shape = mb.loss_mask.shape
    logp = torch.zeros(shape, dtype=F64)
    prox_t = torch.zeros(shape, dtype=F64)
    for span in mb.spans:
        cols = slice(span.start, span.start + span.length)
        logp = logp.index_put((torch.tensor([span.row]), torch.arange(shape[1])[cols]), current[span.sample])
        prox_t[span.row, cols] = prox[span.sample]
    mb.tensors = {k: v.to(F64) for k, v in mb.tensors.items()}
    mb.tensors["prox_logp"] = prox_t
    mb.loss_mask = mb.loss_mask.to(F64)
    objective = Objective(algo)
    loss, metrics = objective.loss_fn(float(mb.num_tokens), float(mb.num_sequences))(TokenOutputs(logp), mb)
    return loss, metrics


LEGACY_NAMES = {"none": "none", "tis": "behaviour_ratio", "decoupled_ppo": "decoupled_ppo",
                "masked_is": "masked_is", "sequence": "sequence"}  # fmt: skip


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("legacy_mode", list(LEGACY_NAMES))
def test_same_loss_and_gradients_as_before(legacy_mode: str, aggregation: str) -> None:
    samples, prox, current = _batch()
    logp_rows, mask = _rows(current)
    prox_rows, _ = _rows(prox)
    behaviour_rows, _ = _rows([torch.tensor(s.behaviour_logprobs, dtype=F64) for s in samples])
    weights, base, cap = _legacy_weights(legacy_mode, prox_rows, behaviour_rows, mask)
    advantages = torch.tensor([s.advantage for s in samples], dtype=F64)
    before = policy_loss(
        logp_rows, base, advantages, mask, clip_low=0.2, clip_high=0.28, aggregation=aggregation,
        token_weights=weights, ratio_cap=cap,
    )  # fmt: skip
    grads_before = torch.autograd.grad(before.loss, current)

    section = {"type": LEGACY_NAMES[legacy_mode]}
    if legacy_mode == "masked_is":
        section |= {"low": 0.5, "high": 2.0}
    algo = AlgoConfig(off_policy=section, loss={"aggregation": aggregation})
    after, metrics = _packed_loss(algo, samples, prox, current)
    grads_after = torch.autograd.grad(after, current)

    torch.testing.assert_close(after, before.loss, rtol=0, atol=1e-12)
    for a, b in zip(grads_after, grads_before, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for key in ("pg_loss", "clip_frac", "ppo_kl"):
        torch.testing.assert_close(metrics[key], before.metrics[key], rtol=0, atol=1e-12, msg=key)


def _trl_grpo_loss(logp, old_logp, advantages, mask, eps_low, eps_high, loss_type):  # type: ignore[no-untyped-def]
    """TRL's GRPOTrainer loss, written from its documentation: per token
    ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` with ``r = exp(logp - old_logp)``; ``dapo`` divides
    the masked sum by the number of completion tokens of the batch, ``grpo`` averages each sequence over its
    tokens and then the sequences."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
    if loss_type == "dapo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


@pytest.mark.parametrize(("aggregation", "loss_type"), [("token", "dapo"), ("sequence", "grpo")])
def test_matches_trls_grpo_and_dapo_loss(aggregation: str, loss_type: str) -> None:
    """On-policy (behaviour = proximal) with no correction, ours is TRL's formula, including gradients."""
    samples, prox, current = _batch(seed=3)
    for s, p in zip(samples, prox, strict=True):
        s.behaviour_logprobs = p.tolist()
    logp_rows, mask = _rows(current)
    prox_rows, _ = _rows(prox)
    advantages = torch.tensor([s.advantage for s in samples], dtype=F64)
    trl = _trl_grpo_loss(logp_rows, prox_rows, advantages, mask, 0.2, 0.28, loss_type)
    algo = AlgoConfig(off_policy="none", loss={"clip_low": 0.2, "clip_high": 0.28, "aggregation": aggregation})
    ours, _ = _packed_loss(algo, samples, prox, current)
    torch.testing.assert_close(ours, trl, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(ours, current), torch.autograd.grad(trl, current), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_finalize_averages_loss_shares_over_minibatches() -> None:
    totals = {"loss": 3.0, "pg_loss": 2.0, "is_tokens": 4.0, "is_weight": 4.0, "is_weight_sq": 4.0}
    metrics = Objective(AlgoConfig()).finalize(totals, minibatches=2)
    assert metrics["loss"] == 1.5 and metrics["pg_loss"] == 1.0 and metrics["is_ess"] == 1.0


def test_estimators_from_the_registry() -> None:
    grpo = Objective(AlgoConfig()).advantages
    assert grpo([[0.0, 1.0], [1.0, 1.0]]) == [pytest.approx([-1.0, 1.0], abs=1e-5), [0.0, 0.0]]
    no_std = Objective(AlgoConfig(advantage="grpo_no_std")).advantages
    assert no_std([[0.0, 2.0, 4.0]]) == [[-2.0, 0.0, 2.0]]
