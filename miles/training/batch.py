"""From a rollout batch of trajectories to training samples and the batch's metrics.

Only episodes with status ``ok`` are trained and enter their group's advantages: an episode whose reward
failed, or that the infrastructure broke, is excluded and counted, never scored 0 (which would bias the
group's baseline). Rewards are shaped first (``trainer.algo.truncated_reward``, ``unfinished_reward`` and
``reward_shaping``, :class:`miles.algo.shaping.RewardShaper`), then advantages come from the configured
estimator over the whole batch's groups. The group filter (DAPO's dynamic sampling) sees the same shaped rewards
(:func:`group_rewards`), so a filtered group is exactly one whose advantages would all be 0 under GRPO.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from miles.algo.advantages import AdvantageEstimator
from miles.algo.filters import has_reward_variance
from miles.algo.shaping import RewardShaper
from miles.backends.base import TrainSample
from miles.bus.schema import Episode, Trajectory
from miles.training.intake import fresh_loss_mask


@dataclass(slots=True)
class Batch:
    samples: list[TrainSample]
    metrics: dict[str, float]


def _percentile(values: Sequence[int], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)])


def group_rewards(traj: Trajectory, shaper: RewardShaper | None = None) -> list[float]:
    """The rewards of a group's trainable episodes as the advantage estimator sees them (shaped)."""
    rewards = [float(e.reward) for e in traj.trained_episodes]  # type: ignore[arg-type]
    if shaper is None or not shaper.active:
        return rewards
    return [
        shaper(r, e.num_model_tokens, e.truncated, e.end_reason)
        for r, e in zip(rewards, traj.trained_episodes, strict=True)
    ]


def build_batch(
    trajs: Sequence[Trajectory],
    advantages: AdvantageEstimator,
    shaper: RewardShaper | None = None,
    fresh: Callable[[int], bool] | None = None,
) -> Batch:
    """Training samples of the batch's trainable episodes, and what the batch looked like.

    ``fresh`` (``staleness.stale_prefix: mask``): whether a version is within the staleness bound; a model token
    of any other version is left out of the loss (counted in ``stale_tokens_masked``)."""
    groups = [t.trained_episodes for t in trajs]
    shaped = [group_rewards(t, shaper) for t in trajs]
    advs = advantages(shaped)
    samples: list[TrainSample] = []
    masked = 0
    for group, group_adv in zip(groups, advs, strict=True):
        for ep, adv in zip(group, group_adv, strict=True):
            loss_mask, version = _trained_tokens(ep, fresh)
            masked += ep.num_model_tokens - sum(loss_mask)
            samples.append(
                TrainSample(
                    prompt_ids=list(ep.prompt_ids),
                    token_ids=list(ep.token_ids),
                    loss_mask=loss_mask,
                    behaviour_logprobs=list(ep.logprobs),
                    advantage=float(adv),
                    weight_version=version,
                )
            )
    episodes = [e for t in trajs for e in t.episodes]
    trained = [e for group in groups for e in group]
    rewards = [float(e.reward) for e in trained]  # type: ignore[arg-type]
    lengths = [e.num_model_tokens for e in trained]
    turns = [e.stats.get("turns", 0.0) for e in trained]

    def total(key: str) -> float:
        return float(sum(e.stats.get(key, 0.0) for e in episodes))

    flat_shaped = [r for group in shaped for r in group]
    metrics = {
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "samples": float(len(samples)),
        "episodes": float(len(episodes)),
        "infra_excluded": float(sum(e.status == "infra_error" for e in episodes)),
        "reward_failed": float(sum(e.status == "reward_failed" for e in episodes)),
        "truncated": float(sum(e.truncated for e in episodes)),
        "groups_without_signal": float(sum(not g for g in groups)),
        "groups_equal_rewards": float(
            sum(bool(g) and not has_reward_variance(r) for g, r in zip(groups, shaped, strict=True))
        ),
        "length_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "length_p50": _percentile(lengths, 50),
        "length_p90": _percentile(lengths, 90),
        "length_max": float(max(lengths, default=0)),
        "turns_mean": sum(turns) / len(turns) if turns else 0.0,
        "tool_calls": total("tool_calls"),
        "parse_errors": total("parse_errors"),
        "env_s_mean": total("env_s") / len(episodes) if episodes else 0.0,
        "template_mismatches": total("template_mismatches"),
        "tokens": float(sum(len(e.token_ids) for e in episodes)),
        "model_tokens": float(sum(e.num_model_tokens for e in episodes)),
        "stale_tokens_masked": float(masked),
    }
    if shaper is not None and shaper.active:
        metrics["reward_shaped_mean"] = sum(flat_shaped) / len(flat_shaped) if flat_shaped else 0.0
    return Batch(samples, metrics)


def _trained_tokens(ep: Episode, fresh: Callable[[int], bool] | None) -> tuple[list[int], int]:
    """The loss mask an episode trains with, and the oldest version behind a trained token."""
    if fresh is None or all(fresh(v) for _, v in ep.spans):
        return list(ep.loss_mask), ep.oldest_version
    loss_mask = fresh_loss_mask(ep.loss_mask, ep.token_versions(), fresh)
    kept = [v for _, v in ep.spans if fresh(v)]
    return loss_mask, min(kept, default=ep.newest_version)
