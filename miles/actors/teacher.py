"""Teacher actor: a frozen checkpoint on the bus that scores token ids for on-policy distillation.

Like a rollout worker it holds a model and serves many requests, but it never samples and never changes
weights: it answers ``teacher_score_request`` messages on ``<run>.teacher.score`` (core NATS request/reply,
queue group ``teachers``, so any number of teacher actors share the load) with the log-prob of every given
token under the teacher (:mod:`miles.engines.scoring`: the model in this process, or an SGLang server).
Start them with ``miles-node --role teacher`` (``miles run`` starts ``trainer.algo.distill.teacher.actors``
of them). The teacher is checked at start-up like the in-trainer one (:func:`miles.training.teacher.check_teacher`):
a missing path, another tokenizer, or weights equal to the student's is one line and exit 2.

A request that does not decode is refused (:meth:`miles.bus.client.Bus.accept`: dead-lettered under the
teacher's role, counted in ``refused_malformed``) and answered with an error reply, so the trainer fails fast
instead of timing out; a request the engine cannot score gets an error reply naming why. Nothing crashes
the actor but its engine dying. With the run's credentials a teacher may publish nothing into another
role's inbox but the one reply to each request it received (docs/security.md).
"""

from __future__ import annotations

import asyncio
from typing import Any

from nats.aio.msg import Msg

from miles.actors.base import Actor
from miles.bus.client import messages_until
from miles.bus.schema import Heartbeat, TeacherScoreReply, TeacherScoreRequest, encode
from miles.engines.base import EngineError
from miles.engines.scoring import TeacherScoring

QUEUE_GROUP = "teachers"


class TeacherActor(Actor):
    role = "teacher"

    def __init__(self, *args: Any, scoring: TeacherScoring, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scoring = scoring
        self.counts = {"requests": 0, "sequences": 0, "tokens": 0, "errors": 0}

    def heartbeat(self) -> Heartbeat:
        stats = {**{k: float(v) for k, v in self.counts.items()}, **self.bus.refusal_stats()}
        return Heartbeat(role=self.role, actor_id=self.actor_id, stats=stats)

    async def main(self) -> None:
        sub = await self.bus.nc.subscribe(self.bus.subjects.teacher_score, queue=QUEUE_GROUP)
        self.log.info("teacher_ready", subject=self.bus.subjects.teacher_score)
        try:
            async with asyncio.TaskGroup() as tg:  # answers in flight finish before the actor stops
                async for msg in messages_until(sub, self.stopping):  # unsubscribes at the end
                    tg.create_task(self._answer(msg), name="teacher.answer")
        finally:
            await self.scoring.close()

    async def _answer(self, msg: Msg) -> None:
        request = await self.bus.accept(msg, TeacherScoreRequest)
        if request is None:  # refused and counted; say so at once rather than let the asker time out
            error = f"refused: not a valid {TeacherScoreRequest.KIND} (see the teacher's dead letters)"
            await self._reply(msg, TeacherScoreReply(request_id="", teacher_id=self.actor_id, error=error))
            return
        self.counts["requests"] += 1
        pairs = [(list(s.prompt_ids), list(s.token_ids)) for s in request.sequences]
        try:
            logprobs = await self.scoring.score(pairs, request.temperature)
        except (EngineError, ValueError) as exc:  # this request cannot be scored; the actor goes on
            self.counts["errors"] += 1
            self.log.warning("teacher_score_failed", request=request.request_id, error=str(exc))
            reply = TeacherScoreReply(request_id=request.request_id, teacher_id=self.actor_id, error=str(exc)[:2000])
        else:
            self.counts["sequences"] += len(pairs)
            self.counts["tokens"] += sum(len(t) for _, t in pairs)
            reply = TeacherScoreReply(request_id=request.request_id, teacher_id=self.actor_id, logprobs=logprobs)
        await self._reply(msg, reply)

    async def _reply(self, msg: Msg, reply: TeacherScoreReply) -> None:
        if msg.reply:
            await self.bus.nc.publish(msg.reply, encode(reply))


def build_teacher_scoring(cfg: Any) -> TeacherScoring:
    """The scoring engine of ``trainer.algo.distill.teacher`` (type ``actor``), its teacher checked against the
    run's student first (:class:`miles.training.teacher.TeacherError`, one line)."""
    from miles.engines.scoring import SglangScoring, TorchScoring
    from miles.models.loading import prepared_model_dir
    from miles.training.teacher import TeacherError, TeacherScorer, check_teacher, load_teacher_model

    distill = cfg.trainer.algo.distill
    if distill is None or distill.teacher.type != "actor":
        raise TeacherError("miles-node --role teacher needs trainer.algo.distill.teacher.type 'actor'")
    teacher = distill.teacher
    source = check_teacher(teacher.path, prepared_model_dir(cfg.model, cfg.task))
    if teacher.engine == "sglang":
        if not teacher.url:
            raise TeacherError("trainer.algo.distill.teacher.url is required with engine 'sglang'")
        return SglangScoring(teacher.url, timeout_s=teacher.timeout_s)
    model = load_teacher_model(source, teacher.device)
    temperature = cfg.rollout.sampling.temperature or 1.0
    return TorchScoring(TeacherScorer(model, temperature=temperature, chunk_tokens=1024, device=teacher.device))
