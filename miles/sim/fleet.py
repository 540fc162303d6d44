"""A discrete-event fleet simulation of Miles' asynchronous schedule, on a virtual clock.

Why: whether asynchrony pays off at 64-1024 GPUs cannot be measured on a 2-core machine, but the rules that
decide it can be run exactly: the controller's admission (:func:`~miles.actors.admission.issue_room`,
:func:`~miles.actors.admission.plan_batch`, :class:`~miles.actors.admission.AdmissionState` with its re-issue
queue) and the trainer's accept/stale verdict (:func:`~miles.training.intake.classify` against a real
:class:`~miles.training.lineage.VersionLineage`). Only the costs are modelled:

* rollout engines batch continuously: up to ``max_batch`` sequences, one decode step takes
  ``step_base_s + step_per_seq_s * batch``, a sequence ends after its length in tokens. Events happen only
  when a sequence ends or the batch changes (between them every sequence advances at the same rate);
* each engine's worker plays up to ``groups_in_flight`` groups (``rollout.groups_in_flight``) and sends
  every episode of a group at once; the engine starts a waiting sequence as soon as a row is free. With
  ``admit_by="episodes"`` (``rollout.admit_by``) the worker counts running episodes instead, so a long group's
  finished members make room for the next group at once;
* lengths are log-normal; a prompt's share of the log-variance is fixed per prompt (so a re-issued long
  prompt is long again: the length bias of re-queueing), the rest is per completion;
* a group starts on an engine that holds at least the weights it was issued at; a new version reaches the
  engines ``transfer_s`` after its step and pauses them ``pause_s`` while it is switched in;
* a training step costs ``train_overhead_s + train_s_per_token * tokens / trainer_gpus``.

Modes: ``sync`` (colocated: every GPU generates the batch, then every GPU trains on it, eta = 0),
``async`` (separate rollout and trainer pools, eta given, stale groups re-queued), and the perfect-overlap
bound (``min(generation rate, training rate)`` at full engine batches and the best split, evaluated at the
mean length of the groups the run trained; see :func:`overlap_bound`).
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from miles.actors.admission import AdmissionState, SampleOrder, issue_room, plan_batch
from miles.bus.schema import GroupsDiscarded
from miles.config import AdmitBy
from miles.tasks.base import Sample
from miles.training.intake import StalePrefix, classify, judged_version
from miles.training.lineage import VersionLineage

Mode = Literal["sync", "async"]


@dataclass(frozen=True, slots=True)
class EngineModel:
    """Continuous-batching decode cost: weights are read once a step, KV cache once per sequence."""

    max_batch: int = 48  # sequences an engine holds (KV memory bound for long contexts)
    step_base_s: float = 0.006  # one decode step at batch 1
    step_per_seq_s: float = 0.00035  # extra per sequence in the batch

    def step_s(self, batch: int) -> float:
        return self.step_base_s + self.step_per_seq_s * batch

    def full_tokens_per_s(self) -> float:
        return self.max_batch / self.step_s(self.max_batch)


@dataclass(frozen=True, slots=True)
class LengthModel:
    """Log-normal completion lengths; ``prompt_share`` of the log-variance belongs to the prompt."""

    median: float = 2000.0
    sigma: float = 1.0
    prompt_share: float = 0.5
    min_len: int = 1
    max_len: int = 32768

    def member(self, prompt_z: float, rng: random.Random) -> int:
        z = math.sqrt(self.prompt_share) * prompt_z + math.sqrt(1.0 - self.prompt_share) * rng.gauss(0.0, 1.0)
        return int(min(self.max_len, max(self.min_len, round(self.median * math.exp(self.sigma * z)))))

    def mean(self, draws: int = 20000, seed: int = 1) -> float:
        """Mean clipped length (Monte Carlo: the clip makes the closed form awkward)."""
        rng = random.Random(seed)
        return sum(self.member(rng.gauss(0.0, 1.0), rng) for _ in range(draws)) / draws


@dataclass(frozen=True, slots=True)
class FleetParams:
    """One simulated run. ``trainer_gpus`` only matters for ``async`` (sync trains on every GPU)."""

    mode: Mode = "async"
    gpus: int = 64
    trainer_gpus: int | None = None  # None: the split that maximises the overlap bound
    gpus_per_engine: int = 1
    eta: int = 2
    groups_in_flight: int | None = None  # per engine (rollout.groups_in_flight); None: max_batch // group_size
    admit_by: AdmitBy = "groups"  # rollout.admit_by: a group's room comes back when it ends, or per episode
    stale_prefix: StalePrefix = "mask"  # staleness.stale_prefix: mask a long group's old tokens, or re-queue it
    groups_per_step: int = 64
    group_size: int = 16
    steps: int = 20
    warmup_steps: int = 4  # throughput is measured from the end of this step to the end of the run
    # The run goes on past its measured steps: admission is never capped at the end, so the window is steady
    # state (else its last eta + 1 steps drain the fleet, a cost a long run pays once, not per step).
    open_ended: bool = False
    engine: EngineModel = field(default_factory=EngineModel)
    lengths: LengthModel = field(default_factory=LengthModel)
    train_s_per_token: float = 1.4e-4  # GPU-seconds per trained token (forward + backward + log-probs)
    train_overhead_s: float = 2.0  # per step: optimizer, export
    transfer_s: float = 3.0  # a version reaches the rollout engines this long after its step
    pause_s: float = 1.0  # engines stop decoding while the weights switch in
    colocated_switch_s: float = 4.0  # sync only: offload/onload engine and trainer state, per step
    dataset: int = 4096
    seed: int = 0


@dataclass(slots=True)
class Group:
    index: int
    sample_id: str
    issued_version: int
    lengths: list[int]
    version: int = -1  # weights its first member started generating with (its oldest version)
    left: int = 0  # members still generating
    engine: int = -1
    starts: list[float] = field(default_factory=list)  # per member: the engine's decode-step count at its start

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


class Engine:
    """One rollout engine: a batch of sequences that all advance one token per decode step."""

    def __init__(self, eid: int, model: EngineModel) -> None:
        self.eid, self.model = eid, model
        self.version = 0
        self.tokens = 0.0  # decode steps done since the start
        self.t_last = 0.0
        self.resume_at = 0.0
        self.active: list[tuple[float, int, Group]] = []  # (finish at self.tokens ==, tie-break, group)
        self.waiting: deque[tuple[Group, int]] = deque()  # (group, member) sent by the worker, no row yet
        self.groups = 0  # groups its worker plays (sent, not all members finished)
        self.row_s = 0.0  # integral of busy rows over decoding time (paused time is idle)
        self.epoch = 0  # invalidates scheduled completions when the batch changes
        self.switch_at: list[float] = [0.0]  # decode-step count from which each version in switch_version held
        self.switch_version: list[int] = [0]

    def switch(self, version: int) -> None:
        if version > self.version:
            self.version = version
            self.switch_at.append(self.tokens)
            self.switch_version.append(version)

    def token_versions(self, start: float, n: int) -> list[tuple[int, int]]:
        """``(version, tokens)`` of a sequence of ``n`` tokens begun at decode-step count ``start``: token ``k`` is
        sampled during step ``start + k``, by the version in force then (in-flight sequences continue under
        new weights, as the torch engine and vLLM do)."""
        out: list[tuple[int, int]] = []
        first = bisect.bisect_right(self.switch_at, start) - 1
        for i in range(first, len(self.switch_at)):
            lo = 0 if i == first else max(0, math.ceil(self.switch_at[i] - start - 1e-9))
            hi = n if i + 1 == len(self.switch_at) else min(n, math.ceil(self.switch_at[i + 1] - start - 1e-9))
            if hi > lo:
                out.append((self.switch_version[i], hi - lo))
        return out

    def advance(self, now: float) -> None:
        start = max(self.t_last, self.resume_at)
        if self.active and now > start:
            self.tokens += (now - start) / self.model.step_s(len(self.active))
            self.row_s += len(self.active) * (now - start)
        self.t_last = max(self.t_last, now)

    def next_done(self, now: float) -> float | None:
        if not self.active:
            return None
        left = max(0.0, self.active[0][0] - self.tokens)
        return max(now, self.resume_at) + left * self.model.step_s(len(self.active))

    def room(self) -> int:
        return self.model.max_batch - len(self.active)


@dataclass(slots=True)
class FleetResult:
    """What one run produced (simulated seconds)."""

    params: FleetParams
    rollout_gpus: int
    trainer_gpus: int
    sim_s: float
    window_s: float
    samples_per_s: float
    steps_per_s: float
    bound_samples_per_s: float
    staleness_mean: float
    staleness_max: int
    trained_groups: int
    requeued: int
    requeued_len_mean: float  # mean completion tokens of re-queued groups
    trained_len_mean: float
    regenerated_fraction: float  # generated tokens thrown away by re-queues / all generated tokens
    masked_fraction: float  # generated tokens kept as context but not trained (stale_prefix: mask) / all generated
    engine_fill: float  # busy rows / all rows of the rollout engines, over the run
    trainer_busy: float  # share of the run the trainer spent training
    events: int

    @property
    def fraction_of_bound(self) -> float:
        return self.samples_per_s / self.bound_samples_per_s if self.bound_samples_per_s else 0.0


def _train_s(p: FleetParams, tokens: float, trainer_gpus: int) -> float:
    return p.train_overhead_s + p.train_s_per_token * tokens / trainer_gpus


def overlap_bound(p: FleetParams, mean_len: float) -> tuple[float, int]:
    """Samples/s if generation (full engine batches, no pauses) and training overlapped perfectly, at the
    best split of the GPUs into a rollout and a trainer pool; and that split's trainer GPU count."""
    step_samples = p.groups_per_step * p.group_size
    best, best_k = 0.0, 1
    for k in range(1, p.gpus):
        engines = (p.gpus - k) // p.gpus_per_engine
        if engines < 1:
            break
        gen = engines * p.engine.full_tokens_per_s() / mean_len
        train = step_samples / _train_s(p, step_samples * mean_len, k)
        if min(gen, train) > best:
            best, best_k = min(gen, train), k
    return best, best_k


def simulate(p: FleetParams) -> FleetResult:
    """Run ``p.steps`` training steps and measure them."""
    rng = random.Random(p.seed)
    _, best_k = overlap_bound(p, p.lengths.mean(seed=p.seed + 1))  # the split is chosen before the run
    if p.mode == "sync":
        trainer_gpus, rollout_gpus, eta = p.gpus, p.gpus, 0
        transfer, pause = 0.0, p.pause_s + p.colocated_switch_s
    else:
        trainer_gpus = p.trainer_gpus or best_k
        rollout_gpus, eta = p.gpus - trainer_gpus, p.eta
        transfer, pause = p.transfer_s, p.pause_s
    engines = [Engine(i, p.engine) for i in range(max(1, rollout_gpus // p.gpus_per_engine))]
    groups_in_flight = p.groups_in_flight or max(1, p.engine.max_batch // p.group_size)
    run_steps = p.steps + eta + 1 if p.open_ended else p.steps

    samples = {f"s{i}": Sample(id=f"s{i}", prompt="", answer="") for i in range(p.dataset)}
    prompt_z = {sid: rng.gauss(0.0, 1.0) for sid in samples}
    order = SampleOrder(samples, p.seed)
    state = AdmissionState()
    lineage = VersionLineage()
    lineage.advance(0, 0)

    heap: list[tuple[float, int, str, int, int]] = []  # (time, tie, kind, engine id / version, engine epoch)
    tie = 0

    def push(t: float, kind: str, arg: int, epoch: int = 0) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(heap, (t, tie, kind, arg, epoch))

    queue: deque[Group] = deque()  # issued, not started (the prompt stream)
    done: deque[Group] = deque()  # finished, not yet pulled by the trainer
    held: dict[int, Group] = {}
    hungry: set[int] = set(range(len(engines)))  # engines that stopped pulling: the stream was empty
    stale_lags: list[int] = []
    trained_tokens = requeued_tokens = masked_tokens = 0
    requeued = 0
    generated_tokens = 0
    discard_seq = 0
    step = 0
    busy = False
    train_s = 0.0  # simulated seconds of training started
    step_end: list[float] = [0.0]
    events = 0
    seq_tie = 0

    def schedule(e: Engine, now: float) -> None:
        e.epoch += 1
        t = e.next_done(now)
        if t is not None:
            push(t, "done", e.eid, e.epoch)

    def wants(e: Engine) -> bool:
        """Whether the engine's worker takes another group (``rollout.admit_by``, :mod:`miles.actors.seats`)."""
        if p.admit_by == "groups":
            return e.groups < groups_in_flight
        return groups_in_flight * p.group_size - len(e.active) - len(e.waiting) >= p.group_size

    def fill(e: Engine, now: float) -> None:
        """The worker pulls prompt groups from the stream while it has room and the weights they need; the
        engine starts waiting sequences in free rows."""
        nonlocal seq_tie
        while queue and wants(e) and queue[0].issued_version <= e.version:
            g = queue.popleft()
            e.groups += 1
            g.left, g.engine, g.starts = len(g.lengths), e.eid, [0.0] * len(g.lengths)
            e.waiting.extend((g, m) for m in range(len(g.lengths)))
        if e.waiting and e.room() > 0:
            e.advance(now)
            while e.waiting and e.room() > 0:
                g, m = e.waiting.popleft()
                if g.version < 0:
                    g.version = e.version
                g.starts[m] = e.tokens
                seq_tie += 1
                heapq.heappush(e.active, (e.tokens + g.lengths[m], seq_tie, g))
            schedule(e, now)
        if not queue and wants(e):
            hungry.add(e.eid)

    def issue(now: float) -> None:
        room = issue_room(state, step=step, max_staleness=eta, groups_per_step=p.groups_per_step, steps=run_steps)
        if room <= 0:
            return
        batch = plan_batch(state, order, room, lineage.version)
        for i, sid in enumerate(batch.sample_ids):
            z = prompt_z[sid]
            lengths = [p.lengths.member(z, rng) for _ in range(p.group_size)]
            queue.append(Group(batch.first_index + i, sid, batch.issued_at_version, lengths))
        for eid in sorted(hungry):  # engines with room or waiting for weights wake on their own events
            if not queue:
                break
            hungry.discard(eid)
            fill(engines[eid], now)

    def collect(now: float) -> None:
        """The trainer pulls finished groups (in finishing order) until it holds a batch, then trains."""
        nonlocal busy, requeued, requeued_tokens, masked_tokens, discard_seq, train_s
        while done and len(held) < p.groups_per_step:
            g = done.popleft()
            spans = [engines[g.engine].token_versions(start, n) for start, n in zip(g.starts, g.lengths, strict=True)]
            newest = max(v for member in spans for v, _ in member)
            lag = lineage.distance(judged_version(g.version, newest, p.stale_prefix))
            verdict = classify(
                g.index, resolved=state.resolved, held=held, lag=lag, max_staleness=eta, has_trained_episodes=True
            )
            if verdict == "stale":
                discard_seq += 1
                msg = GroupsDiscarded(
                    group_ids=[f"g{g.index}"], sample_ids=[g.sample_id], requeue=True, trainer_version=lineage.version
                )
                state.fold_discard(msg, discard_seq, known=samples)
                requeued += 1
                requeued_tokens += g.tokens
                issue(now)  # its credit comes back: a replacement (the re-issued prompt) goes out
            elif verdict == "accept":
                held[g.index] = g
                # As the trainer: tokens past the bound are masked (mask mode only: else there are none).
                lags = [(lineage.distance(v), k) for member in spans for v, k in member]
                fresh = [d for d, _ in lags if d is not None and d <= eta]
                masked_tokens += sum(k for d, k in lags if d is None or d > eta)
                stale_lags.append(max(fresh, default=0))
        if len(held) == p.groups_per_step and not busy:
            busy = True
            took = _train_s(p, sum(g.tokens for g in held.values()), trainer_gpus)
            train_s += took
            push(now + took, "trained", step + 1)

    issue(0.0)
    while heap and step < p.steps:
        now, _, kind, arg, epoch = heapq.heappop(heap)
        events += 1
        if kind == "done":
            e = engines[arg]
            if epoch != e.epoch:
                continue  # the batch changed since this was scheduled
            e.advance(now)
            while e.active and e.active[0][0] <= e.tokens + 1e-6:
                _, _, g = heapq.heappop(e.active)
                g.left -= 1
                if g.left == 0:
                    e.groups -= 1
                    generated_tokens += g.tokens
                    done.append(g)
            fill(e, now)
            schedule(e, now)
            if not busy:
                collect(now)
        elif kind == "trained":
            step = arg
            lineage.advance(step, step)
            trained_tokens += sum(g.tokens for g in held.values())
            for index in held:
                state.resolved.add(index)
            held.clear()
            busy = False
            step_end.append(now)
            push(now + transfer, "weights", step)
            issue(now)
            collect(now)
        elif kind == "weights":
            for e in engines:
                e.advance(now)
                e.switch(arg)
                e.resume_at = now + pause
                fill(e, now)
                schedule(e, now)

    sim_s = step_end[-1]
    w = min(p.warmup_steps, max(0, len(step_end) - 2))
    window = step_end[-1] - step_end[w]
    measured = (len(step_end) - 1 - w) * p.groups_per_step * p.group_size
    trained_groups = len(stale_lags)
    trained_len = trained_tokens / (trained_groups * p.group_size) if trained_groups else 0.0
    # The bound at the lengths actually trained: re-queueing biases them short, so the distribution's mean
    # would understate what a perfect overlap could reach.
    bound = overlap_bound(p, trained_len)[0] if trained_len else 0.0
    return FleetResult(
        params=p,
        rollout_gpus=rollout_gpus,
        trainer_gpus=trainer_gpus,
        sim_s=sim_s,
        window_s=window,
        samples_per_s=measured / window if window > 0 else 0.0,
        steps_per_s=(len(step_end) - 1 - w) / window if window > 0 else 0.0,
        bound_samples_per_s=bound,
        staleness_mean=sum(stale_lags) / trained_groups if trained_groups else 0.0,
        staleness_max=max(stale_lags, default=0),
        trained_groups=trained_groups,
        requeued=requeued,
        requeued_len_mean=requeued_tokens / (requeued * p.group_size) if requeued else 0.0,
        trained_len_mean=trained_len,
        regenerated_fraction=requeued_tokens / generated_tokens if generated_tokens else 0.0,
        masked_fraction=masked_tokens / generated_tokens if generated_tokens else 0.0,
        engine_fill=sum(e.row_s for e in engines) / (len(engines) * p.engine.max_batch * sim_s) if sim_s else 0.0,
        trainer_busy=min(train_s, sim_s) / sim_s if sim_s else 0.0,
        events=events,
    )
