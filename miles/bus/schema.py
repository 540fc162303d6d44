"""Every message on the bus: pydantic models encoded as msgpack maps with a schema version.

Wire form: a msgpack map ``{"schema": SCHEMA_VERSION, "kind": "<kind>", ...fields}``. The ``kind``
tag lets a consumer reject a message of the wrong type on its subject; ``schema`` lets it reject a
producer from an incompatible release. Both failures raise :class:`SchemaError`, which consumers
turn into a dead-letter entry (see :mod:`miles.bus.deadletter`), never a crash.
docs/protocol.md is the language-neutral description of these models.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SCHEMA_VERSION = 1


class SchemaError(ValueError):
    """A payload that is not a valid message of the expected kind and schema version."""


class Message(BaseModel):
    """Base of all bus messages; subclasses set ``KIND``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    KIND: ClassVar[str] = ""


M = TypeVar("M", bound=Message)


# --------------------------------------------------------------------------- work items


class PromptGroup(Message):
    """One prompt to be sampled ``group_size`` times (a GRPO group). Subject ``<run>.prompts``."""

    KIND: ClassVar[str] = "prompt_group"
    group_id: str = Field(description="Unique per issue: '<sample_id>#<attempt>'.")
    sample_id: str
    prompt: str
    answer: str
    group_size: int
    issue_index: int = Field(description="Controller's running count of issued groups, from 0.")
    issued_at_version: int = Field(description="Trainer version when issued; a worker generates with >= this.")
    attempt: int = Field(0, description="0 for a first issue, 1 for a re-issue of a discarded group's prompt.")


class Completion(Message):
    KIND: ClassVar[str] = "completion"
    output_ids: list[int]
    logprobs: list[float] = Field(description="Behaviour log-prob per output token.")
    reward: float
    finish_reason: str
    weight_version: int = Field(description="Policy version that generated the first (oldest) output token.")
    version_spans: list[list[int]] = Field(
        default_factory=list,
        description="[start_index, version] pairs, increasing: the version in force from output token start_index "
        "on (weights switched mid-generation). Empty: one span, every token at weight_version.",
    )

    @model_validator(mode="after")
    def _check_spans(self) -> Completion:
        spans = self.version_spans
        if not spans:
            return self
        if any(len(s) != 2 for s in spans):
            raise ValueError("version_spans entries must be [start_index, version] pairs")
        if spans[0] != [0, self.weight_version]:
            raise ValueError("version_spans must start with [0, weight_version]")
        for (start, version), (nxt, nxt_version) in zip(spans, spans[1:]):
            if nxt <= start or nxt_version < version:
                raise ValueError("version_spans must have increasing starts and non-decreasing versions")
        if spans[-1][0] >= max(len(self.output_ids), 1):
            raise ValueError("version_spans start past the last output token")
        return self

    @property
    def spans(self) -> list[tuple[int, int]]:
        """``(start_index, version)`` per span, the default single span included."""
        if not self.version_spans:
            return [(0, self.weight_version)]
        return [(int(start), int(version)) for start, version in self.version_spans]

    @property
    def oldest_version(self) -> int:
        return min(version for _, version in self.spans)

    def token_versions(self) -> list[int]:
        """The policy version that sampled each output token."""
        out: list[int] = []
        spans = self.spans
        for (start, version), (end, _) in zip(spans, [*spans[1:], (len(self.output_ids), 0)]):
            out.extend([version] * (end - start))
        return out


class Trajectory(Message):
    """A scored group of completions. Subject ``<run>.traj``."""

    KIND: ClassVar[str] = "trajectory"
    group_id: str
    sample_id: str
    worker_id: str
    prompt_ids: list[int]
    completions: list[Completion]
    issued_at_version: int
    gen_s: float = Field(description="Wall time the worker spent generating this group's batch.")

    @property
    def oldest_version(self) -> int:
        """The oldest policy version behind any token of any completion (min over all version spans)."""
        return min(c.oldest_version for c in self.completions)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.completions)


# --------------------------------------------------------------------------- events


class WeightsAnnounced(Message):
    """New policy weights are in the data plane. Subject ``<run>.events.weights``."""

    KIND: ClassVar[str] = "weights_announced"
    version: int
    digest: str = Field(description="xxh3-128 hex of the payload bytes; verified before apply.")
    size: int
    chunks: int
    mode: Literal["full", "delta", "lora"] = Field(
        "full",
        description="full: the whole weight set; delta: changes against base_version; lora: only the LoRA adapter "
        "tensors, applied on the frozen base every worker already holds (docs/weight-sync.md).",
    )
    base_version: int | None = Field(
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
    version: int
    state_digest: str = Field(description="state_digest of the rollout-precision state the worker holds.")
    mode: str = Field(description="How the worker got it: the announcement's mode (full, delta, ...).")
    fetch_bytes: int = Field(0, description="Bytes downloaded to reach this version.")
    pause_s: float = Field(0.0, description="Generation pause the switch cost, in seconds.")


class Heartbeat(Message):
    """Liveness and state of one actor. Subject ``<run>.events.heartbeat.<role>.<actor_id>``."""

    KIND: ClassVar[str] = "heartbeat"
    role: str
    actor_id: str
    version: int = Field(-1, description="Policy version the actor holds (-1: none).")
    state: str = "running"
    stats: dict[str, float] = Field(default_factory=dict)
    ts: float = Field(default_factory=time.time)


class GroupsDiscarded(Message):
    """Trainer rejected groups as too stale. Subject ``<run>.events.discarded``."""

    KIND: ClassVar[str] = "groups_discarded"
    group_ids: list[str]
    sample_ids: list[str]
    requeue: bool = Field(description="True: the controller re-issues these prompts; False: dropped.")
    trainer_version: int


class Control(Message):
    """Run-wide commands. Subject ``<run>.events.control``."""

    KIND: ClassVar[str] = "control"
    command: Literal["stop"]
    reason: str = ""


# --------------------------------------------------------------------------- metrics


class StepMetrics(Message):
    """One optimizer step. Subject ``<run>.metrics.step``."""

    KIND: ClassVar[str] = "step_metrics"
    step: int
    policy_version: int
    metrics: dict[str, float]
    trained_group_ids: list[str]
    staleness: list[int] = Field(description="Per trained group: trainer version minus its oldest token version.")


class EvalResult(Message):
    """Held-out accuracy of the published policy. Subject ``<run>.metrics.eval``."""

    KIND: ClassVar[str] = "eval_result"
    policy_version: int
    accuracy: float
    samples: int


class TrainerDone(Message):
    """The trainer finished all steps (after the final eval). Subject ``<run>.metrics.done``."""

    KIND: ClassVar[str] = "trainer_done"
    policy_version: int
    steps: int


KINDS: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        PromptGroup,
        Trajectory,
        WeightsAnnounced,
        WeightsHeld,
        Heartbeat,
        GroupsDiscarded,
        Control,
        StepMetrics,
        EvalResult,
        TrainerDone,
    )
}


def encode(msg: Message) -> bytes:
    """Serialise a message to its msgpack wire form."""
    body: dict[str, Any] = msg.model_dump(mode="python")
    body["schema"] = SCHEMA_VERSION
    body["kind"] = msg.KIND
    return msgpack.packb(body, use_bin_type=True)


def decode_any(data: bytes) -> Message:
    """Decode a message of any known kind; raises :class:`SchemaError` on anything else."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise SchemaError(f"not msgpack: {exc.__class__.__name__}") from None
    if not isinstance(body, dict):
        raise SchemaError(f"not a msgpack map but {type(body).__name__}")
    schema = body.pop("schema", None)
    if schema != SCHEMA_VERSION:
        raise SchemaError(f"schema version {schema!r} (expected {SCHEMA_VERSION})")
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


def decode(data: bytes, cls: type[M]) -> M:
    """Decode a message that must be of kind ``cls``; raises :class:`SchemaError` otherwise."""
    msg = decode_any(data)
    if not isinstance(msg, cls):
        raise SchemaError(f"expected kind {cls.KIND!r}, got {msg.KIND!r}")
    return msg
