"""Teacher scoring: log-probs of given token ids under a frozen model, for on-policy distillation.

Scoring is prefill only: the teacher reads ``prompt + tokens`` and returns, for every token, its log-prob
given everything before it. Two engines behind one interface (:class:`TeacherScoring`):

* :class:`TorchScoring`: the teacher in this process, packed and chunked like the trainer's own log-probs
  (:class:`miles.training.teacher.TeacherScorer`), on CPU or GPU;
* :class:`SglangScoring`: an SGLang server holding the teacher, one ``/generate`` per sequence with
  ``input_ids``, ``sampling_params.max_new_tokens = 0``, ``return_logprob: true`` and
  ``logprob_start_len: 0``; the log-probs are read from ``meta_info.input_token_logprobs``
  (``[[logprob, token_id, text], ...]``, one entry per input token, the first one's logprob null).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from miles.engines.base import EngineError
from miles.engines.server_client import ServerClient


class TeacherScoring(Protocol):
    """``(prompt_ids, token_ids)`` pairs -> the teacher's log-prob of every ``token_ids[i]``."""

    async def score(self, sequences: Sequence[tuple[list[int], list[int]]], temperature: float) -> list[list[float]]:
        """One list per sequence, ``len(token_ids)`` long."""
        ...

    async def close(self) -> None: ...


class TorchScoring:
    """The teacher model in this process; calls run one at a time on a worker thread (never on the loop).

    Args:
        scorer: a :class:`miles.training.teacher.TeacherScorer` (the frozen model, chunked log-probs).
        token_budget: positions per forward pass (rows x longest row), as the trainer's micro-batches.
    """

    def __init__(self, scorer: Any, *, token_budget: int | None = 8192) -> None:
        self.scorer = scorer
        self.token_budget = token_budget
        self._lock = asyncio.Lock()

    def _score(self, sequences: Sequence[tuple[list[int], list[int]]], temperature: float) -> list[list[float]]:
        from miles.backends.base import TrainSample
        from miles.training.packing import pack_micro_batches

        samples = [
            TrainSample(prompt_ids=list(p), token_ids=list(t), loss_mask=[1] * len(t), behaviour_logprobs=[])
            for p, t in sequences
        ]
        out: list[list[float]] = [[] for _ in samples]
        for mb in pack_micro_batches(samples, pad_id=0, device=self.scorer.device, token_budget=self.token_budget):
            for index, values in mb.per_sample(self.scorer.score(mb, temperature)).items():
                out[index] = values
        return out

    async def score(self, sequences: Sequence[tuple[list[int], list[int]]], temperature: float) -> list[list[float]]:
        async with self._lock:  # one model, one forward at a time
            return await asyncio.to_thread(self._score, sequences, temperature)

    async def close(self) -> None:
        return None


class SglangScoring:
    """A teacher served by SGLang (GPU nodes), scored by prefill-only ``/generate`` calls.

    SGLang returns the log-probs of its raw logits, so only ``temperature == 1`` is accepted (sample the
    student at temperature 1 for distillation, or score with the torch engine)."""

    def __init__(self, url: str, *, timeout_s: float = 120.0, max_connections: int = 64) -> None:
        self.base_url = url.rstrip("/")
        self.client = ServerClient(
            self.base_url, server="the SGLang teacher", timeout_s=timeout_s, max_connections=max_connections
        )

    @staticmethod
    def payload(prompt_ids: list[int], token_ids: list[int]) -> dict[str, Any]:
        """The ``/generate`` request that scores ``token_ids`` after ``prompt_ids`` and generates nothing."""
        return {
            "input_ids": list(prompt_ids) + list(token_ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }

    @staticmethod
    def parse(prompt_ids: list[int], token_ids: list[int], reply: Any) -> list[float]:
        """The log-probs of ``token_ids`` from a ``/generate`` reply; :class:`EngineError` if it does not fit."""
        if isinstance(reply, list) and len(reply) == 1:
            reply = reply[0]
        meta = reply.get("meta_info") if isinstance(reply, dict) else None
        entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        ids = list(prompt_ids) + list(token_ids)
        if not isinstance(entries, list) or len(entries) != len(ids):
            got = len(entries) if isinstance(entries, list) else "none"
            raise EngineError(f"SGLang /generate: {got} input_token_logprobs for {len(ids)} input ids")
        out: list[float] = []
        for position in range(len(prompt_ids), len(ids)):
            entry = entries[position]
            if int(entry[1]) != ids[position]:
                raise EngineError(f"SGLang /generate: input token {position} is {entry[1]}, expected {ids[position]}")
            if entry[0] is None:
                raise EngineError(f"SGLang /generate: no log-prob for input token {position}")
            out.append(float(entry[0]))
        return out

    async def _one(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        if not token_ids:
            return []
        reply = await self.client.call("POST", "/generate", json_body=self.payload(prompt_ids, token_ids))
        return self.parse(prompt_ids, token_ids, reply)

    async def score(self, sequences: Sequence[tuple[list[int], list[int]]], temperature: float) -> list[list[float]]:
        if temperature != 1.0:
            raise EngineError(f"the SGLang teacher scores at temperature 1 only (asked for {temperature})")
        return list(await asyncio.gather(*(self._one(list(p), list(t)) for p, t in sequences)))

    async def close(self) -> None:
        await self.client.close()
