import subprocess
import sys
from pathlib import Path

from miles.ports import free_port  # nothing listens there


def test_unreachable_nats_is_one_line_and_exit_1(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "miles.node", "--role", "rollout", "--nats-url", url, "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"miles-node: error: cannot connect to NATS at {url}")


def test_miles_node_needs_a_nats_url() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "miles.node", "--role", "controller"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2 and "--nats-url" in proc.stderr
