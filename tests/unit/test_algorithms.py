"""Each algorithm's loss against its paper's formula, written out on the unpacked (rows) layout, on identical
inputs: Dr. GRPO, DAPO (clip-higher, token mean, dynamic sampling, overlong shaping), GSPO, CISPO,
REINFORCE++ (with and without baseline), and the on-policy distillation term. Ours runs through the packed
micro-batch path the trainer uses (several sequences per row), so packing and segment sums are checked too."""

from __future__ import annotations

import math

import pytest
import torch

from miles.algo.advantages import ADVANTAGES, batch_whitened
from miles.algo.config import AlgoConfig
from miles.algo.distill import distill_advantages, summarize_distill
from miles.algo.filters import build_group_filter, has_reward_variance, over_issue_groups
from miles.algo.shaping import RewardShaper, overlong_penalty
from tests.unit.test_objective import F64, _batch, _packed_loss, _rows


def _on_policy_batch(seed: int):  # type: ignore[no-untyped-def]
    samples, prox, current = _batch(seed=seed)
    for s, p in zip(samples, prox, strict=True):
        s.behaviour_logprobs = p.tolist()  # behaviour = proximal: no off-policy weight
    logp, mask = _rows(current)
    old, _ = _rows(prox)
    adv = torch.tensor([s.advantage for s in samples], dtype=F64)
    return samples, prox, current, logp, old, mask, adv


def _same(ours: torch.Tensor, reference: torch.Tensor, leaves: list[torch.Tensor]) -> None:
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(ours, leaves, retain_graph=True), torch.autograd.grad(reference, leaves)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- GSPO


def _gspo_paper(logp, old, adv, mask, eps_low, eps_high):  # type: ignore[no-untyped-def]
    """GSPO, eq. 5-7: s_i = (pi / pi_old)(y_i)^(1/|y_i|); J = 1/G sum_i min(s_i A_i, clip(s_i, 1-e_l, 1+e_h) A_i)."""
    lengths = mask.sum(-1)
    s = torch.exp(((logp - old) * mask).sum(-1) / lengths)  # (G,)
    return -torch.min(s * adv, torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv).mean()


@pytest.mark.parametrize(("clip_low", "clip_high"), [(3e-4, 4e-4), (0.05, 0.1), (10.0, 10.0)])
def test_gspo_is_the_papers_sequence_objective(clip_low: float, clip_high: float) -> None:
    samples, prox, current, logp, old, mask, adv = _on_policy_batch(seed=5)
    reference = _gspo_paper(logp, old, adv, mask, clip_low, clip_high)
    algo = AlgoConfig(off_policy="none", loss={"type": "gspo", "clip_low": clip_low, "clip_high": clip_high})
    ours, metrics = _packed_loss(algo, samples, prox, current)
    _same(ours, reference, current)
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    if clip_low == 10.0:
        assert metrics["clip_frac"].item() == 0.0
    else:  # the tiny clip range of the paper clips these (far from on-policy) sequences
        clipped = (adv > 0) & (s > 1 + clip_high) | (adv < 0) & (s < 1 - clip_low)
        per_token = (clipped.double().unsqueeze(1) * mask).sum() / mask.sum()
        assert metrics["clip_frac"].item() == pytest.approx(per_token.item())


def test_gspo_differs_from_token_ppo() -> None:
    samples, prox, current, *_ = _on_policy_batch(seed=5)
    gspo_cfg = AlgoConfig(off_policy="none", loss={"type": "gspo", "clip_low": 0.2, "clip_high": 0.2})
    ppo_cfg = AlgoConfig(off_policy="none", loss={"clip_low": 0.2, "clip_high": 0.2, "aggregation": "sequence"})
    gspo, _ = _packed_loss(gspo_cfg, samples, prox, current)
    ppo, _ = _packed_loss(ppo_cfg, samples, prox, current)
    assert abs(gspo.item() - ppo.item()) > 1e-3


# --------------------------------------------------------------------------- CISPO


def _cispo_paper(logp, old, adv, mask, eps_low, eps_high):  # type: ignore[no-untyped-def]
    """MiniMax-M1 eq. 4: J = 1 / sum|o_i| sum_i sum_t sg(clip(r_it, 1 - e_l, 1 + e_h)) A_i log pi(o_it)."""
    w = torch.clamp(torch.exp(logp - old), 1 - eps_low, 1 + eps_high).detach()
    return -(w * adv.unsqueeze(1) * logp * mask).sum() / mask.sum()


@pytest.mark.parametrize(("clip_low", "clip_high"), [(1.0, 4.0), (0.2, 0.28)])
def test_cispo_gradient_is_the_papers(clip_low: float, clip_high: float) -> None:
    samples, prox, current, logp, old, mask, adv = _on_policy_batch(seed=7)
    loss = {"type": "cispo", "clip_low": clip_low, "clip_high": clip_high, "mask_low": None}  # eq. 4, no mask
    ours, metrics = _packed_loss(AlgoConfig(off_policy="none", loss=loss), samples, prox, current)
    paper = _cispo_paper(logp, old, adv, mask, clip_low, clip_high)
    for a, b in zip(torch.autograd.grad(ours, current, retain_graph=True), torch.autograd.grad(paper, current)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # The value is -w A (the paper's -w A log pi has the same gradient; ours stays comparable with PPO's -A r).
    w = torch.clamp(torch.exp(logp - old), 1 - clip_low, 1 + clip_high)
    expected = -(w * adv.unsqueeze(1) * mask).sum() / mask.sum()
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)
    ratio = torch.exp(logp - old)
    clipped = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).double()
    assert metrics["clip_frac"].item() == pytest.approx(((clipped * mask).sum() / mask.sum()).item())


def test_cispo_keeps_the_gradient_of_clipped_tokens() -> None:
    """PPO zeroes the gradient of a token clipped above with A > 0; CISPO keeps it, weighted by the clip."""
    from miles.algo.losses import policy_loss

    logp = torch.full((1, 1), math.log(3.0), dtype=F64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=F64)
    args = (logp, old, torch.tensor([1.0], dtype=F64), torch.ones(1, 1, dtype=F64))
    (ppo_grad,) = torch.autograd.grad(policy_loss(*args, clip_low=0.2, clip_high=0.28).loss, logp)
    (cispo_grad,) = torch.autograd.grad(policy_loss(*args, clip_low=0.2, clip_high=0.28, surrogate="cispo").loss, logp)
    assert ppo_grad.item() == 0.0
    assert cispo_grad.item() == pytest.approx(-1.28)


def _hand_batch(ratios, k, advantages, base="prox"):  # type: ignore[no-untyped-def]
    """Samples whose log-probs give exactly these per-token ratios ``r`` (current / ratio base) and proximal /
    behaviour ratios ``k``; the current log-probs are the leaves."""
    from miles.backends.base import TrainSample

    samples, prox, current = [], [], []
    for i, (rs, ks, adv) in enumerate(zip(ratios, k, advantages, strict=True)):
        p = torch.tensor([-0.5 - 0.25 * (i + t) for t in range(len(rs))], dtype=F64)  # any proximal log-probs
        mu = p - torch.log(torch.tensor(ks, dtype=F64))  # travels as float32: k is exact to ~1e-7
        anchor = p if base == "prox" else mu
        samples.append(TrainSample([1, 1], [2] * len(rs), [1] * len(rs), mu.tolist(), advantage=adv))
        prox.append(p)
        current.append((anchor + torch.log(torch.tensor(rs, dtype=F64))).requires_grad_(True))
    return samples, prox, current


def test_cispo_gradient_by_hand_with_the_default_correction() -> None:
    """Hand-computed: d loss / d log pi_t = -clip(r_t, 0, 5) * A * min(k_t, 2) / N for every token, through the
    trainer's path (default correction decoupled_ppo, packed rows), including the tokens PPO would drop."""
    ratios = [[0.5, 1.0, 7.0], [0.25, 2.0]]  # 7.0: above the cap 5; 0.25 with A < 0: PPO drops it (r < 0.8)
    k = [[1.0, 3.0, 0.5], [1.0, 1.0]]  # 3.0: truncated to 2 by decoupled_ppo
    samples, prox, current = _hand_batch(ratios, k, [1.5, -0.5])
    paper = AlgoConfig(loss={"type": "cispo", "mask_low": None})  # eq. 4: no trust-region mask
    loss, metrics = _packed_loss(paper, samples, prox, current)
    grads = torch.autograd.grad(loss, current)
    # -w A k / N with N = 5: (-0.5*1.5*1, -1*1.5*2, -5*1.5*0.5) / 5 and (-0.25*-0.5*1, -2*-0.5*1) / 5
    torch.testing.assert_close(grads[0], torch.tensor([-0.15, -0.6, -0.75], dtype=F64), rtol=0, atol=1e-7)
    torch.testing.assert_close(grads[1], torch.tensor([0.025, 0.2], dtype=F64), rtol=0, atol=1e-7)
    assert loss.item() == pytest.approx(-0.15 - 0.6 - 0.75 + 0.025 + 0.2)  # the value -w A k / N, summed
    assert metrics["clip_frac"].item() == pytest.approx(1 / 5)  # only the weight of r = 7 hit the cap
    # PPO-clip on the same tokens: no gradient where r = 7 (A > 0) and r = 0.25 (A < 0) left the trust region.
    ppo, _ = _packed_loss(AlgoConfig(), samples, prox, current)
    ppo_grads = torch.autograd.grad(ppo, current)
    assert ppo_grads[0][2].item() == 0.0 and ppo_grads[1][0].item() == 0.0


def test_cispo_trust_region_mask_drops_only_its_side() -> None:
    """MiniMax-M1 eq. 7's mask: with mask_low 0.2 (the default) the A < 0 token at r = 0.25 loses its gradient;
    with mask_high 0.28 (and no mask_low) the A > 0 token at r = 7 does; every other token keeps
    -clip(r, 0, 5) * A * min(k, 2) / N."""
    ratios = [[0.5, 1.0, 7.0], [0.25, 2.0]]
    samples, prox, current = _hand_batch(ratios, [[1.0, 3.0, 0.5], [1.0, 1.0]], [1.5, -0.5])
    full = ([-0.15, -0.6, -0.75], [0.025, 0.2])
    for mask, dropped in [({}, (1, 0)), ({"mask_low": None, "mask_high": 0.28}, (0, 2))]:
        loss, metrics = _packed_loss(AlgoConfig(loss={"type": "cispo", **mask}), samples, prox, current)
        expected = [torch.tensor(g, dtype=F64) for g in full]
        expected[dropped[0]][dropped[1]] = 0.0
        for got, want in zip(torch.autograd.grad(loss, current), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
        capped_or_masked = 1 if "mask_high" in mask else 2  # r = 7 is capped either way
        assert metrics["clip_frac"].item() == pytest.approx(capped_or_masked / 5)


def test_cispo_ratio_cap_bounds_the_weight_not_the_gradient() -> None:
    """With ``behaviour_ratio`` the ratio is pi_theta / mu, capped at 2: CISPO's weight is min(r, 2) and every
    token keeps its gradient (PPO-clip's truncated tokens get none): -min(r, 2) * A / N by hand."""
    ratios = [[3.0, 1.5], [0.9]]  # 0.9 with A < 0: inside the default lower mask
    samples, prox, current = _hand_batch(ratios, [[1.0, 1.0], [1.0]], [1.0, -2.0], base="behaviour")
    algo = AlgoConfig(loss="cispo", off_policy={"type": "behaviour_ratio", "cap": 2.0})
    loss, metrics = _packed_loss(algo, samples, prox, current)
    grads = torch.autograd.grad(loss, current)
    torch.testing.assert_close(grads[0], torch.tensor([-2.0 / 3, -0.5], dtype=F64), rtol=0, atol=1e-7)
    torch.testing.assert_close(grads[1], torch.tensor([0.6], dtype=F64), rtol=0, atol=1e-7)
    assert metrics["clip_frac"].item() == pytest.approx(1 / 3)


# --------------------------------------------------------------------------- Dr. GRPO and DAPO


def test_dr_grpo_is_trls_dr_grpo_loss() -> None:
    """Dr. GRPO: advantages r - mean (no std), loss summed over tokens / (sequences x L_max) (TRL 'dr_grpo')."""
    samples, prox, current, logp, old, mask, _ = _on_policy_batch(seed=9)
    rewards = [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    advs = ADVANTAGES.build(AlgoConfig(advantage="grpo_no_std").advantage)(rewards)
    flat = [a for g in advs for a in g]
    assert flat == pytest.approx([2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3])
    for s, a in zip(samples, flat, strict=True):
        s.advantage = a
    adv = torch.tensor(flat, dtype=torch.float32).double()  # the packed tensors hold float32
    ratio = torch.exp(logp - old)
    per_token = -torch.min(ratio * adv.unsqueeze(1), torch.clamp(ratio, 0.8, 1.28) * adv.unsqueeze(1))
    max_completion_length = 8
    trl = (per_token * mask).sum() / (mask.shape[0] * max_completion_length)
    loss = {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "constant", "constant_tokens": max_completion_length}
    ours, _ = _packed_loss(AlgoConfig(off_policy="none", advantage="grpo_no_std", loss=loss), samples, prox, current)
    _same(ours, trl, current)


def test_constant_aggregation_takes_the_generation_budget() -> None:
    from miles.algo.objective import Objective

    algo = AlgoConfig(loss={"aggregation": "constant"})
    with pytest.raises(ValueError, match="constant_tokens"):
        Objective(algo)
    assert Objective(algo, generation_budget=12).policy_loss is not None


def test_dynamic_sampling_keeps_only_groups_whose_rewards_differ() -> None:
    assert build_group_filter(AlgoConfig().filter) is None
    keep = build_group_filter(AlgoConfig(filter="reward_variance").filter)
    assert keep is not None
    assert keep([0.0, 1.0, 0.0]) and not keep([1.0, 1.0, 1.0]) and not keep([0.0] * 8) and not keep([0.5])
    assert has_reward_variance([0.1 + 0.2, 0.3]) and not has_reward_variance([0.3, 0.3])
    loose = build_group_filter(AlgoConfig(filter={"type": "reward_variance", "min_std": 0.2}).filter)
    assert loose is not None and not loose([0.0, 0.1]) and loose([0.0, 1.0])
    assert over_issue_groups(AlgoConfig(filter={"type": "reward_variance", "over_issue": 0.3}), 8) == 3
    assert over_issue_groups(AlgoConfig(), 8) == 0


def test_overlong_penalty_is_daops_eq13() -> None:
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then linear to -1 at 10, -1 beyond.
    assert [overlong_penalty(n, 10, 4) for n in (1, 6, 7, 8, 10, 11)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(8, 10, 4, penalty=2.0) == -1.0


def test_reward_shaper_truncation_then_overlong() -> None:
    algo = AlgoConfig(truncated_reward=0.0, reward_shaping={"type": "overlong", "buffer_tokens": 2})
    shaper = RewardShaper(algo, budget=6)
    assert shaper.max_tokens == 6
    assert shaper(1.0, 3, truncated=False) == 1.0
    assert shaper(1.0, 5, truncated=False) == 0.5
    assert shaper(1.0, 6, truncated=True) == -1.0  # truncated: 0, then the full overlong penalty
    assert not RewardShaper(AlgoConfig(), budget=6).active
    unfinished = RewardShaper(AlgoConfig(unfinished_reward=-0.5), budget=6)
    assert unfinished.active and unfinished(1.0, 3, False, "max_turns") == -0.5
    assert unfinished(1.0, 3, False, "done") == 1.0 and shaper(1.0, 3, False, "max_turns") == 1.0
    with pytest.raises(ValueError, match="buffer_tokens"):
        RewardShaper(AlgoConfig(reward_shaping={"type": "overlong", "buffer_tokens": 9}), budget=6)


# --------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_whitens_over_the_batch_without_a_group_baseline() -> None:
    groups = [[1.0, 1.0], [0.0, 1.0, 0.0]]
    flat = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0], dtype=F64)
    expected = ((flat - flat.mean()) / (flat.std(correction=0) + 1e-6)).tolist()
    out = ADVANTAGES.build(AlgoConfig(advantage="reinforce_pp").advantage)(groups)
    assert [a for g in out for a in g] == pytest.approx(expected, abs=1e-12)
    assert out[0][0] > 0  # an all-correct group still gets a positive advantage: no group baseline


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens() -> None:
    groups = [[1.0, 1.0], [0.0, 1.0, 0.0], [2.0, 0.0]]
    centred = torch.tensor([0.0, 0.0, -1 / 3, 2 / 3, -1 / 3, 1.0, -1.0], dtype=F64)
    expected = ((centred - centred.mean()) / (centred.std(correction=0) + 1e-6)).tolist()
    out = batch_whitened(groups, baseline=True)
    assert [a for g in out for a in g] == pytest.approx(expected, abs=1e-12)
    assert out[0] == [0.0, 0.0]  # equal rewards: exactly 0
    assert batch_whitened([], baseline=True) == []


# --------------------------------------------------------------------------- on-policy distillation


def test_distillation_term_is_a_minus_lambda_reverse_kl_on_trained_tokens() -> None:
    adv = torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, 0.0]], dtype=F64)
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]], dtype=F64)
    teacher = torch.tensor([[-0.5, -2.0, -1.5], [-0.3, -1.0, -1.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=F64)  # row 1: an env token and padding
    out, sums = distill_advantages(adv, student, teacher, mask, coef=0.2, task_reward=True)
    expected = torch.tensor([[0.5 + 0.1, 0.5, 0.5 - 0.2], [-1.0 - 0.04, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert sums["distill_tokens"].item() == 4 and sums["distill_kl"].item() == pytest.approx(-0.5 + 1.0 + 0.2)
    pure, _ = distill_advantages(adv, student, teacher, mask, coef=0.2, task_reward=False)
    torch.testing.assert_close(pure, expected - torch.where(mask > 0, adv, 0.0), rtol=0, atol=1e-12)
    assert summarize_distill({"distill_tokens": 4.0, "distill_kl": 0.7}) == {
        "distill_reverse_kl": pytest.approx(0.175),
        "distill_kl_zero": 0.0,
    }
    assert summarize_distill({"distill_tokens": 4.0, "distill_kl": 0.0})["distill_kl_zero"] == 1.0
    assert summarize_distill({})["distill_kl_zero"] == 0.0  # an empty step is not flagged


def test_objective_with_distillation_is_the_policy_loss_of_the_adjusted_advantages() -> None:
    from miles.training.packing import pack_micro_batches

    samples, prox, current, logp, old, mask, adv = _on_policy_batch(seed=11)
    g = torch.Generator().manual_seed(1)
    teacher = [p + torch.randn(len(p), generator=g, dtype=F64) * 0.4 for p in prox]
    for s, t in zip(samples, teacher, strict=True):
        s.teacher_logprobs = t.tolist()
    (mb,) = pack_micro_batches(samples, pad_id=0)
    assert "teacher_logp" in mb.tensors
    teacher_rows, _ = _rows([torch.tensor(t.tolist(), dtype=torch.float32).double() for t in teacher])
    adjusted = adv.unsqueeze(1) - 0.2 * (old - teacher_rows)
    ratio = torch.exp(logp - old)
    per_token = -torch.min(ratio * adjusted, torch.clamp(ratio, 0.8, 1.28) * adjusted)
    reference = (per_token * mask).sum() / mask.sum()
    distill = {"teacher": {"type": "in_trainer", "path": "/nonexistent"}, "coef": 0.2}
    ours, metrics = _packed_loss(AlgoConfig(off_policy="none", distill=distill), samples, prox, current)
    _same(ours, reference, current)
    kl = ((old - teacher_rows) * mask).sum()
    assert metrics["distill_kl"].item() == pytest.approx(kl.item(), abs=1e-6)


def _episode(tokens: int, reward: float, truncated: bool = False):  # type: ignore[no-untyped-def]
    from miles.bus.schema import Episode

    return Episode(
        prompt_ids=[1],
        token_ids=[5] * tokens,
        loss_mask=[1] * tokens,
        logprobs=[-0.5] * tokens,
        turns=[(0, tokens, "model")],
        weight_version=0,
        reward=reward,
        status="ok",
        end_reason="done",
        truncated=truncated,
    )


def test_batch_shapes_rewards_before_the_advantages_and_the_filter_sees_the_same() -> None:
    """Two correct answers, one of them truncated at the cap: with truncated_reward 0 and overlong shaping the
    group has reward variance (the filter keeps it) and the truncated one gets the negative advantage."""
    from miles.bus.schema import Trajectory
    from miles.training.batch import build_batch, group_rewards

    traj = Trajectory(
        group_id="g0",
        sample_id="s0",
        worker_id="w",
        episodes=[_episode(3, 1.0), _episode(6, 1.0, truncated=True)],
        issued_at_version=0,
        gen_s=0.0,
    )
    algo = AlgoConfig(truncated_reward=0.0, reward_shaping={"type": "overlong", "buffer_tokens": 2})
    shaper = RewardShaper(algo, budget=6)
    assert group_rewards(traj) == [1.0, 1.0] and group_rewards(traj, shaper) == [1.0, -1.0]
    keep = build_group_filter(AlgoConfig(filter="reward_variance").filter)
    assert keep is not None and not keep(group_rewards(traj)) and keep(group_rewards(traj, shaper))
    grpo = ADVANTAGES.build(algo.advantage)
    batch = build_batch([traj], grpo, shaper)
    assert [s.advantage for s in batch.samples] == pytest.approx([1.0, -1.0], abs=1e-5)
    assert batch.metrics["reward_mean"] == 1.0 and batch.metrics["reward_shaped_mean"] == 0.0
    assert batch.metrics["groups_equal_rewards"] == 0.0
    plain = build_batch([traj], grpo)
    assert [s.advantage for s in plain.samples] == [0.0, 0.0] and plain.metrics["groups_equal_rewards"] == 1.0


def test_masking_a_stale_prefix_trains_only_the_tokens_within_the_bound() -> None:
    """``staleness.stale_prefix: mask``: an answer begun under version 1 and continued under 3 and 4, with only
    versions >= 3 fresh, keeps every token in the sequence but trains the last ones only; the group's advantages
    are those of its whole answers, and the sample's version is its oldest trained one."""
    from miles.bus.schema import Episode, Trajectory
    from miles.training.batch import build_batch
    from miles.training.intake import fresh_loss_mask, judged_version

    long = Episode(
        prompt_ids=[1],
        token_ids=[5, 6, 7, 8, 9, 10],
        loss_mask=[1] * 6,
        logprobs=[-0.5] * 6,
        turns=[(0, 6, "model")],
        weight_version=1,
        version_spans=[(0, 1), (2, 3), (4, 4)],
        reward=1.0,
        status="ok",
        end_reason="done",
    )
    traj = Trajectory(
        group_id="g0",
        sample_id="s0",
        worker_id="w",
        episodes=[long, _episode(2, 0.0)],
        issued_at_version=0,
        gen_s=0.0,
    )
    assert (traj.oldest_version, traj.newest_version) == (0, 4)
    assert judged_version(traj.oldest_version, traj.newest_version, "discard") == 0
    assert judged_version(traj.oldest_version, traj.newest_version, "mask") == 4
    assert fresh_loss_mask([1, 0, 1, 1], [1, 3, 3, 4], lambda v: v >= 3) == [0, 0, 1, 1]

    grpo = ADVANTAGES.build(AlgoConfig().advantage)
    whole = build_batch([traj], grpo)
    masked = build_batch([traj], grpo, fresh=lambda v: v >= 3)
    assert [s.advantage for s in masked.samples] == [s.advantage for s in whole.samples]
    assert masked.samples[0].token_ids == long.token_ids
    assert masked.samples[0].loss_mask == [0, 0, 1, 1, 1, 1] and masked.samples[0].weight_version == 3
    assert masked.samples[1].loss_mask == [0, 0]  # all of version 0: context only (aggregation clamps its length)
    assert masked.metrics["stale_tokens_masked"] == 4.0 and whole.metrics["stale_tokens_masked"] == 0.0
    assert masked.metrics["model_tokens"] == whole.metrics["model_tokens"] == 8.0
