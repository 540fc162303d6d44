"""Engine that drives an SGLang server over its native HTTP API: one ``/generate`` per request, many in flight.

Used on GPU nodes, where SGLang's paged attention, continuous batching and CUDA graphs beat our embedded
loop; the server does the batching, so this client only keeps requests in flight. Requests go through
:class:`~miles.engines.server_client.ServerClient`: generation on its async side, the weight endpoints on
its blocking side, because they are made from the staging loader thread and from start-up code.

The contract we rely on, pinned down by ``tests/unit/test_sglang_engine_contract.py``:

* ``POST /generate`` with one prompt's ``input_ids`` (a flat list), ``sampling_params`` and
  ``return_logprob: true`` answers one result: ``output_ids``, ``meta_info.output_token_logprobs``
  (``[[logprob, id, text], ...]``), ``meta_info.finish_reason`` (a dict with ``type``, or a string) and
  ``meta_info.weight_version``. The logprobs are of the temperature-scaled distribution as long as the
  server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset, which is what our importance ratios assume.
  Cancelling the awaiting task closes the connection, on which SGLang aborts the request.
* ``POST /update_weights_from_disk`` with ``model_path`` and ``weight_version``: the server reloads a
  checkpoint directory the caller wrote (:mod:`miles.engines.sglang_staging` does that).
* ``GET /get_weight_version`` (newer servers: ``GET /model_info``) for the server's version.

Context: :attr:`SglangEngine.max_context` comes from the config or the checkpoint; ``max_new_tokens`` is
clamped so prompt + output fits (a prompt that fills it returns at once with ``finish_reason="context"``),
because SGLang refuses a request whose budget overflows its context instead of truncating it.

LoRA mode (a frozen base plus adapters trained with peft; only the adapter travels):

* The server must be started with LoRA enabled and sized for our adapters: ``--enable-lora``,
  ``--max-lora-rank`` >= the adapter rank, ``--lora-target-modules`` covering the adapter's
  ``target_modules``, and ``--max-loaded-loras`` >= ``cfg.keep_adapters + 1`` (a new adapter is loaded
  before the oldest is unloaded); ``--max-loras-per-batch`` >= 2 lets requests for the old and the new
  adapter share a batch during a switch.
* ``POST /load_lora_adapter`` with ``lora_name`` and ``lora_path`` (a peft adapter directory the server
  can read, written by :func:`miles.engines.adapter_files.save_peft_adapter`) answers
  ``{success, error_message | message}``; SGLang answers a failure with HTTP 400.
* ``POST /unload_lora_adapter`` with ``lora_name``; the server waits for requests using it to finish.
* ``POST /generate`` with ``lora_path`` set to the *name* of a loaded adapter (SGLang rejects an unknown
  name with HTTP 400). ``meta_info.weight_version`` then describes the base weights, not the adapter.

Adapter names are versioned (``<adapter_prefix>-v<version>``), so a name never refers to two different
adapters: a request that names ``miles-v7`` is served by adapter 7 or refused, never by a stale one.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import structlog

from miles.config import SglangEngineConfig
from miles.engines.base import EngineError, FinishReason, Generation, SamplingParams
from miles.engines.server_client import ServerClient, ServerError, ServerUnreachable

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)

UNBOUNDED_CONTEXT = 2**31 - 1  # no context limit known: the server refuses what does not fit
MAX_CONNECTIONS = 512  # requests beyond this wait for a free connection (no timeout on that wait)


class SglangError(ServerError):
    """The server refused a request or answered outside the contract above (one-line message)."""


def _parse_version(value: Any, default: int) -> int:
    """SGLang stores versions as strings; ours are ints. Unparseable values fall back to ``default``."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _finish_reason(raw: Any) -> FinishReason:
    """Map SGLang's finish reason (``{"type": "stop", ...}``, ``"length"``, ...) to ``stop``/``length``."""
    kind = raw.get("type") if isinstance(raw, dict) else raw
    if kind == "length":
        return "length"
    if kind == "stop":
        return "stop"
    message = raw.get("message") if isinstance(raw, dict) else None
    suffix = f" ({message})" if message else ""
    raise SglangError(f"generation did not finish normally: finish_reason={raw!r}{suffix}")


def _reply_message(reply: Any) -> str:
    """The error text of a ``{success: false, ...}`` reply (SGLang: ``error_message``; some: ``message``)."""
    if isinstance(reply, dict):
        return str(reply.get("error_message") or reply.get("message") or reply)
    return repr(reply)


class SglangEngine:
    """:class:`~miles.engines.base.Engine` over a running SGLang server at ``cfg.url``.

    Full-weights mode: :meth:`load_weights`. LoRA mode: :meth:`load_adapter`; from the first successful
    call on, every :meth:`generate` request names the current adapter. ``adapter_prefix`` starts the
    adapter names this engine gives the server; engines sharing one server, or a server that outlives a
    training run, need distinct prefixes (e.g. include the run id), or a name could mean another adapter.
    The blocking weight calls may run in any thread while requests are in flight.

    A server that cannot be reached makes the engine fail (:attr:`error`; every later request raises
    :class:`~miles.engines.base.EngineError`); a refused request raises :class:`SglangError` for that
    request only.
    """

    def __init__(
        self,
        cfg: SglangEngineConfig,
        version: int = 0,
        *,
        adapter_prefix: str = "miles",
        max_context: int | None = None,
    ) -> None:
        if not adapter_prefix:
            raise ValueError("adapter_prefix must be a non-empty string")
        self.cfg = cfg
        self.base_url = cfg.url.rstrip("/")
        self.adapter_prefix = adapter_prefix
        self._max_context = int(max_context) if max_context else UNBOUNDED_CONTEXT
        self._version = int(version)
        self._state_lock = threading.Lock()  # guards _version, _adapter, _loaded; held only briefly
        self._load_lock = threading.Lock()  # one load_adapter at a time (held across its HTTP calls)
        self._adapter: tuple[str, int] | None = None  # (name, version) that new requests use
        self._loaded: dict[str, str] = {}  # name -> path of adapters loaded and not unloaded, oldest first
        self._client = ServerClient(
            self.base_url,
            server="SGLang",
            timeout_s=cfg.timeout_s,
            max_connections=MAX_CONNECTIONS,
            refused=SglangError,
        )
        self._started = False
        self._error: EngineError | None = None

    # ------------------------------------------------------------------ state

    @property
    def version(self) -> int:
        """Version of the last weights or adapter this engine loaded (or was constructed with)."""
        return self._version

    @property
    def max_context(self) -> int:
        """Most tokens (prompt + output) per request (unbounded if neither config nor checkpoint says)."""
        return self._max_context

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped working (the server could not be reached), or None."""
        return self._error

    @property
    def current_adapter(self) -> str | None:
        """Name of the adapter new requests use (``<adapter_prefix>-v<version>``), or None before any."""
        current = self._adapter
        return None if current is None else current[0]

    def adapter_name(self, version: int) -> str:
        """The server-side name of adapter ``version``."""
        return f"{self.adapter_prefix}-v{int(version)}"

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Accept generation requests (the client's connections open on the running event loop)."""
        if self._started:
            raise EngineError("SglangEngine is already started")
        self._started = True

    async def close(self) -> None:
        """Close the client's connections; the engine may be started again."""
        self._started = False
        await self._client.close()

    async def __aenter__(self) -> SglangEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @asynccontextmanager
    async def pinned(self) -> AsyncIterator[int]:
        """The version requests run at. This engine loads nothing by itself; :class:`SglangStagingEngine`
        holds its background loads back while pinned."""
        yield self._version

    # ------------------------------------------------------------------ generation

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """One ``/generate`` call; output ids include a matched stop token, as SGLang returns them."""
        if len(prompt_ids) == 0:
            raise ValueError("every prompt needs at least one token (encode_prompt adds BOS)")
        if params.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {params.max_new_tokens}")
        if self._error is not None:
            raise EngineError(str(self._error)) from self._error
        if not self._started:
            raise EngineError("SglangEngine is not started: use `async with engine:` or `await engine.start()`")
        with self._state_lock:  # one adapter for the whole request, even if load_adapter runs meanwhile
            adapter = self._adapter
        budget = min(params.max_new_tokens, self._max_context - len(prompt_ids))
        if budget <= 0:
            return Generation(list(prompt_ids), [], [], "context", adapter[1] if adapter else self._version)
        payload: dict[str, Any] = {
            "input_ids": list(prompt_ids),
            "sampling_params": {
                "max_new_tokens": budget,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "stop_token_ids": list(params.stop_token_ids),
            },
            "return_logprob": True,
        }
        if adapter is not None:
            payload["lora_path"] = adapter[0]
        reply = await self._post_generate(payload)
        if isinstance(reply, list) and len(reply) == 1:  # a server that answers every request as a batch
            reply = reply[0]
        if not isinstance(reply, dict):
            raise SglangError(f"/generate returned {type(reply).__name__}, expected one result object")
        gen = self._parse(list(prompt_ids), reply, None if adapter is None else adapter[1])
        if gen.finish_reason == "length" and budget < params.max_new_tokens:
            gen.finish_reason = "context"  # the budget was the context's, not max_new_tokens
        return gen

    async def _post_generate(self, payload: dict[str, Any]) -> Any:
        try:
            return await self._client.call("POST", "/generate", json_body=payload)
        except ServerUnreachable as exc:
            if self._error is None:  # the first request to find the server gone says so; the rest only fail
                self._error = EngineError(str(exc))
                log.error("sglang_unreachable", url=self.base_url, error=str(self._error))
            raise EngineError(str(self._error)) from None
        except ServerError as exc:
            if isinstance(exc, SglangError):
                raise
            raise SglangError(str(exc)) from None  # a dropped connection fails this request only

    def _parse(self, prompt: list[int], item: Mapping[str, Any], adapter_version: int | None) -> Generation:
        meta = item.get("meta_info") or {}
        token_lps = meta.get("output_token_logprobs")
        if token_lps is None:
            raise SglangError("/generate result has no meta_info.output_token_logprobs (was return_logprob sent?)")
        output_ids = item.get("output_ids")
        if output_ids is None:
            output_ids = [int(entry[1]) for entry in token_lps]
        if len(output_ids) != len(token_lps):
            raise SglangError(f"/generate result has {len(output_ids)} output ids but {len(token_lps)} logprobs")
        return Generation(
            prompt_ids=prompt,
            output_ids=[int(t) for t in output_ids],
            logprobs=[float(entry[0]) for entry in token_lps],
            finish_reason=_finish_reason(meta.get("finish_reason")),
            weight_version=(
                adapter_version
                if adapter_version is not None  # the server's weight_version is the base's in LoRA mode
                else _parse_version(meta.get("weight_version"), self._version)
            ),
        )

    # ------------------------------------------------------------------ blocking control calls

    def _request(self, method: str, path: str, payload: Any | None = None) -> Any:
        """A blocking call to a weight or info endpoint (any thread); every failure is a :class:`SglangError`."""
        try:
            return self._client.call_blocking(method, path, json_body=payload)
        except SglangError:
            raise
        except ServerError as exc:
            raise SglangError(str(exc)) from None

    def load_weights(
        self, state: Mapping[str, torch.Tensor] | None, version: int, model_path: str | None = None
    ) -> None:
        """Make the server reload weights from ``model_path`` and tag them ``version`` (blocking).

        ``state`` is ignored: weights travel through storage the server can read, which the caller
        must have written (``save_pretrained``/safetensors) before calling this.
        """
        if model_path is None:
            raise ValueError(
                "SglangEngine.load_weights needs model_path: save the weights as safetensors to a directory the "
                "SGLang server can read, then pass that directory"
            )
        reply = self._request(
            "POST", "/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version)}
        )
        if not isinstance(reply, dict) or not reply.get("success", False):
            message = reply.get("message") if isinstance(reply, dict) else reply
            raise SglangError(f"/update_weights_from_disk {model_path!r} failed: {message}")
        self._version = int(version)

    def load_adapter(self, adapter_path: str, version: int) -> str:
        """Load the peft adapter directory ``adapter_path`` (readable by the server) as adapter ``version``.

        The server gets it as ``<adapter_prefix>-v<version>``; once loaded it is the adapter every new
        :meth:`generate` request uses and ``version`` is this engine's :attr:`version`. Then adapters
        beyond the ``cfg.keep_adapters`` most recently loaded are unloaded (a failed unload is logged and
        forgotten). Requests already sent keep the adapter they named; SGLang finishes them before
        unloading it. Returns the adapter's name. Blocking.

        A refused load raises :class:`SglangError` naming the adapter and the server's message, and
        leaves the current adapter as it was. Loading a version again from the same path only makes it
        current again; from a different path it raises ``ValueError`` (one name, one adapter).
        """
        name = self.adapter_name(version)
        with self._load_lock:
            known = self._loaded.get(name)
            if known is not None and known != adapter_path:
                raise ValueError(
                    f"LoRA adapter {name!r} is already loaded from {known!r}; refusing to load {adapter_path!r} "
                    "under the same name (use a new version)"
                )
            if known is None:
                try:
                    reply = self._request("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": adapter_path})
                except SglangError as exc:
                    raise SglangError(f"loading LoRA adapter {name!r} from {adapter_path!r} failed: {exc}") from None
                if not isinstance(reply, dict) or not reply.get("success", False):
                    raise SglangError(
                        f"loading LoRA adapter {name!r} from {adapter_path!r} failed: {_reply_message(reply)}"
                    )
            with self._state_lock:
                self._loaded.pop(name, None)
                self._loaded[name] = adapter_path  # now the most recently loaded
                self._adapter = (name, int(version))
                self._version = int(version)
                stale = list(self._loaded)[: max(0, len(self._loaded) - self.cfg.keep_adapters)]
                for old in stale:
                    del self._loaded[old]
            for old in stale:
                self._unload(old)
        log.info("sglang_adapter_loaded", adapter=name, path=adapter_path, unloaded=stale)
        return name

    def _unload(self, name: str) -> None:
        try:
            reply = self._request("POST", "/unload_lora_adapter", {"lora_name": name})
        except SglangError as exc:
            log.warning("sglang_adapter_unload_failed", adapter=name, error=str(exc))
            return
        if not isinstance(reply, dict) or not reply.get("success", False):
            log.warning("sglang_adapter_unload_failed", adapter=name, error=_reply_message(reply))

    def server_version(self) -> int | None:
        """The server's current weight version (``/get_weight_version``, else ``/model_info``), or None."""
        try:
            reply = self._request("GET", "/get_weight_version")
        except SglangError:
            reply = self._request("GET", "/model_info")
        value = reply.get("weight_version") if isinstance(reply, dict) else None
        return None if value is None else _parse_version(value, -1)
