"""Path rules shared by sandbox providers: what a caller may name inside a sandbox.

Work-directory paths (``write_file``, ``read_file``, ``copy_in``) are relative and may not climb out with
``..``: a task or environment that names ``/etc/passwd`` or ``../../x`` is a bug to surface, not a path to
resolve. Mount targets (``run(mounts=...)``) are absolute and must stay clear of the work directory and of
the read-only system, so that a per-command mount can never shadow or leak into what the agent keeps.
"""

from __future__ import annotations

from pathlib import PurePosixPath

# Sandbox paths that per-command mounts may not cover: the read-only system and the kernel's views.
RESERVED: tuple[str, ...] = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc", "/proc", "/dev", "/tmp")


def work_path(path: str) -> str:
    """``path`` normalised as a relative POSIX path inside the work directory, or :class:`ValueError`."""
    if not path or "\x00" in path:
        raise ValueError(f"sandbox path {path!r}: empty or contains NUL")
    pure = PurePosixPath(path)
    if pure.is_absolute():
        raise ValueError(f"sandbox path {path!r}: absolute paths are refused (paths are relative to the work dir)")
    if ".." in pure.parts:
        raise ValueError(f"sandbox path {path!r}: '..' is refused")
    parts = [p for p in pure.parts if p != "."]
    if not parts:
        raise ValueError(f"sandbox path {path!r}: names the work directory itself, not a file in it")
    return "/".join(parts)


def mount_target(path: str, workdir: str) -> str:
    """``path`` checked as the absolute target of a per-command mount, or :class:`ValueError`."""
    pure = PurePosixPath(path)
    if "\x00" in path or not pure.is_absolute() or ".." in pure.parts or pure == PurePosixPath("/"):
        raise ValueError(f"mount target {path!r}: must be an absolute path below / without '..'")
    work = PurePosixPath(workdir)
    if pure == work or work in pure.parents or pure in work.parents:
        raise ValueError(f"mount target {path!r}: overlaps the work directory {workdir}")
    for reserved in RESERVED:
        top = PurePosixPath(reserved)
        if pure == top or top in pure.parents:
            raise ValueError(f"mount target {path!r}: inside the sandbox's system path {reserved}")
    return str(pure)
