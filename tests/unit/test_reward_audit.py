"""The trajectory audit's rules: what it re-scores, when it refuses, whom it stops believing."""

from __future__ import annotations

from miles.bus.schema import Episode, PromptGroup, Trajectory
from miles.config import ArithmeticTaskConfig
from miles.models.tiny import build_char_tokenizer
from miles.tasks.arithmetic import ArithmeticTask
from miles.training.audit import RewardCheck, TrajectoryAudit, audit_alarm, completion_text, logprob_samples

TOKENIZER = build_char_tokenizer()
TASK = ArithmeticTask(ArithmeticTaskConfig())
SAMPLE = TASK.samples("train")[0]
TICKET = PromptGroup(
    group_id="g0", sample_id=SAMPLE.id, prompt=SAMPLE.prompt, answer=SAMPLE.answer, group_size=2, issue_index=0,
    issued_at_version=0,
)  # fmt: skip


def _decode(ids: object) -> str:
    return TOKENIZER.decode(list(ids), skip_special_tokens=True)  # type: ignore[call-overload]


def _episode(answer: str, reward: float, end: str = "done") -> Episode:
    ids = TOKENIZER.encode(answer, add_special_tokens=False) + [TOKENIZER.eos_token_id]
    return Episode(
        prompt_ids=[1], token_ids=ids, loss_mask=[1] * len(ids), logprobs=[-0.5] * len(ids),
        turns=[(0, len(ids), "model")], weight_version=0, reward=reward, status="ok", end_reason=end,  # type: ignore[arg-type]
    )  # fmt: skip


def _traj(worker: str, *episodes: Episode) -> Trajectory:
    return Trajectory(
        group_id="g0", sample_id=SAMPLE.id, worker_id=worker, episodes=list(episodes), issued_at_version=0, gen_s=0.0
    )


def test_the_completion_is_the_model_turn_as_the_worker_decoded_it() -> None:
    assert completion_text(_episode(SAMPLE.answer, 1.0), _decode) == SAMPLE.answer  # <eos> dropped
    assert completion_text(_episode(SAMPLE.answer, 0.0, end="context_full"), _decode) == ""  # never stepped


async def test_a_lie_is_refused_and_its_worker_excluded_an_honest_worker_is_not() -> None:
    audit = TrajectoryAudit(RewardCheck(TASK, _decode), rate=1.0)
    honest = _traj("w1", _episode(SAMPLE.answer, 1.0), _episode("99999", 0.0))
    assert await audit.refusal(honest, TICKET) is None
    lie = _traj("w2", _episode(SAMPLE.answer, 1.0), _episode("99999", 1.0))
    why = await audit.refusal(lie, TICKET)
    assert why is not None and "episode 1: reward 1.0, the task gives 0.0" in why
    assert audit.excluded == {"w2"} and audit_alarm(audit.stats()) is not None
    assert "excluded" in (await audit.refusal(_traj("w2", _episode(SAMPLE.answer, 1.0)), TICKET) or "")
    assert await audit.refusal(honest, TICKET) is None
    assert audit.stats() == {
        "audited": 3.0, "audit_mismatches": 1.0, "audit_excluded_workers": 1.0, "audit_refused_excluded": 1.0,
        "audit_logprobs_checked": 0.0, "audit_logprob_mismatches": 0.0, "audit_logprob_gap_max": 0.0,
    }  # fmt: skip


async def test_only_the_drawn_share_is_re_scored_and_exclusion_can_wait_for_more_lies() -> None:
    draws = iter([0.9, 0.1, 0.1, 0.1])  # rate 0.5: the first is not audited, the rest are
    audit = TrajectoryAudit(RewardCheck(TASK, _decode), rate=0.5, exclude_after=2, draw=lambda: next(draws))
    lie = _traj("w", _episode("99999", 1.0))
    assert await audit.refusal(lie, TICKET) is None  # not drawn: believed
    assert await audit.refusal(lie, TICKET) is not None and audit.excluded == set()  # one lie of two allowed
    assert await audit.refusal(lie, TICKET) is not None and audit.excluded == {"w"}
    assert audit.audited == 2 and audit_alarm({}) is None


async def test_a_reward_that_raises_on_the_trainer_disagrees_with_a_worker_that_reported_one() -> None:
    """An honest worker's episode would have failed (reward_failed): one that reports a reward did not run it."""

    class Raising(ArithmeticTask):
        def reward(self, completion: str, sample: object) -> float:  # type: ignore[override]
            raise KeyError("difficulty")

    audit = TrajectoryAudit(RewardCheck(Raising(ArithmeticTaskConfig()), _decode), rate=1.0)
    why = await audit.refusal(_traj("w", _episode(SAMPLE.answer, 1.0)), TICKET)
    assert why is not None and "raised KeyError" in why and audit.excluded == {"w"}


def test_the_log_prob_audit_checks_only_whole_episodes_of_versions_held_and_judges_their_mean_gap() -> None:
    spans = {"weight_version": 3, "version_spans": [(0, 3), (2, 4)]}  # its weights changed after 2 tokens
    split = Episode(**(_episode(SAMPLE.answer, 1.0).model_dump() | spans))
    whole = Episode(**(_episode(SAMPLE.answer, 1.0).model_dump() | {"weight_version": 4}))
    (sample,) = logprob_samples(_traj("w", split, whole), {4})  # the split episode's cache held version-3 tokens
    assert sample.token_ids == whole.token_ids and sample.loss_mask == whole.loss_mask
    assert logprob_samples(_traj("w", split, whole), {3}) == []  # nothing sampled under version 3 alone
    assert logprob_samples(_traj("w", whole), {5}) == []  # version 4's weights are not held
    episode = whole
    audit = TrajectoryAudit(logprob_rate=1.0, logprob_tolerance=0.05)
    assert audit.judge_logprobs(_traj("w1", episode), abs_diff_sum=0.4, tokens=10) is None  # 0.04 per token
    assert audit.stats()["audit_logprob_gap_max"] == 0.04
    why = audit.judge_logprobs(_traj("w2", episode), abs_diff_sum=6.0, tokens=10)
    assert why is not None and "0.6 nats per token on 10 tokens" in why and audit.excluded == {"w2"}
    assert audit.judge_logprobs(_traj("w3", episode), abs_diff_sum=float("nan"), tokens=3) is not None
    stats = audit.stats()
    assert stats["audit_logprobs_checked"] == 3 and stats["audit_logprob_mismatches"] == 2
    assert "2 on log-probs" in (audit_alarm(stats) or "")
