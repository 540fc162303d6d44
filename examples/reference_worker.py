"""A Miles rollout worker written from docs/protocol.md alone: it imports nothing from ``miles``.

    python examples/reference_worker.py --nats-url nats://127.0.0.1:4222 --run myrun --worker-id ref-0

With per-role credentials (a ``miles creds`` bundle's ``rollout/`` directory) add ``--credentials DIR``.
Everything else (task, sampling parameters, tokenizer, model architecture, weights) comes from the bus.

Libraries: nats-py and msgpack (the bus), xxhash (the data plane's xxh3-128 digest), cryptography (ed25519,
to verify signed messages when the run has identities), torch and transformers (the model: tokenizer and
forward pass only; sampling, weight loading, signatures and the token contract are written out here).

Scope, on purpose small: single-turn tasks with the ``exact_match`` reward, weights synced in ``full``
mode over the bus in ``bfloat16`` or ``float32``. A run info asking for anything else is refused at start
with one line and exit status 2. One unit of work at a time (a prompt group's episodes are one batch, an
evaluation shard one sample at a time); new weights are switched in between units. A ``§`` in a comment
names the section of docs/protocol.md the code follows.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import inspect
import json
import signal
import ssl
import struct
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import nats
import torch
import xxhash
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError

SCHEMA = 2
SAFETENSORS_DTYPES = {"BF16": (torch.bfloat16, "bfloat16"), "F32": (torch.float32, "float32")}
END_MARKERS = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<pad>")


class Refused(Exception):
    """A message that breaks the protocol: dead-lettered with this reason (category ``malformed``, ``unsigned``
    or ``untrusted``)."""

    def __init__(self, reason: str, category: str = "malformed") -> None:
        super().__init__(reason)
        self.category = category


class Unsupported(Exception):
    """A run this worker cannot join (exit status 2)."""


def log(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "ts": round(time.time(), 3), **fields}), file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- wire format (§ Wire format)


def pack(kind: str, **fields: Any) -> bytes:
    return msgpack.packb({"schema": SCHEMA, "kind": kind, **fields}, use_bin_type=True)


def unpack(data: bytes, kind: str, required: dict[str, type | tuple[type, ...]], optional: dict[str, Any]) -> dict:
    """Decode a message of ``kind``: required fields with their types, optional ones with defaults, no others."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:
        raise Refused(f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise Refused("not a msgpack map")
    if body.pop("schema", None) != SCHEMA:
        raise Refused(f"schema version is not {SCHEMA}")
    if body.get("kind") != kind:
        raise Refused(f"kind {body.get('kind')!r}, expected {kind!r}")
    body.pop("kind")
    unknown = set(body) - set(required) - set(optional)
    if unknown:
        raise Refused(f"{kind}: unknown fields {sorted(unknown)}")
    for name, types in required.items():
        if name not in body:
            raise Refused(f"{kind}: missing field {name}")
        value = body[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            raise Refused(f"{kind}: field {name} has type {type(value).__name__}")
    for name, default in optional.items():
        body.setdefault(name, default)
    return body


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def check_version(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not -1 <= value < 2**53:
        raise Refused(f"{what} is not a version in [-1, 2^53)")
    return value


# --------------------------------------------------------------------------- signatures (§ Signatures)

SIGNED_BY = {
    "weights_announced": "trainer",
    "prompt_group": "controller",
    "eval_task": "controller",
    "control": "controller",
}  # fmt: skip  (the kinds this worker reads that a role signs)


def crc16(data: bytes) -> int:
    """CRC-16/XMODEM, the nkey checksum."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) & 0xFFFF if crc & 0x8000 else (crc << 1) & 0xFFFF
    return crc


def account_key(nkey: str) -> Any:
    """An ``A...`` public nkey: base32 of type byte 0x00, the 32 ed25519 key bytes, CRC-16 little-endian."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    raw = base64.b32decode(nkey + "=" * (-len(nkey) % 8))
    if len(raw) != 35 or raw[0] != 0 or crc16(raw[:-2]) != int.from_bytes(raw[-2:], "little"):
        raise Unsupported(f"{nkey[:8]}... is not an account-type public nkey")
    return Ed25519PublicKey.from_public_bytes(raw[1:33])


@dataclass
class Verifier:
    """The signing roles' public keys of one run instance (from a role directory's identity.json)."""

    run: str
    nonce: str
    keys: dict[str, Any]

    def check(self, subject: str, data: bytes, headers: dict | None, kind: str) -> None:
        """§ Signed messages: ``Miles-Signer`` names the kind's signer, ``Miles-Signature`` (hex) verifies over
        TAG || str(run) || str(run_nonce) || str(subject) || u64(len) || payload."""
        signer = SIGNED_BY.get(kind)
        if signer is None:
            return
        headers = headers or {}
        signature = headers.get("Miles-Signature", "")
        if headers.get("Miles-Signer") != signer or len(signature) != 128:
            raise Refused(f"{kind}: not signed by the {signer}", "unsigned")

        def field(text: str) -> bytes:
            raw = text.encode()
            return struct.pack(">I", len(raw)) + raw

        message = b"miles.signed.v1\x00" + field(self.run) + field(self.nonce) + field(subject)
        try:
            self.keys[signer].verify(bytes.fromhex(signature), message + struct.pack(">Q", len(data)) + data)
        except Exception:  # InvalidSignature, or a signature that is not hex
            raise Refused(f"{kind}: no valid signature by the {signer}", "unsigned") from None


# --------------------------------------------------------------------------- run info (§ Run info)


@dataclass
class Run:
    name: str
    nonce: str
    info: dict[str, Any]
    directory: Path  # the run info's files, written out for transformers

    @property
    def sampling(self) -> dict[str, Any]:
        return self.info["sampling"]


async def read_run_info(js: Any, run: str, stopping: asyncio.Event) -> Run | None:
    """Wait for key ``run`` of bucket ``<run>_RUNINFO``, check that this worker can play the run, fetch its files."""
    while not stopping.is_set():
        try:  # the bucket and the key appear once the run's controller has started
            kv = await js.key_value(f"{run}_RUNINFO")
            entry = await kv.get("run")
            break
        except (BucketNotFoundError, NotFoundError, KeyNotFoundError):
            log("waiting_for_run_info", bucket=f"{run}_RUNINFO")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), 1.0)
    else:
        return None
    body = msgpack.unpackb(entry.value, raw=False)
    if body.get("schema") != SCHEMA or body.get("kind") != "run_info":
        raise Unsupported(f"run {run!r} speaks schema {body.get('schema')!r}; this worker speaks {SCHEMA}")
    task, sync = body["task"], body["sync"]
    if task["environment"] != "single_turn" or task["reward"] != "exact_match":
        raise Unsupported(f"task {task['type']!r} ({task['environment']}, reward {task['reward']}) is not supported")
    if sync["mode"] != "full" or sync["transport"] != "bus" or sync["precision"] not in ("bfloat16", "float32"):
        raise Unsupported(f"weight sync {sync} is not supported (full mode over the bus, bfloat16/float32 only)")
    directory = Path(tempfile.mkdtemp(prefix=f"refworker-{run}-"))
    for f in body["files"]:
        parts = []
        for i in range(f["chunks"]):
            parts.append((await kv.get(f"files/{f['name']}/{i}")).value)
        data = b"".join(parts)
        if len(data) != f["size"] or hashlib.sha256(data).hexdigest() != f["sha256"]:
            raise Unsupported(f"run info file {f['name']} does not match its size and sha256")
        (directory / f["name"]).write_bytes(data)
    return Run(name=run, nonce=body["run_nonce"], info=body, directory=directory)


# --------------------------------------------------------------------------- weights (§ Weight data plane)


@dataclass
class Weights:
    version: int
    state: dict[str, torch.Tensor]
    state_digest: str
    nbytes: int


def parse_safetensors(payload: bytes) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of a payload and its state digest (§ weights_announced, state_digest), from the bytes."""
    header_len = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + header_len])
    data = memoryview(payload)[8 + header_len :]
    tensors: dict[str, torch.Tensor] = {}
    h = xxhash.xxh3_128()
    for name in sorted(k for k in header if k != "__metadata__"):
        entry = header[name]
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise Refused(f"tensor {name} has dtype {entry['dtype']}, not bfloat16/float32")
        dtype, dtype_name = SAFETENSORS_DTYPES[entry["dtype"]]
        start, end = entry["data_offsets"]
        raw = data[start:end]
        line = f"{name}\0{dtype_name}\0{','.join(map(str, entry['shape']))}\0{end - start}\n".encode()
        h.update((len(line)).to_bytes(8, "little"))
        h.update(line)
        h.update(raw)
        tensors[name] = (
            torch.frombuffer(bytearray(raw), dtype=dtype).reshape(entry["shape"])
            if raw
            else torch.empty(entry["shape"], dtype=dtype)
        )
    return tensors, h.hexdigest()


async def fetch_weights(nc: Any, js: Any, run: str, ann: dict[str, Any]) -> Weights:
    """Manifest by subject (leader read), chunks by sequence (direct gets), digest checked before parsing."""
    version = ann["version"]
    meta = await js.get_msg(f"{run}_WEIGHTS", subject=f"{run}.weights.{version}.meta")
    try:
        manifest = json.loads(meta.data)
        size, chunk_bytes = int(manifest["size"]), int(manifest["chunk_bytes"])
        seqs = [int(first) + k for first, count in manifest["seqs"] for k in range(int(count))]
        consistent = len(seqs) == manifest["chunks"] == -(-size // chunk_bytes) and size == ann["size"]
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        raise Refused(f"manifest of v{version} is malformed: {exc!r}") from None
    if manifest.get("algorithm") != "xxh3_128" or manifest.get("version") != version:
        raise Refused(f"manifest of v{version} is of another version or digest algorithm")
    if manifest.get("digest") != ann["digest"] or not consistent:
        raise Refused(f"manifest of v{version} does not match its announcement")
    payload = bytearray(size)
    subject = f"{run}.weights.{version}.chunk"
    window = asyncio.Semaphore(8)

    async def chunk(i: int, seq: int) -> None:
        async with window:
            reply = await nc.request(f"$JS.API.DIRECT.GET.{run}_WEIGHTS", json.dumps({"seq": seq}).encode(), timeout=30)
        headers = reply.headers or {}
        if headers.get("Status"):
            raise Refused(f"chunk {i} (seq {seq}): {headers.get('Status')} {headers.get('Description', '')}")
        want = min(chunk_bytes, size - i * chunk_bytes)
        if headers.get("Nats-Subject") != subject or len(reply.data) != want:
            raise Refused(f"stream seq {seq} is not chunk {i} of v{version}")
        payload[i * chunk_bytes : i * chunk_bytes + want] = reply.data

    await asyncio.gather(*(chunk(i, seq) for i, seq in enumerate(seqs)))
    if xxhash.xxh3_128_hexdigest(payload) != ann["digest"]:
        raise Refused(f"payload of v{version} does not hash to its announced digest")
    if ann["payload_sha256"] and hashlib.sha256(payload).hexdigest() != ann["payload_sha256"]:
        raise Refused(f"payload of v{version} does not match its signed SHA-256")
    try:
        state, digest = parse_safetensors(bytes(payload))
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise Refused(f"payload of v{version} is not a safetensors file: {exc!r}") from None
    if ann.get("state_digest") and digest != ann["state_digest"]:
        raise Refused(f"state of v{version} does not match its announced state_digest")
    return Weights(version=version, state=state, state_digest=digest, nbytes=size)


ANNOUNCEMENT = {"version": int, "digest": str, "size": int, "chunks": int}
ANNOUNCEMENT_OPTIONAL = {
    "step": 0,
    "consumed": [],
    "replayed": False,
    "mode": "full",
    "base_version": None,
    "format": "safetensors",
    "dtype": "bfloat16",
    "published_at": 0.0,
    "state_digest": "",
    "precision": "bfloat16",
    "transport": "bus",
    "location": "",
    "payload_sha256": "",
}


# --------------------------------------------------------------------------- generation (§ Episodes)


def first_answer(completion: str) -> str:
    """§ exact_match: cut at the first end marker, strip, keep up to the first whitespace."""
    for marker in END_MARKERS:
        at = completion.find(marker)
        if at >= 0:
            completion = completion[:at]
    completion = completion.strip()
    return completion.split(maxsplit=1)[0] if completion else ""


@torch.no_grad()
def sample(
    model: Any,
    prompt_ids: list[int],
    rows: int,
    budget: int,
    temperature: float,
    top_p: float,
    stops: set[int],
    gen: Any,
) -> list[tuple[list[int], list[float], str]]:
    """``rows`` completions of one prompt: (token ids, behaviour log-probs, finish) per row, finish being
    ``stop`` or ``length`` (the budget). Log-probs are under ``log_softmax(logits / T)`` (T = 1 when greedy),
    before top-p truncation (§ trajectory, episode)."""
    from transformers import DynamicCache

    ids: list[list[int]] = [[] for _ in range(rows)]
    logps: list[list[float]] = [[] for _ in range(rows)]
    done = [False] * rows
    inputs = torch.tensor([prompt_ids] * rows)
    # transformers renamed the cache argument (past_key_values -> cache); ask the signature.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    kv = {cache_arg: DynamicCache(), "use_cache": True}  # filled in place, one prefill for the group's rows
    for _ in range(budget):
        out = model(input_ids=inputs, **kv)
        logits = out.logits[:, -1, :].float()
        logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
        if temperature == 0:
            tokens = logits.argmax(dim=-1)
        else:
            probs = logp.exp()
            if top_p < 1.0:
                ranked, order = probs.sort(dim=-1, descending=True)
                outside = (ranked.cumsum(dim=-1) - ranked) >= top_p
                probs = probs.scatter(-1, order, ranked.masked_fill(outside, 0.0))
            tokens = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        for r in range(rows):
            if not done[r]:
                t = int(tokens[r])
                ids[r].append(t)
                logps[r].append(float(logp[r, t]))
                done[r] = t in stops
        if all(done):
            break
        inputs = tokens.unsqueeze(-1)
    return [(ids[r], logps[r], "stop" if done[r] else "length") for r in range(rows)]


# --------------------------------------------------------------------------- the worker


@dataclass
class Worker:
    nc: Any
    js: Any
    run: Run
    worker_id: str
    verifier: Verifier | None = None  # with credentials: signed kinds must verify
    model: Any = None
    tokenizer: Any = None
    held: int = -1
    held_digest: str = ""
    ready: Weights | None = None  # fetched and verified, switched in before the next unit of work
    gen: Any = None  # the sampling generator, seeded by the worker id
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    stats: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            ("groups", "tokens", "syncs", "evals", "checksum_failures", "dead_lettered", "controls_refused"), 0.0
        )
    )

    @property
    def s(self) -> str:
        return self.run.name

    def verify(self, subject: str, data: bytes, headers: dict | None, kind: str) -> None:
        if self.verifier is not None:
            self.verifier.check(subject, data, headers, kind)

    def load_model(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.run.directory), local_files_only=True)
        config = AutoConfig.from_pretrained(str(self.run.directory), local_files_only=True)
        self.model = AutoModelForCausalLM.from_config(config).float().eval()
        seed = zlib.crc32(self.worker_id.encode())
        self.gen = torch.Generator().manual_seed(seed)

    async def dead_letter(self, subject: str, data: bytes, reason: str, category: str = "malformed") -> None:
        """§ Dead letters: the raw bytes to ``<run>.dlq.rollout.<origin with '.' -> '_'>``, with the reason."""
        self.stats["dead_lettered"] += 1
        self.stats[f"refused_{category}"] = self.stats.get(f"refused_{category}", 0.0) + 1
        log("dead_letter", origin=subject, reason=reason, category=category)
        headers = {
            "Miles-Origin": subject,
            "Miles-Reason": reason[:500],
            "Miles-Category": category,
            "Miles-Actor": self.worker_id,
        }
        await self.js.publish(f"{self.s}.dlq.rollout.{subject.replace('.', '_')}", data, headers=headers)

    # ---------------------------------------------------------------- background loops

    async def heartbeats(self) -> None:
        """§ heartbeat: core NATS, every heartbeat_s."""
        period = self.run.info["bus"]["heartbeat_s"]
        while not self.stopping.is_set():
            hb = pack(
                "heartbeat", role="rollout", actor_id=self.worker_id, version=self.held, state="running",
                stats=dict(self.stats), ts=time.time(),
            )  # fmt: skip
            await self.nc.publish(f"{self.s}.hb.rollout.{self.worker_id}", hb)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), period)

    async def control(self) -> None:
        """§ control: obey ``stop`` only when it carries this run instance's nonce; live messages only."""
        sub = await self.nc.subscribe(f"{self.s}.events.control")
        try:
            while not self.stopping.is_set():
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except NatsTimeout:
                    continue
                try:
                    body = unpack(msg.data, "control", {"command": str}, {"reason": "", "run_instance": ""})
                    self.verify(msg.subject, msg.data, msg.headers, "control")
                except Refused as exc:
                    await self.dead_letter(msg.subject, msg.data, str(exc), exc.category)
                    continue
                if body["command"] == "stop" and body["run_instance"] == self.run.nonce:
                    log("stop", reason=body["reason"])
                    self.stopping.set()
                else:  # § The run-instance rule: another instance's (or no instance's) command is never obeyed
                    self.stats["controls_refused"] += 1
                    why = f"control: for run instance {body['run_instance'][:8] or '(none)'}, not this one"
                    await self.dead_letter(msg.subject, msg.data, why, "untrusted")
        finally:
            await sub.unsubscribe()

    async def announcements(self) -> None:
        """§ weights_announced: the newest by direct get (last by subject), then each next one by sequence; a
        core subscription only wakes the reader. A verified payload waits in ``ready`` for the main loop."""
        stream, subject = f"{self.s}_EVENTS", f"{self.s}.events.weights"
        wake = asyncio.Event()

        async def woken(_: Any) -> None:  # nothing is read from the core copy: only the stream is trusted
            wake.set()

        sub = await self.nc.subscribe(subject, cb=woken)
        seq = 0
        try:
            with contextlib.suppress(NotFoundError):
                newest = await self.js.get_msg(stream, subject=subject, direct=True)
                seq = newest.seq
                await self.consider(newest)
            while not self.stopping.is_set():
                while True:
                    try:
                        msg = await self.js.get_msg(stream, seq=seq + 1, subject=subject, direct=True, next=True)
                    except NotFoundError:
                        break
                    seq = msg.seq
                    await self.consider(msg)
                wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), 0.5)
        finally:
            await sub.unsubscribe()

    async def consider(self, msg: Any) -> None:
        try:
            ann = unpack(msg.data, "weights_announced", ANNOUNCEMENT, ANNOUNCEMENT_OPTIONAL)
            check_version(ann["version"], "version")
            self.verify(msg.subject, msg.data, msg.headers, "weights_announced")
        except Refused as exc:
            await self.dead_letter(msg.subject, msg.data, str(exc), exc.category)
            return
        newest = self.ready.version if self.ready else self.held
        if ann["version"] <= newest or ann["mode"] != "full" or ann["transport"] != "bus":
            return
        try:
            weights = await fetch_weights(self.nc, self.js, self.s, ann)
        except (Refused, NotFoundError, NatsTimeout, NoRespondersError) as exc:  # never applied; newer ones come
            self.stats["checksum_failures"] += isinstance(exc, Refused)
            log("weights_refused", version=ann["version"], error=str(exc))
            return
        self.ready = weights

    # ---------------------------------------------------------------- weights

    async def switch(self) -> None:
        """Adopt fetched weights between units of work, then report them (§ weights_held)."""
        weights, self.ready = self.ready, None
        if weights is None or weights.version <= self.held:
            return
        start = time.perf_counter()
        state = {k: v.to(torch.float32) for k, v in weights.state.items()}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        if unexpected or (missing and not (tied and set(missing) <= {"lm_head.weight"})):
            log("weights_refused", version=weights.version, missing=missing, unexpected=unexpected)
            return
        self.held, self.held_digest = weights.version, weights.state_digest
        self.stats["syncs"] += 1
        report = pack(
            "weights_held", worker_id=self.worker_id, version=self.held, state_digest=self.held_digest,
            mode="full", fetch_bytes=weights.nbytes, pause_s=time.perf_counter() - start,
        )  # fmt: skip
        await self.js.publish(f"{self.s}.events.weights_held", report)
        log("weights_held", version=self.held)

    async def hold_at_least(self, version: int) -> bool:
        while self.held < version and not self.stopping.is_set():
            await self.switch()
            await asyncio.sleep(0.05)
        return self.held >= version

    # ---------------------------------------------------------------- work

    def prompt_ids(self, prompt: str) -> list[int]:
        """§ Episodes: raw rendering is BOS + the prompt's ids (no other special token)."""
        ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        bos = self.run.info["tokenizer"]["bos_token_id"]
        if bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def episodes(self, prompt: str, answer: str, rows: int, budget: int, temperature: float) -> list[dict]:
        """``rows`` one-turn episodes of ``prompt`` (runs in a thread: torch releases the GIL)."""
        sampling, limits = self.run.sampling, self.run.info["episode"]
        prompt_ids = self.prompt_ids(prompt)
        room = self.run.info["model"]["max_context"] - len(prompt_ids)
        if limits["max_tokens"] is not None:
            room = min(room, limits["max_tokens"])
        steps = min(budget, room)
        started = time.perf_counter()
        stops = set(sampling["stop_token_ids"])
        rows_out: list[tuple[list[int], list[float], str]] = [([], [], "context")] * rows
        if steps > 0:
            rows_out = sample(self.model, prompt_ids, rows, steps, temperature, sampling["top_p"], stops, self.gen)
        out = []
        for ids, logps, finish in rows_out:
            if finish == "length" and steps < budget:
                finish = "context"  # the context window, not the turn's budget, cut it
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append(
                {
                    "prompt_ids": prompt_ids,
                    "token_ids": ids,
                    "loss_mask": [1] * len(ids),
                    "logprobs": logps,
                    "turns": [[0, len(ids), "model"]] if ids else [],
                    "weight_version": self.held,
                    "version_spans": [[0, self.held]] if ids else [],
                    "reward": 1.0 if first_answer(text) == answer else 0.0,
                    "status": "ok",
                    "end_reason": "context_full" if finish == "context" else "done",
                    "truncated": finish == "length",
                    "stats": {"turns": 1.0, "model_tokens": float(len(ids)), "gen_s": time.perf_counter() - started},
                }
            )
        return out

    async def keep_in_progress(self, msg: Any) -> None:
        while True:
            await asyncio.sleep(self.run.info["bus"]["ack_wait_s"] / 3)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def play_group(self, msg: Any) -> None:
        """§ prompt_group -> § trajectory: publish (durably), then ack the prompt."""
        try:
            group = unpack(
                msg.data, "prompt_group",
                {"group_id": str, "sample_id": str, "prompt": str, "answer": str, "group_size": int,
                 "issue_index": int, "issued_at_version": int},
                {"meta": {}, "attempt": 0},
            )  # fmt: skip
            if group["group_id"] != f"g{group['issue_index']}":
                raise Refused("prompt_group: group_id is not g<issue_index>")
            if group["group_size"] != self.run.info["group_size"]:
                raise Refused(f"prompt_group: group_size {group['group_size']}, not the run's", "untrusted")
            check_version(group["issued_at_version"], "issued_at_version")
            self.verify(msg.subject, msg.data, msg.headers, "prompt_group")
        except Refused as exc:
            await self.dead_letter(msg.subject, msg.data, str(exc), exc.category)
            await msg.ack()
            return
        pinger = asyncio.create_task(self.keep_in_progress(msg))
        try:
            if not await self.hold_at_least(group["issued_at_version"]):
                await msg.nak()
                return
            start = time.perf_counter()
            s = self.run.sampling
            episodes = await asyncio.to_thread(
                self.episodes,
                group["prompt"],
                group["answer"],
                group["group_size"],
                s["max_new_tokens"],
                s["temperature"],
            )
            traj = pack(
                "trajectory", group_id=group["group_id"], sample_id=group["sample_id"], worker_id=self.worker_id,
                episodes=episodes, issued_at_version=group["issued_at_version"], gen_s=time.perf_counter() - start,
                # § Prompt tickets: the group as issued, byte for byte, with its signature (when the run signs)
                ticket=bytes(msg.data), ticket_signature=(msg.headers or {}).get("Miles-Signature", ""),
            )  # fmt: skip
            await self.js.publish(f"{self.s}.traj", traj)
            await msg.ack()
            self.stats["groups"] += 1
            self.stats["tokens"] += sum(len(e["token_ids"]) for e in episodes)
        finally:
            pinger.cancel()

    async def play_eval(self, msg: Any) -> None:
        """§ eval_task -> § eval_shard_result: greedy, at one version >= the requested one."""
        try:
            work = unpack(
                msg.data, "eval_task",
                {"eval_id": str, "version": int, "shard": int, "shards": int, "samples": list, "max_new_tokens": int},
                {"claim": ""},
            )  # fmt: skip
            check_version(work["version"], "version")
            self.verify(msg.subject, msg.data, msg.headers, "eval_task")
        except Refused as exc:
            await self.dead_letter(msg.subject, msg.data, str(exc), exc.category)
            await msg.ack()
            return
        pinger = asyncio.create_task(self.keep_in_progress(msg))
        try:
            if not await self.hold_at_least(work["version"]):
                await msg.nak()
                return
            reward_sum, tokens = 0.0, 0
            for item in work["samples"]:
                (ep,) = await asyncio.to_thread(
                    self.episodes, item["prompt"], item.get("answer", ""), 1, work["max_new_tokens"], 0.0
                )
                reward_sum += ep["reward"]
                tokens += len(ep["token_ids"])
            result = pack(
                "eval_shard_result", eval_id=work["eval_id"], shard=work["shard"], worker_id=self.worker_id,
                version=self.held, samples=len(work["samples"]), reward_sum=reward_sum, failed=0, tokens=tokens,
                claim=work["claim"],  # § the shard's claim, carried back: without it the result does not count
            )  # fmt: skip
            await self.js.publish(f"{self.s}.events.eval_results", result)
            await msg.ack()
            self.stats["evals"] += 1
        finally:
            pinger.cancel()

    async def work(self) -> None:
        """§ Durable consumers: bind to ``rollout`` and ``rollout-eval`` (created by the run's setup)."""
        prompts = await self.js.pull_subscribe_bind(durable="rollout", stream=f"{self.s}_PROMPTS")
        evals = await self.js.pull_subscribe_bind(durable="rollout-eval", stream=f"{self.s}_EVALQ")
        while not self.stopping.is_set():
            await self.switch()
            if self.held < 0:  # nothing to generate with yet
                await asyncio.sleep(0.1)
                continue
            for sub, play, wait in ((evals, self.play_eval, 0.05), (prompts, self.play_group, 0.3)):
                try:
                    msgs = await sub.fetch(1, timeout=wait)
                except NatsTimeout:
                    continue
                await play(msgs[0])
                break


async def connect(args: argparse.Namespace) -> Any:
    options: dict[str, Any] = {"name": f"{args.run}:{args.worker_id}"}
    if args.credentials:
        d = Path(args.credentials)
        identity = json.loads((d / "identity.json").read_text())
        tls = ssl.create_default_context(cafile=str(d / "ca.pem"))
        tls.load_cert_chain(str(d / "client-cert.pem"), str(d / "client-key.pem"))
        options |= {"nkeys_seed": str(d / "user.nk"), "tls": tls, "inbox_prefix": identity["inbox_prefix"]}
    return await nats.connect(servers=[args.nats_url], **options)


async def main(args: argparse.Namespace) -> int:
    nc = await connect(args)
    js = nc.jetstream(timeout=10.0)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        run = await read_run_info(js, args.run, stopping)
        if run is None:
            return 0
        worker = Worker(nc=nc, js=js, run=run, worker_id=args.worker_id, stopping=stopping)
        if args.credentials:  # the run signs: verify what the trainer and the controller sign
            identity = json.loads((Path(args.credentials) / "identity.json").read_text())
            if identity["run_nonce"] != run.nonce:
                raise Unsupported(f"credentials of run instance {identity['run_nonce'][:8]}, not {run.nonce[:8]}")
            keys = {"trainer": identity["signing_public_key"], "controller": identity["controller_signing_public_key"]}
            worker.verifier = Verifier(run.name, run.nonce, {k: account_key(v) for k, v in keys.items()})
        await asyncio.to_thread(worker.load_model)
        log("joined", run=run.name, nonce=run.nonce, task=run.info["task"]["type"])
        async with asyncio.TaskGroup() as tg:
            tg.create_task(worker.heartbeats())
            tg.create_task(worker.control())
            tg.create_task(worker.announcements())
            await worker.work()
            stopping.set()
        return 0
    except Unsupported as exc:
        print(f"reference_worker: error: {exc}", file=sys.stderr)
        return 2
    finally:
        # Every durable publish was acknowledged already; flush the rest (a last heartbeat) and leave.
        with contextlib.suppress(Exception):
            await nc.flush(timeout=2)
        await nc.close()


def cli() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nats-url", required=True)
    p.add_argument("--run", required=True, help="The run name.")
    p.add_argument("--worker-id", required=True, help="Unique id of this worker ([A-Za-z0-9_-]+).")
    p.add_argument("--credentials", help="A `miles creds` role directory (rollout/): nkey, client certificate, CA.")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads.")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    return asyncio.run(main(args))


if __name__ == "__main__":
    sys.exit(cli())
