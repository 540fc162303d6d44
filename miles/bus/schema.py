"""Every message on the bus: pydantic models encoded as msgpack maps with a schema version.

Wire form: a msgpack map ``{"schema": SCHEMA_VERSION, "kind": "<kind>", ...fields}``. The ``kind``
tag lets a consumer reject a message of the wrong type on its subject; ``schema`` lets it reject a
producer from an incompatible release. Both failures raise :class:`SchemaError`, which consumers
turn into a dead-letter entry (:meth:`miles.bus.client.Bus.refuse`), never a crash.
docs/protocol.md is the language-neutral description of these models.
"""

from __future__ import annotations

import math
import time
from functools import cached_property
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from miles.config_base import REGISTERED_NAME

SCHEMA_VERSION = 2
# What changed at each version, for the dead-letter reason of a message from an older producer.
SCHEMA_CHANGES = {
    1: "schema 1 is single-turn: trajectories without loss masks, turns or end reasons, prompt groups without "
    "sample metadata; upgrade that producer (docs/protocol.md, 'Schema versions')",
}
MAX_SAFE_INT = 2**53  # versions, steps and counts stay exact in every msgpack implementation, JSON included

EndReason = Literal["done", "max_turns", "timeout", "context_full", "env_error", "infra_error"]
EpisodeStatus = Literal["ok", "reward_failed", "infra_error"]


class SchemaError(ValueError):
    """A payload that is not a valid message of the expected kind and schema version."""


class Message(BaseModel):
    """Base of all bus messages; subclasses set ``KIND``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    KIND: ClassVar[str] = ""


M = TypeVar("M", bound=Message)

Version = Annotated[int, Field(ge=-1, lt=MAX_SAFE_INT)]
Count = Annotated[int, Field(ge=0, lt=MAX_SAFE_INT)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


# --------------------------------------------------------------------------- work items


class PromptGroup(Message):
    """One prompt to be sampled ``group_size`` times (a GRPO group). Subject ``<run>.prompts``."""

    KIND: ClassVar[str] = "prompt_group"
    group_id: str = Field(pattern=r"^g[0-9]+$", description="'g<issue_index>': unique per issue.")
    sample_id: str
    prompt: str = Field(description="The sample's prompt (a task's first user message, or raw text).")
    answer: str = Field(description="Reference answer for the reward ('' when the task has none).")
    meta: dict[str, Any] = Field(
        default_factory=dict, description="The sample's other fields, as the task's reward receives them."
    )
    group_size: int = Field(ge=1, le=4096)
    issue_index: Count = Field(description="Controller's running count of issued groups, from 0.")
    issued_at_version: Version = Field(description="Trainer version when issued; a worker generates with >= this.")
    attempt: Count = Field(0, description="0 for a first issue, n for the n-th re-issue of a discarded group.")

    @model_validator(mode="after")
    def _check_id(self) -> PromptGroup:
        if self.group_id != f"g{self.issue_index}":
            raise ValueError(f"group_id {self.group_id!r} is not 'g<issue_index>' (issue_index {self.issue_index})")
        return self


class Episode(Message):
    """One sampled episode of a group: exactly the tokens the engine sampled, and those the environment added.

    ``token_ids`` is everything after ``prompt_ids``; ``loss_mask[i]`` is 1 where ``token_ids[i]`` was sampled
    by the model and is trained on, 0 on tokens the environment or the chat template added. ``turns`` are
    ``[start, end, role]`` spans of ``token_ids`` (role ``model`` or ``env``), contiguous from 0 to the end;
    the mask is 0 on every env turn. ``logprobs[i]`` is the behaviour log-prob of a model token (0.0 on env
    tokens). ``version_spans`` (``[start, version]`` pairs over ``token_ids``) give the policy version in force
    from model token ``start`` on; ``weight_version`` is the first span's (the oldest).
    """

    KIND: ClassVar[str] = "episode"
    prompt_ids: list[TokenId] = Field(min_length=1)
    token_ids: list[TokenId]
    loss_mask: list[int]
    logprobs: list[float]
    turns: list[tuple[int, int, Literal["model", "env"]]]
    weight_version: Version
    version_spans: list[tuple[int, int]] = Field(default_factory=list)
    reward: float | None = Field(description="None unless status is ok.")
    status: EpisodeStatus = Field(
        description="ok: trained; reward_failed: the reward raised or was not finite; infra_error: the "
        "infrastructure failed (sandbox, verifier). Anything but ok is excluded from its group's advantages."
    )
    end_reason: EndReason
    truncated: bool = Field(False, description="The last model turn hit max_new_tokens.")
    error: str = Field("", max_length=2000, description="Why status is not ok (one line).")
    stats: dict[str, float] = Field(
        default_factory=dict, description="Counters: turns, tool_calls, parse_errors, env_s, gen_s, ..."
    )

    @model_validator(mode="after")
    def _check(self) -> Episode:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(f"{n} tokens but {len(self.loss_mask)} mask entries and {len(self.logprobs)} logprobs")
        if not set(self.loss_mask) <= {0, 1}:  # set() and sum()/max() below run in C: validation is per token
            raise ValueError("loss_mask entries must be 0 or 1")
        position = 0
        for start, end, role in self.turns:
            if start != position or end < start:
                raise ValueError("turns must be contiguous [start, end, role] spans from 0")
            if role == "env" and any(self.loss_mask[start:end]):
                raise ValueError("loss_mask must be 0 on environment turns")
            position = end
        if position != n:
            raise ValueError(f"turns cover {position} of {n} tokens")
        lps = self.logprobs
        if lps and not (math.isfinite(sum(lps)) and max(lps) <= 1e-4):  # all fine (a finite sum: no nan, no inf)
            for i, (lp, m) in enumerate(zip(lps, self.loss_mask, strict=True)):  # or not: which one
                if m and not (math.isfinite(lp) and lp <= 1e-4):
                    raise ValueError(f"logprobs[{i}] = {lp} is not a finite log-probability")
        if (self.status == "ok") != (self.reward is not None) or (
            self.reward is not None and not math.isfinite(self.reward)
        ):
            raise ValueError("reward must be a finite number exactly when status is ok")
        spans = self.version_spans
        if spans:
            if spans[0] != (0, self.weight_version):
                raise ValueError("version_spans must start with [0, weight_version]")
            for (start, version), (nxt, nxt_version) in zip(spans, spans[1:]):
                if nxt <= start or nxt_version < version:
                    raise ValueError("version_spans must have increasing starts and non-decreasing versions")
            if spans[-1][0] >= max(n, 1) or any(not (-1 <= v < MAX_SAFE_INT) for _, v in spans):
                raise ValueError("version_spans out of range")
        return self

    @property
    def spans(self) -> list[tuple[int, int]]:
        """``(start, version)`` per span, the default single span included."""
        return list(self.version_spans) or [(0, self.weight_version)]

    @cached_property  # messages are frozen: computed once (the trainer asks per trajectory, per step)
    def oldest_version(self) -> int:
        return min(version for _, version in self.spans)

    @cached_property
    def newest_version(self) -> int:
        return max(version for _, version in self.spans)

    @property
    def trained(self) -> bool:
        return self.status == "ok"

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    def token_versions(self) -> list[int]:
        """The policy version in force at each token (environment tokens take the span they fall in)."""
        out: list[int] = []
        spans = self.spans
        for (start, version), (end, _) in zip(spans, [*spans[1:], (len(self.token_ids), 0)]):
            out.extend([version] * (end - start))
        return out


class Trajectory(Message):
    """The scored episodes of one prompt group. Subject ``<run>.traj``."""

    KIND: ClassVar[str] = "trajectory"
    group_id: str = Field(pattern=r"^g[0-9]+$")
    sample_id: str
    worker_id: str
    episodes: list[Episode] = Field(min_length=1)
    issued_at_version: Version
    gen_s: float = Field(ge=0, description="Wall time the worker spent on this group's episodes.")
    ticket: bytes = Field(
        b"",
        description="The prompt group this answers, byte for byte as the controller published it (optional; "
        "required when the run signs: the trainer checks the controller's signature over it).",
    )
    ticket_signature: str = Field(
        "", description="The Miles-Signature header the prompt group was published with ('' when unsigned)."
    )

    @cached_property  # messages are frozen: computed once
    def trained_episodes(self) -> tuple[Episode, ...]:
        return tuple(e for e in self.episodes if e.trained)

    @cached_property
    def oldest_version(self) -> int:
        """The oldest policy version behind any trained token (any token when nothing is trained)."""
        episodes = self.trained_episodes or self.episodes
        return min(e.oldest_version for e in episodes)

    @cached_property
    def newest_version(self) -> int:
        """The newest policy version behind any trained token (any token when nothing is trained)."""
        episodes = self.trained_episodes or self.episodes
        return max(e.newest_version for e in episodes)

    @property
    def num_model_tokens(self) -> int:
        """Tokens the engine sampled for this group, over every episode (trained or not)."""
        return sum(e.num_model_tokens for e in self.episodes)

    @property
    def num_tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.episodes)

    @property
    def issue_index(self) -> int:
        return int(self.group_id[1:])


class EvalTask(Message):
    """A shard of a held-out evaluation. Subject ``<run>.evalq`` (work queue): any rollout worker takes it,
    waits until it holds at least ``version``, and evaluates greedily at one version (pinned)."""

    KIND: ClassVar[str] = "eval_task"
    eval_id: str
    version: Version = Field(description="Evaluate with this version or, if the worker holds a newer one, that.")
    shard: Count
    shards: int = Field(ge=1)
    samples: list[dict[str, Any]] = Field(description="{sample_id, prompt, answer, meta} per held-out sample.")
    max_new_tokens: int = Field(ge=1)
    claim: str = Field(
        "", max_length=64, description="The shard's claim token: its result counts only if it carries it back."
    )


class EvalShardResult(Message):
    """A worker's result for one :class:`EvalTask`. Subject ``<run>.events.eval_results``."""

    KIND: ClassVar[str] = "eval_shard_result"
    eval_id: str
    shard: Count
    worker_id: str
    version: Version = Field(description="The version the shard was evaluated at.")
    samples: Count
    reward_sum: FiniteFloat
    failed: Count = Field(0, description="Samples whose reward failed (scored 0, counted here).")
    tokens: Count = Field(0, description="Completion tokens generated.")
    claim: str = Field("", max_length=64, description="The claim token of the EvalTask this answers.")


# --------------------------------------------------------------------------- events


class WeightsAnnounced(Message):
    """New policy weights are in the data plane. Subject ``<run>.events.weights``."""

    KIND: ClassVar[str] = "weights_announced"
    version: Version = Field(description="Unique per set of weights: never reused, even after a trainer restart.")
    step: Count = Field(
        0,
        description="Rollout batches trained into these weights along their lineage (== version until a trainer "
        "restart supersedes versions published after its checkpoint).",
    )
    consumed: list[Count] = Field(
        default_factory=list,
        description="Stream sequences in <run>_TRAJ of the trajectories trained into this version (its step's "
        "batch): what a restarted trainer replays if this version is lost.",
    )
    replayed: bool = Field(False, description="The step re-trained, after a restart, a lost version's batch.")
    digest: str = Field(description="xxh3-128 hex of the payload bytes; verified before apply.")
    size: Count
    chunks: Count
    mode: Literal["full", "delta", "lora"] = Field(
        "full",
        description="full: the whole weight set; delta: changes against base_version; lora: only the LoRA adapter "
        "tensors, applied on the frozen base every worker already holds (docs/weight-sync.md).",
    )
    base_version: Version | None = Field(
        None, description="Delta mode: the version the delta applies to (None for a full payload)."
    )
    format: Literal["safetensors", "miles-delta"] = Field(
        "safetensors", description="safetensors for full payloads, miles-delta (miles/sync/delta.py) for deltas."
    )
    dtype: str = "bfloat16"
    published_at: float = Field(default_factory=time.time)
    state_digest: str = Field(
        "",
        description="miles.sync.precision.state_digest of the rollout-precision state this version stands for "
        "(the adapter state in LoRA mode), whatever the mode; empty from producers that predate it.",
    )
    precision: str = Field(
        "bfloat16", description="Rollout precision (sync.dtype): bfloat16, float32, fp8_e4m3 or fp4_e2m1."
    )
    transport: str = Field(
        "bus",
        pattern=REGISTERED_NAME,
        description="Where the payload is, a registered transport name: 'bus' (the data plane streams), 'fs' (the "
        "directory 'location' under the run's shared weights directory), 'broadcast' (already received by the "
        "weight-update group 'location'; readers outside the group wait for a bus announcement of a newer "
        "version). A worker fetches from the transport of that name, or refuses the version if it reads none.",
    )
    location: str = Field("", description="fs: the version's directory name; broadcast: the group's name.")
    payload_sha256: str = Field(
        "", description="SHA-256 hex of the payload (bus.payload_sha256; '' when not computed), docs/security.md."
    )

    @model_validator(mode="after")
    def _check_mode(self) -> WeightsAnnounced:
        if self.mode == "delta":
            if self.base_version is None or self.base_version >= self.version:
                raise ValueError("a delta announcement needs base_version < version")
            if self.format != "miles-delta":
                raise ValueError("a delta announcement has format 'miles-delta'")
        elif self.base_version is not None or self.format != "safetensors":
            raise ValueError("a full announcement has no base_version and format 'safetensors'")
        return self


class WeightsHeld(Message):
    """A rollout worker's engine adopted a version. Subject ``<run>.events.weights_held``.

    The controller compares ``state_digest`` with the announced one to catch a worker whose weights
    differ from what the trainer published (a bad reconstruction, a lossy engine load).
    """

    KIND: ClassVar[str] = "weights_held"
    worker_id: str
    version: Version
    state_digest: str = Field(description="state_digest of the rollout-precision state the worker holds.")
    mode: str = Field(description="How the worker got it: the announcement's mode (full, delta, ...).")
    fetch_bytes: Count = Field(0, description="Bytes downloaded to reach this version.")
    pause_s: FiniteFloat = Field(0.0, ge=0, description="Generation pause the switch cost, in seconds.")


class Heartbeat(Message):
    """Liveness and state of one actor. Subject ``<run>.hb.<role>.<actor_id>`` (core NATS)."""

    KIND: ClassVar[str] = "heartbeat"
    role: str
    actor_id: str
    version: Version = Field(-1, description="Policy version the actor holds (-1: none).")
    state: str = "running"
    stats: dict[str, float] = Field(default_factory=dict)
    ts: FiniteFloat = Field(default_factory=time.time)


class GroupsDiscarded(Message):
    """Groups the trainer will not train (stale, no signal, invalid). Subject ``<run>.events.discarded``."""

    KIND: ClassVar[str] = "groups_discarded"
    group_ids: list[Annotated[str, Field(pattern=r"^g[0-9]+$")]]
    sample_ids: list[str]
    requeue: bool = Field(description="True: the controller re-issues these prompts; False: dropped.")
    trainer_version: Version
    reason: Literal["stale", "no_signal", "infra", "filtered", "invalid"] = Field(
        "stale",
        description="stale: older than the staleness bound; no_signal: no episode of the group can be trained "
        "(every one failed or was infra-excluded); filtered: the group filter (DAPO dynamic sampling) left it "
        "out (its rewards do not differ); invalid: the trainer refused the group's trajectory (tokens "
        "outside the vocabulary, a version never published: docs/security.md), so the group is issued again.",
    )
    model_tokens: Count = Field(
        0, description="Tokens the engine sampled for these groups (generation thrown away, or redone if re-queued)."
    )

    @model_validator(mode="after")
    def _check(self) -> GroupsDiscarded:
        if len(self.group_ids) != len(self.sample_ids):
            raise ValueError(f"{len(self.group_ids)} group_ids but {len(self.sample_ids)} sample_ids")
        return self


class Control(Message):
    """Run-wide commands. Subject ``<run>.events.control``."""

    KIND: ClassVar[str] = "control"
    command: Literal["stop"]
    reason: str = ""
    run_instance: str = Field(
        "", description="The run instance it is for (state bucket key run_instance); any other is not obeyed."
    )


# --------------------------------------------------------------------------- metrics


class StepMetrics(Message):
    """One optimizer step. Subject ``<run>.metrics.step``."""

    KIND: ClassVar[str] = "step_metrics"
    step: Count = Field(description="The step's index along the surviving lineage (0-based).")
    policy_version: Version = Field(description="The version these weights were published as.")
    metrics: dict[str, float]
    trained_group_ids: list[Annotated[str, Field(pattern=r"^g[0-9]+$")]]
    staleness: list[Count] = Field(
        description="Per trained group: optimizer-step distance between the weights that generated its oldest "
        "token and the weights it was trained into."
    )
    replayed: bool = Field(False, description="Re-trained after a restart (the lost version's batch).")

    @model_validator(mode="after")
    def _check(self) -> StepMetrics:
        if len(self.staleness) != len(self.trained_group_ids):
            raise ValueError("one staleness entry per trained group")
        return self


class EvalResult(Message):
    """Held-out accuracy of the published policy. Subject ``<run>.metrics.eval``."""

    KIND: ClassVar[str] = "eval_result"
    policy_version: Version = Field(description="The version evaluated (>= requested_version).")
    accuracy: float = Field(description="Mean reward of greedy episodes (the accuracy, for 0/1 rewards); finite.")
    samples: Count
    requested_version: Version = Field(-1, description="The version the evaluation was issued for.")
    eval_id: str = ""
    failed: Count = 0
    tokens: Count = Field(0, description="Completion tokens the evaluation generated (length = tokens / samples).")

    @model_validator(mode="after")
    def _finite(self) -> EvalResult:
        if not math.isfinite(self.accuracy):
            raise ValueError("accuracy must be finite")
        return self


class GroupsIssued(Message):
    """The controller's issue record: the prompt groups it is about to publish, and its admission state once they
    are out. Subject ``<run>.metrics.issued``, published (durably) *before* the prompts, so the run's record and
    a restarted controller's state are rebuilt from the streams: a restart publishes the last batch again with
    the same contents (the prompt stream drops a copy it holds by message id, the group id) and never gives a
    group id to another prompt."""

    KIND: ClassVar[str] = "groups_issued"
    first_index: Count = Field(description="Issue index of the first group (its id is 'g<first_index>').")
    sample_ids: list[str] = Field(description="Per group, in issue order: the sample it plays.")
    attempts: list[Count] = Field(description="Per group: 0 for a first issue, n for the n-th re-issue.")
    issued_at_version: Version = Field(description="Trainer version the batch is issued at.")
    cursor: Count = Field(description="Position in the shuffled train samples after this batch.")
    reissue: list[str] = Field(default_factory=list, description="Sample ids still waiting to be issued again.")
    reissue_attempts: dict[str, Count] = Field(default_factory=dict, description="Their re-issues so far.")
    discards_seq: Count = Field(0, description="EVENTS sequence of the last discard folded into this state.")

    @model_validator(mode="after")
    def _check(self) -> GroupsIssued:
        if len(self.sample_ids) != len(self.attempts) or not self.sample_ids:
            raise ValueError(f"{len(self.sample_ids)} sample_ids but {len(self.attempts)} attempts (at least one)")
        return self

    @property
    def group_ids(self) -> list[str]:
        return [f"g{self.first_index + i}" for i in range(len(self.sample_ids))]

    @property
    def end_index(self) -> int:
        """Groups issued once this batch is out."""
        return self.first_index + len(self.sample_ids)


class TrainerDone(Message):
    """The trainer finished all steps (after the final eval). Subject ``<run>.metrics.done``."""

    KIND: ClassVar[str] = "trainer_done"
    policy_version: Version
    steps: Count


# --------------------------------------------------------------------------- the controller's snapshot


class _Part(BaseModel):
    """A part of a snapshot (not a message of its own). Integer-keyed maps travel as pairs: msgpack maps on
    the bus have string keys only."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class AdmissionPart(_Part):
    issued: Count
    discarded: Count
    cursor: Count
    reissue: list[str]
    reissue_attempts: dict[str, Count]
    resolved_floor: Count = Field(description="Issue indices below this are trained or discarded ...")
    resolved_above: list[Count] = Field(description="... and these above it.")
    discards_seq: Count


class AuditPart(_Part):
    announced: list[tuple[Version, list[str]]] = Field(description="Version -> digests announced for it.")
    held: list[WeightsHeld] = Field(description="Reports waiting for their announcement, oldest first.")
    verified: Count
    mismatches: Count
    unverifiable: Count
    last_verified: dict[str, Version]
    recent_mismatches: list[tuple[str, Version, list[str], str]] = Field(
        description="(worker, version, expected digests, got), oldest first."
    )


class EvaluationPart(_Part):
    eval_id: str
    version: Version
    sizes: list[Count] = Field(description="Samples per shard, as issued.")
    results: list[EvalShardResult] = Field(description="Shard results counted (while the evaluation is open).")
    counted: list[Count] = Field(description="Shards counted (of a completed evaluation, whose results are gone).")
    reissued: list[tuple[Count, Count]] = Field(description="Shard -> times issued again after a refused result.")
    result: EvalResult | None = Field(description="Its result, once complete.")


class StepTotalsPart(_Part):
    """The totals over the step reports (:class:`miles.actors.step_totals.StepTotals`)."""

    steps_floor: Count = Field(description="Steps below this are counted ...")
    steps_above: list[Count] = Field(description="... and these above it.")
    staleness: list[tuple[Count, Count]] = Field(description="Staleness -> trained groups.")
    sums: dict[str, float] = Field(description="Counting metrics summed over the steps (samples, episodes, ...).")
    replayed: Count = Field(description="Reports of a counted step sent again after a trainer restart.")


class RecordPart(_Part):
    evals: list[tuple[Count, float, float, Version]] = Field(
        description="(step, accuracy, mean completion tokens, requested version) per recorded evaluation."
    )
    steps: StepTotalsPart
    dropped: Count
    requeued: Count
    discard_reasons: dict[str, Count]
    discarded_tokens: dict[str, Count]
    groups_issued: Count
    file_sizes: dict[str, Count] = Field(description="Bytes of metrics.jsonl, evals.jsonl, groups.jsonl at the cut.")


class ControllerSnapshot(Message):
    """The controller's state as the fold of EVENTS and METRICS up to ``positions``. Subject
    ``<run>.snapshot.controller``, every ``bus.snapshot_every_steps`` steps: a restarted controller reads the newest
    one and replays only what was stored after it, so its restart costs the same at any run length and nothing
    older than the snapshot need be kept (docs/architecture.md, "Controller snapshots")."""

    KIND: ClassVar[str] = "controller_snapshot"
    positions: dict[str, Count] = Field(
        description="Per subject of EVENTS (weights, discarded, weights_held, eval_results) and for METRICS: the "
        "sequence of the last message folded in."
    )
    admission: AdmissionPart
    last_batch: GroupsIssued | None = Field(description="The newest issue record (published again at a restart).")
    trainer_version: Version
    trainer_step: Count
    version_steps: list[tuple[Version, Count]] = Field(description="Announced version -> its step, oldest first.")
    sync_bytes: dict[str, dict[str, Count]] = Field(description="Per sync mode: versions, bytes and max announced.")
    audit: AuditPart
    evaluations: list[EvaluationPart]
    due_evals: list[Version] = Field(description="Versions whose evaluation is due and not complete.")
    trainer_done: TrainerDone | None
    refused: dict[str, Count] = Field(description="The controller's refusals by category ...")
    dead_lettered: Count = Field(description="... and in all.")
    record: RecordPart


# --------------------------------------------------------------------------- teacher scoring (distillation)


class TeacherSequence(BaseModel):
    """One sequence to score: the teacher returns the log-prob of every ``token_ids[i]`` given everything before."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    prompt_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(min_length=1, max_length=1 << 20)
    token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(max_length=1 << 20)


class TeacherScoreRequest(Message):
    """Trainer leader -> any teacher actor (core request/reply, queue group ``teachers``). Subject
    ``<run>.teacher.score``."""

    KIND: ClassVar[str] = "teacher_score_request"
    request_id: str = Field(min_length=1, max_length=128)
    sequences: list[TeacherSequence] = Field(min_length=1, max_length=4096)
    temperature: float = Field(1.0, gt=0, le=100, description="Log-probs of softmax(logits / temperature).")


class TeacherScoreReply(Message):
    """A teacher's answer: one list of log-probs per requested sequence (same lengths), or ``error``."""

    KIND: ClassVar[str] = "teacher_score_reply"
    request_id: str = Field(max_length=128)
    teacher_id: str = Field(max_length=256)
    logprobs: list[list[float]] = Field(default_factory=list, max_length=4096)
    error: str = Field("", max_length=2000, description="Why nothing was scored (one line); empty on success.")

    @model_validator(mode="after")
    def _check(self) -> TeacherScoreReply:
        if self.error and self.logprobs:
            raise ValueError("a reply carries either log-probs or an error")
        for i, row in enumerate(self.logprobs):
            if any(not (math.isfinite(x) and x <= 1e-4) for x in row):
                raise ValueError(f"logprobs[{i}] holds a value that is not a finite log-probability")
        return self


KINDS: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        PromptGroup,
        Trajectory,
        EvalTask,
        EvalShardResult,
        WeightsAnnounced,
        WeightsHeld,
        Heartbeat,
        GroupsDiscarded,
        Control,
        StepMetrics,
        EvalResult,
        GroupsIssued,
        TrainerDone,
        TeacherScoreRequest,
        TeacherScoreReply,
        ControllerSnapshot,
    )
}


def encode(msg: Message) -> bytes:
    """Serialise a message to its msgpack wire form."""
    body: dict[str, Any] = msg.model_dump(mode="python")
    body["schema"] = SCHEMA_VERSION
    body["kind"] = msg.KIND
    return msgpack.packb(body, use_bin_type=True)


def decode_any(data: bytes | None) -> Message:
    """Decode a message of any known kind; raises :class:`SchemaError` on anything else (an empty payload,
    which nats-py hands over as ``None`` from a stored-message read, included)."""
    if not data:
        raise SchemaError("empty payload")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise SchemaError(f"not msgpack: {exc.__class__.__name__}") from None
    if not isinstance(body, dict):
        raise SchemaError(f"not a msgpack map but {type(body).__name__}")
    schema = body.pop("schema", None)
    if schema != SCHEMA_VERSION:
        why = SCHEMA_CHANGES.get(schema) if isinstance(schema, int) else None
        raise SchemaError(f"schema version {schema!r} (expected {SCHEMA_VERSION})" + (f": {why}" if why else ""))
    kind = body.pop("kind", None)
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise SchemaError(f"unknown kind {kind!r}")
    try:
        return cls.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise SchemaError(f"{kind}: {loc}: {first['msg']}") from None


def decode(data: bytes | None, cls: type[M]) -> M:
    """Decode a message that must be of kind ``cls``; raises :class:`SchemaError` otherwise."""
    msg = decode_any(data)
    if not isinstance(msg, cls):
        raise SchemaError(f"expected kind {cls.KIND!r}, got {msg.KIND!r}")
    return msg
