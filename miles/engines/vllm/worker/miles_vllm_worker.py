"""Miles' side inside a vLLM server: a worker extension that loads a versioned weight file in place.

This file runs in the vLLM server's own Python environment (``miles vllm-env``), not in Miles': it imports
only torch, safetensors and xxhash, never ``miles``. The server is started with
``--worker-extension-cls miles_vllm_worker.MilesWeightLoader`` and this folder on ``PYTHONPATH``; the Miles
client calls its methods through vLLM's ``POST /collective_rpc`` (string arguments only).

``miles_prefetch(path)``: start reading the safetensors file the worker wrote and hashing it with
the same digest as :func:`miles.sync.precision.state_digest` (names, dtypes, shapes, raw bytes; a unit test
pins the two together) on a thread of this process, and return at once: an RPC runs between engine steps, so
the read and the hash happen while the server keeps generating. ``miles_prefetched(path)`` says whether that
is done. ``miles_load_weights(path, digest)``: take the prefetched state (or read and hash it now), refuse
it (nothing loaded) if its digest is not the expected one, else copy the tensors into the running model
through vLLM's reload path (which knows its fused layouts) and return the digest; the client calls it while
the server is paused, so only the copy is paused time. ``miles_held_digest()`` answers the digest of the
last file loaded, so the server itself vouches for what it holds.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
import xxhash
from safetensors.torch import load_file


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """The same bytes as ``miles.sync.precision.state_digest`` (tests/unit/test_vllm_engine.py checks it)."""
    h = xxhash.xxh3_128()
    for name in sorted(state):
        t = state[name].detach()
        dtype_name = str(t.dtype).removeprefix("torch.")
        raw = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)
        header = f"{name}\0{dtype_name}\0{','.join(map(str, t.shape))}\0{raw.numel()}\n".encode()
        h.update(len(header).to_bytes(8, "little"))
        h.update(header)
        if raw.numel():
            h.update(raw.numpy())
    return h.hexdigest()


def read_and_hash(path: str) -> tuple[dict[str, torch.Tensor], str]:
    """A safetensors file's tensors and their :func:`state_digest`."""
    state = load_file(path)
    return state, state_digest(state)


class MilesWeightLoader:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); ``self.model_runner`` is the worker's.

    Methods answer ``{"ok": False, "error": ...}`` instead of raising: an exception in a worker RPC takes the
    whole vLLM engine down, and a refused update must leave the server serving the weights it had.
    """

    model_runner: Any
    vllm_config: Any

    def miles_prefetch(self, path: str) -> dict[str, Any]:
        """Read and hash ``path`` on a thread (one prefetch kept: a newer path replaces an older one)."""
        future: Future[tuple[dict[str, torch.Tensor], str]] = Future()

        def read() -> None:
            try:
                future.set_result(read_and_hash(path))
            except BaseException as exc:  # noqa: BLE001 - handed to miles_load_weights, which answers it
                future.set_exception(exc)

        self._miles_prefetch = (path, future)
        threading.Thread(target=read, name="miles-prefetch", daemon=True).start()
        return {"ok": True}

    def miles_prefetched(self, path: str) -> dict[str, bool]:
        """Whether the prefetch of ``path`` has finished (read and hashed, or failed). A dict: the server's
        ``/collective_rpc`` answers a bare bool as a string."""
        pending = getattr(self, "_miles_prefetch", None)
        return {"done": pending is not None and pending[0] == path and pending[1].done()}

    def _miles_read(self, path: str) -> tuple[dict[str, torch.Tensor], str]:
        pending = getattr(self, "_miles_prefetch", None)
        self._miles_prefetch = None
        if pending is not None and pending[0] == path:
            return pending[1].result()
        return read_and_hash(path)

    def miles_load_weights(self, path: str, digest: str) -> dict[str, Any]:
        try:
            state, got = self._miles_read(path)
        except Exception as exc:  # noqa: BLE001 - answered to the client, never a default
            return {"ok": False, "error": f"cannot read weight file {path}: {type(exc).__name__}: {exc}"}
        if got != digest:
            return {"ok": False, "error": f"weight file {path} has digest {got}, expected {digest}: not loaded"}
        start = time.perf_counter()
        try:
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(self.vllm_config):
                # In place, through vLLM's reload path: it re-runs the kernels' weight processing (packing).
                self.model_runner.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        except Exception as exc:  # noqa: BLE001 - the model may be half-written: the client marks it unusable
            self._miles_digest = ""
            return {"ok": False, "error": f"loading {path} failed: {type(exc).__name__}: {exc}", "partial": True}
        self._miles_digest = got
        return {"ok": True, "digest": got, "tensors": len(state), "copy_s": time.perf_counter() - start}

    def miles_file_digest(self, path: str) -> dict[str, str]:
        """The digest of a (small) safetensors file as this process reads it: a LoRA adapter's, checked before
        the server loads it."""
        try:
            return {"digest": read_and_hash(path)[1]}
        except Exception as exc:  # noqa: BLE001 - answered to the client, which refuses the file
            return {"error": f"cannot read {path}: {type(exc).__name__}: {exc}"}

    def miles_held_digest(self) -> str:
        return getattr(self, "_miles_digest", "")
