"""Control logic of the vLLM engine that needs no server: the server-side digest is Miles' digest, the
server's weight-version spans become ours, the config refuses what the engine cannot do, the command line."""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from miles.config import ConfigError, VllmEngineConfig, load_config
from miles.engines.server_client import ConnectionLost, ServerClient, ServerError
from miles.engines.vllm.engine import VllmEngine, VllmError
from miles.engines.vllm.server import WORKER_DIR, server_command
from miles.sync.precision import state_digest


def load_worker_module():
    spec = importlib.util.spec_from_file_location("miles_vllm_worker", WORKER_DIR / "miles_vllm_worker.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_server_side_digest_is_miles_state_digest() -> None:
    worker = load_worker_module()
    torch.manual_seed(0)
    state = {
        "b.weight": torch.randn(3, 4).to(torch.bfloat16),
        "a.bias": torch.randn(5),
        "c.scale": torch.tensor(2.0),
        "empty": torch.zeros(0, 2),
    }
    assert worker.state_digest(state) == state_digest(state)
    flipped = dict(state, **{"a.bias": state["a.bias"].clone()})
    flipped["a.bias"].view(torch.int32)[0] ^= 1
    assert worker.state_digest(flipped) != state_digest(state)


def test_the_worker_module_imports_nothing_of_miles() -> None:
    source = (WORKER_DIR / "miles_vllm_worker.py").read_text()
    assert "import miles" not in source and "from miles" not in source  # it runs in vLLM's environment


def make_engine(version: int = 3) -> VllmEngine:
    return VllmEngine(
        VllmEngineConfig(url="http://127.0.0.1:1"),
        "/nonexistent",
        version=version,
        weights_dir="/tmp/unused",
        log_path="/tmp/unused.log",
        max_context=64,
    )


def test_weight_version_spans_become_ours() -> None:
    engine = make_engine(3)
    assert engine._spans([{"version": "3", "start": 0, "end": 4}], 4) == [(0, 3)]
    assert engine._spans([{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}], 5) == [
        (0, 3),
        (2, 4),
    ]
    assert engine._spans([{"version": "default", "start": 0, "end": 1}], 1) == [(0, 3)]
    assert engine._spans(None, 2) == [(0, 3)]
    with pytest.raises(VllmError, match="not one Miles set"):
        engine._spans([{"version": "mystery", "start": 0, "end": 1}], 1)
    with pytest.raises(VllmError, match="in order"):
        engine._spans([{"version": "3", "start": 1, "end": 2}], 2)


def test_a_reply_whose_logprobs_are_of_other_tokens_is_refused() -> None:
    engine = make_engine()
    reply = {
        "choices": [
            {
                "token_ids": [5, 6],
                "finish_reason": "length",
                "logprobs": {"content": [{"token_id": 5, "logprob": -1.0}, {"token_id": 7, "logprob": -2.0}]},
            }
        ]
    }
    with pytest.raises(VllmError, match="not of the returned token ids"):
        engine._parse([1], reply)
    reply["choices"][0]["logprobs"]["content"][1]["token_id"] = 6
    gen = engine._parse([1], reply)
    assert gen.output_ids == [5, 6] and gen.logprobs == [-1.0, -2.0] and gen.version_spans == [(0, 3)]


def test_sparse_updates_are_declined_and_older_versions_ignored() -> None:
    from miles.engines.base import SparseValues

    engine = make_engine(3)
    # The delta fast path is declined (False), so the follower stages the whole state, as it does for any
    # engine that cannot take one (it must not raise: that would end the worker).
    sparse = {"w": SparseValues(torch.tensor([0]), torch.tensor([1.0]))}
    assert not engine.stage_weights(sparse, 4, base_version=3, complete=False)
    assert engine.pending_version is None
    with pytest.raises(ValueError, match="sparse"):
        engine.stage_weights(sparse, 4)
    assert not engine.stage_weights({"w": torch.zeros(1)}, 3)
    assert engine.stage_weights({"w": torch.zeros(1)}, 5) and engine.pending_version == 5


class DiesAfterLoading:
    """Stand-in for our own server's process that a kill reaches after it loaded the new weights."""

    def exited(self) -> int | None:
        return None


class KilledAfterFirstLoad:
    """A local HTTP server that answers ``/pause`` and the first ``/collective_rpc``, then drops every
    connection without a reply, as a server killed at that moment does."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?")[0]
                server.calls.append(path)
                body = b""
                if path == "/collective_rpc" and server.calls.count("/collective_rpc") == 1:
                    body = json.dumps({"results": [{"ok": True, "digest": "d5"}]}).encode()
                elif path != "/pause":
                    self.close_connection = True  # killed from here on: the connection drops, no reply
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


async def test_a_server_lost_between_load_and_label_is_restarted_not_given_up(tmp_path: Path) -> None:
    fake = KilledAfterFirstLoad()
    engine = make_engine(3)
    engine.server = DiesAfterLoading()  # type: ignore[assignment]  # ours to restart
    engine._held_file = (3, tmp_path / "v3.safetensors", "d3")
    engine._client = ServerClient(fake.url, server="vLLM", timeout_s=5.0, refused=VllmError)
    engine._serving.set()
    try:
        with pytest.raises(ConnectionLost):
            await engine._switch(5, tmp_path / "v5.safetensors", "d5")
        # The restore found the server gone: not a fatal error (a restart reloads the held file), but nothing
        # is sent to it meanwhile and the supervisor is asked to restart it.
        assert fake.calls[0] == "/pause" and fake.calls[3] == "/collective_rpc"  # the held file, sent again
        assert sorted(fake.calls[1:3]) == ["/collective_rpc", "/update_weight_version"]  # load and label at once
        assert engine.error is None and engine.version == 3
        assert not engine._serving.is_set() and engine._restart_reason is not None
        # A server of someone else's (a URL) that cannot be restored is given up on: it may serve wrong weights.
        fake.calls.clear()
        engine.server = None
        engine._serving.set()
        with pytest.raises(ServerError):
            await engine._switch(5, tmp_path / "v5.safetensors", "d5")
        assert engine.error is not None and "no known version" in str(engine.error)
    finally:
        await engine._client.close()
        fake.stop()


def test_lora_mode_stages_the_adapter_itself_and_sizes_the_server_for_it(tmp_path: Path) -> None:
    from miles.config import LoraConfig

    lora = LoraConfig(rank=4, alpha=8, target_modules=["q_proj"])
    engine = make_engine(-1)
    with pytest.raises(ValueError, match="serve_adapters"):
        engine.weight_sink("bfloat16", 2.0)  # a merged LoRA path does not exist: the server applies adapters
    engine.serve_adapters(lora)
    adapter = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 6).bfloat16(),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(6, 4).bfloat16(),
    }
    passed, _ = engine.weight_sink("bfloat16", 2.0).decode(adapter)
    assert set(passed) == set(adapter)  # handed through untouched, not merged
    assert engine.stage_weights(passed, 0, complete=False)
    assert engine._slot.staged is not None and set(engine._slot.staged[1]) == set(adapter)
    with pytest.raises(ValueError):
        engine.stage_weights({"model.layers.0.self_attn.q_proj.weight": torch.zeros(6, 6)}, 1)  # not an adapter
    cmd = server_command("python", VllmEngineConfig(max_loras=3), "/m", 8000, lora)
    assert cmd[cmd.index("--max-lora-rank") + 1] == "8" and cmd[cmd.index("--max-loras") + 1] == "3"
    assert "--enable-lora" not in server_command("python", VllmEngineConfig(), "/m", 8000)


def write_recipe(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text("rollout:\n  engine:\n    type: vllm\n" + extra)
    return path


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("sync:\n  transport: broadcast\n", "loads weights from files"),
        ("  sampling:\n    top_p: 0.9\n", "top-p cut"),
    ],
)
def test_the_config_refuses_what_the_vllm_engine_cannot_do(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(str(write_recipe(tmp_path, extra)), [])


def test_the_server_command_serves_token_ids_with_processed_logprobs_and_our_extension() -> None:
    cfg = VllmEngineConfig(max_context=64, extra_args=["--block-size", "16"])
    cmd = server_command("/py", cfg, "/model", 8000)
    text = " ".join(cmd)
    for part in (
        "--skip-tokenizer-init",
        "--logprobs-mode processed_logprobs",
        "--enable-scale-out",
        "--worker-extension-cls miles_vllm_worker.MilesWeightLoader",
        "--max-model-len 64",
        "--dtype float32",
    ):
        assert part in text
    assert cmd[-2:] == ["--block-size", "16"]
