"""Embedded generation engine: continuous batching over an HF causal LM, in a dedicated loop thread.

Why our own loop rather than ``model.generate``: we need the exact behaviour log-prob of every sampled
token, requests that join and leave a running batch, and control at every token boundary (new weights
switch in between two decode steps). The loop itself is :class:`~miles.engines.torch_loop.SamplingLoop`;
this module owns the thread around it and the weights.

Threads. ``await engine.generate(...)`` (any event loop) puts a request in an inbox and awaits a future;
one loop thread runs the sampling loop and resolves each future with ``loop.call_soon_threadsafe`` on
the caller's loop, so the event loop never blocks on torch. Cancelling the awaiting task flags the
request and the loop drops it at the next token boundary. A failure of the loop thread is kept in
:attr:`TorchEngine.error`, logged once, and fails every pending and later request with
:class:`~miles.engines.base.EngineError`.

In-flight weight updates. :meth:`TorchEngine.stage_weights` validates and parks weights
(:mod:`miles.engines.weight_slot`); the loop thread copies them in at the next token boundary, or at once
when idle, except while :meth:`TorchEngine.pinned`. Each :class:`Generation` records ``version_spans``:
the output index from which each version sampled.

KV-cache policy after a switch: **keep**. The cache computed by the old weights for the prompt and the
tokens generated so far stays; only new tokens are computed with the new weights (as PipelineRL and AReaL
do). Recomputing the prefix would cost a full prefill of prompt + output per switch for every row, and
still would not make the earlier tokens on-policy. Keeping it is exact where it matters: every token's
behaviour log-prob is the log-prob of the distribution it was actually drawn from (new weights over the
old cache), which is what the trainer's importance ratios correct against.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import structlog
import torch
from transformers import PreTrainedModel

from miles.config import TorchEngineConfig
from miles.engines.base import EngineError, Generation, SamplingParams, SparseValues
from miles.engines.kv_cache import batching_plan
from miles.engines.model_forward import select_forward
from miles.engines.torch_loop import Request, Row, SamplingLoop
from miles.engines.weight_slot import WeightSlot, copy_into, validate_state
from miles.models.dsa_topk import stabilize_dsa_topk
from miles.models.loading import to_torch_dtype

if TYPE_CHECKING:
    from miles.sync.engine_weights import EngineWeights

log = structlog.get_logger(__name__)

UNBOUNDED_CONTEXT = 2**31 - 1  # a model whose config names no position limit


def _max_context(model: Any) -> int:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if value else UNBOUNDED_CONTEXT


def _deliver_to(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Generation]) -> Any:
    """A thread-safe callback that resolves ``future`` on ``loop`` (unless its awaiter is gone)."""

    def resolve(outcome: Generation | BaseException) -> None:
        if future.done():  # cancelled meanwhile
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def deliver(outcome: Generation | BaseException) -> None:
        try:
            loop.call_soon_threadsafe(resolve, outcome)
        except RuntimeError:  # the caller's event loop is closed: nobody is waiting for this result
            log.debug("engine_result_dropped", reason="event loop closed")

    return deliver


class TorchEngine:
    """:class:`~miles.engines.base.StagingEngine` over an in-process HF model, batching continuously.

    ``async with engine:`` (or :meth:`start` / :meth:`close`) runs the loop thread; many
    :meth:`generate` calls are in flight at once. Weights change by :meth:`stage_weights` (non-blocking,
    applied by the loop thread at a token boundary) or :meth:`load_weights` (blocking, immediate; for
    tests and start-up). ``switches`` counts applied staged versions, ``last_pause_s`` / ``pauses_s`` are
    their copy times (the generation pause).

    ``seed`` seeds the per-request random streams: request ``i`` (in the order :meth:`generate` is called)
    samples from its own generator, so its tokens do not depend on what else shares the batch.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        cfg: TorchEngineConfig | None = None,
        version: int = 0,
        seed: int | None = None,
    ) -> None:
        self.cfg = cfg or TorchEngineConfig()
        self.model = model.to(device=self.cfg.device, dtype=to_torch_dtype(self.cfg.dtype)).eval()
        # Cached decoding must select the DSA keys a full forward selects (load_policy does it too; a model
        # built elsewhere gets it here).
        stabilize_dsa_topk(self.model)
        self.device = torch.device(self.cfg.device)
        self.pad_token_id = int(pad_token_id)
        self._max_context = _max_context(self.model)
        embeddings = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        self._vocab = int(embeddings.num_embeddings) if embeddings is not None else None
        plan = batching_plan(self.model)
        self.continuous = plan.continuous
        max_batch, max_prefill_tokens = self.cfg.max_batch, self.cfg.max_prefill_tokens
        forward, self.forward_kind = select_forward(self.model, self.cfg.forward)
        self._loop = SamplingLoop(
            self.model,
            self.pad_token_id,
            max_context=self._max_context,
            max_batch=max_batch,
            max_prefill_tokens=max_prefill_tokens,
            continuous=plan.continuous,
            device=self.device,
            forward=forward,
        )
        log.info("engine_forward", forward=self.forward_kind)
        if not plan.continuous:
            log.warning("engine_batching_fallback", model=type(self.model).__name__, reason=plan.reason)
        self._version = int(version)
        self._seeds = random.Random(seed)
        # _cond guards the inbox, the weight slot, pins, _version writes, _thread/_stopping/_error.
        self._cond = threading.Condition()
        # Held by the loop thread for a whole token boundary, and by load_weights: no copy lands mid-forward.
        self._model_lock = threading.Lock()
        self._inbox: deque[Request] = deque()
        self._slot = WeightSlot()
        self._pins = 0
        self._loads_waiting = 0  # load_weights calls waiting for the model lock: the loop lets them in first
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: EngineError | None = None
        self.switches = 0
        self.last_pause_s = 0.0
        self.pauses_s: list[float] = []  # one per applied switch (bounded: the most recent 1000)

    # ------------------------------------------------------------------ state

    @property
    def version(self) -> int:
        """Policy version of the weights generation currently uses."""
        return self._version

    @property
    def max_context(self) -> int:
        """Most tokens (prompt + output) per request: the model's ``max_position_embeddings``."""
        return self._max_context

    @property
    def error(self) -> BaseException | None:
        """Why the loop thread died (an :class:`EngineError` whose cause is the original), or None."""
        return self._error

    @property
    def pending_version(self) -> int | None:
        """Version staged (or being copied in) but not yet adopted; None if none."""
        with self._cond:
            return self._slot.pending_version()

    @property
    def running_rows(self) -> int:
        """Requests in the running batch (a gauge for heartbeats; read without a lock)."""
        return len(self._loop.rows)

    @property
    def queued(self) -> int:
        """Requests waiting to join the batch."""
        return len(self._inbox)

    def heartbeat_stats(self) -> dict[str, float]:
        """Gauges for the worker's heartbeat: rows running, requests queued, applied switches."""
        rows, queued = float(self.running_rows), float(self.queued)
        return {"engine_rows": rows, "engine_queued": queued, "switches": float(self.switches)}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the loop thread. An engine may be started again after :meth:`close`, not after a failure."""
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._thread is not None:
                raise EngineError("TorchEngine is already started")
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="torch-engine-loop", daemon=True)
            self._thread.start()

    async def close(self) -> None:
        """Stop the loop thread; requests still pending fail with :class:`EngineError`."""
        with self._cond:
            thread = self._thread
            self._stopping = True
            self._cond.notify_all()
        if thread is not None:
            await asyncio.to_thread(thread.join)
        with self._cond:
            self._thread = None

    async def __aenter__(self) -> TorchEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ generation

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Sample one completion; output ids include the stop token that ended it, if any.

        Raises ``ValueError`` for an invalid request (nothing is queued) and :class:`EngineError` if the
        engine is not started or has failed. Cancelling the awaiting task removes the request from the batch.
        """
        self._validate_request(prompt_ids, params)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Generation] = loop.create_future()
        request = Request(list(prompt_ids), params, self._seeds.getrandbits(63), _deliver_to(loop, future))
        with self._cond:
            if self._error is not None:
                raise EngineError(str(self._error)) from self._error.__cause__
            if self._thread is None or self._stopping:
                raise EngineError("TorchEngine is not started: use `async with engine:` or `await engine.start()`")
            self._inbox.append(request)
            self._cond.notify_all()
        try:
            return await future
        except asyncio.CancelledError:
            request.cancelled = True
            raise

    def _validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if len(prompt_ids) == 0:
            raise ValueError("every prompt needs at least one token (encode_prompt adds BOS)")
        if params.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {params.max_new_tokens}")
        if params.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        if self._vocab is not None and not (0 <= min(prompt_ids) and max(prompt_ids) < self._vocab):
            low, high = min(prompt_ids), max(prompt_ids)
            raise ValueError(f"prompt token ids must be in [0, {self._vocab}), got {low}..{high}")

    @asynccontextmanager
    async def pinned(self) -> AsyncIterator[int]:
        """``async with engine.pinned() as version:`` staged weights wait until the block ends.

        Waits for a copy already under way, so ``version`` is the version every token sampled inside the
        block uses. :meth:`load_weights` (immediate by contract) is not held back.
        """
        with self._cond:
            self._pins += 1
            copying = self._slot.applying is not None
        try:
            if copying:
                await asyncio.to_thread(self._wait_copied)
            yield self._version
        finally:
            with self._cond:
                self._pins -= 1
                self._cond.notify_all()

    def _wait_copied(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._slot.applying is None)

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        try:
            while self._wait_for_work():
                with self._model_lock, torch.inference_mode():
                    self._boundary()
        except BaseException as exc:  # the thread's supervisor: record, log once, fail every request
            self._fail(exc)
            return
        self._abort_all(EngineError("TorchEngine closed while the request was pending"))

    def _wait_for_work(self) -> bool:
        """Block while idle (no request, no row, no staged weights it may apply) or while a ``load_weights``
        waits for the model lock (a lock is not fair: the loop would take it again first); False once stopping."""
        with self._cond:
            while not self._stopping and (
                self._loads_waiting
                or not (self._inbox or self._loop.batch is not None or (self._slot.has_pending() and not self._pins))
            ):
                self._cond.wait()
            return not self._stopping

    def _boundary(self) -> None:
        """One token boundary: departures, arrivals, weights, then one token for every row.

        Weights apply *after* admission: whatever was staged before a newcomer was submitted is then in the
        slot when it is admitted, so its first token is at least that version (the rollout worker's staleness
        floor: it waits until the version is staged, then submits).
        """
        self._deliver(self._loop.retire())
        with self._cond:
            fresh = self._loop.admit(self._inbox)
        self._apply_staged()
        if fresh:
            joined = self._loop.prefill(fresh, self._version)
            if joined is not None:
                self._loop.merge(joined)
            self._deliver(self._loop.retire())
        if self._loop.batch is not None:
            self._loop.step(self._version)
            self._deliver(self._loop.retire())

    def _deliver(self, rows: list[Row]) -> None:
        for row in rows:
            row.request.deliver(row.generation(self._version))

    def _fail(self, exc: BaseException) -> None:
        error = EngineError(f"torch engine loop failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        with self._cond:
            self._error = error
        log.error("engine_loop_failed", error=str(error), exc_info=exc)
        self._abort_all(error)

    def _abort_all(self, error: EngineError) -> None:
        """Fail every request still held: queued, running, or finished but not yet delivered."""
        with self._cond:
            queued, self._inbox = list(self._inbox), deque()
        for request in queued + [row.request for row in self._loop.abandon()]:
            failure = EngineError(str(error))
            failure.__cause__ = error.__cause__
            request.deliver(failure)

    # ------------------------------------------------------------------ weights

    def weight_sink(self, precision: str, lora_scale: float | None) -> EngineWeights:
        """Tensors copied in place: FP8/FP4 dequantized, a LoRA adapter merged on the frozen base this model holds."""
        from miles.sync.engine_weights import EngineWeights

        return EngineWeights(self.model.state_dict, precision=precision, lora_scale=lora_scale)

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int, *, complete: bool = True) -> None:
        """Copy a full HF state dict into the model in place (dtype/device converted), adopt ``version``.

        Everything is validated before anything is copied, so a bad payload leaves the old weights intact.
        Tied parameters may be given once. ``complete=False`` loads only the given tensors. Immediate and
        unconditional (any version, even an older one; not held back by :meth:`pinned`); it waits for the
        running token step, so rows in flight switch at that boundary (recorded in their spans). A staged
        version not newer than ``version`` is dropped. Blocking: not for the event-loop thread.
        """
        targets = self.model.state_dict()
        validate_state(targets, state, "load_weights", complete=complete)
        with self._cond:
            self._loads_waiting += 1
        try:
            with self._model_lock:
                copy_into(targets, [state])
                with self._cond:
                    self._version = int(version)
                    self._slot.drop_superseded(self._version)
        finally:
            with self._cond:
                self._loads_waiting -= 1
                self._cond.notify_all()

    def stage_weights(
        self,
        state: Mapping[str, torch.Tensor | SparseValues],
        version: int,
        *,
        base_version: int | None = None,
        complete: bool = True,
    ) -> bool:
        """Park weights for the loop thread (next token boundary, or at once when idle and not pinned).

        Thread-safe and non-blocking. Keys, shapes and sparse indices are validated now (``ValueError``,
        nothing staged). Newest wins: a version not newer than the one in use, being applied or staged is
        refused (False). ``complete=False`` stages a partial update (tensors, or :class:`SparseValues`
        relative to ``base_version``, refused unless the engine will be exactly at that version). The caller
        must not mutate ``state`` afterwards.
        """
        if not complete and base_version is None and any(isinstance(v, SparseValues) for v in state.values()):
            raise ValueError("stage_weights: sparse values are relative, so they need base_version")
        validate_state(self.model.state_dict(), state, "stage_weights", complete=complete)
        with self._cond:
            accepted = self._slot.offer(
                state, int(version), current=self._version, base_version=base_version, complete=complete
            )
            if accepted:
                self._cond.notify_all()
        return accepted

    def _apply_staged(self) -> None:
        """Copy staged weights in at this boundary (loop thread, model lock held), unless pinned."""
        with self._cond:
            if self._pins or not self._slot.has_pending():
                return
            taken = self._slot.take(self._version)
        if taken is None:
            return
        try:
            pause = copy_into(self.model.state_dict(), taken.states)
        except BaseException:
            with self._cond:
                self._slot.applying = None
                self._cond.notify_all()
            raise
        with self._cond:  # adopt and clear together: pending_version never reads None before version moves
            self._version = taken.version
            self._slot.applying = None
            self._cond.notify_all()
        self.switches += 1
        self.last_pause_s = pause
        self.pauses_s = [*self.pauses_s[-999:], pause]
        log.info(
            "weights_applied",
            version=taken.version,
            pause_ms=round(pause * 1e3, 2),
            rows=len(self._loop.rows),
            updates=len(taken.states),
        )
