"""A shared-filesystem directory as a weight transport (NFS, Lustre, a local disk for one node).

Layout under ``root``::

    v<version>/model.safetensors   the streamed payload (a standard safetensors file)
    v<version>/manifest.json       {"version", "size", "digest", "state_digest", "algorithm"}

The export streams into ``.v<version>.tmp-<pid>/`` (one file write per piece, nothing buffered), which is
fsynced, renamed to ``v<version>`` and the root fsynced: a reader that finds ``v<version>`` finds it
complete, and the announcement is only sent after the rename, so a worker never sees a partial version.
Readers verify the payload's xxh3-128 against the announced digest (and the manifest's). The newest
``keep_versions`` directories are kept. Given ``companion_dir`` (the served model's directory), its
non-weight files (``config.json``, tokenizer) are copied into each version, so an engine that reloads a
whole checkpoint directory (SGLang's ``/update_weights_from_disk``, bf16/fp32 payloads) can load it as is.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, ClassVar

import structlog

from miles.bus.errors import ChecksumMismatch, PayloadMissing
from miles.sync.checksum import ALGORITHM, digest
from miles.sync.stream_export import PayloadLayout, encode_payload
from miles.sync.transport.base import Params, Published, Runner, TransportKind, runner
from miles.sync.transport.dataplane import allocate

log = structlog.get_logger(__name__)

PAYLOAD = "model.safetensors"
MANIFEST = "manifest.json"
_VERSION_DIR = re.compile(r"^v(\d+)$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsTransport:
    """Publishes version directories under ``root`` and reads them back, verified."""

    kind: ClassVar[TransportKind] = "fs"

    def __init__(self, root: str | os.PathLike[str], *, keep_versions: int = 3, companion_dir: str | None = None):
        if keep_versions < 1:
            raise ValueError("keep_versions must be >= 1")
        self.root = Path(root)
        self.keep_versions = keep_versions
        self.companion_dir = Path(companion_dir) if companion_dir else None

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    # ------------------------------------------------------------------ publish

    async def publish(self, layout: PayloadLayout, params: Params, *, run: Runner | None = None) -> Published:
        return await runner(run)(lambda: self._publish(layout, params))

    def _publish(self, layout: PayloadLayout, params: Params) -> Published:
        """On the torch thread: stream into a temporary directory, then commit it with a rename."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".v{layout.version}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            with open(tmp / PAYLOAD, "wb") as f:
                summary = encode_payload(layout, params(), f.write)
                f.flush()
                os.fsync(f.fileno())
            manifest = {
                "version": layout.version,
                "size": summary.size,
                "digest": summary.digest,
                "state_digest": summary.state_digest,
                "algorithm": ALGORITHM,
            }
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f)
                f.flush()
                os.fsync(f.fileno())
            self._copy_companions(tmp)
            _fsync_dir(tmp)
            self._commit(tmp, self.path(layout.version))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        log.info("weights_written", version=layout.version, path=str(self.path(layout.version)), size=summary.size)
        return Published(
            transport="fs",
            version=layout.version,
            size=summary.size,
            chunks=1,
            digest=summary.digest,
            state_digest=summary.state_digest,
            payload_sha256=summary.payload_sha256,
            location=str(self.path(layout.version)),
        )

    def _copy_companions(self, target: Path) -> None:
        if self.companion_dir is None:
            return
        for item in self.companion_dir.iterdir():
            if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(item, target / item.name)

    def _commit(self, tmp: Path, final: Path) -> None:
        if final.exists():  # the same version published again (a restart): replace it
            old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(final, old)
            shutil.rmtree(old)
        os.replace(tmp, final)
        _fsync_dir(self.root)

    def versions(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m[1]) for p in self.root.iterdir() if (m := _VERSION_DIR.match(p.name)) and p.is_dir())

    def _prune(self) -> None:
        for version in self.versions()[: -self.keep_versions]:
            shutil.rmtree(self.path(version))

    # ------------------------------------------------------------------ fetch

    async def fetch(self, version: int, digest: str, *, location: str = "") -> memoryview:
        """The payload of ``version`` from this reader's root; ``location`` is the directory name the announcement
        carries (the writer's root may be mounted elsewhere here), never a path out of the root."""
        if location and (Path(location).name != location or location in (".", "..")):
            raise PayloadMissing(f"weights v{version}: location {location!r} is not a directory name under {self.root}")
        return await asyncio.to_thread(self._fetch, version, digest, self.root / location if location else None)

    def _fetch(self, version: int, expected: str, directory: Path | None) -> memoryview:
        directory = directory or self.path(version)
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
            with open(directory / PAYLOAD, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buf = allocate(size)
                got = f.readinto(buf) if size else 0
        except FileNotFoundError:
            raise PayloadMissing(f"weights v{version} are not in {directory}") from None
        if manifest.get("version") != version or manifest.get("algorithm") != ALGORITHM:
            raise ChecksumMismatch(f"{directory / MANIFEST} describes {manifest}, not v{version} ({ALGORITHM})")
        if got != size or size != manifest.get("size"):
            raise ChecksumMismatch(f"weights v{version}: read {got} of {size} bytes, manifest says {manifest['size']}")
        actual = digest(buf)
        if actual != expected or actual != manifest.get("digest"):
            raise ChecksumMismatch(f"weights v{version} in {directory} hash to {actual}, announced {expected}")
        return buf


def fs_root(cfg: Any, run_dir: Path) -> Path:
    """The shared weights directory of a run: ``sync.fs_dir``, or ``<run dir>/weights-fs`` (one machine)."""
    return Path(cfg.sync.fs_dir).expanduser() if cfg.sync.fs_dir else Path(run_dir) / "weights-fs"
