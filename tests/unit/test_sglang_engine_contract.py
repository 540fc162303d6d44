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
import structlog

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
        # LoRA: adapter name -> path, as the server holds them; a name in fail_loads is refused.
        self.adapters: dict[str, str] = {}
        self.fail_loads: dict[str, str] = {}
        self.fail_unloads = False
        self.load_failure_status = 400  # SGLang answers a refused load with HTTP 400
        self.generate_gate: threading.Event | None = None  # when set, /generate waits for it
        self.generate_started = threading.Event()
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
                elif self.path == "/load_lora_adapter":
                    self._reply(*server.load_lora_adapter(body))
                elif self.path == "/unload_lora_adapter":
                    self._reply(*server.unload_lora_adapter(body))
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

    def load_lora_adapter(self, body: dict[str, Any]) -> tuple[int, Any]:
        name, path = body.get("lora_name"), body.get("lora_path")
        if set(body) != {"lora_name", "lora_path"} or not isinstance(name, str) or not isinstance(path, str):
            return 400, {"error": f"expected lora_name and lora_path strings, got {body}"}
        if name in self.adapters:
            return 400, {"success": False, "error_message": f"LoRA adapter {name} is already loaded"}
        if name in self.fail_loads:
            if self.load_failure_status == 200:  # the brief's {success, message} shape
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
        if self.generate_gate is not None:
            self.generate_gate.wait(5)
        ids, sp = body.get("input_ids"), body.get("sampling_params", {})
        if (
            body.get("return_logprob") is not True
            or not isinstance(ids, list)
            or not all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in ids)
        ):
            return 400, {"error": "expected input_ids: list[list[int]] and return_logprob: true"}
        if set(sp) != {"max_new_tokens", "temperature", "top_p", "stop_token_ids"}:
            return 400, {"error": f"unexpected sampling_params keys {sorted(sp)}"}
        if not set(body) <= {"input_ids", "sampling_params", "return_logprob", "lora_path"}:
            return 400, {"error": f"unexpected keys {sorted(body)}"}
        if "lora_path" in body:
            names = body["lora_path"] if isinstance(body["lora_path"], list) else [body["lora_path"]] * len(ids)
            unknown = [n for n in names if n is not None and n not in self.adapters]
            if unknown or len(names) != len(ids):
                return 400, {"object": "error", "message": f"LoRA adapter {unknown} not loaded", "code": 400}
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


# ---------------------------------------------------------------------------------------------- LoRA


def test_load_adapter_uses_versioned_names_and_generate_names_the_newest(fake: FakeSglangServer) -> None:
    fake.weight_version = "0"  # LoRA mode: the server's version is the base's, never the adapter's
    engine = engine_for(fake)
    assert engine.current_adapter is None
    engine.generate([[1]], SamplingParams(max_new_tokens=1))
    assert "lora_path" not in fake.requests[-1][2]

    assert engine.load_adapter("/shared/adapters/v3", version=3) == "miles-v3"
    assert fake.requests[-1] == (
        "POST",
        "/load_lora_adapter",
        {"lora_name": "miles-v3", "lora_path": "/shared/adapters/v3"},
    )
    assert engine.current_adapter == "miles-v3" and engine.version == 3
    gens = engine.generate([[1], [2]], SamplingParams(max_new_tokens=2))
    assert fake.requests[-1][2]["lora_path"] == "miles-v3"
    assert [g.weight_version for g in gens] == [3, 3]

    engine.load_adapter("/shared/adapters/v4", version=4)
    gens = engine.generate([[1]], SamplingParams(max_new_tokens=1))
    assert fake.requests[-1][2]["lora_path"] == "miles-v4" and gens[0].weight_version == 4
    assert fake.adapters == {"miles-v3": "/shared/adapters/v3", "miles-v4": "/shared/adapters/v4"}


def test_adapter_prefix_names_adapters() -> None:
    engine = SglangEngine(SglangEngineConfig(url="http://127.0.0.1:1"), adapter_prefix="run42")
    assert engine.adapter_name(7) == "run42-v7"
    with pytest.raises(ValueError, match="adapter_prefix"):
        SglangEngine(SglangEngineConfig(url="http://127.0.0.1:1"), adapter_prefix="")


def test_adapters_beyond_keep_adapters_are_unloaded(fake: FakeSglangServer) -> None:
    engine = SglangEngine(SglangEngineConfig(url=fake.url, timeout_s=5, keep_adapters=2))
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

    one = SglangEngine(SglangEngineConfig(url=fake.url, timeout_s=5, keep_adapters=1), adapter_prefix="solo")
    one.load_adapter("/a/v1", version=1)
    one.load_adapter("/a/v2", version=2)
    assert sorted(n for n in fake.adapters if n.startswith("solo")) == ["solo-v2"]


def test_failed_unload_is_logged_not_fatal(fake: FakeSglangServer) -> None:
    engine = SglangEngine(SglangEngineConfig(url=fake.url, timeout_s=5, keep_adapters=1))
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
def test_failed_load_raises_and_keeps_the_previous_adapter(fake: FakeSglangServer, status: int) -> None:
    engine = engine_for(fake)
    engine.load_adapter("/a/v1", version=1)
    fake.load_failure_status = status
    fake.fail_loads["miles-v2"] = "LoRA rank 64 exceeds --max-lora-rank 16"
    with pytest.raises(SglangError, match=r"'miles-v2'.*max-lora-rank 16"):
        engine.load_adapter("/a/v2", version=2)
    assert engine.current_adapter == "miles-v1" and engine.version == 1
    gens = engine.generate([[1]], SamplingParams(max_new_tokens=1))
    assert fake.requests[-1][2]["lora_path"] == "miles-v1" and gens[0].weight_version == 1
    assert "miles-v1" in fake.adapters  # nothing was unloaded for the failed load

    del fake.fail_loads["miles-v2"]
    engine.load_adapter("/a/v2", version=2)  # the same version can be retried
    assert engine.current_adapter == "miles-v2"


def test_reloading_a_version_never_rebinds_its_name(fake: FakeSglangServer) -> None:
    engine = engine_for(fake)
    engine.load_adapter("/a/v1", version=1)
    engine.load_adapter("/a/v2", version=2)
    calls = len(fake.lora_calls())
    assert engine.load_adapter("/a/v1", version=1) == "miles-v1"  # same adapter: current again, no request
    assert len(fake.lora_calls()) == calls and engine.current_adapter == "miles-v1" and engine.version == 1
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_adapter("/elsewhere/v2", version=2)
    assert engine.current_adapter == "miles-v1"

    # A name the server holds from elsewhere (another engine, an earlier run) is refused, not reused.
    other = engine_for(fake)
    with pytest.raises(SglangError, match="'miles-v2'.*already loaded"):
        other.load_adapter("/b/v2", version=2)
    assert other.current_adapter is None


def test_unknown_adapter_name_is_rejected_by_the_server(fake: FakeSglangServer) -> None:
    engine = engine_for(fake)
    engine.load_adapter("/a/v1", version=1)
    fake.adapters.clear()  # e.g. the server restarted
    with pytest.raises(SglangError, match="HTTP 400.*not loaded"):
        engine.generate([[1]], SamplingParams(max_new_tokens=1))


def test_request_keeps_its_adapter_while_a_new_one_loads(fake: FakeSglangServer) -> None:
    engine = engine_for(fake)
    engine.load_adapter("/a/v1", version=1)
    fake.generate_gate = threading.Event()
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.extend(engine.generate([[1]], SamplingParams(max_new_tokens=1))))
    worker.start()
    assert fake.generate_started.wait(5)
    engine.load_adapter("/a/v2", version=2)  # while the request is in flight
    fake.generate_gate.set()
    worker.join(5)
    generate_bodies = [b for _, p, b in fake.requests if p == "/generate"]
    assert generate_bodies[-1]["lora_path"] == "miles-v1"
    assert [g.weight_version for g in result] == [1]
    fake.generate_gate = None
    assert engine.generate([[1]], SamplingParams(max_new_tokens=1))[0].weight_version == 2
