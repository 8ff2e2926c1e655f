"""Local-filesystem helpers shared by the file-backed sinks.

* :func:`exclusive_lock` -- an ``fcntl.flock`` lock file, held across a sink's
  "check state, then commit" step. ``flock`` locks belong to an open file
  description, so two threads of one process that each open the lock file
  exclude each other just as two processes do. It only works between
  processes on one machine: on NFS and other network filesystems ``flock`` may
  be emulated locally or not at all, so it must never be the *only* guard of
  a commit (the Delta sink relies on Delta's own conflict detection first).
* :func:`atomic_write` -- temp file in the same directory, ``fsync``,
  ``os.replace``, ``fsync`` of the directory: readers see the old bytes or the
  new ones, never a torn file, even after a power cut.
* :func:`create_exclusive` -- put-if-absent: a file that appears whole, only
  if no file of that name exists (two writers of one name: one wins), made
  durable like :func:`atomic_write`.
* :func:`sink_os_error` -- turns an ``OSError`` into a :class:`SinkError`
  whose message names the output, the path and the reason in plain words.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from reclock.contracts.sink import SinkError
from reclock.core.errors import TransientError

_REASONS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("disk full", "free space on the volume, then retry"),
    errno.EDQUOT: ("disk quota exceeded", "raise the quota or free space, then retry"),
    errno.EACCES: ("permission denied", "give the pipeline's user write access to the path"),
    errno.EPERM: ("permission denied", "give the pipeline's user write access to the path"),
    errno.EROFS: ("read-only file system", "point the output at a writable volume"),
    errno.ENOTDIR: (
        "a parent of the path is not a directory",
        "point the output at a directory path",
    ),
    errno.EEXIST: ("the path exists and is not a directory", "point the output elsewhere"),
    errno.ENOENT: ("no such file or directory", "check that the path exists"),
}


def sink_os_error(output: str, path: str | Path, exc: OSError, doing: str = "write") -> SinkError:
    """A :class:`SinkError` for ``exc``, naming the output and the path."""
    reason, hint = _REASONS.get(exc.errno or -1, (exc.strerror or str(exc), ""))
    err = SinkError(
        f"output {output!r}: cannot {doing} {path}: {reason}", hint=hint or None
    )
    err.__cause__ = exc
    return err


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_of(path: str) -> str:
    """A new temp name beside ``path``, starting with a dot (see :func:`atomic_write`).

    Paths here are strings, not :class:`~pathlib.Path`: this Python's pathlib
    interns every component it parses, and a driver writing a file a second
    under new names would churn the interpreter's table of interned strings
    (it grows by a resize once the churn fills it: a 3.7 MiB step)."""
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.{uuid.uuid4().hex}.tmp")


def _write_synced(tmp: str, write: Callable[[object], None] | bytes) -> None:
    """Write ``tmp`` (the bytes, or through a function given the open binary
    file) and sync it to disk."""
    with open(tmp, "wb") as f:
        if isinstance(write, bytes):
            f.write(write)
        else:
            write(f)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: str | Path, write: Callable[[object], None] | bytes) -> int:
    """Write ``path`` atomically; return its size in bytes.

    ``write`` is the bytes, or a function given the open binary file. The temp
    name starts with a dot so that nothing scanning the directory for data
    files (Delta readers, :func:`os.scandir` filters) mistakes it for one.
    """
    path = os.fspath(path)
    tmp = _temp_of(path)
    try:
        _write_synced(tmp, write)
        os.replace(tmp, path)
    except BaseException:
        # Never leave a half-written temp file behind on a failure we saw.
        with suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))
    return os.stat(path).st_size


def create_exclusive(path: str | Path, data: bytes) -> bool:
    """Create ``path`` holding ``data`` unless a file of that name exists;
    whether it was created. The bytes go to a temp file (synced) that is then
    hard-linked to ``path``: ``link`` fails when the name exists, so of two
    writers exactly one succeeds, and a reader sees no file or the whole file.
    The temp name starts with a dot (see :func:`atomic_write`); a kill between
    writing and unlinking it leaves it behind, and nothing reads it."""
    path = os.fspath(path)
    tmp = _temp_of(path)
    try:
        _write_synced(tmp, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        with suppress(OSError):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(path))
    return True


@contextmanager
def exclusive_lock(path: Path, *, output: str, timeout: float = 60.0) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if absent).

    Polls with a short backoff instead of blocking in the kernel so that a
    stuck holder turns into a :class:`TransientError` after ``timeout``
    seconds rather than a hang.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise sink_os_error(output, path, exc, "lock") from exc
    try:
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TransientError(
                        f"output {output!r}: lock {path} still held after {timeout:g} s",
                        hint="another committer of this output is running or hung",
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def vacuum_staged(output: str, root: Path, pattern: re.Pattern[str], grace_seconds: float,
                  now: float) -> list[str]:
    """Delete files in ``root`` matching ``pattern`` (or ``*.tmp``) older than
    ``grace_seconds``: staged data of failed commits and abandoned jobs.
    Returns their names, sorted."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise sink_os_error(output, root, exc, "vacuum") from exc
    for entry in entries:
        if not (pattern.fullmatch(entry.name) or entry.name.endswith(".tmp")):
            continue
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime < grace_seconds:
                continue
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise sink_os_error(output, entry.path, exc, "vacuum") from exc
        removed.append(entry.name)
    return sorted(removed)


def check_descriptor(output: str, sink: str, d: Any, pattern: re.Pattern[str],
                     fields: dict[str, type]) -> str:
    """The staged file a descriptor names (see :meth:`reclock.contracts.sink.Stager.stage`),
    once its ``path`` matches the sink's file pattern and each of ``fields``
    has its type; a ValueError naming the sink otherwise (a bug: descriptors
    come from the sink's own stager)."""
    name = d.get("path") if isinstance(d, dict) else None
    ok = (isinstance(name, str) and pattern.fullmatch(name) is not None
          and all(isinstance(d.get(k), t) for k, t in fields.items()))
    if not ok:
        raise ValueError(f"output {output!r}: not a {sink} staging descriptor: {d!r}")
    return str(name)


def check_staged_file(output: str, path: str | Path, size: int) -> None:
    """A staged file must still be there with the size it was staged with."""
    from reclock.contracts.sink import SinkError

    try:
        actual: int | None = os.stat(path).st_size
    except FileNotFoundError:
        actual = None
    except OSError as exc:
        raise sink_os_error(output, path, exc, "read") from exc
    if actual != size:
        raise SinkError(
            f"output {output!r}: staged file {path} is "
            + ("gone" if actual is None else f"{actual} bytes, staged as {size}"),
            hint="restage the batch (was it committed already, or vacuumed?)",
        )


#: Batch ids the driver hands to stagers (they become part of file names).
BATCH_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def check_stage_args(batch_id: str, part: int) -> None:
    """``Stager.stage`` arguments every file-staging sink accepts."""
    if not BATCH_ID.fullmatch(batch_id):
        raise ValueError(f"batch id {batch_id!r} must match {BATCH_ID.pattern}")
    if part < 0:
        raise ValueError(f"part {part} must be >= 0")


def remove_staged(output: str, files: Sequence[str | Path], log: logging.Logger) -> None:
    """Delete staged files after their commit; a leftover only costs space."""
    for path in files:
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("output %r: cannot remove staged file %s: %s", output, path, exc)


_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


def staging_root(staging_dir: str | Path, name: str) -> Path:
    """``staging_dir/<name>``, the output's name made safe for a path (a name
    that is not gets a digest of itself, so two names never share a root)."""
    if _SAFE_NAME.fullmatch(name):
        sub = name
    else:
        digest = hashlib.sha256(name.encode()).hexdigest()[:10]
        sub = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80].lstrip(".") + "-" + digest
    return Path(staging_dir).absolute() / sub
