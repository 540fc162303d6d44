"""What a rollout worker must publish, judged from the record of a conformance session (driver.py).

Every check is against docs/protocol.md, decoded with the project's own schema (the strictest reader the
run has: the trainer and controller decode exactly so), and recomputed from the weights the driver
published where a value can be: prompt ids, rewards and every behaviour log-prob.
"""

from __future__ import annotations

import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.bus.schema import EvalShardResult, Heartbeat, Trajectory, WeightsHeld, decode, decode_any
from miles.config import RunConfig
from miles.models.loading import load_policy, prepared_model_dir, stop_token_ids
from miles.rollout.render import Renderer
from miles.tasks.base import Sample
from miles.tasks.registry import build_task

from .conftest import conformance_config
from .driver import Record

pytestmark = pytest.mark.slow  # starts a worker process per implementation
LOGPROB_ATOL = 2e-3  # float32 recomputation of the same weights: batched vs incremental forward passes


@cache
def _policy(model_cache: Path) -> tuple[Any, Any, Any, RunConfig]:
    cfg = conformance_config(model_cache, "conf-check")
    model, tokenizer = load_policy(prepared_model_dir(cfg.model, cfg.task))
    return model, tokenizer, build_task(cfg.task), cfg


@pytest.fixture
def policy(conformance_models: Path) -> tuple[Any, Any, Any, RunConfig]:
    """The prepared model (its weights replaced per version below), tokenizer, task and config."""
    return _policy(conformance_models)


def trajectories(record: Record) -> list[Trajectory]:
    return [decode(m.data, Trajectory) for m in record.traj]


def test_the_worker_went_through_every_phase(record: Record) -> None:
    assert not record.aborted, record.aborted


def test_every_prompt_group_gets_one_trajectory_that_the_trainer_accepts(record: Record) -> None:
    trajs = trajectories(record)  # raises (fails) on anything the trainer would dead-letter
    assert sorted(t.group_id for t in trajs) == sorted(record.issued), record.log_tail
    for t in trajs:
        group = record.issued[t.group_id]
        assert (t.sample_id, t.worker_id, t.issued_at_version) == (
            group.sample_id,
            record.worker_id,
            group.issued_at_version,
        )
        assert len(t.episodes) == group.group_size and t.gen_s >= 0
    # Acked once stored: nothing of the work queue is left, pending or unacked.
    assert (record.unacked, record.pending) == (0, 0)


def test_episodes_keep_the_token_contract(record: Record, policy: tuple) -> None:
    _, tokenizer, task, cfg = policy
    renderer = Renderer(tokenizer, "raw")
    stops = set(stop_token_ids(tokenizer))
    for t in trajectories(record):
        group = record.issued[t.group_id]
        expected_prompt = renderer.initial([{"role": "user", "content": group.prompt}])
        for ep in t.episodes:
            n = len(ep.token_ids)
            assert ep.prompt_ids == expected_prompt
            assert ep.loss_mask == [1] * n and [list(x) for x in ep.turns] == [[0, n, "model"]]
            assert 1 <= n <= cfg.rollout.sampling.max_new_tokens
            assert ep.token_ids[-1] in stops or ep.truncated, "a turn ends at a stop token or at its budget"
            assert not any(tok in stops for tok in ep.token_ids[:-1])
            assert ep.weight_version >= group.issued_at_version and ep.oldest_version >= group.issued_at_version
            assert ep.status == "ok" and ep.end_reason == "done"
            completion = renderer.decode(ep.token_ids)
            sample = Sample(id=group.sample_id, prompt=group.prompt, answer=group.answer, meta=dict(group.meta))
            assert ep.reward == task.reward(completion, sample), (completion, group.answer)


@torch.no_grad()
def test_behaviour_logprobs_are_those_of_the_published_weights(record: Record, policy: tuple) -> None:
    """Each log-prob recomputed under the published weights of the episode's version (temperature applied):
    a worker that samples from other weights (its local checkpoint, a forged version) or reports log-probs
    after top-p truncation fails here."""
    model, _, _, cfg = policy
    temperature = cfg.rollout.sampling.temperature
    by_version: dict[int, list] = {}
    for t in trajectories(record):
        for ep in t.episodes:
            assert len(ep.spans) == 1, "one version per single-turn episode here (weights switch between units)"
            by_version.setdefault(ep.weight_version, []).append(ep)
    assert record.forged not in by_version, "generated with the forged version"
    for version, episodes in by_version.items():
        model.load_state_dict({k: v.float() for k, v in record.states[version].items()})
        for ep in episodes:
            ids = torch.tensor([ep.prompt_ids + ep.token_ids])
            logits = model(input_ids=ids).logits[0].float()  # (P + T, V)
            start = len(ep.prompt_ids) - 1
            logp = torch.log_softmax(logits[start : start + len(ep.token_ids)] / temperature, dim=-1)
            want = logp.gather(-1, torch.tensor(ep.token_ids).unsqueeze(-1)).squeeze(-1)
            got = torch.tensor(ep.logprobs)
            assert torch.allclose(got, want, atol=LOGPROB_ATOL), f"v{version}: {got.tolist()} != {want.tolist()}"


def test_held_weights_are_reported_with_the_announced_digest_before_use(record: Record) -> None:
    reports = [(m.ts, decode(m.data, WeightsHeld)) for m in record.held]
    versions = [r.version for _, r in reports]
    assert record.forged not in versions, "reported holding the forged version"
    assert {0, 3} <= set(versions) <= {0, 1, 3}, versions
    assert versions == sorted(versions), "versions held only go up"
    for _, r in reports:
        assert r.worker_id == record.worker_id and r.state_digest == record.announced[r.version]
    reported_at = {r.version: ts for ts, r in reports}
    for m in record.traj:
        t = decode(m.data, Trajectory)
        for v in {v for e in t.episodes for _, v in e.spans}:
            assert reported_at[v] <= m.ts, f"{t.group_id} used v{v} before reporting it"


def test_heartbeats_name_the_worker_its_version_and_state(record: Record) -> None:
    beats = [(at, decode(data, Heartbeat)) for at, data in record.heartbeats]
    assert len(beats) >= 3, record.log_tail
    for at, hb in beats:
        assert (hb.role, hb.actor_id) == ("rollout", record.worker_id)
        assert hb.state in ("running", "engine_error") and abs(hb.ts - at) < 5.0
        assert all(isinstance(v, float) for v in hb.stats.values())
    assert hb.state == "running"
    versions = [hb.version for _, hb in beats]
    assert 3 in versions and versions == sorted(versions) and set(versions) <= {-1, 0, 1, 3}, versions
    # Once the worker holds weights (start-up may pause a worker that loads its engine on the event loop):
    working = [at for at, hb in beats if hb.version >= 0]
    gaps = [b - a for a, b in zip(working, working[1:], strict=False)]
    assert gaps and max(gaps) < 5.0, "heartbeats every bus.heartbeat_s (0.5 s here), not seconds apart"


def test_evaluation_shards_are_played_and_reported(record: Record) -> None:
    [result] = [decode(m.data, EvalShardResult) for m in record.eval_results]
    task = record.eval_task
    assert (result.eval_id, result.shard, result.worker_id) == (task.eval_id, task.shard, record.worker_id)
    assert result.samples == len(task.samples) and 0 <= result.reward_sum <= result.samples
    assert result.version >= task.version and result.version != record.forged
    assert 1 <= result.tokens <= task.max_new_tokens * len(task.samples)


def test_malformed_prompts_are_dead_lettered_with_their_origin(record: Record) -> None:
    run = record.traj[0].subject.split(".")[0]
    from_prompts = [m for m in record.dead_letters if m.headers.get("Miles-Origin") == f"{run}.prompts"]
    assert len(from_prompts) == 2, [(m.subject, m.headers) for m in record.dead_letters]
    assert {m.data[:3] for m in from_prompts} == {b"\x00\xffn", b"\x84\xa6s"}  # parked unchanged
    assert all(m.headers.get("Miles-Reason") and m.subject.startswith(f"{run}.dlq.") for m in from_prompts)
    good = set(record.good)
    refused_good = [decode_any(m.data) for m in record.dead_letters if m.data in good]
    assert refused_good == [], "well-formed work, weights or this instance's stop were refused"


def test_stops_of_another_run_instance_are_refused(record: Record) -> None:
    """A stop stored by an earlier run, live ones with a wrong or no nonce, and garbage: the worker plays on
    (g3 was issued after them) and only leaves after this instance's stop."""
    g3 = [m for m in record.traj if decode(m.data, Trajectory).group_id == "g3"]
    assert g3 and g3[0].ts > record.refused_stops_at
    assert record.exited_at >= record.valid_stop_at


def test_the_valid_stop_ends_the_worker_cleanly(record: Record) -> None:
    assert record.exit_code == 0, record.log_tail
    assert record.exited_at - record.valid_stop_at < 60
    assert time.time() >= record.exited_at
