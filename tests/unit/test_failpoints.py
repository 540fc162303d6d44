"""Failpoints in a real child process: ``kill`` ends it at the n-th arrival, ``stop`` freezes it at every n-th."""

import os
import signal
import subprocess
import sys

import pytest

from miles.failpoints import _parse
from tests.integration.harness import process_state

CHILD = """
from miles.failpoints import failpoint
for i in range(1, 8):
    failpoint("step")
    print(i, flush=True)
"""


def _child(spec: str) -> subprocess.Popen:
    env = dict(os.environ, MILES_FAILPOINTS=spec)
    return subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, env=env)


def test_kill_ends_the_process_at_the_nth_arrival() -> None:
    proc = _child("step:3")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert out.split() == ["1", "2"]


def test_stop_freezes_the_process_at_every_nth_arrival_until_continued() -> None:
    proc = _child("step:3:stop")
    assert proc.stdout is not None
    try:
        for printed in (["1", "2"], ["3", "4", "5"]):  # frozen at arrivals 3 and 6
            assert [proc.stdout.readline().strip() for _ in printed] == printed
            while process_state(proc.pid) != "T":
                assert proc.poll() is None
            proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.split() == ["6", "7"]
    finally:
        proc.kill()


def test_an_unknown_action_is_named() -> None:
    with pytest.raises(ValueError, match="'step:2:pause'"):
        _parse("step:2:pause")
