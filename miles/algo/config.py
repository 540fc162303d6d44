"""Config of the RL objective (``trainer.algo``): every piece chosen by the ``type`` of its section.

Torch-free, like the rest of the config tree (:mod:`miles.config` imports it), so that config errors are
instant. The formulas are in docs/algorithms.md and in the docstrings of the functions each type selects.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Tag, model_validator

from miles.config_base import Strict, variant


class CustomPiece(Strict):
    """A user's own piece of the objective: ``path`` names a factory ``(config) -> piece`` (docs/algorithms.md)."""

    type: Literal["custom"] = "custom"
    path: str = Field(description="Import path 'package.module:factory' of the factory.")
    params: dict[str, Any] = Field(default_factory=dict, description="Passed to the factory inside this section.")


# --------------------------------------------------------------------------- advantages


class GrpoAdvantage(Strict):
    """Group-relative advantages: ``(r - mean(group)) / (std(group) + eps)`` (population std)."""

    type: Literal["grpo"] = "grpo"
    eps: float = Field(1e-6, gt=0, description="Keeps the division finite for a group of nearly equal rewards.")


class GrpoNoStdAdvantage(Strict):
    """``r - mean(group)`` (Dr. GRPO's advantage): no std scaling, so nearly solved or nearly failed groups are
    not up-weighted."""

    type: Literal["grpo_no_std"] = "grpo_no_std"


class ReinforcePPAdvantage(Strict):
    """REINFORCE++: no group baseline; the rewards of the whole rollout batch are whitened,
    ``(r - mean(batch)) / (std(batch) + eps)``."""

    type: Literal["reinforce_pp"] = "reinforce_pp"
    eps: float = Field(1e-6, gt=0, description="Keeps the division finite for a batch of nearly equal rewards.")


class ReinforcePPBaselineAdvantage(Strict):
    """REINFORCE++-baseline: the group mean as baseline, then whitening over the whole batch,
    ``a = r - mean(group)``, ``A = (a - mean(batch a)) / (std(batch a) + eps)``."""

    type: Literal["reinforce_pp_baseline"] = "reinforce_pp_baseline"
    eps: float = Field(1e-6, gt=0, description="Keeps the division finite for a batch of nearly equal rewards.")


AdvantageConfig = Annotated[
    Annotated[GrpoAdvantage, Tag("grpo")]
    | Annotated[GrpoNoStdAdvantage, Tag("grpo_no_std")]
    | Annotated[ReinforcePPAdvantage, Tag("reinforce_pp")]
    | Annotated[ReinforcePPBaselineAdvantage, Tag("reinforce_pp_baseline")]
    | Annotated[CustomPiece, Tag("custom")],
    variant("grpo"),
]


# --------------------------------------------------------------------------- policy losses


class PpoClipLoss(Strict):
    """PPO-clip with separate bounds (clip-higher): ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``."""

    type: Literal["ppo_clip"] = "ppo_clip"
    clip_low: float = Field(0.2, ge=0, description="PPO ratio lower clip: 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio upper clip: 1 + clip_high (clip-higher).")
    aggregation: Literal["token", "sequence", "constant"] = Field(
        "token",
        description="token: sum over the batch's trained tokens / their count; sequence: mean per sequence, then "
        "over sequences; constant: sum over tokens / (sequences x constant_tokens), no length normalisation "
        "(Dr. GRPO).",
    )
    constant_tokens: int | None = Field(
        None,
        ge=1,
        description="aggregation 'constant': the per-sequence divisor (None: the generation budget, "
        "rollout.sampling.max_new_tokens x rollout.episode.max_turns or rollout.episode.max_tokens).",
    )


class GspoLoss(Strict):
    """GSPO: one importance ratio per sequence, ``s = exp(mean_t log(pi_theta / pi_prox))``, clipped like PPO
    at ``[1 - clip_low, 1 + clip_high]``, each sequence weighted equally."""

    type: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0, description="Lower clip of the sequence ratio: 1 - clip_low.")
    clip_high: float = Field(4e-4, ge=0, description="Upper clip of the sequence ratio: 1 + clip_high.")


class CispoLoss(Strict):
    """CISPO: REINFORCE on every token, weighted by the clipped, detached importance ratio,
    ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi_theta``; no token with A > 0 loses its gradient
    (by default those with A < 0 do below PPO's lower trust region, ``mask_low``)."""

    type: Literal["cispo"] = "cispo"
    clip_low: float = Field(
        1.0, ge=0, le=1, description="Lower clip of the weight: 1 - clip_low (1.0: no lower bound, as MiniMax-M1)."
    )
    clip_high: float = Field(4.0, ge=0, description="Upper clip of the weight: 1 + clip_high.")
    aggregation: Literal["token", "sequence"] = Field("token", description="As for ppo_clip.")
    mask_low: float | None = Field(
        0.2,
        ge=0,
        le=1,
        description="Tokens with A < 0 whose ratio fell below 1 - mask_low get no gradient (the token mask of "
        "MiniMax-M1's unified form, eq. 7: PPO's lower trust region). Without it, several mini-batches keep "
        "pushing down the same sampled tokens and the quickstart collapses (benchmarks/RESULTS.md); it never "
        "acts with minibatches: 1. None: no mask, the paper's CISPO (eq. 4).",
    )
    mask_high: float | None = Field(
        None,
        ge=0,
        description="Tokens with A > 0 whose ratio rose above 1 + mask_high get no gradient (eq. 7's mask, PPO's "
        "upper trust region). None: no mask.",
    )


class SurrogateLoss(Strict):
    """Your own per-token term inside Miles' assembly (docs/algorithms.md, "Your own per-token surrogate"):
    ``path`` names ``fn(log_ratio, advantages, mask, seq_index, **params) -> term`` (or ``(term, clipped)``),
    every tensor ``(R, L)``; Miles applies the off-policy correction's weights and truncation, the aggregation,
    the KL and entropy terms and the metrics, exactly as for its own surrogates."""

    type: Literal["surrogate"] = "surrogate"
    path: str = Field(description="Import path 'package.module:function' of the per-token term.")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the function.")
    aggregation: Literal["token", "sequence", "constant"] = Field("token", description="As for ppo_clip.")
    constant_tokens: int | None = Field(None, ge=1, description="As for ppo_clip.")

    @model_validator(mode="after")
    def _importable(self) -> SurrogateLoss:
        from miles.plugins import import_callable

        import_callable(self.path, "trainer.algo.loss.path")  # a wrong path fails the recipe, not a step
        return self


LossConfig = Annotated[
    Annotated[PpoClipLoss, Tag("ppo_clip")]
    | Annotated[GspoLoss, Tag("gspo")]
    | Annotated[CispoLoss, Tag("cispo")]
    | Annotated[SurrogateLoss, Tag("surrogate")]
    | Annotated[CustomPiece, Tag("custom")],
    variant("ppo_clip"),
]


# --------------------------------------------------------------------------- off-policy corrections


class NoCorrection(Strict):
    """PPO ratio ``pi_theta / pi_prox``; the behaviour policy is ignored."""

    type: Literal["none"] = "none"


class DecoupledPpoCorrection(Strict):
    """AReaL's decoupled PPO with truncated importance weights (what slime and verl call TIS): ratio
    ``pi_theta / pi_prox``, each token weighted by ``min(pi_prox / pi_behaviour, clip)``."""

    type: Literal["decoupled_ppo"] = "decoupled_ppo"
    clip: float = Field(2.0, ge=1.0, description="Upper truncation of the importance weight.")


class BehaviourRatioCorrection(Strict):
    """The PPO ratio taken against the behaviour policy itself, ``min(pi_theta / pi_behaviour, cap)``, with no
    proximal policy (formerly called ``tis``; for negative advantages the cap is dual-clip PPO)."""

    type: Literal["behaviour_ratio"] = "behaviour_ratio"
    cap: float = Field(2.0, ge=1.0, description="Upper truncation of the ratio.")


class MaskedIsCorrection(Strict):
    """IcePop-style masking: weight ``k = pi_prox / pi_behaviour`` inside ``[low, high]``, 0 outside."""

    type: Literal["masked_is"] = "masked_is"
    low: float = Field(0.5, ge=0, le=1, description="Tokens whose k is below this get weight 0.")
    high: float = Field(2.0, ge=1, description="Tokens whose k is above this get weight 0.")


class SequenceCorrection(Strict):
    """Whole sequences weighted by ``min(prod_t pi_prox / pi_behaviour, clip)``."""

    type: Literal["sequence"] = "sequence"
    clip: float = Field(2.0, ge=1.0, description="Upper truncation of the sequence weight.")


OffPolicyConfig = Annotated[
    Annotated[NoCorrection, Tag("none")]
    | Annotated[DecoupledPpoCorrection, Tag("decoupled_ppo")]
    | Annotated[BehaviourRatioCorrection, Tag("behaviour_ratio")]
    | Annotated[MaskedIsCorrection, Tag("masked_is")]
    | Annotated[SequenceCorrection, Tag("sequence")]
    | Annotated[CustomPiece, Tag("custom")],
    variant("decoupled_ppo"),
]


# --------------------------------------------------------------------------- group filters (dynamic sampling)


class NoGroupFilter(Strict):
    """Every group with a trainable episode is trained (a group of equal rewards gets advantage 0)."""

    type: Literal["none"] = "none"


class RewardVarianceFilter(Strict):
    """DAPO's dynamic sampling: a group whose trainable rewards are all equal (no learning signal) is
    filtered out by the trainer, reported to the controller like a discard (its credit comes back, the
    ledger says ``filtered``) and replaced by a new prompt, so every step still trains a full batch."""

    type: Literal["reward_variance"] = "reward_variance"
    min_std: float = Field(
        0.0, ge=0, description="Groups whose reward std (population) is <= this are filtered (0: exactly equal)."
    )
    over_issue: float = Field(
        0.0,
        ge=0,
        le=4,
        description="Extra groups the controller keeps in flight, as a fraction of trainer.groups_per_step, so "
        "replacements for filtered groups are already being played (they may exceed the staleness window by "
        "that much; the trainer's re-check still drops or re-queues anything too old).",
    )


GroupFilterConfig = Annotated[
    Annotated[NoGroupFilter, Tag("none")]
    | Annotated[RewardVarianceFilter, Tag("reward_variance")]
    | Annotated[CustomPiece, Tag("custom")],
    variant("none"),
]


# --------------------------------------------------------------------------- reward shaping


class NoShaping(Strict):
    """Rewards as the task scored them."""

    type: Literal["none"] = "none"


class OverlongShaping(Strict):
    """DAPO's soft overlong punishment, added to the reward: 0 up to ``max_tokens - buffer_tokens`` model
    tokens, then falling linearly to ``-penalty`` at ``max_tokens`` (and ``-penalty`` beyond)."""

    type: Literal["overlong"] = "overlong"
    max_tokens: int | None = Field(
        None, ge=1, description="L_max: where the penalty is full (None: the generation budget)."
    )
    buffer_tokens: int = Field(4, ge=1, description="L_cache: length of the soft penalty zone before max_tokens.")
    penalty: float = Field(1.0, ge=0, description="The penalty at max_tokens.")


ShapingConfig = Annotated[
    Annotated[NoShaping, Tag("none")] | Annotated[OverlongShaping, Tag("overlong")], variant("none")
]


# --------------------------------------------------------------------------- on-policy distillation


class TrainerTeacher(Strict):
    """A frozen teacher loaded in every trainer rank (unsharded, no gradients), scoring the batch's tokens."""

    type: Literal["in_trainer"] = "in_trainer"
    path: str = Field(
        description="A Hugging Face checkpoint directory (config.json, weights), or a Miles run directory "
        "(config.yaml + checkpoints/): its newest complete checkpoint."
    )


class BusTeacher(Strict):
    """Teacher actors on the bus (``miles-node --role teacher``): the trainer leader sends each batch's token ids
    and receives the teacher's log-probs of them (docs/protocol.md, ``teacher_score``)."""

    type: Literal["actor"] = "actor"
    path: str = Field(description="What every teacher actor loads, as for the trainer teacher.")
    actors: int = Field(1, ge=1, description="Teacher actors `miles run` starts (each loads the teacher).")
    engine: Literal["torch", "sglang"] = Field("torch", description="torch: scores in-process; sglang: /generate.")
    url: str | None = Field(None, description="engine sglang: base URL of the SGLang server holding the teacher.")
    timeout_s: float = Field(120.0, gt=0, description="How long the trainer waits for a batch's scores.")
    device: str = Field("cpu", description="engine torch: the teacher's device.")


TeacherConfig = Annotated[
    Annotated[TrainerTeacher, Tag("in_trainer")] | Annotated[BusTeacher, Tag("actor")], variant("in_trainer")
]


class DistillConfig(Strict):
    """On-policy distillation: per sampled token the advantage becomes
    ``A_t - coef * (log pi_student - log pi_teacher)`` (after the advantage estimator, before the policy loss),
    on trained tokens only; the student's log-prob is the proximal one (trainer weights at the batch start)."""

    teacher: TeacherConfig = Field(description="Where the teacher's log-probs come from.")
    coef: float = Field(0.2, gt=0, description="lambda: weight of the per-token reverse-KL term.")
    task_reward: bool = Field(
        True, description="Keep the estimator's advantage A_t beside the KL term (False: A_t = 0, pure distillation)."
    )


# --------------------------------------------------------------------------- the objective

_RENAMED = {
    ("off_policy", "tis"): "'tis' was renamed: 'behaviour_ratio' is what it computed (the PPO ratio taken against "
    "the behaviour policy, capped); 'decoupled_ppo' is truncated importance sampling as slime and verl mean it",
}
_SECTIONS = ("advantage", "loss", "off_policy", "filter", "reward_shaping")


class AlgoConfig(Strict):
    """The RL objective, assembled from registered pieces (docs/algorithms.md). Each piece is chosen by the
    ``type`` of its section; a bare string is shorthand for ``{type: <string>}``."""

    advantage: AdvantageConfig = Field(default_factory=GrpoAdvantage, description="Advantage estimator.")
    loss: LossConfig = Field(default_factory=PpoClipLoss, description="Policy-gradient loss.")
    off_policy: OffPolicyConfig = Field(
        default_factory=DecoupledPpoCorrection,
        description="Correction for tokens sampled by an older or differently rounded behaviour policy "
        "(docs/staleness.md): none, decoupled_ppo, behaviour_ratio, masked_is, sequence, or custom.",
    )
    filter: GroupFilterConfig = Field(
        default_factory=NoGroupFilter, description="Which groups are trained: none, or reward_variance (DAPO)."
    )
    reward_shaping: ShapingConfig = Field(
        default_factory=NoShaping, description="Added to each episode's reward: none, or overlong (DAPO)."
    )
    truncated_reward: float | None = Field(
        None,
        description="Reward of an episode cut off by the token limit, instead of its task reward (0: truncated "
        "answers score 0, as under a tight length cap); None: as scored.",
    )
    unfinished_reward: float | None = Field(
        None,
        description="Reward of an episode that ran out of turns (end reason max_turns: the agent never "
        "finished) instead of its task reward; None: as the verifier scored it.",
    )
    distill: DistillConfig | None = Field(None, description="On-policy distillation from a frozen teacher.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL penalty to the reference policy.")
    entropy_coef: float = Field(0.0, description="Weight of the entropy bonus.")
    minibatches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per rollout batch: the batch is split into this many mini-batches, each one "
        "step against the same proximal policy (so the PPO ratio and its clip act from the second on).",
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key in _SECTIONS:
            value = data.get(key)
            if isinstance(value, str):
                hint = _RENAMED.get((key, value))
                if hint:
                    raise ValueError(hint)
                data[key] = {"type": value}
            elif isinstance(value, dict) and (key, value.get("type")) in _RENAMED:
                raise ValueError(_RENAMED[(key, value["type"])])
        return data


def generation_budget(cfg: Any) -> int:
    """Most model tokens one episode of a run config may have: ``rollout.episode.max_tokens`` when set, else
    ``rollout.sampling.max_new_tokens`` per model turn times ``rollout.episode.max_turns``."""
    episode = cfg.rollout.episode
    if episode.max_tokens is not None:
        return int(episode.max_tokens)
    return int(cfg.rollout.sampling.max_new_tokens) * int(episode.max_turns)
