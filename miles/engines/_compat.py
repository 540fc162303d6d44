"""TEMPORARY (removed when the continuous-batching engine lands): the batch TorchEngine behind the async
per-request interface, one request at a time on a worker thread."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from miles.engines.base import EngineError, Generation, SamplingParams


class AsyncBatchAdapter:
    def __init__(self, engine: Any) -> None:
        self.inner = engine
        self._lock = asyncio.Lock()
        self._pins = 0
        self.error: BaseException | None = None
        cfg = getattr(engine.model, "config", None)
        self._max_context = int(getattr(cfg, "max_position_embeddings", 512) or 512)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def pending_version(self) -> int | None:
        return self.inner.pending_version

    @property
    def max_context(self) -> int:
        return self._max_context

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if len(prompt_ids) >= self._max_context:
            return Generation(list(prompt_ids), [], [], "context", self.version)
        async with self._lock:
            try:
                (gen,) = await asyncio.to_thread(self.inner.generate, [prompt_ids], params, self._pins == 0)
            except Exception as exc:
                self.error = exc
                raise EngineError(str(exc)) from exc
        return gen

    @contextlib.asynccontextmanager
    async def pinned(self) -> AsyncIterator[int]:
        self._pins += 1
        try:
            yield self.version
        finally:
            self._pins -= 1

    def stage_weights(self, state: Any, version: int, **kw: Any) -> bool:
        staged = self.inner.stage_weights(state, version, **kw)
        if staged and self._pins == 0:
            self.inner.apply_pending()
        return staged
