"""SglangEngine against a fake SGLang HTTP server: the request JSON we send and the replies we parse.

``FakeSglangServer`` is a contract stand-in (stdlib ``http.server`` on 127.0.0.1, port 0), not an
SGLang implementation: it checks the request shape and answers with SGLang-shaped JSON.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from miles.config import SglangEngineConfig
from miles.engines.base import SamplingParams
from miles.engines.registry import build_engine
from miles.engines.sglang_engine import SglangEngine, SglangError


class FakeSglangServer:
    """Records every request; ``/generate`` replies per prompt from ``self.script`` (a function of the prompt)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.weight_version = "0"
        self.update_ok = True
        self.legacy_version_route = True
        self.omit_output_ids = False
        self.finish_reasons: list[Any] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
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
                server.requests.append(("GET", self.path, None))
                if self.path == "/get_weight_version" and server.legacy_version_route:
                    self._reply(200, {"weight_version": server.weight_version})
                elif self.path == "/model_info":
                    self._reply(200, {"model_path": "/m", "weight_version": server.weight_version})
                else:
                    self._reply(404, {"detail": "Not Found"})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(("POST", self.path, body))
                if self.path == "/generate":
                    self._reply(*server.generate(body))
                elif self.path == "/update_weights_from_disk":
                    if not isinstance(body.get("model_path"), str) or not isinstance(body.get("weight_version"), str):
                        self._reply(400, {"error": "bad update request"})
                    elif server.update_ok:
                        server.weight_version = body["weight_version"]
                        self._reply(200, {"success": True, "message": "Succeeded to update model weights."})
                    else:
                        self._reply(200, {"success": False, "message": "Failed to load: shape mismatch"})
                else:
                    self._reply(404, {"detail": "Not Found"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)

    def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        ids, sp = body.get("input_ids"), body.get("sampling_params", {})
        if (
            body.get("return_logprob") is not True
            or not isinstance(ids, list)
            or not all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in ids)
        ):
            return 400, {"error": "expected input_ids: list[list[int]] and return_logprob: true"}
        if set(sp) != {"max_new_tokens", "temperature", "top_p", "stop_token_ids"}:
            return 400, {"error": f"unexpected sampling_params keys {sorted(sp)}"}
        out = []
        for i, prompt in enumerate(ids):
            # Row i answers with prompt[-1] + 1, + 2, ... and stops if it hits a stop token.
            tokens: list[int] = []
            for k in range(sp["max_new_tokens"]):
                tokens.append(prompt[-1] + 1 + k)
                if tokens[-1] in sp["stop_token_ids"]:
                    break
            reason: Any = {"type": "length", "length": len(tokens)}
            if tokens[-1] in sp["stop_token_ids"]:
                reason = {"type": "stop", "matched": tokens[-1]}
            if i < len(self.finish_reasons):
                reason = self.finish_reasons[i]
            item: dict[str, Any] = {
                "text": "ignored",
                "output_ids": tokens,
                "meta_info": {
                    "id": f"req-{i}",
                    "finish_reason": reason,
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(tokens),
                    "output_token_logprobs": [[-0.1 * (k + 1), t, None] for k, t in enumerate(tokens)],
                    "weight_version": self.weight_version,
                },
            }
            if self.omit_output_ids:
                del item["output_ids"]
            out.append(item)
        return 200, out


@pytest.fixture
def fake() -> Iterator[FakeSglangServer]:
    server = FakeSglangServer()
    server.thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def engine_for(fake: FakeSglangServer, **kw: Any) -> SglangEngine:
    engine = build_engine(SglangEngineConfig(url=fake.url + "/", timeout_s=5), "/unused", **kw)
    assert isinstance(engine, SglangEngine)
    return engine


def test_generate_sends_batched_request_and_parses_results(fake: FakeSglangServer) -> None:
    fake.weight_version = "4"
    engine = engine_for(fake)
    params = SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, stop_token_ids=[12])
    gens = engine.generate([[1, 10], [5]], params)

    (method, path, body) = fake.requests[-1]
    assert (method, path) == ("POST", "/generate")
    assert body == {
        "input_ids": [[1, 10], [5]],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.7, "top_p": 0.9, "stop_token_ids": [12]},
        "return_logprob": True,
    }
    assert [g.prompt_ids for g in gens] == [[1, 10], [5]]
    assert gens[0].output_ids == [11, 12] and gens[0].finish_reason == "stop"
    assert gens[1].output_ids == [6, 7, 8] and gens[1].finish_reason == "length"
    assert gens[1].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert all(g.weight_version == 4 for g in gens)
    assert engine.generate([], params) == []


def test_output_ids_fall_back_to_logprob_entries_and_string_reasons(fake: FakeSglangServer) -> None:
    fake.omit_output_ids = True
    fake.finish_reasons = ["length", "stop"]
    fake.weight_version = "not-an-int"
    engine = engine_for(fake, version=2)
    gens = engine.generate([[3], [7]], SamplingParams(max_new_tokens=2))
    assert [g.output_ids for g in gens] == [[4, 5], [8, 9]]
    assert [g.finish_reason for g in gens] == ["length", "stop"]
    assert [g.weight_version for g in gens] == [2, 2]  # unparseable server version: the engine's own


def test_aborted_generation_raises(fake: FakeSglangServer) -> None:
    fake.finish_reasons = [{"type": "abort", "message": "weights are being updated"}]
    with pytest.raises(SglangError, match="weights are being updated"):
        engine_for(fake).generate([[1]], SamplingParams(max_new_tokens=1))


def test_load_weights_posts_model_path_and_version(fake: FakeSglangServer) -> None:
    engine = engine_for(fake)
    engine.load_weights({}, version=5, model_path="/shared/ckpt/v5")
    assert fake.requests[-1] == (
        "POST",
        "/update_weights_from_disk",
        {"model_path": "/shared/ckpt/v5", "weight_version": "5"},
    )
    assert engine.version == 5 and engine.server_version() == 5
    assert engine.generate([[1]], SamplingParams(max_new_tokens=1))[0].weight_version == 5

    fake.update_ok = False
    with pytest.raises(SglangError, match="shape mismatch"):
        engine.load_weights({}, version=6, model_path="/shared/ckpt/v6")
    assert engine.version == 5
    with pytest.raises(ValueError, match="model_path"):
        engine.load_weights({}, version=6)


def test_server_version_falls_back_to_model_info(fake: FakeSglangServer) -> None:
    fake.legacy_version_route = False
    fake.weight_version = "9"
    assert engine_for(fake).server_version() == 9
    assert [p for _, p, _ in fake.requests] == ["/get_weight_version", "/model_info"]


def test_http_errors_and_unreachable_server_raise_sglang_error(fake: FakeSglangServer) -> None:
    engine = engine_for(fake)
    with pytest.raises(SglangError, match="HTTP 400"):
        engine.generate([["not-a-token"]], SamplingParams())  # type: ignore[list-item]
    fake.httpd.shutdown()
    fake.httpd.server_close()
    with pytest.raises(SglangError, match="cannot reach SGLang"):
        engine.generate([[1]], SamplingParams())
