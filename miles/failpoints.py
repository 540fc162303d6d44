"""Failpoints: let a test kill or freeze a process at an exact moment of its work (inside a step, mid-export,
mid-checkpoint, between steps).

A crash test that only kills at random times rarely lands in the short windows that matter most, so the
trainer marks those windows with :func:`failpoint` calls. With ``MILES_FAILPOINTS=export:2`` in its
environment, the process SIGKILLs itself the second time it reaches ``failpoint("export")``: a real,
unannounced death, exactly as from the kernel's OOM killer or a lost node.

``name:n:stop`` freezes the process instead (SIGSTOP) at every n-th arrival, until someone sends SIGCONT: a
test that must act while a run is certainly mid-way (a bus node lost between two steps) waits for that
state rather than racing the run to it. Unset (always, outside tests), a failpoint is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ENV = "MILES_FAILPOINTS"
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


@dataclass
class Armed:
    every: int
    action: str
    arrivals: int = 0


def _parse(spec: str) -> dict[str, Armed]:
    out: dict[str, Armed] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, rest = item.partition(":")
        count, _, action = rest.partition(":")
        action = action or "kill"
        if action not in ACTIONS:
            raise ValueError(f"{ENV}: {item!r} has action {action!r}; expected one of {sorted(ACTIONS)}")
        out[name] = Armed(every=int(count or 1), action=action)
    return out


_armed: dict[str, Armed] = _parse(os.environ.get(ENV, ""))


def failpoint(name: str) -> None:
    """SIGKILL this process at the n-th arrival at ``name``, or SIGSTOP it at every n-th, if ``name`` is armed."""
    armed = _armed.get(name)
    if armed is None:
        return
    armed.arrivals += 1
    due = armed.arrivals % armed.every == 0 if armed.action == "stop" else armed.arrivals >= armed.every
    if due:
        os.kill(os.getpid(), ACTIONS[armed.action])
