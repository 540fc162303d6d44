"""Child processes that do not outlive the process that started them.

The launcher's actors, the embedded nats-server and a worker's vLLM server each run in their own session
(so a signal to the parent's group does not reach them and the parent stops them in order). A parent killed
with SIGKILL cannot stop them, so each is also asked to receive SIGTERM when its parent dies: no orphaned
trainer holding cores, no vLLM server holding memory and a port after its worker is gone.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

PR_SET_PDEATHSIG = 1


def _sigterm_on_parent_death() -> None:  # pragma: no cover - runs in the child between fork and exec
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # no glibc (musl): the child may outlive a SIGKILLed parent, as on other systems
        pass


def die_with_parent() -> dict[str, Any]:
    """``subprocess.Popen`` keyword arguments that make the child get SIGTERM when its parent dies (Linux).

    The kernel fires this when the *thread* that forked exits, so it is armed only from the main thread
    (a thread pool's worker thread may exit while the child should live on); elsewhere it is empty.
    """
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        return {"preexec_fn": _sigterm_on_parent_death}
    return {}
