"""Run info: everything a worker needs to join a run besides the NATS URL, its credentials and the run name.

The controller writes it once, at its first start, into the key-value bucket ``<run>_RUNINFO``: the run
instance's nonce, the task's identity and reward, the sampling parameters, episode limits and group size,
how weights are synced, and the model's tokenizer and architecture files (``tokenizer.json``,
``config.json``, ...). A rollout worker (the project's, or one written from docs/protocol.md) reads it
before it generates anything; the project's worker refuses to start when its own recipe disagrees.

Layout in the bucket (docs/protocol.md, "Run info", is the language-neutral description)::

    files/<name>/<i>   chunk i of file <name>, FILE_CHUNK_BYTES each (the last one shorter); written first
    run                the RunInfo message (msgpack map, kind run_info); written last: the commit marker

Why a key-value bucket with chunked files rather than a JetStream object store: reading an object with
nats-py creates an ephemeral ordered consumer, and under per-role identities no actor may create consumers
(docs/security.md: a consumer's creator can make the server publish on its behalf). A KV read is a direct
get by key, which every reader already has, and files of a few MB (a 150k-token ``tokenizer.json`` is
about 11 MB) need only a handful of chunks. Chunks of 512 KiB fit under the 1 MiB ``max_payload`` of a
default nats-server; a file's SHA-256 (over its bytes) is checked by every reader.

Written once: the ``run`` key is created (never overwritten), so two controllers racing cannot both win,
and a restarted controller finds its own run info and keeps it (same nonce). A run info that describes
another task, model or sampling set-up than the restarted controller's config is an error: that is a new
run under an old name, and workers would follow the stale one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import msgpack
from nats.js import JetStreamContext
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from miles.bus.errors import BusError
from miles.bus.schema import SCHEMA_VERSION, Count, Message, SchemaError, encode
from miles.config_base import REGISTERED_NAME
from miles.models.tokenizer_facts import TOKENIZER_FILES, tokenizer_facts
from miles.plugins import is_import_path

RUN_KEY = "run"
FILE_CHUNK_BYTES = 512 * 1024
MAX_FILE_BYTES = 64 * 1024 * 1024  # a tokenizer or model config, not weights
# Tokenizer (TOKENIZER_FILES) and architecture files published when the model directory has them.
MODEL_FILES = ("config.json", "generation_config.json")


class RunInfoError(BusError):
    """Run info that is missing, malformed, or does not match this process's config; one line says why."""


def file_key(name: str, index: int) -> str:
    """KV key of chunk ``index`` of file ``name``."""
    return f"files/{name}/{index}"


def new_run_nonce() -> str:
    """128 random bits as 32 lower-case hex characters: the id of one run instance."""
    return secrets.token_hex(16)


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunFile(_Part):
    """A file stored in the bucket, chunked under ``files/<name>/<i>``."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=200)
    size: Count = Field(description="Bytes.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 hex of the file's bytes.")
    chunks: Count = Field(description="ceil(size / 524288) keys, 0 for an empty file.")


class TaskInfo(_Part):
    type: str = Field(description="The task's config type: arithmetic, copy, scratchpad, jsonl, terminal.")
    fingerprint: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="SHA-256 hex of the task's config and data (miles.tasks.fingerprint), canonical JSON.",
    )
    environment: Literal["single_turn", "terminal", "python", "agent"] = Field(
        description="single_turn: one user message (the prompt), one model turn, a reward on the text; "
        "terminal: multi-turn shell episodes in a sandbox (docs/agents.md); python: a user's task, imported from "
        "the path its reward names (docs/extending.md); agent: a user's agent through the worker's chat endpoint, "
        "imported from the path its reward names (docs/agents.md)."
    )
    render: Literal["raw", "chat"] | None = Field(
        description="raw: BOS + prompt text; chat: the chat template; null: the task says when built (environment "
        "python: a factory's task, or a class that sets it per instance)."
    )
    reward: str = Field(
        description="exact_match or committed_answer (docs/protocol.md), python:<module:function> (a user's "
        "reward, or with environment python a user's task, to be imported), harbor (the task folder's verifier in "
        "the sandbox)."
    )


class SamplingInfo(_Part):
    temperature: float = Field(ge=0, description="0: greedy.")
    top_p: float = Field(gt=0, le=1)
    max_new_tokens: int = Field(ge=1, description="Per model turn.")
    stop_token_ids: list[int] = Field(description="A model turn ends after sampling any of these (kept in it).")


class EpisodeInfo(_Part):
    max_turns: int = Field(ge=1)
    max_tokens: int | None = Field(None, ge=1, description="Tokens after the prompt; None: the context window.")
    timeout_s: float | None = Field(None, gt=0)
    reward_timeout_s: float | None = Field(None, gt=0)


class TokenizerInfo(_Part):
    files: list[str] = Field(description="Names (in files) of the tokenizer's files, loadable as a HF tokenizer.")
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    chat_template: str | None = Field(None, description="None: no template (raw rendering only).")


class ModelInfo(_Part):
    files: list[str] = Field(description="Names (in files) of the architecture's files (config.json, ...).")
    architecture: str = Field(description="config.json's architectures[0], e.g. LlamaForCausalLM.")
    max_context: int = Field(ge=1, description="Prompt plus generated tokens per request.")


class SyncInfo(_Part):
    mode: str = Field(pattern=REGISTERED_NAME, description="sync.mode: a sync mode registered by name.")
    precision: str = Field(description="Rollout precision: bfloat16, float32, fp8_e4m3, fp4_e2m1.")
    transport: str = Field(pattern=REGISTERED_NAME, description="sync.transport: a transport registered by name.")


class BusInfo(_Part):
    ack_wait_s: float = Field(
        gt=0, description="The work queues' ack wait: send +WPI at least every ack_wait_s / 3 while working."
    )
    heartbeat_s: float = Field(gt=0, description="Heartbeat period.")


class RunInfo(Message):
    """What a run is, for every process that joins it. Key ``run`` of bucket ``<run>_RUNINFO``."""

    KIND: ClassVar[str] = "run_info"
    run: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    run_nonce: str = Field(pattern=r"^[0-9a-f]{32}$", description="Id of this run instance (docs/protocol.md).")
    created_at: float = Field(description="Unix seconds when the controller first wrote it.")
    task: TaskInfo
    sampling: SamplingInfo
    episode: EpisodeInfo
    group_size: int = Field(ge=1, le=4096)
    sync: SyncInfo
    bus: BusInfo
    tokenizer: TokenizerInfo
    model: ModelInfo
    files: list[RunFile]

    def identity(self) -> dict[str, Any]:
        """Everything but the instance's nonce and creation time: what a restart must agree on."""
        return self.model_dump(mode="json", exclude={"run_nonce", "created_at"})

    def file(self, name: str) -> RunFile:
        for f in self.files:
            if f.name == name:
                return f
        raise RunInfoError(f"run info of {self.run!r} lists no file {name!r}")


def decode_run_info(data: bytes) -> RunInfo:
    """The run info of a ``run`` key's value; :class:`SchemaError` for anything else."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise SchemaError(f"run info is not msgpack: {exc.__class__.__name__}") from None
    if not isinstance(body, dict):
        raise SchemaError(f"run info is not a msgpack map but {type(body).__name__}")
    if body.pop("schema", None) != SCHEMA_VERSION:
        raise SchemaError(f"run info of another schema version (this process speaks {SCHEMA_VERSION})")
    if body.pop("kind", None) != RunInfo.KIND:
        raise SchemaError("the run key does not hold a run_info message")
    try:
        return RunInfo.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        raise SchemaError(f"run_info: {'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None


# --------------------------------------------------------------------------- what the controller publishes


def canonical_fingerprint(fingerprint: Mapping[str, Any]) -> str:
    """SHA-256 hex of a task fingerprint as canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def task_info(task_cfg: Any) -> TaskInfo:
    """The identity and reward of a task config (torch-free)."""
    from miles.tasks.fingerprint import task_fingerprint

    kind = task_cfg.type
    if is_import_path(kind):  # a user's task: whoever plays it imports it
        from miles.plugins import import_object

        declared = getattr(import_object(kind, "task.type"), "render", None)
        render = declared if declared in ("raw", "chat") else None
        environment, reward = "python", f"python:{kind}"
    elif kind == "agent":  # a user's agent through the worker's chat endpoint
        environment, render, reward = "agent", "chat", f"python:{task_cfg.agent}"
    elif kind == "terminal":
        environment, render, reward = "terminal", "chat", "harbor"
    elif kind == "jsonl":
        render = "chat" if task_cfg.render == "chat" else "raw"
        environment, reward = "single_turn", f"python:{task_cfg.reward}"
    elif kind == "scratchpad":  # exact match of the answer committed after the last '#', not of the whole text
        environment, render, reward = "single_turn", "raw", "committed_answer"
    else:  # arithmetic, copy: miles.tasks.base.ExactMatchTask
        environment, render, reward = "single_turn", "raw", "exact_match"
    return TaskInfo(
        type=kind,
        fingerprint=canonical_fingerprint(task_fingerprint(task_cfg)),
        environment=environment,
        render=render,
        reward=reward,
    )


def sampling_info(cfg: Any, stop_token_ids: list[int]) -> SamplingInfo:
    s = cfg.rollout.sampling
    return SamplingInfo(
        temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens, stop_token_ids=stop_token_ids
    )


def episode_info(cfg: Any) -> EpisodeInfo:
    e = cfg.rollout.episode
    return EpisodeInfo(
        max_turns=e.max_turns, max_tokens=e.max_tokens, timeout_s=e.timeout_s, reward_timeout_s=e.reward_timeout_s
    )


def build_run_info(cfg: Any, model_dir: Path, *, run_nonce: str) -> tuple[RunInfo, dict[str, bytes]]:
    """The run info of ``cfg`` with the prepared model in ``model_dir``, and the files it lists.

    The tokenizer's facts come from the cache preparation fills (:mod:`miles.models.tokenizer_facts`), else from
    transformers: call it in a worker thread.
    """
    model_dir = Path(model_dir)
    contents: dict[str, bytes] = {}
    for name in (*TOKENIZER_FILES, *MODEL_FILES):
        path = model_dir / name
        if path.is_file():
            data = path.read_bytes()
            if len(data) > MAX_FILE_BYTES:
                raise RunInfoError(f"{path} has {len(data)} bytes, more than run info carries ({MAX_FILE_BYTES})")
            contents[name] = data
    if "config.json" not in contents:
        raise RunInfoError(f"{model_dir} has no config.json: the run info needs the model's architecture")
    model_config = json.loads(contents["config.json"])
    tokenizer = tokenizer_facts(model_dir)
    architectures = model_config.get("architectures") or ["unknown"]
    max_context = model_config.get("max_position_embeddings")
    info = RunInfo(
        run=cfg.name,
        run_nonce=run_nonce,
        created_at=time.time(),
        task=task_info(cfg.task),
        sampling=sampling_info(cfg, tokenizer.stop_token_ids),
        episode=episode_info(cfg),
        group_size=cfg.rollout.group_size,
        sync=SyncInfo(mode=cfg.sync.mode, precision=cfg.sync.dtype, transport=cfg.sync.transport),
        bus=BusInfo(ack_wait_s=cfg.bus.ack_wait_s, heartbeat_s=cfg.bus.heartbeat_s),
        tokenizer=TokenizerInfo(
            files=[n for n in TOKENIZER_FILES if n in contents],
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            chat_template=tokenizer.chat_template,
        ),
        model=ModelInfo(
            files=[n for n in MODEL_FILES if n in contents],
            architecture=str(architectures[0]),
            max_context=int(max_context) if isinstance(max_context, int) and max_context > 0 else 2048,
        ),
        files=[
            RunFile(
                name=name,
                size=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                chunks=-(-len(data) // FILE_CHUNK_BYTES),
            )
            for name, data in contents.items()
        ],
    )
    return info, contents


def check_worker_config(info: RunInfo, cfg: Any) -> None:
    """Raise :class:`RunInfoError` naming the first field where a worker's recipe disagrees with the run's.

    The project's rollout worker generates from its own recipe and local model; a recipe that differs
    from the controller's (another task, temperature or group size) would silently train on the wrong
    samples. Stop tokens come from the tokenizer, which the fingerprint of a tiny model covers and a
    pretrained path names; they are compared by the worker that loads it.
    """
    mine = {
        "task": task_info(cfg.task).model_dump(mode="json"),
        "sampling": {k: v for k, v in sampling_info(cfg, []).model_dump(mode="json").items() if k != "stop_token_ids"},
        "episode": episode_info(cfg).model_dump(mode="json"),
        "group_size": cfg.rollout.group_size,
        "sync": {"mode": cfg.sync.mode, "precision": cfg.sync.dtype, "transport": cfg.sync.transport},
    }
    theirs = info.model_dump(mode="json")
    theirs["sampling"].pop("stop_token_ids")
    for section, value in mine.items():
        if isinstance(value, dict):
            for key, v in value.items():
                if theirs[section].get(key) != v:
                    raise RunInfoError(
                        f"this worker's {section}.{key} is {v!r}, but run {info.run!r} uses "
                        f"{theirs[section].get(key)!r} (run info written by its controller): start the worker "
                        "with the run's recipe"
                    )
        elif theirs[section] != value:
            raise RunInfoError(f"this worker's {section} is {value!r}, but run {info.run!r} uses {theirs[section]!r}")


# --------------------------------------------------------------------------- the bucket


async def run_info_bucket(js: JetStreamContext, run: str) -> KeyValue:
    try:
        return await js.key_value(f"{run}_RUNINFO")
    except (BucketNotFoundError, NotFoundError):
        raise RunInfoError(f"bucket {run}_RUNINFO does not exist (the run's streams are not set up)") from None


async def publish_run_info(js: JetStreamContext, info: RunInfo, files: Mapping[str, bytes]) -> RunInfo:
    """Write ``info`` and its files once; returns the run info in force (the existing one after a restart).

    Files go first, the ``run`` key last (created, never overwritten). An existing run info is kept when it
    describes the same run (:meth:`RunInfo.identity`); otherwise :class:`RunInfoError`.
    """
    kv = await run_info_bucket(js, info.run)
    existing = await _get(kv, RUN_KEY)
    if existing is None:
        for f in info.files:
            data = files[f.name]
            for i in range(f.chunks):
                await kv.put(file_key(f.name, i), data[i * FILE_CHUNK_BYTES : (i + 1) * FILE_CHUNK_BYTES])
        try:
            await kv.create(RUN_KEY, encode(info))
            return info
        except KeyWrongLastSequenceError:  # another controller of this run was faster
            existing = await _get(kv, RUN_KEY)
    assert existing is not None
    try:
        stored = decode_run_info(existing)
    except SchemaError as exc:
        raise RunInfoError(f"bucket {info.run}_RUNINFO holds unreadable run info ({exc})") from None
    if stored.identity() != info.identity():
        differing = sorted(k for k, v in info.identity().items() if stored.identity().get(k) != v)
        raise RunInfoError(
            f"bucket {info.run}_RUNINFO describes another run instance (differs in {', '.join(differing)}): "
            "a new run needs a new name, or the old run's streams deleted"
        )
    return stored


async def _get(kv: KeyValue, key: str) -> bytes | None:
    try:
        entry = await kv.get(key)
    except (KeyNotFoundError, KeyDeletedError):
        return None
    return entry.value


async def read_run_info(js: JetStreamContext, run: str) -> RunInfo | None:
    """The run's info, or None while its controller has not written it yet."""
    kv = await run_info_bucket(js, run)
    data = await _get(kv, RUN_KEY)
    if data is None:
        return None
    try:
        return decode_run_info(data)
    except SchemaError as exc:
        raise RunInfoError(f"bucket {run}_RUNINFO: {exc}") from None


async def wait_run_info(
    js: JetStreamContext, run: str, stopping: asyncio.Event, *, poll_s: float = 0.5, log: Any = None
) -> RunInfo | None:
    """Poll until the run info is there (None if ``stopping`` is set first)."""
    waited = 0.0
    while not stopping.is_set():
        info = await read_run_info(js, run)
        if info is not None:
            return info
        if log is not None and waited % 10.0 < poll_s:
            log.info("waiting_for_run_info", bucket=f"{run}_RUNINFO")
        waited += poll_s
        try:
            await asyncio.wait_for(stopping.wait(), timeout=poll_s)
        except asyncio.TimeoutError:
            pass
    return None


async def read_run_file(js: JetStreamContext, info: RunInfo, name: str) -> bytes:
    """A file of the run info, checked against its size and SHA-256."""
    kv = await run_info_bucket(js, info.run)
    f = info.file(name)
    parts: list[bytes] = []
    for i in range(f.chunks):
        part = await _get(kv, file_key(name, i))
        if part is None:
            raise RunInfoError(f"run info file {name}: chunk {i} of {f.chunks} is missing")
        parts.append(part)
    data = b"".join(parts)
    if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
        raise RunInfoError(f"run info file {name}: {len(data)} bytes that do not match its size and sha256")
    return data
