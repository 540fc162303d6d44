"""The reward audit's cost per step and its detection probability against the audit rate, in one run.

    python benchmarks/reward_audit.py --out benchmarks/results/reward_audit.json

Cost: the trainer's intake of a trajectory without the audit (decode the message, the trust checks) and with
it (plus re-scoring every episode with the task's own reward, :class:`miles.training.audit.RewardCheck`),
timed side by side on the quickstart's shape (arithmetic task, the tiny model's character tokenizer, groups of
8 episodes of up to 8 tokens, 32 groups per step), interleaved, as CPU time of this one process.

Detection: a worker that lies (reports 1 - the task's reward) on ``n`` trajectories against the real audit at
rate ``r`` (trials of fresh audits, the operating system's randomness as in a run): the share of trials in
which it was excluded, beside ``1 - (1 - r)^n``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from miles.actors import trust
from miles.bus.schema import Episode, PromptGroup, Trajectory, decode, encode
from miles.config import ArithmeticTaskConfig
from miles.logs import configure_logging
from miles.models.tiny import build_char_tokenizer
from miles.tasks.arithmetic import ArithmeticTask
from miles.training.audit import RewardCheck, TrajectoryAudit, completion_text

GROUP_SIZE = 8
GROUPS_PER_STEP = 32


def _trajectories(task: ArithmeticTask, tokenizer, count: int, rng: random.Random) -> list[tuple[bytes, PromptGroup]]:  # noqa: ANN001
    """``count`` encoded trajectories with their tickets, honestly scored."""
    samples = task.samples("train")
    eos = tokenizer.eos_token_id
    out = []
    for i in range(count):
        sample = samples[i % len(samples)]
        ticket = PromptGroup(
            group_id=f"g{i}", sample_id=sample.id, prompt=sample.prompt, answer=sample.answer, group_size=GROUP_SIZE,
            issue_index=i, issued_at_version=0,
        )  # fmt: skip
        episodes = []
        for _ in range(GROUP_SIZE):
            answer = str(rng.randint(0, 60)) if rng.random() < 0.5 else sample.answer
            ids = tokenizer.encode(answer, add_special_tokens=False)[:7] + [eos]
            text = completion_text(
                Episode(
                    prompt_ids=[1], token_ids=ids, loss_mask=[1] * len(ids), logprobs=[-0.5] * len(ids),
                    turns=[(0, len(ids), "model")], weight_version=0, reward=0.0, status="ok", end_reason="done",
                ),
                lambda t: tokenizer.decode(list(t), skip_special_tokens=True),
            )  # fmt: skip
            episodes.append(
                Episode(
                    prompt_ids=tokenizer.encode(sample.prompt, add_special_tokens=False), token_ids=ids,
                    loss_mask=[1] * len(ids), logprobs=[-0.5] * len(ids), turns=[(0, len(ids), "model")],
                    weight_version=0, reward=task.reward(text, sample), status="ok", end_reason="done",
                )
            )  # fmt: skip
        traj = Trajectory(
            group_id=ticket.group_id, sample_id=sample.id, worker_id="w", episodes=episodes, issued_at_version=0,
            gen_s=0.1, ticket=encode(ticket),
        )  # fmt: skip
        out.append((encode(traj), ticket))
    return out


def _intake(data: bytes, vocab: int) -> tuple[Trajectory, PromptGroup]:
    """What the trainer does with every trajectory anyway: decode it and its ticket, the trust checks."""
    traj = decode(data, Trajectory)
    ticket = decode(traj.ticket, PromptGroup)
    assert trust.trajectory_refusal(traj, ticket, vocab_size=vocab, issued=10**9, newest=0, reward_range=(0, 1)) is None
    return traj, ticket


def measure_cost(task: ArithmeticTask, tokenizer, repeats: int) -> dict[str, float]:  # noqa: ANN001
    rng = random.Random(0)
    trajs = _trajectories(task, tokenizer, GROUPS_PER_STEP, rng)
    check = RewardCheck(task, lambda t: tokenizer.decode(list(t), skip_special_tokens=True))
    vocab = len(tokenizer)
    plain, audited = [], []
    for _ in range(repeats):  # interleaved: one step's batch without, then with the audit
        t0 = time.process_time()
        for data, _ in trajs:
            _intake(data, vocab)
        t1 = time.process_time()
        for data, _ in trajs:
            traj, ticket = _intake(data, vocab)
            assert check.disagreement(traj, ticket, 1e-6) is None  # honest: the re-score agrees
        t2 = time.process_time()
        plain.append(t1 - t0)
        audited.append(t2 - t1)
    p, a = statistics.median(plain), statistics.median(audited)
    return {
        "groups_per_step": GROUPS_PER_STEP,
        "group_size": GROUP_SIZE,
        "intake_ms_per_step": round(1e3 * p, 3),
        "intake_with_audit_ms_per_step": round(1e3 * a, 3),
        "audit_ms_per_step_at_rate_1": round(1e3 * (a - p), 3),
        "ratio_with_vs_without": round(a / p, 3),
    }


async def _detected(task: ArithmeticTask, tokenizer, lies: list[tuple[Trajectory, PromptGroup]], rate: float) -> bool:  # noqa: ANN001
    check = RewardCheck(task, lambda t: tokenizer.decode(list(t), skip_special_tokens=True))
    audit = TrajectoryAudit(check, rate=rate)
    for traj, ticket in lies:
        await audit.refusal(traj, ticket)
    return "liar" in audit.excluded


def measure_detection(task: ArithmeticTask, tokenizer, rates: list[float], ns: list[int], trials: int) -> list[dict]:  # noqa: ANN001
    rng = random.Random(1)
    honest = _trajectories(task, tokenizer, max(ns), rng)
    lies = []
    for data, ticket in honest:  # the liar's trajectories: every reward flipped
        traj = decode(data, Trajectory)
        flipped = [e.model_copy(update={"reward": 1.0 - e.reward}) for e in traj.episodes]
        lies.append((traj.model_copy(update={"worker_id": "liar", "episodes": flipped}), ticket))
    rows = []
    for rate in rates:
        for n in ns:
            caught = sum(asyncio.run(_detected(task, tokenizer, lies[:n], rate)) for _ in range(trials))
            rows.append(
                {"rate": rate, "lies": n, "detected": caught / trials, "expected": round(1 - (1 - rate) ** n, 4)}
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=200, help="Interleaved step batches timed for the cost.")
    p.add_argument("--trials", type=int, default=400, help="Fresh audits per (rate, lies) for the detection.")
    p.add_argument("--rates", default="0.01,0.05,0.1,0.25")
    p.add_argument("--lies", default="10,50,100")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    configure_logging(level="critical")  # every trial's exclusion is logged as an error otherwise
    task = ArithmeticTask(ArithmeticTaskConfig())
    tokenizer = build_char_tokenizer()
    cost = measure_cost(task, tokenizer, args.repeats)
    print(json.dumps(cost))
    rates = [float(x) for x in args.rates.split(",")]
    ns = [int(x) for x in args.lies.split(",")]
    detection = measure_detection(task, tokenizer, rates, ns, args.trials)
    print("| rate | lies | detected | 1 - (1 - rate)^lies |\n|---|---|---|---|")
    for row in detection:
        print(f"| {row['rate']} | {row['lies']} | {row['detected']:.3f} | {row['expected']:.3f} |")
    if args.out:
        args.out.write_text(json.dumps({"cost": cost, "detection": detection}, indent=1) + "\n")


if __name__ == "__main__":
    main()
