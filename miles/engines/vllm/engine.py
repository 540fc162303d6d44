"""Engine that drives a vLLM server over HTTP: token ids in and out, many requests in flight.

The worker starts the server itself (:class:`~miles.engines.vllm.server.VllmServer`, from the cached vLLM
environment) unless ``rollout.engine.url`` points at one already running. The contract we rely on, checked
against a real vLLM CPU server by ``tests/integration/test_vllm_engine.py``:

* ``POST /inference/v1/generate`` with ``token_ids`` and ``sampling_params`` (``max_tokens``,
  ``temperature``, ``top_p``, ``stop_token_ids``, ``logprobs: 0``) answers one choice: ``token_ids`` (a stop
  token that ended it included), ``logprobs.content[i].logprob`` (the sampled token's log-probability after
  temperature: the server runs with ``--logprobs-mode processed_logprobs``; with ``top_p < 1`` vLLM reports
  it after the top-p cut, which is not what our importance ratios assume, so keep ``top_p`` at 1 with this
  engine), ``finish_reason`` and ``weight_versions``: ``[{version, start, end}]``, the weight version that
  sampled each span of output tokens, as the server itself recorded it.
* Weight updates: the worker writes the staged state to ``<weights_dir>/v<version>.safetensors`` and has
  the server read and hash it on a thread while it keeps generating (``miles_prefetch``, polled with
  ``miles_prefetched``), then ``POST /pause?mode=keep`` (requests in flight freeze where they are),
  ``POST /collective_rpc`` ``miles_load_weights(path, digest)`` (Miles' worker extension checks the
  prefetched state's digest, reloads the weights in place through vLLM's own reload path and answers the
  digest it loaded),
  ``POST /update_weight_version``, ``POST /resume``. Frozen requests continue under the new weights and the
  server splits their ``weight_versions`` at the switch, so per-token versions stay exact without aborting
  and resubmitting anything. A refused or failed load resumes on the old weights and version; it is counted
  (``failures``) and tried again a second later, unless a newer version was staged meanwhile.
* The server dying (its process exits) or hanging (``/health`` unanswered ``hang_checks`` times in a row) is
  seen by a supervisor task: generation is held, the server is killed and started again, the held version's
  file is loaded back (and verified), and requests that were in flight are sent again from their start
  (nothing of them was returned, so nothing is lost or used twice). After ``max_restarts`` restarts the
  engine fails (:attr:`error`) and the worker with it, so its unacked prompt groups go to another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from miles.config import LoraConfig, VllmEngineConfig
from miles.engines.adapter_files import WEIGHTS_NAME, save_peft_adapter
from miles.engines.base import EngineError, FinishReason, Generation, SamplingParams, SparseValues
from miles.engines.server_client import ConnectionLost, ServerClient, ServerError
from miles.engines.staging import StagedSlot, whole_state

if TYPE_CHECKING:
    import torch

    from miles.engines.vllm.server import VllmServer
    from miles.sync.engine_weights import EngineWeights

log = structlog.get_logger(__name__)

MAX_CONNECTIONS = 512
RETRY_S = 1.0  # a failed load (the server restarting under it, a refused file) is tried again after this
PREFETCH_POLL_S = 0.01
KEEP_FILES = 2  # weight files kept: the held version's (a restarted server loads it back) and the newest


class VllmError(ServerError):
    """The server refused a request or answered outside the contract above."""


def _load_rpc(path: Path, digest: str) -> dict[str, Any]:
    """The ``/collective_rpc`` body that has Miles' worker extension check ``path``'s digest and load it."""
    return {"method": "miles_load_weights", "kwargs": {"path": str(path), "digest": digest}}


class ServerDown(Exception):
    """A request found the server gone (connection refused or dropped): wait for the restart, send again."""


def _finish_reason(raw: Any) -> FinishReason:
    if raw == "length":
        return "length"
    if raw == "stop":
        return "stop"
    raise VllmError(f"generation did not finish normally: finish_reason={raw!r}")


def _engine_dead(server: VllmServer, error: ServerError) -> bool:
    """A 5xx that means the server is going down (its engine core died), not that it refused this request."""
    if error.status is None or error.status < 500:
        return False
    return server.exited() is not None or "EngineDead" in error.body or "EngineCore encountered" in error.body


class VllmEngine:
    """:class:`~miles.engines.base.StagingEngine` over a vLLM server (started here, or at ``cfg.url``)."""

    def __init__(
        self,
        cfg: VllmEngineConfig,
        model_dir: str | Path,
        *,
        version: int = -1,
        weights_dir: str | Path,
        log_path: str | Path,
        max_context: int,
    ) -> None:
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.weights_dir = Path(weights_dir).resolve()  # the server opens it: an absolute path
        self.log_path = Path(log_path)
        self._max_context = max_context
        self._version = int(version)
        self.server: VllmServer | None = None
        self.base_url = cfg.url.rstrip("/") if cfg.url else ""
        self._client: ServerClient | None = None  # requests and control calls, opened by start()
        self._probe: ServerClient | None = None  # the supervisor's /health, on connections of its own
        self._error: EngineError | None = None
        self._slot = StagedSlot()  # stage_weights may be called from any thread
        self.lora: LoraConfig | None = None  # LoRA mode (serve_adapters): adapters served by the server
        self._adapter: tuple[str, int] | None = None  # (name, version) new requests name
        self._adapters: dict[str, Path] = {}  # loaded on the server and not unloaded, oldest first
        self._adapter_requests: Counter[str] = Counter()  # requests in flight per adapter name
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving = asyncio.Event()  # set while requests may go to the server (cleared during a restart)
        self._pins = 0
        self._unpinned = asyncio.Event()
        self._unpinned.set()
        self._held_file: tuple[int, Path, str] | None = None  # version, file, digest the server holds
        self._restart_reason: str | None = None  # set when the server's weights are unknown: the supervisor acts
        self._tasks: list[asyncio.Task[None]] = []
        self._labeller = ThreadPoolExecutor(1, thread_name_prefix="vllm-label")  # the label beside the load
        self.switches = 0
        self.last_pause_s = 0.0  # the server paused, see _switch
        self.last_switch_s = 0.0  # pause requested to resumed, the step in progress included
        self.last_write_s = 0.0
        self.last_copy_s = 0.0  # the server's in-place copy of the newest version (inside the pause)
        self.failures = 0
        self.last_error: Exception | None = None
        self.restarts = 0
        self.resent = 0  # requests sent again after a restart
        self.requests_in_flight = 0  # generate requests sent to the server and not answered yet

    # ------------------------------------------------------------------ state

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def pending_version(self) -> int | None:
        return self._slot.pending

    def heartbeat_stats(self) -> dict[str, float]:
        """Server health for the worker's heartbeat (and so the monitor)."""
        up = self._serving.is_set() and (self.server is None or self.server.exited() is None)
        return {
            "engine_server_up": float(up),
            "engine_restarts": float(self.restarts),
            "engine_resent": float(self.resent),
            "weight_load_failures": float(self.failures),
            "weight_load_failing": float(self.last_error is not None),
            "last_write_ms": self.last_write_s * 1e3,
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._client is not None:
            raise EngineError("VllmEngine is already started")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        if not self.cfg.url:
            from miles.engines.vllm.env import ensure_vllm_env
            from miles.engines.vllm.server import VllmServer

            python = self.cfg.python or await asyncio.to_thread(ensure_vllm_env)
            self.server = VllmServer(self.cfg, python, self.model_dir, self.log_path, lora=self.lora)
            await self.server.start()
            self.base_url = self.server.url
        self._client = self._server_client(self.cfg.timeout_s, MAX_CONNECTIONS)
        self._probe = self._server_client(self.cfg.health_timeout_s, 2)
        self._serving.set()
        self._tasks = [asyncio.create_task(self._apply_staged(), name="vllm.weights")]
        if self.server is not None:
            self._tasks.append(asyncio.create_task(self._supervise(), name="vllm.supervisor"))
        for task in self._tasks:
            task.add_done_callback(self._task_done)

    def _server_client(self, timeout_s: float, max_connections: int) -> ServerClient:
        return ServerClient(
            self.base_url, server="vLLM", timeout_s=timeout_s, max_connections=max_connections, refused=VllmError
        )

    def _task_done(self, task: asyncio.Task[None]) -> None:
        """A background task that ends other than by cancellation fails the engine (never silently)."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._error is None:
            self._error = exc if isinstance(exc, EngineError) else EngineError(f"{task.get_name()}: {exc!r}")
            log.error("vllm_engine_failed", task=task.get_name(), error=str(exc))
            self._serving.set()  # waiting requests wake up and raise

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        for client in (self._client, self._probe):
            if client is not None:
                await client.close()
        self._client = self._probe = None
        if self.server is not None:
            await self.server.stop()

    async def __aenter__(self) -> VllmEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @contextlib.asynccontextmanager
    async def pinned(self) -> AsyncIterator[int]:
        """No staged weights switch in until the block ends (an evaluation at one version)."""
        self._pins += 1
        self._unpinned.clear()
        try:
            yield self._version
        finally:
            self._pins -= 1
            if self._pins == 0:
                self._unpinned.set()

    # ------------------------------------------------------------------ generation

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if len(prompt_ids) == 0:
            raise ValueError("every prompt needs at least one token (encode_prompt adds BOS)")
        if params.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {params.max_new_tokens}")
        budget = min(params.max_new_tokens, self._max_context - len(prompt_ids))
        if budget <= 0:
            self._raise_if_failed()
            return Generation(list(prompt_ids), [], [], "context", self._version)
        payload: dict[str, Any] = {
            "token_ids": list(prompt_ids),
            "sampling_params": {
                "max_tokens": budget,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "stop_token_ids": list(params.stop_token_ids),
                "logprobs": 0,
                "ignore_eos": not params.stop_token_ids,  # only the caller's stop tokens end a request
            },
        }
        while True:
            await self._serving.wait()
            self._raise_if_failed()
            client = self._client
            if client is None:
                raise EngineError("VllmEngine is not started: use `async with engine:` or `await engine.start()`")
            adapter = self._adapter  # LoRA mode: the whole request runs on this adapter, even across a load
            if adapter is not None:
                payload["model"] = adapter[0]
                self._adapter_requests[adapter[0]] += 1
            self.requests_in_flight += 1
            lost: ServerDown | None = None
            try:
                reply = await self._post_generate(client, payload)
            except ServerDown as exc:
                lost = exc
            finally:
                self.requests_in_flight -= 1
                if adapter is not None:
                    self._adapter_requests[adapter[0]] -= 1
            if lost is not None:
                if self.server is None:  # not ours to restart
                    self._error = EngineError(f"cannot reach vLLM at {self.base_url}: {lost}")
                    raise self._error from None
                self.resent += 1
                await self._wait_for_restart()
                continue  # sent again from its start, on the adapter that is newest then
            gen = self._parse(list(prompt_ids), reply, None if adapter is None else adapter[1])
            if gen.finish_reason == "length" and budget < params.max_new_tokens:
                gen.finish_reason = "context"
            return gen

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise EngineError(str(self._error)) from self._error

    async def _wait_for_restart(self) -> None:
        """A request lost its connection: send it again once the server answers /health. That is at once when
        only the connection dropped (a keep-alive connection the server closed), else after the supervisor
        has restarted the server (only the supervisor decides that the server is down)."""
        async with asyncio.timeout(self.cfg.startup_timeout_s * 2 + 60):
            while True:
                self._raise_if_failed()
                if self._serving.is_set() and self.server is not None and self.server.exited() is None:
                    if await self._answers_health():
                        return
                await asyncio.sleep(0.2)

    async def _answers_health(self) -> bool:
        probe = self._probe
        return probe is not None and await probe.healthy(timeout_s=self.cfg.health_timeout_s)

    async def _post_generate(self, client: ServerClient, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            return await client.call("POST", "/inference/v1/generate", json_body=payload)
        except ConnectionLost as exc:
            raise ServerDown(str(exc)) from None
        except ServerError as exc:
            if self.server is not None and _engine_dead(self.server, exc):
                raise ServerDown(f"HTTP {exc.status} from a server whose engine died") from None
            raise

    def _parse(self, prompt: list[int], reply: Mapping[str, Any], adapter_version: int | None = None) -> Generation:
        """One choice as a :class:`Generation`. LoRA mode: every token's version is the adapter's (the server's
        ``weight_versions`` label the base, which never changes)."""
        choices = reply.get("choices")
        if not isinstance(choices, list) or len(choices) != 1:
            raise VllmError(f"/inference/v1/generate answered {len(choices or [])} choices, expected 1")
        choice = choices[0]
        output_ids = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content")
        if content is None or len(content) != len(output_ids):
            raise VllmError(
                f"/inference/v1/generate: {len(output_ids)} token ids but "
                f"{'no' if content is None else len(content)} log-probs (was logprobs: 0 sent?)"
            )
        if any(int(entry["token_id"]) != tok for entry, tok in zip(content, output_ids, strict=True)):
            raise VllmError("/inference/v1/generate: log-probs are not of the returned token ids")
        if adapter_version is not None:
            spans = [(0, adapter_version)]
        else:
            spans = self._spans(choice.get("weight_versions"), len(output_ids))
        return Generation(
            prompt_ids=prompt,
            output_ids=output_ids,
            logprobs=[float(entry["logprob"]) for entry in content],
            finish_reason=_finish_reason(choice.get("finish_reason")),
            weight_version=spans[0][1],
            version_spans=spans,
        )

    def _spans(self, raw: Any, n_tokens: int) -> list[tuple[int, int]]:
        """The server's ``weight_versions`` as ``[(first index, version)]``; its label before our first load
        (``default``) is the version the engine was built with."""
        if not raw:
            return [(0, self._version)]
        spans: list[tuple[int, int]] = []
        for span in raw:
            label = str(span.get("version"))
            try:
                version = int(label)
            except ValueError:
                if label != "default":
                    raise VllmError(f"weight_versions names version {label!r}, not one Miles set") from None
                version = self._version if not spans else spans[-1][1]
            start = int(span.get("start", 0))
            if spans and spans[-1][1] == version:
                continue
            spans.append((start, version))
        if spans[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(spans, spans[1:], strict=False)):
            raise VllmError(f"weight_versions {raw!r} do not cover {n_tokens} tokens in order")
        return spans

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        expect_json: bool = True,
    ) -> Any:
        """A control call (pause, load, label, resume); :class:`ConnectionLost` if the server may have died."""
        client = self._client
        if client is None:
            raise EngineError("VllmEngine is not started")
        return await client.call(method, path, json_body=json, params=params, expect_json=expect_json)

    # ------------------------------------------------------------------ weights

    def serve_adapters(self, lora: LoraConfig) -> None:
        """LoRA mode: the server applies the adapters itself (vLLM's LoRA serving); call before :meth:`start`.

        Each version is a peft adapter directory loaded as ``miles-v<version>`` while the server keeps
        generating (no pause: new requests name the new adapter, requests in flight keep theirs), and unloaded
        once no request in flight names it and it is not the newest."""
        if self._client is not None:
            raise EngineError("serve_adapters must be called before start()")
        self.lora = lora

    def stage_weights(
        self,
        state: Mapping[str, torch.Tensor | SparseValues],
        version: int,
        *,
        base_version: int | None = None,
        complete: bool = True,
    ) -> bool:
        """Park a whole state (LoRA mode: a whole adapter) as ``version`` for the loader task; False if not newer
        than what it has.

        Never blocks. vLLM reloads whole tensors from a file: the follower's delta fast path is declined (False)
        and other states are checked by :func:`~miles.engines.staging.whole_state` (``ValueError``)."""
        tensors = whole_state(state, server="vLLM", lora=self.lora, base_version=base_version, complete=complete)
        if tensors is None or not self._slot.offer(int(version), tensors, self._version):
            return False
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)
        return True

    def weight_sink(self, precision: str, lora_scale: float | None) -> EngineWeights:
        """Whole states in the server's dtype (FP8/FP4 dequantized); in LoRA mode the adapter itself, which the
        server applies (its scale comes from the adapter's config, so ``lora_scale`` is not used then)."""
        from miles.sync.engine_weights import EngineWeights

        if lora_scale is not None and self.lora is None:
            raise ValueError("a vLLM engine serves LoRA adapters itself: call serve_adapters(lora) before start()")
        return EngineWeights(dict, precision=precision, adapters="passthrough" if self.lora is not None else "merge")

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Load ``state`` as ``version`` now (blocking, from a thread other than the engine's event loop)."""
        loop = self._loop
        if loop is None:
            raise EngineError("VllmEngine is not started")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError("VllmEngine.load_weights blocks: call it from another thread, or stage_weights")
        asyncio.run_coroutine_threadsafe(self._load(int(version), dict(state)), loop).result()
        if self._version != int(version):
            raise EngineError(f"loading version {version} failed: {self.last_error}")

    async def _apply_staged(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            staged = self._slot.take()
            if staged is None:
                continue
            try:
                await self._load(*staged)
            finally:
                self._slot.done()

    async def _load(self, version: int, state: dict[str, torch.Tensor]) -> None:
        start = time.perf_counter()
        write = self._write if self.lora is None else self._write_adapter
        path, digest = await asyncio.to_thread(write, version, state)
        self.last_write_s = time.perf_counter() - start
        await self._unpinned.wait()  # an evaluation in progress keeps its version
        await self._serving.wait()
        try:
            if self.lora is None:
                await self._prefetch(path)
                pause_s, switch_s = await self._switch(version, path, digest)
            else:  # no pause: requests in flight keep the adapter they named
                pause_s, switch_s = 0.0, await self._switch_adapter(version, path, digest)
        except EngineError as exc:
            self.failures += 1
            self.last_error = exc
            log.error("vllm_weights_load_failed", version=version, error=str(exc))
            self._slot.retry(version, state)  # unless a newer one came meanwhile
            await asyncio.sleep(RETRY_S)
            assert self._wake is not None
            self._wake.set()
            return
        self.last_error = None
        self.switches += 1
        self.last_pause_s = pause_s
        self.last_switch_s = switch_s
        self._held_file = (version, path, digest)
        if self.lora is None:
            await asyncio.to_thread(self._prune, path)
        log.info(
            "vllm_weights_loaded",
            version=version,
            pause_ms=round(pause_s * 1e3, 1),
            switch_ms=round(switch_s * 1e3, 1),
            copy_ms=round(self.last_copy_s * 1e3, 1),
            digest=digest,
        )

    async def _prefetch(self, path: Path) -> None:
        """Have the server read and hash ``path`` on a thread of its own while it keeps generating, and wait
        until it has (each poll is one RPC between engine steps), so the pause that follows holds only the
        copy into the model. A server restarted meanwhile just reads the file during the load."""
        await self._call("POST", "/collective_rpc", json={"method": "miles_prefetch", "kwargs": {"path": str(path)}})
        async with asyncio.timeout(self.cfg.timeout_s):
            while True:
                reply = await self._call(
                    "POST", "/collective_rpc", json={"method": "miles_prefetched", "kwargs": {"path": str(path)}}
                )
                results = reply.get("results") if isinstance(reply, dict) else None
                if not isinstance(results, list) or not results:
                    raise VllmError(f"miles_prefetched answered {reply!r}")
                if all(isinstance(result, dict) and result.get("done") is True for result in results):
                    return
                await asyncio.sleep(PREFETCH_POLL_S)

    async def _switch(self, version: int, path: Path, digest: str) -> tuple[float, float]:
        """Pause (requests freeze in place), load and verify, label the version, resume.

        The four calls run on a thread with blocking requests: on the worker's event loop each reply would also
        wait for the worker's other tasks, and while the server is paused that wait is lost generation.

        Returns ``(paused, switch)``: ``paused`` from the pause's reply to the resume's reply, a time when the
        server certainly generates nothing (vLLM pauses at the end of the step in progress, then waits for its
        outputs to be sent and 20 ms more before it replies, so the server is paused a little longer);
        ``switch`` from the pause request on, which includes the step in progress, during which the server
        still generates."""
        client = self._client
        if client is None:
            raise EngineError("VllmEngine is not started")
        restore_failed: list[EngineError] = []
        try:
            return await asyncio.to_thread(self._switch_calls, client, version, path, digest, restore_failed)
        finally:
            if restore_failed:  # new weights under the old label, and the held ones could not be put back
                self._held_weights_lost(restore_failed[0])

    def _switch_calls(
        self, client: ServerClient, version: int, path: Path, digest: str, restore_failed: list[EngineError]
    ) -> tuple[float, float]:
        """While paused, the load and the new label go out at once (no step runs until the resume, so their
        order does not matter); each undoes the other if only one of them succeeds."""
        start = time.perf_counter()
        client.call_blocking("POST", "/pause?mode=keep")
        paused = time.perf_counter()
        try:
            label = self._labeller.submit(
                client.call_blocking, "POST", "/update_weight_version", json_body={"new_version": str(version)}
            )
            try:
                reply = client.call_blocking("POST", "/collective_rpc", json_body=_load_rpc(path, digest))
                self._check_load(reply, path, digest)
            except EngineError:
                if label.exception() is None:  # the old weights under the new label: put the old label back
                    try:
                        old = {"new_version": str(self._version)}
                        client.call_blocking("POST", "/update_weight_version", json_body=old)
                    except EngineError as exc:
                        restore_failed.append(exc)
                raise
            try:
                label.result()
            except EngineError:
                try:  # the new weights under the old label: put the held weights back before resuming
                    held = self._held_file
                    if held is None:
                        raise VllmError("no earlier weight file to go back to") from None
                    reply = client.call_blocking("POST", "/collective_rpc", json_body=_load_rpc(held[1], held[2]))
                    self._check_load(reply, held[1], held[2])
                except EngineError as exc:
                    restore_failed.append(exc)
                raise
            self._version = version
        finally:
            client.call_blocking("POST", "/resume")
        end = time.perf_counter()
        return end - paused, end - start

    def _held_weights_lost(self, exc: EngineError) -> None:
        """The server may hold new weights under the old label. Our own server, gone mid-switch (killed,
        crashed): nothing is sent to it until the supervisor has restarted it from the held file. Anyone
        else's, or one that refused the held file: the engine fails."""
        if isinstance(exc, ConnectionLost) and self.server is not None:
            self._serving.clear()
            self._restart_reason = f"unreachable during a weight switch ({exc})"
            return
        self._error = EngineError(f"the vLLM server holds weights of no known version: {exc}")

    def adapter_name(self, version: int) -> str:
        """The server-side name of adapter ``version`` (one name, one adapter: never reused)."""
        return f"miles-v{int(version)}"

    async def _switch_adapter(self, version: int, path: Path, digest: str) -> float:
        """LoRA mode: the server checks the adapter file's digest, loads it between two steps while generating,
        and new requests name it; adapters no request in flight names are unloaded. Returns the time taken."""
        start = time.perf_counter()
        await self._load_adapter(version, path, digest)
        self._adapter = (self.adapter_name(version), version)
        self._version = version
        await self._unload_idle_adapters()
        return time.perf_counter() - start

    async def _load_adapter(self, version: int, path: Path, digest: str) -> None:
        rpc = {"method": "miles_file_digest", "kwargs": {"path": str(path / WEIGHTS_NAME)}}
        reply = await self._call("POST", "/collective_rpc", json=rpc)
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list) or not results:
            raise VllmError(f"miles_file_digest answered {reply!r}")
        for result in results:
            got = result.get("digest") if isinstance(result, dict) else None
            if got != digest:
                error = result.get("error") if isinstance(result, dict) else result
                raise VllmError(f"the vLLM server read adapter {path.name} as {got} ({error}), expected {digest}")
        name = self.adapter_name(version)
        body = {"lora_name": name, "lora_path": str(path)}
        await self._call("POST", "/v1/load_lora_adapter", json=body, expect_json=False)
        self._adapters[name] = path

    async def _unload_idle_adapters(self) -> None:
        """Unload (and delete) every adapter but the newest that no request in flight names. A failed unload is
        logged and tried again after the next load."""
        current = self._adapter[0] if self._adapter is not None else None
        for name, path in list(self._adapters.items()):
            if name == current or self._adapter_requests[name] > 0:
                continue
            try:
                await self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name}, expect_json=False)
            except VllmError as exc:
                log.warning("vllm_adapter_unload_failed", adapter=name, error=str(exc))
                continue
            del self._adapters[name]
            self._adapter_requests.pop(name, None)
            await asyncio.to_thread(shutil.rmtree, path, True)

    async def _rpc_load(self, path: Path, digest: str) -> None:
        self._check_load(await self._call("POST", "/collective_rpc", json=_load_rpc(path, digest)), path, digest)

    def _check_load(self, reply: Any, path: Path, digest: str) -> None:
        """``miles_load_weights``' answer: every server worker (tensor-parallel rank) loaded the file, and its
        digest is ``digest``."""
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list) or not results:
            raise VllmError(f"miles_load_weights answered {reply!r}")
        for result in results:
            if not isinstance(result, dict) or not result.get("ok"):
                error = result.get("error") if isinstance(result, dict) else result
                raise VllmError(f"the vLLM server did not load {path.name}: {error}")
            if result.get("digest") != digest:
                raise VllmError(f"the vLLM server loaded digest {result.get('digest')}, expected {digest}")
        self.last_copy_s = max(float(result.get("copy_s") or 0.0) for result in results)

    async def held_digest(self) -> str:
        """The digest of the weights the server says it holds (its own answer, not ours)."""
        reply = await self._call("POST", "/collective_rpc", json={"method": "miles_held_digest"})
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list) or not results or len(set(results)) != 1:
            raise VllmError(f"miles_held_digest answered {reply!r}")
        return str(results[0])

    def _write(self, version: int, state: dict[str, torch.Tensor]) -> tuple[Path, str]:
        from safetensors.torch import save_file

        from miles.sync.precision import state_digest

        self.weights_dir.mkdir(parents=True, exist_ok=True)
        contiguous = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
        path = self.weights_dir / f"v{version}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(contiguous, str(tmp))
        tmp.replace(path)
        return path, state_digest(contiguous)

    def _write_adapter(self, version: int, state: dict[str, torch.Tensor]) -> tuple[Path, str]:
        from miles.sync.precision import state_digest

        assert self.lora is not None
        target = self.weights_dir / f"lora-v{version}"
        path = save_peft_adapter(state, self.lora, target, base_model=str(self.model_dir))
        return path, state_digest({name: t.detach().to("cpu").contiguous() for name, t in state.items()})

    def _prune(self, keep: Path) -> None:
        files = sorted(self.weights_dir.glob("v*.safetensors"), key=lambda p: p.stat().st_mtime)
        for old in files[:-KEEP_FILES]:
            if old != keep:
                old.unlink(missing_ok=True)

    # ------------------------------------------------------------------ supervision

    async def _supervise(self) -> None:
        """Watch the server; restart it when it exits or stops answering /health."""
        assert self.server is not None
        misses = 0
        while True:
            await asyncio.sleep(self.cfg.health_every_s)
            code = self.server.exited()
            reason = None if code is None else f"exited with status {code}"
            if reason is None and self._restart_reason is not None:
                reason = self._restart_reason
            self._restart_reason = None
            if reason is None:
                misses = 0 if await self._answers_health() else misses + 1
                if misses >= self.cfg.hang_checks:
                    reason = f"/health unanswered {misses} times"
            if reason is not None:
                misses = 0
                await self._restart(reason)

    async def _restart(self, reason: str) -> None:
        assert self.server is not None
        self._serving.clear()
        self.restarts += 1
        log.error("vllm_server_down", reason=reason, restarts=self.restarts, pid=self.server.pid)
        if self.restarts > self.cfg.max_restarts:
            raise EngineError(
                f"vLLM server {reason}; restarted {self.cfg.max_restarts} times already "
                "(rollout.engine.max_restarts): giving up"
            )
        await asyncio.to_thread(self.server.kill)  # reaps the process group: never on the event loop
        await self.server.start()
        self.base_url = self.server.url
        for client in (self._client, self._probe):
            if client is not None:
                await client.reopen(self.base_url)
        held = self._held_file
        if held is not None and self.lora is not None:  # a new server has no adapter: load the newest again
            version, path, digest = held
            self._adapters.clear()
            await self._load_adapter(version, path, digest)
        elif held is not None:  # the new server starts from the checkpoint: give it the version we hold
            version, path, digest = held
            await self._rpc_load(path, digest)
            await self._call("POST", "/update_weight_version", json={"new_version": str(version)})
        log.info("vllm_server_restarted", restarts=self.restarts, version=self._version, pid=self.server.pid)
        self._serving.set()
