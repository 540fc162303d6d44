"""A :class:`~miles.engines.base.StagingEngine` over an SGLang server, so rollout workers can follow
weight announcements (:class:`~miles.sync.follower.WeightFollower`) with SGLang as their engine.

SGLang takes new weights from storage it can read, not from our memory: a full checkpoint directory
(``/update_weights_from_disk``) or a peft adapter directory (``/load_lora_adapter``). Writing that to disk
and waiting for the server to load it takes seconds, so :meth:`SglangStagingEngine.stage_weights` (called on
the asyncio event-loop thread) only parks the weights; one background thread writes the newest parked
version to ``weights_dir/v<version>`` and asks the server to load it, then picks up whatever was staged
meanwhile (newest wins: intermediate versions are skipped, never loaded out of order).

Two modes:

* **LoRA** (``lora`` given): every state is a whole LoRA adapter under peft's saved-state names
  (``base_model.model.<module>.lora_A.weight`` ...), written with
  :func:`~miles.engines.adapter_files.save_peft_adapter` and loaded as a versioned adapter
  (:meth:`~miles.engines.sglang_engine.SglangEngine.load_adapter`); from then on every ``generate``
  names it. The server merges nothing into its base, so the rollout worker must hand the *adapter*
  through: its follower's decoder is the identity (``decode(state) -> (dict(state), False)``), not
  :class:`~miles.sync.engine_weights.EngineWeights` with ``lora_scale`` (that one returns merged weights,
  which only an in-process engine can use).
* **full**: every state is a complete HF state dict in rollout precision, written as one
  ``model.safetensors`` and reloaded with :meth:`~miles.engines.sglang_engine.SglangEngine.load_weights`
  (``model_path`` = the version's directory). SGLang reloads a whole checkpoint directory, which needs the
  model's ``config.json`` (and tokenizer files) next to the weights: give ``model_dir`` (the served
  checkpoint) and its non-weight files are copied into each version's directory; without it the caller
  must put them there. Deltas (:class:`~miles.engines.base.SparseValues`, ``complete=False``) are refused:
  reconstruct the full state first (the follower does so in delta mode).

``weights_dir`` must be readable by the server at the same path (a local or shared filesystem) and
should be per run. The 3 newest version directories are kept (and the adopted one); older ones are deleted
once the server has loaded from a newer one.

Failures are not fatal but never silent: a failed write or load is logged (``sglang_weights_load_failed``),
counted in :attr:`SglangStagingEngine.failures` and kept in :attr:`SglangStagingEngine.last_error` until a
load succeeds; :meth:`SglangStagingEngine.heartbeat_stats` puts both into the worker's heartbeat. The version
is not adopted, and the next :meth:`stage_weights` (of that version again, or a newer one) tries again.

While :meth:`SglangStagingEngine.pinned`, the loader holds staged versions back (an evaluation runs at one
version); a load already under way is waited for.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import threading
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from miles.config import LoraConfig
from miles.engines.adapter_files import fsync_file, save_peft_adapter, write_dir_atomically
from miles.engines.base import Generation, SamplingParams, SparseValues
from miles.engines.sglang_engine import SglangEngine
from miles.engines.staging import StagedSlot, whole_state

if TYPE_CHECKING:
    import torch

    from miles.sync.engine_weights import EngineWeights

log = structlog.get_logger(__name__)

WEIGHTS_FILE = "model.safetensors"
KEEP_DIRS = 3  # version directories kept on disk (plus the adopted one)
_VERSION_DIR = re.compile(r"^v(\d+)$")
# Files of a checkpoint directory that are weights (ours replace them), not config or tokenizer.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


class SglangStagingEngine:
    """Stages weights for a :class:`SglangEngine` and loads them into its server in the background.

    :meth:`stage_weights` never blocks on HTTP or disk (thread-safe; meant for the event-loop thread). A
    single daemon thread writes the newest staged version and loads it; :attr:`version` is the version the
    server adopted last, :attr:`pending_version` the one staged or being loaded. The switch happens in the
    server as soon as its load call returns, so there is nothing to apply. ``switches`` counts adoptions and
    ``last_pause_s`` is the duration of the latest load call, during which the server pauses (full mode:
    flushes its cache and reloads; LoRA mode: loads the adapter). Generation, lifecycle and ``error`` are the
    wrapped engine's.
    """

    def __init__(
        self,
        engine: SglangEngine,
        weights_dir: str | Path,
        *,
        lora: LoraConfig | None = None,
        model_dir: str | Path | None = None,
        base_model: str = "",
    ) -> None:
        self.engine = engine
        self.weights_dir = Path(weights_dir).resolve()  # an absolute path: the server resolves it, not us
        self.lora = lora
        self.model_dir = None if model_dir is None else Path(model_dir)
        self.base_model = base_model  # LoRA: base_model_name_or_path in adapter_config.json
        self._slot = StagedSlot()
        self._cond = self._slot.cond  # guards the slot and the fields below; never held across disk or HTTP
        self._worker: threading.Thread | None = None
        self._pins = 0  # pinned() blocks in force: staged versions wait
        self.switches = 0
        self.last_pause_s = 0.0
        self.pauses_s: list[float] = []  # one per adopted version (bounded: the most recent 1000)
        self.last_write_s = 0.0  # time writing the latest version to disk
        self.last_error: Exception | None = None  # the latest failed write/load; None once one succeeds
        self.failures = 0  # failed writes/loads since start (never reset)

    # ------------------------------------------------------------------ Engine

    @property
    def version(self) -> int:
        """Version the server adopted last (the engine's)."""
        return self.engine.version

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def error(self) -> BaseException | None:
        """The wrapped engine's failure (server unreachable). A failed *load* is not one: see ``last_error``."""
        return self.engine.error

    @property
    def pending_version(self) -> int | None:
        """Version staged or being loaded, not yet adopted; None if none."""
        return self._slot.pending

    def heartbeat_stats(self) -> dict[str, float]:
        """Load health for the worker's heartbeat: failures so far, whether the latest load failed, last write time."""
        with self._cond:
            return {
                "weight_load_failures": float(self.failures),
                "weight_load_failing": float(self.last_error is not None),
                "last_write_ms": self.last_write_s * 1e3,
            }

    async def start(self) -> None:
        await self.engine.start()

    async def close(self) -> None:
        """Drop what is staged, wait for a load under way (at most ``cfg.timeout_s``), close the engine."""
        self._slot.clear()
        if not await asyncio.to_thread(self.wait_idle, self.engine.cfg.timeout_s):
            log.warning("sglang_staging_close_timeout", loading=self._slot.loading, timeout_s=self.engine.cfg.timeout_s)
        await self.engine.close()

    async def __aenter__(self) -> SglangStagingEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Delegates to the SglangEngine (in LoRA mode its requests name the newest loaded adapter)."""
        return await self.engine.generate(prompt_ids, params)

    @asynccontextmanager
    async def pinned(self) -> AsyncIterator[int]:
        """``async with engine.pinned() as version:`` no staged version is loaded until the block ends; a load
        already under way is waited for first, so ``version`` is what the server runs meanwhile."""
        with self._cond:
            self._pins += 1
            loading = self._slot.loading is not None
        try:
            if loading:
                await asyncio.to_thread(self._wait_loaded)
            yield self.engine.version
        finally:
            with self._cond:
                self._pins -= 1
                self._cond.notify_all()

    def _wait_loaded(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._slot.loading is None)

    def weight_sink(self, precision: str, lora_scale: float | None) -> EngineWeights:
        """Whole states (dequantized FP8/FP4) written as checkpoints; in LoRA mode the adapter itself, which the
        server loads and applies (``lora_scale`` is the server's business then, from adapter_config.json)."""
        from miles.sync.engine_weights import EngineWeights

        return EngineWeights(dict, precision=precision, adapters="passthrough" if self.lora is not None else "merge")

    def load_weights(
        self, state: Mapping[str, torch.Tensor] | None, version: int, model_path: str | None = None
    ) -> None:
        """Delegates to :meth:`SglangEngine.load_weights` (blocking; ``model_path`` must hold the checkpoint)."""
        self.engine.load_weights(state, version, model_path=model_path)

    # ------------------------------------------------------------------ staging

    def stage_weights(
        self,
        state: Mapping[str, torch.Tensor | SparseValues],
        version: int,
        *,
        base_version: int | None = None,
        complete: bool = True,
    ) -> bool:
        """Park ``state`` as ``version`` for the background loader; False if not newer than the version
        adopted, being loaded or already staged (a newer stage replaces an older one not yet taken).

        Never blocks on disk or HTTP. SGLang reloads whole checkpoints (or whole adapters): the follower's delta
        fast path is declined (False) and other states are checked by :func:`~miles.engines.staging.whole_state`
        (``ValueError``, nothing staged). The caller must not mutate the tensors afterwards.
        """
        tensors = whole_state(state, server="SGLang", lora=self.lora, base_version=base_version, complete=complete)
        if tensors is None:
            return False
        with self._cond:
            if not self._slot.offer(int(version), tensors, self.engine.version):
                return False
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="sglang-staging", daemon=True)
                self._worker.start()
        return True

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until nothing is staged or loading; False on timeout. (Tests, shutdown: not the event loop.)"""
        with self._cond:
            return self._cond.wait_for(lambda: self._worker is None, timeout=timeout_s)

    # ------------------------------------------------------------------ the loader thread

    def _run(self) -> None:
        """Load the newest staged version, then whatever was staged meanwhile; exit when nothing is left.

        A failed load is recorded (``failures``, ``last_error``, an error log) and the thread goes on: the
        server keeps the version it had, and a later stage retries. That is the failure policy, not a default.
        """
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pins == 0 or self._slot.staged is None)  # pinned: hold loads back
                staged = self._slot.take()
                if staged is None:
                    self._worker = None
                    self._cond.notify_all()
                    return
                version, tensors = staged
                if version <= self.engine.version:  # e.g. load_weights jumped past it meanwhile
                    self._slot.done()
                    continue
            try:
                self._load(version, tensors)
            except Exception as exc:
                with self._cond:
                    self.failures += 1
                    self.last_error = exc
                log.error("sglang_weights_load_failed", version=version, error=f"{type(exc).__name__}: {exc}")
            finally:
                self._slot.done()
                del tensors
            try:
                self._prune()
            except OSError as exc:
                log.warning("sglang_weights_prune_failed", error=str(exc))

    def _load(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        path = self.weights_dir / f"v{version}"
        start = time.perf_counter()
        if self.lora is not None:
            save_peft_adapter(tensors, self.lora, path, base_model=self.base_model)
        else:
            self._write_checkpoint(tensors, path)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        if self.lora is not None:
            self.engine.load_adapter(str(path), version)
        else:
            self.engine.load_weights(None, version, model_path=str(path))
        pause = time.perf_counter() - start
        with self._cond:
            self.last_write_s = write_s
            self.last_pause_s = pause
            self.pauses_s = [*self.pauses_s[-999:], pause]
            self.switches += 1
            self.last_error = None
        log.info(
            "weights_applied",
            version=version,
            pause_ms=round(pause * 1e3, 2),
            write_ms=round(write_s * 1e3, 2),
            mode="lora" if self.lora is not None else "full",
            path=str(path),
        )

    def _write_checkpoint(self, tensors: dict[str, torch.Tensor], path: Path) -> None:
        """``model.safetensors`` (+ ``model_dir``'s config and tokenizer files) into ``path``, atomically."""
        from safetensors.torch import save_file

        seen: set[tuple[int, int]] = set()
        cpu: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            t = tensor.detach().to("cpu").contiguous()
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if t.numel() and key in seen:
                t = t.clone()  # tied weights: safetensors refuses tensors sharing memory
            seen.add(key)
            cpu[name] = t

        def fill(tmp: Path) -> None:
            if self.model_dir is not None:
                for src in sorted(self.model_dir.iterdir()):
                    if src.is_file() and not src.name.endswith(_WEIGHT_SUFFIXES):
                        shutil.copy2(src, tmp / src.name)
            save_file(cpu, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
            fsync_file(tmp / WEIGHTS_FILE)

        write_dir_atomically(path, fill)

    def _prune(self) -> None:
        """Delete version directories beyond the KEEP_DIRS newest, except the adopted version's."""
        if not self.weights_dir.is_dir():
            return
        found = []
        for entry in self.weights_dir.iterdir():
            m = _VERSION_DIR.match(entry.name)
            if m and entry.is_dir():
                found.append((int(m[1]), entry))
        found.sort(reverse=True)
        adopted = self.engine.version
        for v, entry in found[KEEP_DIRS:]:
            if v != adopted:
                shutil.rmtree(entry, ignore_errors=True)
