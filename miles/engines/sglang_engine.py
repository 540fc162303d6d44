"""Engine that drives an SGLang server over its native HTTP API (stdlib ``urllib`` only).

Used on GPU nodes, where SGLang's paged attention and CUDA graphs beat our embedded loop. The
contract we rely on, and which ``tests/unit/test_sglang_engine_contract.py`` pins down:

* ``POST /generate`` with ``input_ids`` (a batch), ``sampling_params`` and ``return_logprob``; each
  result carries ``output_ids`` and ``meta_info.output_token_logprobs`` (``[[logprob, id, text], ...]``),
  ``meta_info.finish_reason`` (a dict with ``type`` or a string) and ``meta_info.weight_version``.
  The logprobs are of the temperature-scaled distribution as long as the server runs with
  ``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset, which is what our importance ratios assume.
* ``POST /update_weights_from_disk`` with ``model_path`` and ``weight_version``: the server reloads
  a checkpoint directory. This engine writes nothing itself: the caller saves the new weights as
  safetensors (plus config) to a path the *server* can read, then calls :meth:`SglangEngine.load_weights`
  with ``model_path``.
* ``GET /get_weight_version`` (newer servers: ``GET /model_info``) for the server's version.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from miles.config import SglangEngineConfig
from miles.engines.base import Generation, SamplingParams

if TYPE_CHECKING:
    import torch


class SglangError(RuntimeError):
    """The server refused a request or answered outside the contract above."""


def _parse_version(value: Any, default: int) -> int:
    """SGLang stores versions as strings; ours are ints. Unparseable values fall back to ``default``."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _finish_reason(raw: Any) -> str:
    """Map SGLang's finish reason (``{"type": "stop", ...}``, ``"length"``, ...) to ``stop``/``length``."""
    kind = raw.get("type") if isinstance(raw, dict) else raw
    if kind == "length":
        return "length"
    if kind == "stop":
        return "stop"
    message = raw.get("message") if isinstance(raw, dict) else None
    suffix = f" ({message})" if message else ""
    raise SglangError(f"generation did not finish normally: finish_reason={raw!r}{suffix}")


class SglangEngine:
    """:class:`~miles.engines.base.Engine` over a running SGLang server at ``cfg.url``."""

    def __init__(self, cfg: SglangEngineConfig, version: int = 0) -> None:
        self.cfg = cfg
        self.base_url = cfg.url.rstrip("/")
        self._version = int(version)

    @property
    def version(self) -> int:
        """Version of the last weights this engine loaded (or was constructed with)."""
        return self._version

    # ------------------------------------------------------------------ HTTP

    def _request(self, method: str, path: str, payload: Any | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise SglangError(f"{method} {path} -> HTTP {exc.code}: {detail}") from None
        except urllib.error.URLError as exc:
            raise SglangError(f"{method} {path}: cannot reach SGLang at {self.base_url} ({exc.reason})") from None
        try:
            return json.loads(body) if body else None
        except json.JSONDecodeError:
            raise SglangError(f"{method} {path}: response is not JSON: {body[:200]!r}") from None

    # ------------------------------------------------------------------ Engine

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One batched ``/generate`` call; output ids include a matched stop token, as SGLang returns them."""
        if not prompts:
            return []
        payload = {
            "input_ids": [list(p) for p in prompts],
            "sampling_params": {
                "max_new_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "stop_token_ids": list(params.stop_token_ids),
            },
            "return_logprob": True,
        }
        results = self._request("POST", "/generate", payload)
        if isinstance(results, dict):  # a single-prompt server reply
            results = [results]
        if not isinstance(results, list) or len(results) != len(prompts):
            got = len(results) if isinstance(results, list) else type(results).__name__
            raise SglangError(f"/generate returned {got} results for {len(prompts)} prompts")
        return [self._parse(prompt, item) for prompt, item in zip(prompts, results, strict=True)]

    def _parse(self, prompt: list[int], item: Mapping[str, Any]) -> Generation:
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
            prompt_ids=list(prompt),
            output_ids=[int(t) for t in output_ids],
            logprobs=[float(entry[0]) for entry in token_lps],
            finish_reason=_finish_reason(meta.get("finish_reason")),
            weight_version=_parse_version(meta.get("weight_version"), self._version),
        )

    def load_weights(
        self, state: Mapping[str, torch.Tensor] | None, version: int, model_path: str | None = None
    ) -> None:
        """Make the server reload weights from ``model_path`` and tag them ``version``.

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

    def server_version(self) -> int | None:
        """The server's current weight version (``/get_weight_version``, else ``/model_info``), or None."""
        try:
            reply = self._request("GET", "/get_weight_version")
        except SglangError:
            reply = self._request("GET", "/model_info")
        value = reply.get("weight_version") if isinstance(reply, dict) else None
        return None if value is None else _parse_version(value, -1)
