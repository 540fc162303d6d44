"""A torch.distributed weight-update group as a weight transport: the trainer broadcasts, engines receive.

The group is its own process group of the trainer leader (group rank 0) and N engine processes, built
from a TCP rendezvous on ``master_addr:master_port`` (the trainer hosts the store) and independent of the
trainer's data-parallel group: gloo on CPU, NCCL on GPU. It is created with the public
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` constructors over the store-prefix chain that torch's own group
helper uses (``<name>`` / ``<name>/`` / ``<device>/``), which is how SGLang's ``/init_weights_update_group``
joins: the same group serves SGLang servers (:mod:`miles.sync.transport.sglang`) and Miles engines.

One **round** per published version (Miles engines, :class:`BroadcastReceiver`):

1. the trainer rings the doorbell: key ``miles/round/<n>`` in the group's store, ``{"version", "size",
   "bucket_bytes"}`` (receivers poll for the next round's key between rounds, so an idle group holds no
   collective open and cannot time out);
2. it broadcasts the streamed payload in ``bucket_bytes`` uint8 buckets (the last one shorter) as the
   export produces them: one parameter plus one bucket in memory; receivers land every bucket straight in
   one preallocated buffer;
3. a 65-byte trailer: status (1 ok, 2 aborted), the payload digest and the state digest, both known only
   now. A receiver checks the payload against it; a round aborted by an export error (the trainer pads the
   rest with zeros so every member stays in step) is dropped.

The trainer then announces the version on the bus (``transport: broadcast``) with the same digests as
every other transport; :meth:`BroadcastReceiver.fetch` hands out the received payload only if it matches
the announced digest, and the worker checks the ``state_digest`` before staging
(:func:`~miles.sync.transport.base.verified_state`), so the held-weight audit is unchanged.

**A member that dies.** Its peers' collectives fail (gloo reports the closed connection at once; a hung
member surfaces after the group timeout). The trainer marks the group broken (:class:`TransportBroken`)
and never uses it again: a broken collective group cannot be repaired in place. The version is then
re-sent over the bus (:class:`~miles.sync.transport.FallbackTransport`), announced ``transport: bus``, and
so are the following ones; surviving receivers see their round fail, report it from ``fetch`` and the
follower reads bus-announced versions from the data plane as usual. Re-forming means a new group (new
name or port) joined by every live member, after which the trainer switches back.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from datetime import timedelta
from typing import TYPE_CHECKING, ClassVar, Literal

import structlog
import torch
import torch.distributed as dist

from miles.bus.errors import ChecksumMismatch, PayloadMissing
from miles.sync.checksum import digest
from miles.sync.stream_export import PayloadLayout, Rechunker, encode_payload
from miles.sync.transport.base import Params, Published, Runner, TransportBroken, TransportKind, runner
from miles.sync.transport.dataplane import allocate

if TYPE_CHECKING:
    from miles.config import RunConfig

log = structlog.get_logger(__name__)

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
TRAILER_BYTES = 65
_OK, _ABORTED = 1, 2


def group_backend(cfg: RunConfig) -> Literal["gloo", "nccl"]:
    """The one backend of the run's weight-update group, the same for the trainer and every worker (members that
    chose their own could not meet: the rendezvous keys are prefixed by the backend's device). NCCL only when
    the trainer (FSDP on cuda, or Megatron) and the engines are all on CUDA; gloo otherwise (a CUDA trainer
    sends from host memory). An NCCL member joins on its current device, which every process pins first
    (:mod:`miles.devices`)."""
    from miles.devices import engine_on_cuda, trainer_on_cuda

    return "nccl" if trainer_on_cuda(cfg) and engine_on_cuda(cfg) else "gloo"


def join_run_group(cfg: RunConfig, rank: int) -> WeightUpdateGroup:
    """Join the run's weight-update group as ``rank`` (0: the trainer; workers 1..rollout.workers), blocking
    until every member did; both sides call this, so they agree on name, size and backend."""
    sync = cfg.sync
    return WeightUpdateGroup.join(
        sync.broadcast_addr,
        sync.broadcast_port,
        rank,
        1 + cfg.rollout.workers,
        name=f"{cfg.name}_weights",
        backend=group_backend(cfg),
        timeout_s=sync.broadcast_timeout_s,
    )


def rendezvous_store(store: dist.Store, name: str, backend: str) -> dist.Store:
    """The store a member of group ``name`` builds its process group on: torch's group helper (and so SGLang's
    ``/init_weights_update_group``) prefixes the keys ``<name>`` / ``<name>/`` / ``<device>/``, the device being
    ``cuda`` for NCCL and ``cpu`` for gloo."""
    device_type = "cuda" if backend == "nccl" else "cpu"
    return dist.PrefixStore(f"{device_type}/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))


class WeightUpdateGroup:
    """One member's handle on a weight-update group (the source is group rank 0)."""

    def __init__(
        self, pg: dist.ProcessGroup, store: dist.Store, rank: int, world_size: int, name: str, device: torch.device
    ) -> None:
        self.pg = pg
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.name = name
        self.device = device

    @classmethod
    def join(
        cls,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        *,
        name: str = "miles_weights",
        backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> WeightUpdateGroup:
        """Join (blocking until all ``world_size`` members did). Rank 0 hosts the rendezvous store.

        ``timeout_s`` bounds the rendezvous and every collective: a member that stops answering turns into
        an error, not a hang.
        """
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight-update group backend must be gloo or nccl, got {backend!r}")
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        chain = rendezvous_store(store, name, backend)
        if backend == "gloo":
            pg: dist.ProcessGroup = dist.ProcessGroupGloo(chain, rank, world_size, timeout)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(chain, rank, world_size, options)
        log.info("weight_group.joined", name=name, rank=rank, world_size=world_size, backend=backend)
        return cls(pg, dist.PrefixStore(f"{name}/miles", store), rank, world_size, name, device)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` from group rank 0 (in place on the others) and wait for it. Collective."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()


def _tensor_view(buf: memoryview, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A uint8 tensor over ``buf`` (CPU, no copy) and, for NCCL, a device staging tensor."""
    host = torch.frombuffer(buf, dtype=torch.uint8) if buf.nbytes else torch.empty(0, dtype=torch.uint8)
    return host, (torch.empty_like(host, device=device) if device.type != "cpu" else None)


class BroadcastTransport:
    """Sender side (trainer leader, group rank 0). ``fetch`` is the receivers' business."""

    kind: ClassVar[TransportKind] = "broadcast"

    def __init__(self, group: WeightUpdateGroup, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if group.rank != 0:
            raise ValueError("the sender of a weight-update group is its rank 0")
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.round = 0
        self.broken: str | None = None

    async def publish(self, layout: PayloadLayout, params: Params, *, run: Runner | None = None) -> Published:
        if self.broken is not None:
            raise TransportBroken(f"weight-update group {self.group.name} is broken: {self.broken}")
        return await runner(run)(lambda: self._round(layout, params))

    def _send(self, chunk: memoryview) -> None:
        if chunk.readonly:  # torch wants a writable buffer to wrap (gloo only reads the source's)
            chunk = memoryview(bytearray(chunk))
        host = torch.frombuffer(chunk, dtype=torch.uint8)  # a view: the broadcast completes before we return
        try:
            self.group.broadcast(host.to(self.group.device) if self.group.device.type != "cpu" else host)
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            raise TransportBroken(f"broadcast to weight-update group {self.group.name} failed: {exc}") from exc

    def _round(self, layout: PayloadLayout, params: Params) -> Published:
        self.round += 1
        bell = {"version": layout.version, "size": layout.size, "bucket_bytes": self.bucket_bytes}
        self.group.store.set(f"round/{self.round}", json.dumps(bell))
        buckets = Rechunker(self.bucket_bytes, self._send)
        try:
            summary = encode_payload(layout, params(), buckets.write)
            buckets.flush()
        except TransportBroken:
            raise
        except Exception:  # the export failed, the group did not: finish the round so receivers stay in step
            self._abort(buckets, layout.size)
            raise
        self._send(memoryview(bytearray([_OK]) + summary.digest.encode() + summary.state_digest.encode()))
        log.info("weights_broadcast", version=layout.version, round=self.round, size=summary.size)
        return Published(
            transport="broadcast",
            version=layout.version,
            size=summary.size,
            chunks=-(-summary.size // self.bucket_bytes),
            digest=summary.digest,
            state_digest=summary.state_digest,
            payload_sha256=summary.payload_sha256,
            location=self.group.name,
        )

    def _abort(self, buckets: Rechunker, size: int) -> None:
        filler = memoryview(bytearray(min(self.bucket_bytes, size)))
        while (remaining := size - buckets.written) > 0:
            buckets.write(filler[:remaining])
        buckets.flush()
        self._send(memoryview(bytearray([_ABORTED]) + bytearray(TRAILER_BYTES - 1)))
        log.warning("weights_broadcast_aborted", round=self.round)


class BroadcastReceiver:
    """Receiver side (an engine process, group rank > 0): a supervised thread takes part in every round and
    keeps the newest ``keep`` verified payloads for :meth:`fetch`."""

    kind: ClassVar[TransportKind] = "broadcast"

    def __init__(self, group: WeightUpdateGroup, *, keep: int = 2, poll_s: float = 0.05) -> None:
        if group.rank == 0:
            raise ValueError("rank 0 of a weight-update group is the sender")
        self.group = group
        self.keep = keep
        self.poll_s = poll_s
        self.round = 0
        self.error: BaseException | None = None
        self._received: OrderedDict[int, tuple[memoryview, str]] = OrderedDict()  # version -> (payload, digest)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None  # replaced by a fresh one after every change

    async def start(self) -> BroadcastReceiver:
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name=f"weights-recv-{self.group.name}", daemon=True)
        self._thread.start()
        return self

    async def stop(self) -> None:
        """Stop after the round in progress; re-raises the thread's error if it died of one."""
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if self.error is not None:
            raise TransportBroken(f"weight receiver {self.group.name} failed: {self.error!r}") from self.error

    async def __aenter__(self) -> BroadcastReceiver:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                key = f"round/{self.round + 1}"
                if not self.group.store.check([key]):
                    self._stop.wait(self.poll_s)
                    continue
                bell = json.loads(self.group.store.get(key))
                self.round += 1
                self._receive(int(bell["version"]), int(bell["size"]), int(bell["bucket_bytes"]))
        except BaseException as exc:  # kept and raised by fetch()/stop(): the follower falls back to the bus
            self.error = exc
            log.error("weight_receiver.failed", group=self.group.name, round=self.round, error=repr(exc))
        finally:
            self._notify()

    def _receive(self, version: int, size: int, bucket_bytes: int) -> None:
        buf = allocate(size)
        for offset in range(0, size, bucket_bytes):
            host, staging = _tensor_view(buf[offset : offset + bucket_bytes], self.group.device)
            if staging is None:
                self.group.broadcast(host)  # lands in buf
            else:
                self.group.broadcast(staging)
                host.copy_(staging.cpu())
        trailer, staging = _tensor_view(memoryview(bytearray(TRAILER_BYTES)), self.group.device)
        self.group.broadcast(trailer if staging is None else staging)
        raw = bytes(trailer.tolist() if staging is None else staging.cpu().tolist())
        if raw[0] != _OK:
            log.warning("weights_round_aborted", version=version, round=self.round)
            return
        sent_digest = raw[1:33].decode()
        actual = digest(buf)
        if actual != sent_digest:
            log.error("weights_round_corrupt", version=version, got=actual, sent=sent_digest)
            return
        with self._lock:
            self._received[version] = (buf, actual)
            self._received.move_to_end(version)
            while len(self._received) > self.keep:
                self._received.popitem(last=False)
        log.info("weights_received", version=version, round=self.round, size=size)
        self._notify()

    def _notify(self) -> None:
        """From the receiver thread: wake every fetch waiting on the loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._bump)

    def _bump(self) -> None:
        assert self._changed is not None
        self._changed.set()
        self._changed = asyncio.Event()

    async def fetch(self, version: int, digest: str, *, location: str = "", timeout_s: float = 60.0) -> memoryview:
        """The payload broadcast as ``version``, once it arrived, if it matches the announced ``digest``.

        The announcement follows the broadcast, so the payload is normally here already; ``timeout_s``
        bounds the wait. :class:`PayloadMissing` if it did not come (or was superseded), :class:`TransportBroken`
        if this member's group failed, :class:`ChecksumMismatch` if it differs from the announcement.
        """
        assert self._changed is not None, "start() the receiver first"
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not (self.error is not None or version in self._received or self._newer_than(version)):
            changed = self._changed
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(changed.wait(), max(remaining, 0.0))
            except TimeoutError:
                raise PayloadMissing(f"weights v{version} were not broadcast within {timeout_s:.0f}s") from None
        with self._lock:
            got = self._received.get(version)
        if got is None:
            if self.error is not None:
                raise TransportBroken(f"weight-update group {self.group.name} failed: {self.error!r}")
            raise PayloadMissing(f"weights v{version} were not received (aborted, corrupt or superseded)")
        payload, actual = got
        if actual != digest:
            raise ChecksumMismatch(f"weights v{version} received with digest {actual}, announced {digest}")
        return payload

    def _newer_than(self, version: int) -> bool:
        with self._lock:
            return any(v > version for v in self._received)
