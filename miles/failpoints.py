"""Failpoints: let a test kill a process at an exact moment of its work (inside a step, mid-export, mid-checkpoint).

A crash test that only kills at random times rarely lands in the short windows that matter most, so the
trainer marks those windows with :func:`failpoint` calls. With ``MILES_FAILPOINTS=export:2`` in its
environment, the process SIGKILLs itself the second time it reaches ``failpoint("export")``: a real,
unannounced death, exactly as from the kernel's OOM killer or a lost node. Unset (always, outside tests),
a failpoint is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "MILES_FAILPOINTS"


def _parse(spec: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = item.partition(":")
        out[name] = int(count or 1)
    return out


_armed: dict[str, int] = _parse(os.environ.get(ENV, ""))


def failpoint(name: str) -> None:
    """SIGKILL this process if ``name`` is armed and this is its n-th arrival."""
    if name not in _armed:
        return
    _armed[name] -= 1
    if _armed[name] <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
