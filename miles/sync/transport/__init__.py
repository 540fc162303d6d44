"""Weight transports: the same streamed payload, announcement and audit over the bus, a shared filesystem,
or a torch.distributed weight-update group (Miles engines or SGLang servers). See :mod:`.base`.

The package itself imports nothing heavy: the controller reads the data plane (:mod:`.dataplane`) without
torch, so the names below are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FallbackTransport": "miles.sync.transport.fallback",
    "Params": "miles.sync.transport.base",
    "Published": "miles.sync.transport.base",
    "Runner": "miles.sync.transport.base",
    "TransportBroken": "miles.sync.transport.base",
    "TransportKind": "miles.sync.transport.base",
    "WeightTransport": "miles.sync.transport.base",
    "verified_state": "miles.sync.transport.base",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
