"""`miles run`'s progress lines: turns and lengths for multi-turn tasks, evaluations as they arrive."""

from __future__ import annotations

import io

from rich.console import Console

from miles.bus.schema import EvalResult, StepMetrics
from miles.config import load_config
from miles.progress import ProgressView, eval_line, is_multi_turn, step_info

METRICS = {
    "reward_mean": 0.5,
    "tokens_per_s": 120.0,
    "step_s": 0.5,
    "turns_mean": 3.25,
    "length_mean": 41.6,
    "length_p90": 80.0,
    "length_max": 128.0,
    "infra_excluded": 2.0,
    "reward_failed": 1.0,
}


def _step(step: int, version: int, **metrics: float) -> StepMetrics:
    return StepMetrics(
        step=step, policy_version=version, metrics=metrics, trained_group_ids=["g0", "g1"], staleness=[0, 1]
    )


def test_step_info_shows_turns_and_lengths_only_for_multi_turn() -> None:
    single = step_info(_step(0, 1, **METRICS), multi_turn=False, last_eval=None)
    assert single == "reward 0.500 | staleness 0.50 (max 1) | 120 tok/s | 0.50 s/step"
    multi = step_info(_step(0, 1, **METRICS), multi_turn=True, last_eval=0.25)
    assert "turns 3.2 | len 42 (p90 80, max 128) | excluded 3" in multi
    assert multi.endswith("| eval 0.250")


def test_multi_turn_from_config() -> None:
    assert not is_multi_turn(load_config(None, []))
    assert is_multi_turn(load_config(None, ["rollout.episode.max_turns=4"]))


def test_eval_line() -> None:
    msg = EvalResult(policy_version=7, requested_version=6, accuracy=0.375, samples=40, failed=2)
    assert eval_line(msg, 5) == "eval  step 5: accuracy 0.375 on 40 samples (2 failed)"
    assert eval_line(msg, None).startswith("eval  version 7:")


def test_view_prints_evaluations_as_they_arrive_with_their_step() -> None:
    view = ProgressView(load_config(None, ["trainer.steps=2"]), "nats://unused")
    out = io.StringIO()
    view.console = Console(file=out, width=200)
    assert not view.live
    view._show(EvalResult(policy_version=3, requested_version=3, accuracy=0.25, samples=8))  # the initial policy
    view._show(_step(0, 4, **{**METRICS, "turns_mean": 2.0}))  # two turns: multi-turn after all
    view._show(EvalResult(policy_version=5, requested_version=4, accuracy=0.5, samples=8))
    view._show(_step(1, 5, **METRICS))
    lines = out.getvalue().splitlines()
    assert lines[0] == "eval  step 0: accuracy 0.250 on 8 samples"
    assert lines[1].startswith("step 1/2 | reward 0.500") and "turns 2.0" in lines[1]
    assert lines[2] == "eval  step 1: accuracy 0.500 on 8 samples"
    assert lines[3].startswith("step 2/2") and lines[3].endswith("| eval 0.500")
