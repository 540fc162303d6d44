"""The request side of SGLang's distributed weight update: ``/init_weights_update_group`` and
``/update_weights_from_distributed``, with the trainer leader as rank 0 of the group.

SGLang receives *named tensors*, not a payload: each ``/update_weights_from_distributed`` request lists
``names``, ``dtypes`` and ``shapes``; the server allocates them, then takes one broadcast per tensor from
group rank 0, in that order, loads them and replies. So the trainer sends, per bucket of at most
``bucket_bytes`` of tensors (in the streamed export's sorted order): the request to every server (on
helper threads, since the reply only comes once the tensors arrived), then the bucket's broadcasts, one
tensor at a time as the export yields them, then it waits for every reply. Only the last request carries
``weight_version`` and ``flush_cache``, so the server's version label moves once the whole set is in.

Group layout: trainer rank 0; server ``i`` with ``tp_sizes[i]`` ranks takes ranks ``1 + sum(tp_sizes[:i])``
onwards (``rank_offset``); world size ``1 + sum(tp_sizes)``. SGLang joins with torch's group helper over
``tcp://master_addr:master_port``; :meth:`WeightUpdateGroup.join` builds the same store-prefix chain.

Precision: SGLang loads tensors by HF name in its own dtype, so only ``bfloat16`` / ``float32`` payloads
apply (the ``.qscale`` scales of fp8/fp4 have no meaning to SGLang's loaders). The state digest of exactly
the tensors sent is computed on the way and announced as usual; SGLang does not report a digest back, so a
worker driving SGLang can only confirm the version (``/get_weight_version``), not re-hash what it holds.

Needs a GPU in production (SGLang, NCCL); the contract test uses gloo and a fake server.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

import structlog
import torch

from miles.engines.server_client import ServerClient, ServerError
from miles.sync.precision import is_quantized
from miles.sync.stream_export import PayloadLayout, StateHasher, TensorSpec, drain, iter_rollout_tensors
from miles.sync.transport.base import Params, Published, Runner, TransportKind, runner
from miles.sync.transport.broadcast import WeightUpdateGroup

log = structlog.get_logger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


class SglangUpdateError(ServerError):
    """An SGLang server refused (or failed) a weight-update request."""


def _post(client: ServerClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A blocking update call (a helper thread: the reply only comes once the tensors arrived)."""
    reply = client.call_blocking("POST", path, json_body=body)
    if not isinstance(reply, dict) or not reply.get("success", False):
        message = reply.get("message") if isinstance(reply, dict) else reply
        raise SglangUpdateError(f"POST {client.base_url}{path} failed: {message}")
    return reply


def buckets(specs: Iterable[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of at most ``bucket_bytes`` (a larger tensor is a bucket of its own)."""
    out: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not out or size + spec.nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(spec)
        size += spec.nbytes
    return out


class SglangDistributedSync:
    """Pushes each version into SGLang servers over a weight-update group the trainer leader hosts."""

    kind: ClassVar[TransportKind] = "sglang"

    def __init__(
        self,
        urls: list[str],
        *,
        master_addr: str,
        master_port: int,
        tp_sizes: list[int] | None = None,
        group_name: str = "miles_weights",
        backend: str = "nccl",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 600.0,
    ) -> None:
        self.urls = list(urls)
        self.tp_sizes = list(tp_sizes) if tp_sizes is not None else [1] * len(self.urls)
        if len(self.tp_sizes) != len(self.urls) or min(self.tp_sizes, default=1) < 1:
            raise ValueError("one tp size >= 1 per SGLang server")
        self.master_addr = master_addr
        self.master_port = master_port
        self.group_name = group_name
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.clients = [
            ServerClient(url, server="SGLang", timeout_s=timeout_s, refused=SglangUpdateError) for url in self.urls
        ]
        self.group: WeightUpdateGroup | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)), thread_name_prefix="sglang-update")

    @property
    def world_size(self) -> int:
        return 1 + sum(self.tp_sizes)

    def init_requests(self) -> list[dict[str, Any]]:
        """The ``/init_weights_update_group`` body for each server."""
        offsets = [1 + sum(self.tp_sizes[:i]) for i in range(len(self.urls))]
        return [
            {
                "master_address": self.master_addr,
                "master_port": self.master_port,
                "rank_offset": offset,
                "world_size": self.world_size,
                "group_name": self.group_name,
                "backend": self.backend,
            }
            for offset in offsets
        ]

    def connect(self) -> WeightUpdateGroup:
        """Form the group: ask every server to join (their replies come once everyone joined) while joining
        as rank 0. Blocking: call it on a worker thread."""
        futures = [
            self._pool.submit(_post, client, "/init_weights_update_group", body)
            for client, body in zip(self.clients, self.init_requests(), strict=True)
        ]
        try:
            self.group = WeightUpdateGroup.join(
                self.master_addr,
                self.master_port,
                0,
                self.world_size,
                name=self.group_name,
                backend=self.backend,
                timeout_s=self.timeout_s,
            )
        finally:
            for fut in futures:
                fut.result()  # raises a refused join; waits for every request either way
        return self.group

    async def publish(self, layout: PayloadLayout, params: Params, *, run: Runner | None = None) -> Published:
        if is_quantized(layout.precision):
            raise ValueError(f"SGLang loads HF tensors: publish bfloat16 or float32, not {layout.precision}")
        if self.group is None:
            raise RuntimeError("connect() the weight-update group first")
        return await runner(run)(lambda: self._update(layout, params))

    def update_requests(self, layout: PayloadLayout) -> list[dict[str, Any]]:
        """The ``/update_weights_from_distributed`` bodies of one version, bucket by bucket."""
        groups = buckets(layout.tensors, self.bucket_bytes)
        return [
            {
                "names": [s.name for s in bucket],
                "dtypes": [str(s.dtype).removeprefix("torch.") for s in bucket],
                "shapes": [list(s.shape) for s in bucket],
                "group_name": self.group_name,
                "flush_cache": i == len(groups) - 1,
                **({"weight_version": str(layout.version)} if i == len(groups) - 1 else {}),
            }
            for i, bucket in enumerate(groups)
        ]

    def _update(self, layout: PayloadLayout, params: Params) -> Published:
        assert self.group is not None
        source = iter(params())
        tensors: Iterator[tuple[TensorSpec, torch.Tensor]] = iter_rollout_tensors(layout, source)
        hasher = StateHasher()
        requests = self.update_requests(layout)
        try:
            for body in requests:
                replies: list[Future] = [
                    self._pool.submit(_post, client, "/update_weights_from_distributed", body)
                    for client in self.clients
                ]
                try:
                    for name in body["names"]:
                        spec, tensor = next(tensors)
                        assert spec.name == name, (spec.name, name)
                        hasher.update(spec.name, tensor)
                        self.group.broadcast(tensor.to(self.group.device).contiguous())
                finally:
                    for reply in replies:
                        reply.result()
            drain(tensors)  # the export's end: the plan check raises if a planned tensor never came
        except Exception:
            drain(source)  # the export is collective on the trainer: finish it before failing
            raise
        log.info("weights_sglang_updated", version=layout.version, servers=len(self.urls), buckets=len(requests))
        return Published(
            transport="sglang",
            version=layout.version,
            size=sum(s.nbytes for s in layout.tensors),
            chunks=len(requests),
            digest="",
            state_digest=hasher.hexdigest(),
            location=self.group_name,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for client in self.clients:
            client.close_blocking()
