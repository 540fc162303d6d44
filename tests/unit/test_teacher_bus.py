"""The bus teacher: a teacher actor answering score requests over a real nats-server, the trainer's client,
and the SGLang scoring contract (a stand-in HTTP server: SGLang itself needs a GPU)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.actors.teacher import TeacherActor
from miles.backends.base import TrainSample
from miles.bus.client import Bus
from miles.bus.schema import TeacherScoreReply, TeacherScoreRequest, decode, encode
from miles.engines.base import EngineError
from miles.engines.scoring import SglangScoring, TorchScoring
from miles.training.packing import pack_micro_batches
from miles.training.teacher import TeacherScorer, load_teacher_model, resolve_teacher
from miles.training.teacher_client import TeacherClient, TeacherUnavailable
from tests.unit.test_teacher import _copy, student  # noqa: F401  (the module-scoped tiny student)

PAIRS = [([1, 5, 6], [7, 8, 2]), ([1, 9], [10, 11, 12, 2]), ([1, 4, 4, 4], [2])]


async def test_teacher_actor_scores_over_the_bus_like_the_trainer_teacher(
    student: Any,  # noqa: F811
    nats_server: str,
    tmp_path: Path,
) -> None:
    cfg, student_dir = student
    teacher_dir = _copy(student_dir, tmp_path / "teacher", perturb=True)
    model = load_teacher_model(resolve_teacher(str(teacher_dir)))
    scorer = TeacherScorer(model, temperature=1.0, chunk_tokens=8)
    bus = await Bus.open(cfg.bus, nats_server, cfg.name, "teacher-0")
    actor = TeacherActor(cfg, bus, tmp_path, scoring=TorchScoring(scorer, token_budget=16))
    running = asyncio.create_task(actor.run())
    client_bus = await Bus.open(cfg.bus, nats_server, cfg.name, "trainer-0")
    try:
        await asyncio.sleep(0.3)  # the actor subscribes
        client = TeacherClient(client_bus, timeout_s=10, chunk=2)
        samples = [TrainSample(p, t, [1] * len(t), []) for p, t in PAIRS]
        await client.fill(samples, temperature=1.0)
        (mb,) = pack_micro_batches(samples, pad_id=0)
        direct = mb.per_sample(scorer.score(mb))
        for i, sample in enumerate(samples):
            assert sample.teacher_logprobs is not None and len(sample.teacher_logprobs) == len(PAIRS[i][1])
            torch.testing.assert_close(
                torch.tensor(sample.teacher_logprobs), torch.tensor(direct[i]), atol=1e-5, rtol=0
            )

        # A malformed request is refused (dead-lettered, counted) and answered with an error; the actor goes on.
        reply = await client_bus.nc.request(client_bus.subjects.teacher_score, b"\x81\xa4junk\x01", timeout=5)
        assert "refused" in decode(reply.data, TeacherScoreReply).error
        assert bus.dead_lettered == 1 and bus.refused["malformed"] == 1
        assert actor.heartbeat().stats["refused_malformed"] == 1.0
        again = await client.score(PAIRS[:1], temperature=1.0)
        assert len(again[0]) == 3
        assert actor.counts["requests"] >= 3
    finally:
        actor.request_stop("test over")
        await asyncio.wait_for(running, 10)
        await bus.close()
        await client_bus.close()
    assert not running.exception()


async def test_a_bad_reply_is_refused_and_counted_and_the_chunk_asked_again(
    student: Any,  # noqa: F811
    nats_server: str,
) -> None:
    cfg, _ = student
    bus = await Bus.open(cfg.bus, nats_server, cfg.name + "-bad-reply", "trainer-0")
    answers = [b"\x81\xa4junk\x01", "short", "good"]  # undecodable, then one that does not fit, then a fit

    async def fake_teacher(msg: Any) -> None:
        request = decode(msg.data, TeacherScoreRequest)
        answer = answers.pop(0)
        if isinstance(answer, bytes):
            await msg.respond(answer)
            return
        rows = [[-0.5] * (len(s.token_ids) - (answer == "short")) for s in request.sequences]
        reply = TeacherScoreReply(request_id=request.request_id, teacher_id="fake", logprobs=rows)
        await msg.respond(encode(reply))

    sub = await bus.nc.subscribe(bus.subjects.teacher_score, cb=fake_teacher)
    try:
        client = TeacherClient(bus, timeout_s=5, attempts=3)
        (row,) = await client.score(PAIRS[:1], temperature=1.0)
        assert row == [-0.5] * len(PAIRS[0][1])
        assert bus.refused == {"malformed": 1, "untrusted": 1} and bus.dead_lettered == 2
    finally:
        await sub.unsubscribe()
        await bus.close()


async def test_no_teacher_is_a_loud_failure_not_a_silent_zero(
    student: Any,  # noqa: F811
    nats_server: str,
) -> None:
    cfg, _ = student
    bus = await Bus.open(cfg.bus, nats_server, "nobody", "trainer-0")
    try:
        client = TeacherClient(bus, timeout_s=0.2, attempts=2)
        with pytest.raises(TeacherUnavailable, match="no teacher answered on nobody.teacher.score after 2 tries"):
            await client.score(PAIRS, temperature=1.0)
    finally:
        await bus.close()


async def test_a_teacher_that_starts_listening_late_is_waited_for(
    student: Any,  # noqa: F811
    nats_server: str,
) -> None:
    """The trainer's first step can come before the teacher actors subscribe (they load a model): no responders
    is waited out, within timeout_s, not spent as the chunk's tries."""
    cfg, _ = student
    bus = await Bus.open(cfg.bus, nats_server, cfg.name + "-late", "trainer-0")
    asked: list[str] = []

    async def late_teacher(msg: Any) -> None:
        request = decode(msg.data, TeacherScoreRequest)
        asked.append(request.request_id)
        rows = [[-0.25] * len(s.token_ids) for s in request.sequences]
        await msg.respond(encode(TeacherScoreReply(request_id=request.request_id, teacher_id="late", logprobs=rows)))

    try:
        client = TeacherClient(bus, timeout_s=30, attempts=1)
        scoring = asyncio.create_task(client.score(PAIRS[:1], temperature=1.0))
        await asyncio.sleep(0.5)  # several no-responders answers meanwhile
        assert not scoring.done()
        sub = await bus.nc.subscribe(bus.subjects.teacher_score, cb=late_teacher)
        (row,) = await asyncio.wait_for(scoring, 30)
        assert row == [-0.25] * len(PAIRS[0][1]) and len(asked) == 1
        await sub.unsubscribe()
    finally:
        await bus.close()


class _FakeSglang(ThreadingHTTPServer):
    """Contract stand-in for SGLang's ``/generate`` in scoring mode: checks the request's shape and answers
    ``meta_info.input_token_logprobs`` (one entry per input token, the first one's logprob null)."""

    daemon_threads = True

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.wrong_token = False
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _FakeSglang

    def log_message(self, *args: Any) -> None:
        return None

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        ids = body["input_ids"]
        entries: list[list[Any]] = [[None if i == 0 else -0.1 * i, t, "x"] for i, t in enumerate(ids)]
        if self.server.wrong_token:
            entries[-1][1] = ids[-1] + 1
        data = json.dumps({"text": "", "meta_info": {"input_token_logprobs": entries, "output_token_logprobs": []}})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())


@pytest.fixture
def fake_sglang() -> Iterator[_FakeSglang]:
    server = _FakeSglang()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


async def test_sglang_scoring_contract(fake_sglang: _FakeSglang) -> None:
    scoring = SglangScoring(f"http://127.0.0.1:{fake_sglang.server_address[1]}", timeout_s=10)
    try:
        out = await scoring.score([([1, 5, 6], [7, 8]), ([3], [4])], temperature=1.0)
        assert out == [pytest.approx([-0.3, -0.4]), pytest.approx([-0.1])]
        # One request per sequence, sent concurrently: they may arrive in either order.
        (first,) = [r for r in fake_sglang.requests if len(r["input_ids"]) == 5]
        assert first["input_ids"] == [1, 5, 6, 7, 8]
        assert first["sampling_params"]["max_new_tokens"] == 0
        assert first["return_logprob"] is True and first["logprob_start_len"] == 0
        fake_sglang.wrong_token = True
        with pytest.raises(EngineError, match="input token 4 is 9, expected 8"):
            await scoring.score([([1, 5, 6], [7, 8])], temperature=1.0)
        with pytest.raises(EngineError, match="temperature 1 only"):
            await scoring.score([([1], [2])], temperature=0.7)
    finally:
        await scoring.close()
