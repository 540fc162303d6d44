"""The trainer leader's side of a bus teacher: each batch's token ids out, the teacher's log-probs back.

Before a step trains, :meth:`TeacherClient.fill` sends the batch's sequences to the teacher actors
(``teacher_score_request`` on ``<run>.teacher.score``, core request/reply: scoring is idempotent, so a lost
request is simply sent again) in chunks of ``chunk`` sequences, concurrently, and puts the replies on the
samples (``TrainSample.teacher_logprobs``, packed into ``teacher_logp`` like every per-token input). A reply
that does not decode (``refused_malformed``) or does not fit its request (another id or length:
``refused_untrusted``) is refused through the trainer's bus (dead-lettered, counted in its heartbeat) and the
chunk asked again. While no teacher listens yet (they start with the trainer and load a model) a try waits for
one, up to ``timeout_s``; when no teacher answers a chunk after ``attempts`` tries the step fails with
:class:`TeacherUnavailable`, naming the subject: training without the teacher would silently distill nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from miles.bus.client import Bus
from miles.bus.retry import request_across_reconnects
from miles.bus.schema import TeacherScoreReply, TeacherScoreRequest, TeacherSequence, encode

log = structlog.get_logger(__name__)

NO_TEACHER_FIRST_WAIT_S = 0.05  # no teacher subscribed yet: look again after this, doubling ...
NO_TEACHER_MAX_WAIT_S = 2.0  # ... up to this


class TeacherUnavailable(RuntimeError):
    """No teacher actor gave a usable answer; the message says which subject and why."""


class TeacherClient:
    def __init__(self, bus: Bus, *, timeout_s: float, chunk: int = 64, attempts: int = 3) -> None:
        self.bus = bus
        self.subject = bus.subjects.teacher_score
        self.timeout_s = timeout_s
        self.chunk = chunk
        self.attempts = attempts

    async def score(self, pairs: Sequence[tuple[list[int], list[int]]], temperature: float) -> list[list[float]]:
        """The teacher's log-probs of every ``(prompt_ids, token_ids)`` pair, in order."""
        chunks = [list(pairs[i : i + self.chunk]) for i in range(0, len(pairs), self.chunk)]
        results = await asyncio.gather(*(self._chunk(c, temperature) for c in chunks))
        return [row for part in results for row in part]

    async def fill(self, samples: Sequence[Any], temperature: float) -> None:
        """Set ``teacher_logprobs`` of every :class:`~miles.backends.base.TrainSample`."""
        scored = await self.score([(list(s.prompt_ids), list(s.token_ids)) for s in samples], temperature)
        for sample, logprobs in zip(samples, scored, strict=True):
            sample.teacher_logprobs = logprobs

    async def _chunk(self, pairs: list[tuple[list[int], list[int]]], temperature: float) -> list[list[float]]:
        request = TeacherScoreRequest(
            request_id=uuid.uuid4().hex,
            sequences=[TeacherSequence(prompt_ids=p, token_ids=t) for p, t in pairs],
            temperature=temperature,
        )
        why = "no reply"
        for attempt in range(1, self.attempts + 1):
            try:
                msg = await self._ask(encode(request))
            except (NatsTimeoutError, asyncio.TimeoutError, NoRespondersError) as exc:  # try again, then fail loudly
                why = type(exc).__name__
                log.warning("teacher_request_failed", subject=self.subject, attempt=attempt, error=why)
                continue
            reply = await self.bus.accept(msg, TeacherScoreReply)
            if reply is None:  # refused (dead-lettered, counted): ask again
                why = "a reply that does not decode"
                continue
            if reply.error:
                raise TeacherUnavailable(f"teacher {reply.teacher_id} on {self.subject}: {reply.error}")
            if reply.request_id != request.request_id or [len(r) for r in reply.logprobs] != [len(t) for _, t in pairs]:
                why = f"a reply from {reply.teacher_id} that does not fit the request"
                await self.bus.refuse(msg, why, category="untrusted")
                continue
            return [list(row) for row in reply.logprobs]
        raise TeacherUnavailable(f"no teacher answered on {self.subject} after {self.attempts} tries ({why})")

    async def _ask(self, payload: bytes) -> Msg:
        """One try: the reply, within ``timeout_s``. While no teacher listens yet (no responders) it waits for one,
        for up to ``timeout_s`` too: teacher actors start with the trainer and load a model, and the first step can
        come before they subscribe (CI saw three immediate tries fail a run that way)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        delay = NO_TEACHER_FIRST_WAIT_S
        while True:
            try:
                return await request_across_reconnects(
                    self.bus.nc, self.subject, payload, self.timeout_s, self.bus.outage
                )
            except NoRespondersError:
                left = deadline - loop.time()
                if left <= 0:
                    raise
                if delay == NO_TEACHER_FIRST_WAIT_S:
                    log.info("teacher_waiting", subject=self.subject, up_to_s=self.timeout_s)
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 2, NO_TEACHER_MAX_WAIT_S)


def teacher_client(cfg: Any, bus: Bus) -> TeacherClient | None:
    """The client of a run whose distillation teacher is on the bus (``teacher.type: actor``), else None."""
    distill = cfg.trainer.algo.distill
    if distill is None or distill.teacher.type != "actor":
        return None
    return TeacherClient(bus, timeout_s=distill.teacher.timeout_s)
