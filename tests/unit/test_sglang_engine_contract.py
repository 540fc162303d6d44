"""SglangEngine against a fake SGLang HTTP server: the request JSON we send and the replies we parse.

``FakeSglangServer`` is a **contract stand-in** (stdlib ``http.server`` on 127.0.0.1, port 0), not an SGLang
implementation: it checks each request's shape against the contract documented in
:mod:`miles.engines.sglang_engine` and answers with SGLang-shaped JSON. SGLang itself needs a GPU, so these
tests pin down our side of the contract only.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import structlog

from miles.config import SglangEngineConfig
from miles.engines.base import EngineError, SamplingParams
from miles.engines.registry import build_engine
from miles.engines.sglang_engine import SglangEngine, SglangError

SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "stop_token_ids"}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # many requests connect at once (socketserver's default backlog is 5)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exception(), (BrokenPipeError, ConnectionResetError)):
            return  # the client went away (a cancelled request): nothing to report
        super().handle_error(request, client_address)


class FakeSglangServer:
    """Records every request; ``/generate`` answers one prompt with ``prompt[-1] + 1, + 2, ...`` (contract
    stand-in, see the module docstring). Knobs: ``finish_reasons`` (consumed one per request), gates and a
    barrier to hold requests in flight, LoRA adapters and refusals."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.weight_version = "0"
        self.update_ok = True
        self.legacy_version_route = True
        self.omit_output_ids = False
        self.reply_as_list = False  # some servers answer every request as a batch of one
        self.finish_reasons: list[Any] = []
        # LoRA: adapter name -> path, as the server holds them; a name in fail_loads is refused.
        self.adapters: dict[str, str] = {}
        self.fail_loads: dict[str, str] = {}
        self.fail_unloads = False
        self.load_failure_status = 400  # SGLang answers a refused load with HTTP 400
        self.generate_gate: threading.Event | None = None  # when set, /generate waits for it
        self.generate_barrier: threading.Barrier | None = None  # when set, /generate waits for N in flight
        self.generate_started = threading.Event()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn serves

            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

            def _reply(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                server.record("GET", self.path, None)
                if self.path == "/get_weight_version" and server.legacy_version_route:
                    self._reply(200, {"weight_version": server.weight_version})
                elif self.path == "/model_info":
                    self._reply(200, {"model_path": "/m", "weight_version": server.weight_version})
                else:
                    self._reply(404, {"detail": "Not Found"})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.record("POST", self.path, body)
                if self.path == "/generate":
                    self._reply(*server.generate(body))
                elif self.path == "/load_lora_adapter":
                    self._reply(*server.load_lora_adapter(body))
                elif self.path == "/unload_lora_adapter":
                    self._reply(*server.unload_lora_adapter(body))
                elif self.path == "/update_weights_from_disk":
                    self._reply(*server.update_weights_from_disk(body))
                else:
                    self._reply(404, {"detail": "Not Found"})

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)

    def record(self, method: str, path: str, body: Any) -> None:
        with self._lock:
            self.requests.append((method, path, body))

    def generate_bodies(self) -> list[dict[str, Any]]:
        return [b for _, p, b in self.requests if p == "/generate"]

    def update_weights_from_disk(self, body: dict[str, Any]) -> tuple[int, Any]:
        if not isinstance(body.get("model_path"), str) or not isinstance(body.get("weight_version"), str):
            return 400, {"error": "bad update request"}
        if not self.update_ok:
            return 200, {"success": False, "message": "Failed to load: shape mismatch"}
        self.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update model weights."}

    def load_lora_adapter(self, body: dict[str, Any]) -> tuple[int, Any]:
        name, path = body.get("lora_name"), body.get("lora_path")
        if set(body) != {"lora_name", "lora_path"} or not isinstance(name, str) or not isinstance(path, str):
            return 400, {"error": f"expected lora_name and lora_path strings, got {body}"}
        if name in self.adapters:
            return 400, {"success": False, "error_message": f"LoRA adapter {name} is already loaded"}
        if name in self.fail_loads:
            if self.load_failure_status == 200:  # the {success, message} shape
                return 200, {"success": False, "message": self.fail_loads[name]}
            return self.load_failure_status, {"success": False, "error_message": self.fail_loads[name]}
        self.adapters[name] = path
        return 200, {"success": True, "error_message": None, "loaded_adapters": dict(self.adapters)}

    def unload_lora_adapter(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = body.get("lora_name")
        if self.fail_unloads or name not in self.adapters:
            return 400, {"success": False, "error_message": f"LoRA adapter {name} is not loaded"}
        del self.adapters[name]
        return 200, {"success": True, "error_message": None, "loaded_adapters": dict(self.adapters)}

    def lora_calls(self) -> list[tuple[str, Any]]:
        return [(p, b) for _, p, b in self.requests if p in ("/load_lora_adapter", "/unload_lora_adapter")]

    def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        self.generate_started.set()
        if self.generate_barrier is not None:
            self.generate_barrier.wait(5)
        if self.generate_gate is not None:
            self.generate_gate.wait(5)
        prompt, sp = body.get("input_ids"), body.get("sampling_params", {})
        if (
            body.get("return_logprob") is not True
            or not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(t, int) for t in prompt)
        ):
            return 400, {"error": "expected input_ids: list[int] (one prompt) and return_logprob: true"}
        if set(sp) != SAMPLING_KEYS:
            return 400, {"error": f"unexpected sampling_params keys {sorted(sp)}"}
        if not set(body) <= {"input_ids", "sampling_params", "return_logprob", "lora_path"}:
            return 400, {"error": f"unexpected keys {sorted(body)}"}
        if "lora_path" in body and body["lora_path"] not in self.adapters:
            return 400, {"object": "error", "message": f"LoRA adapter {body['lora_path']} not loaded", "code": 400}
        tokens: list[int] = []
        for k in range(sp["max_new_tokens"]):
            tokens.append(prompt[-1] + 1 + k)
            if tokens[-1] in sp["stop_token_ids"]:
                break
        reason: Any = {"type": "length", "length": len(tokens)}
        if tokens[-1] in sp["stop_token_ids"]:
            reason = {"type": "stop", "matched": tokens[-1]}
        with self._lock:
            if self.finish_reasons:
                reason = self.finish_reasons.pop(0)
        item: dict[str, Any] = {
            "text": "ignored",
            "output_ids": tokens,
            "meta_info": {
                "id": "req",
                "finish_reason": reason,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(tokens),
                "output_token_logprobs": [[-0.1 * (k + 1), t, None] for k, t in enumerate(tokens)],
                "weight_version": self.weight_version,
            },
        }
        if self.omit_output_ids:
            del item["output_ids"]
        return 200, [item] if self.reply_as_list else item


@pytest.fixture
def fake() -> Iterator[FakeSglangServer]:
    server = FakeSglangServer()
    server.thread.start()
    yield server
    if server.generate_gate is not None:
        server.generate_gate.set()
    server.httpd.shutdown()
    server.httpd.server_close()


Make = Callable[..., Awaitable[SglangEngine]]


@pytest.fixture
async def make(fake: FakeSglangServer) -> AsyncIterator[Make]:
    """``await make(...)``: a started engine on the fake server, closed at the end of the test."""
    made: list[SglangEngine] = []

    async def factory(*, keep_adapters: int = 2, adapter_prefix: str = "miles", version: int = 0) -> SglangEngine:
        cfg = SglangEngineConfig(url=fake.url + "/", timeout_s=5, keep_adapters=keep_adapters)
        engine = SglangEngine(cfg, version=version, adapter_prefix=adapter_prefix)
        await engine.start()
        made.append(engine)
        return engine

    yield factory
    for engine in made:
        await engine.close()


# ---------------------------------------------------------------------------------------------- generation


async def test_generate_sends_one_request_per_prompt_and_parses_the_result(fake: FakeSglangServer, make: Make) -> None:
    fake.weight_version = "4"
    engine = await make()
    params = SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, stop_token_ids=[12])
    stopped, full = await asyncio.gather(engine.generate([1, 10], params), engine.generate([5], params))
    assert sorted(b["input_ids"] for b in fake.generate_bodies()) == [[1, 10], [5]]
    assert fake.generate_bodies()[0] == {
        "input_ids": fake.generate_bodies()[0]["input_ids"],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.7, "top_p": 0.9, "stop_token_ids": [12]},
        "return_logprob": True,
    }
    assert stopped.prompt_ids == [1, 10] and stopped.output_ids == [11, 12] and stopped.finish_reason == "stop"
    assert full.output_ids == [6, 7, 8] and full.finish_reason == "length"
    assert full.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert stopped.weight_version == full.weight_version == 4 and full.version_spans == [(0, 4)]


async def test_many_requests_are_in_flight_at_once(fake: FakeSglangServer, make: Make) -> None:
    engine = await make()
    fake.generate_barrier = threading.Barrier(16)  # no reply until all 16 requests have reached the server
    gens = await asyncio.gather(*(engine.generate([i + 1], SamplingParams(max_new_tokens=2)) for i in range(16)))
    assert [g.output_ids for g in gens] == [[i + 2, i + 3] for i in range(16)]


async def test_output_ids_fall_back_to_logprob_entries_and_string_reasons(fake: FakeSglangServer, make: Make) -> None:
    fake.omit_output_ids = True
    fake.reply_as_list = True
    fake.finish_reasons = ["length", "stop"]
    fake.weight_version = "not-an-int"
    engine = await make(version=2)
    first = await engine.generate([3], SamplingParams(max_new_tokens=2))
    second = await engine.generate([7], SamplingParams(max_new_tokens=2))
    assert (first.output_ids, second.output_ids) == ([4, 5], [8, 9])
    assert (first.finish_reason, second.finish_reason) == ("length", "stop")
    assert first.weight_version == second.weight_version == 2  # unparseable server version: the engine's own


async def test_the_context_window_clamps_requests(fake: FakeSglangServer, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 8}}))
    engine = build_engine(SglangEngineConfig(url=fake.url, timeout_s=5), tmp_path)
    assert isinstance(engine, SglangEngine) and engine.max_context == 8
    async with engine:
        clamped = await engine.generate([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=10))
        assert fake.generate_bodies()[-1]["sampling_params"]["max_new_tokens"] == 3
        fits = await engine.generate([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=3))
        sent = len(fake.generate_bodies())
        full = await engine.generate(list(range(1, 9)), SamplingParams(max_new_tokens=4))
        assert len(fake.generate_bodies()) == sent  # nothing fits: no request
    assert clamped.output_ids == [6, 7, 8] and clamped.finish_reason == "context"
    assert fits.finish_reason == "length"
    assert full.output_ids == [] and full.finish_reason == "context"


async def test_aborted_generation_raises(fake: FakeSglangServer, make: Make) -> None:
    fake.finish_reasons = [{"type": "abort", "message": "weights are being updated"}]
    engine = await make()
    with pytest.raises(SglangError, match="weights are being updated"):
        await engine.generate([1], SamplingParams(max_new_tokens=1))
    assert engine.error is None  # one request failed, not the engine


async def test_refused_requests_raise_one_line_sglang_errors(fake: FakeSglangServer, make: Make) -> None:
    engine = await make()
    with pytest.raises(SglangError, match="HTTP 400") as refused:
        await engine.generate([-1.5], SamplingParams())  # type: ignore[list-item]
    assert "\n" not in str(refused.value) and engine.error is None
    with pytest.raises(ValueError, match="at least one token"):
        await engine.generate([], SamplingParams())
    assert len((await engine.generate([1], SamplingParams(max_new_tokens=1))).output_ids) == 1


async def test_an_unreachable_server_fails_the_engine(fake: FakeSglangServer) -> None:
    engine = SglangEngine(SglangEngineConfig(url=fake.url, timeout_s=5))
    with pytest.raises(EngineError, match="not started"):
        await engine.generate([1], SamplingParams())
    async with engine:
        fake.httpd.shutdown()
        fake.httpd.server_close()
        with structlog.testing.capture_logs() as logs:
            with pytest.raises(EngineError, match="cannot reach SGLang"):
                await engine.generate([1], SamplingParams())
            with pytest.raises(EngineError, match="cannot reach SGLang"):
                await engine.generate([2], SamplingParams())  # fails at once: the engine is down
    assert isinstance(engine.error, EngineError)
    assert [e["event"] for e in logs] == ["sglang_unreachable"]


async def test_cancelling_a_request_leaves_the_engine_usable(fake: FakeSglangServer, make: Make) -> None:
    engine = await make()
    fake.generate_gate = threading.Event()
    task = asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=1)))
    assert await asyncio.to_thread(fake.generate_started.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    fake.generate_gate.set()
    assert (await engine.generate([4], SamplingParams(max_new_tokens=1))).output_ids == [5]


# ---------------------------------------------------------------------------------------------- weights


async def test_load_weights_posts_model_path_and_version(fake: FakeSglangServer, make: Make) -> None:
    engine = await make()
    await asyncio.to_thread(engine.load_weights, {}, 5, "/shared/ckpt/v5")
    assert fake.requests[-1] == (
        "POST",
        "/update_weights_from_disk",
        {"model_path": "/shared/ckpt/v5", "weight_version": "5"},
    )
    assert engine.version == 5 and await asyncio.to_thread(engine.server_version) == 5
    assert (await engine.generate([1], SamplingParams(max_new_tokens=1))).weight_version == 5
    async with engine.pinned() as version:
        assert version == 5

    fake.update_ok = False
    with pytest.raises(SglangError, match="shape mismatch"):
        await asyncio.to_thread(engine.load_weights, {}, 6, "/shared/ckpt/v6")
    assert engine.version == 5
    with pytest.raises(ValueError, match="model_path"):
        engine.load_weights({}, version=6)


async def test_server_version_falls_back_to_model_info(fake: FakeSglangServer, make: Make) -> None:
    fake.legacy_version_route = False
    fake.weight_version = "9"
    assert await asyncio.to_thread((await make()).server_version) == 9
    assert [p for _, p, _ in fake.requests] == ["/get_weight_version", "/model_info"]


# ---------------------------------------------------------------------------------------------- LoRA
# load_adapter is a blocking call (made from the staging thread); the tests call it directly.


async def test_load_adapter_uses_versioned_names_and_generate_names_the_newest(
    fake: FakeSglangServer, make: Make
) -> None:
    fake.weight_version = "0"  # LoRA mode: the server's version is the base's, never the adapter's
    engine = await make()
    assert engine.current_adapter is None
    await engine.generate([1], SamplingParams(max_new_tokens=1))
    assert "lora_path" not in fake.requests[-1][2]

    assert engine.load_adapter("/shared/adapters/v3", version=3) == "miles-v3"
    assert fake.requests[-1] == (
        "POST",
        "/load_lora_adapter",
        {"lora_name": "miles-v3", "lora_path": "/shared/adapters/v3"},
    )
    assert engine.current_adapter == "miles-v3" and engine.version == 3
    gens = await asyncio.gather(*(engine.generate([p], SamplingParams(max_new_tokens=2)) for p in (1, 2)))
    assert [b.get("lora_path") for b in fake.generate_bodies()[-2:]] == ["miles-v3", "miles-v3"]
    assert [g.weight_version for g in gens] == [3, 3]

    engine.load_adapter("/shared/adapters/v4", version=4)
    gen = await engine.generate([1], SamplingParams(max_new_tokens=1))
    assert fake.requests[-1][2]["lora_path"] == "miles-v4" and gen.weight_version == 4
    assert fake.adapters == {"miles-v3": "/shared/adapters/v3", "miles-v4": "/shared/adapters/v4"}


def test_adapter_prefix_names_adapters() -> None:
    engine = SglangEngine(SglangEngineConfig(url="http://127.0.0.1:1"), adapter_prefix="run42")
    assert engine.adapter_name(7) == "run42-v7"
    with pytest.raises(ValueError, match="adapter_prefix"):
        SglangEngine(SglangEngineConfig(url="http://127.0.0.1:1"), adapter_prefix="")


async def test_adapters_beyond_keep_adapters_are_unloaded(fake: FakeSglangServer, make: Make) -> None:
    engine = await make(keep_adapters=2)
    for v in (1, 2, 3, 4):
        engine.load_adapter(f"/a/v{v}", version=v)
    assert fake.lora_calls() == [
        ("/load_lora_adapter", {"lora_name": "miles-v1", "lora_path": "/a/v1"}),
        ("/load_lora_adapter", {"lora_name": "miles-v2", "lora_path": "/a/v2"}),
        ("/load_lora_adapter", {"lora_name": "miles-v3", "lora_path": "/a/v3"}),
        ("/unload_lora_adapter", {"lora_name": "miles-v1"}),  # only after the new one is loaded
        ("/load_lora_adapter", {"lora_name": "miles-v4", "lora_path": "/a/v4"}),
        ("/unload_lora_adapter", {"lora_name": "miles-v2"}),
    ]
    assert sorted(fake.adapters) == ["miles-v3", "miles-v4"] and engine.current_adapter == "miles-v4"

    one = await make(keep_adapters=1, adapter_prefix="solo")
    one.load_adapter("/a/v1", version=1)
    one.load_adapter("/a/v2", version=2)
    assert sorted(n for n in fake.adapters if n.startswith("solo")) == ["solo-v2"]


async def test_failed_unload_is_logged_not_fatal(fake: FakeSglangServer, make: Make) -> None:
    engine = await make(keep_adapters=1)
    engine.load_adapter("/a/v1", version=1)
    fake.fail_unloads = True
    with structlog.testing.capture_logs() as logs:
        assert engine.load_adapter("/a/v2", version=2) == "miles-v2"
    assert engine.current_adapter == "miles-v2"
    failed = [e for e in logs if e["event"] == "sglang_adapter_unload_failed"]
    assert len(failed) == 1 and failed[0]["adapter"] == "miles-v1" and "not loaded" in failed[0]["error"]
    fake.fail_unloads = False
    engine.load_adapter("/a/v3", version=3)  # the failed one is not retried
    assert fake.lora_calls()[-1] == ("/unload_lora_adapter", {"lora_name": "miles-v2"})


@pytest.mark.parametrize("status", [400, 200])
async def test_failed_load_raises_and_keeps_the_previous_adapter(
    fake: FakeSglangServer, make: Make, status: int
) -> None:
    engine = await make()
    engine.load_adapter("/a/v1", version=1)
    fake.load_failure_status = status
    fake.fail_loads["miles-v2"] = "LoRA rank 64 exceeds --max-lora-rank 16"
    with pytest.raises(SglangError, match=r"'miles-v2'.*max-lora-rank 16"):
        engine.load_adapter("/a/v2", version=2)
    assert engine.current_adapter == "miles-v1" and engine.version == 1
    gen = await engine.generate([1], SamplingParams(max_new_tokens=1))
    assert fake.requests[-1][2]["lora_path"] == "miles-v1" and gen.weight_version == 1
    assert "miles-v1" in fake.adapters  # nothing was unloaded for the failed load

    del fake.fail_loads["miles-v2"]
    engine.load_adapter("/a/v2", version=2)  # the same version can be retried
    assert engine.current_adapter == "miles-v2"


async def test_reloading_a_version_never_rebinds_its_name(fake: FakeSglangServer, make: Make) -> None:
    engine = await make()
    engine.load_adapter("/a/v1", version=1)
    engine.load_adapter("/a/v2", version=2)
    calls = len(fake.lora_calls())
    assert engine.load_adapter("/a/v1", version=1) == "miles-v1"  # same adapter: current again, no request
    assert len(fake.lora_calls()) == calls and engine.current_adapter == "miles-v1" and engine.version == 1
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_adapter("/elsewhere/v2", version=2)
    assert engine.current_adapter == "miles-v1"

    # A name the server holds from elsewhere (another engine, an earlier run) is refused, not reused.
    other = await make()
    with pytest.raises(SglangError, match="'miles-v2'.*already loaded"):
        other.load_adapter("/b/v2", version=2)
    assert other.current_adapter is None


async def test_unknown_adapter_name_is_rejected_by_the_server(fake: FakeSglangServer, make: Make) -> None:
    engine = await make()
    engine.load_adapter("/a/v1", version=1)
    fake.adapters.clear()  # e.g. the server restarted
    with pytest.raises(SglangError, match="HTTP 400.*not loaded"):
        await engine.generate([1], SamplingParams(max_new_tokens=1))


async def test_request_keeps_its_adapter_while_a_new_one_loads(fake: FakeSglangServer, make: Make) -> None:
    engine = await make()
    engine.load_adapter("/a/v1", version=1)
    fake.generate_gate = threading.Event()
    task = asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=1)))
    assert await asyncio.to_thread(fake.generate_started.wait, 5)
    await asyncio.to_thread(engine.load_adapter, "/a/v2", 2)  # while the request is in flight
    fake.generate_gate.set()
    assert (await task).weight_version == 1
    assert fake.generate_bodies()[-1]["lora_path"] == "miles-v1"
    fake.generate_gate = None
    assert (await engine.generate([1], SamplingParams(max_new_tokens=1))).weight_version == 2
