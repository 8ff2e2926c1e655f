"""Where a one-shot load reads: local paths and globs, S3 URLs and HTTP(S) URLs.

:func:`list_files` expands what ``reclock load --from`` names into a sorted
list of :class:`FileRef` (URL, size and a *version*: the modification time in
nanoseconds of a local file or an S3 object, the ``ETag`` of an HTTP object,
else its ``Last-Modified``). The version and size are what a load's identity
and its re-reads are checked against: a task whose file no longer has them
fails definitely (:class:`FileChanged`) instead of reading other data.

:class:`Store` is picklable: S3 settings are resolved once on the driver
(the pipeline's ``AWS_*`` environment, as the S3 outputs do) and shipped to
the executors with the reader.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from reclock.clients.s3 import S3Access, explained, is_definite
from reclock.core.errors import DefiniteError, TransientError

_WILD = "*?["


class FileChanged(DefiniteError):
    """A file of a load is gone or no longer what the load recorded."""


@dataclass(frozen=True)
class FileRef:
    url: str  # absolute local path, s3://bucket/key or http(s)://...
    size: int
    version: str

    def as_json(self) -> dict[str, Any]:
        return {"url": self.url, "size": self.size, "version": self.version}

    @classmethod
    def of_json(cls, d: dict[str, Any]) -> FileRef:
        return cls(str(d["url"]), int(d["size"]), str(d["version"]))


def _s3_error(what: str, exc: Exception) -> Exception:
    cls = DefiniteError if is_definite(exc) else TransientError
    return cls(f"{what}: {explained(exc)}")


@dataclass(frozen=True)
class Store:
    """Reads the files of loads (picklable; see the module docstring)."""

    s3: S3Access = field(default_factory=S3Access)

    # -- listing (driver side) ---------------------------------------------------
    def files(self, spec: str) -> list[FileRef]:
        """The files ``spec`` names, sorted by URL: a file, a directory (its
        files, not recursively; hidden ones skipped), a glob, an S3 key,
        prefix (ending in ``/``) or glob, one HTTP(S) URL. None: an error."""
        scheme = urlsplit(spec).scheme.lower()
        if scheme in ("http", "https"):
            files = [self._http_head(spec)]
        elif scheme in ("s3", "s3a"):
            files = self._s3_list(spec)
        elif scheme in ("", "file"):
            files = self._local_list(urlsplit(spec).path if scheme == "file" else spec)
        else:
            raise DefiniteError(f"cannot load from {spec!r}: expected a local path or glob, "
                                "s3://bucket/key (or prefix/, or a glob) or an http(s) URL")
        if not files:
            raise DefiniteError(f"no files match {spec!r}")
        return sorted(files, key=lambda f: f.url)

    def _local_list(self, spec: str) -> list[FileRef]:
        spec = os.path.abspath(os.path.expanduser(spec))
        if any(c in spec for c in _WILD):
            paths = glob.glob(spec)
        elif os.path.isdir(spec):
            paths = [os.path.join(spec, n) for n in os.listdir(spec)
                     if not n.startswith((".", "_"))]
        else:
            paths = [spec] if os.path.exists(spec) else []
        out = []
        for p in paths:
            st = os.stat(p)
            if os.path.isfile(p):
                out.append(FileRef(p, st.st_size, str(st.st_mtime_ns)))
        return out

    def _s3_list(self, spec: str) -> list[FileRef]:
        u = urlsplit(spec)
        key = u.path.lstrip("/")
        fs = self.s3.filesystem()
        try:
            if any(c in key for c in _WILD):
                base = key[:min(key.find(c) for c in _WILD if c in key)].rsplit("/", 1)[0]
                infos = fs.get_file_info(pafs.FileSelector(f"{u.netloc}/{base}", recursive=True))
                infos = [i for i in infos
                         if fnmatch.fnmatchcase(i.path.split("/", 1)[1], key)]
            elif key == "" or key.endswith("/"):
                infos = fs.get_file_info(pafs.FileSelector(f"{u.netloc}/{key.rstrip('/')}",
                                                           recursive=False))
            else:
                infos = [fs.get_file_info(f"{u.netloc}/{key}")]
        except OSError as exc:
            raise _s3_error(f"listing {spec}", exc) from exc
        return [FileRef(f"s3://{i.path}", int(i.size or 0), str(i.mtime_ns))
                for i in infos if i.type == pafs.FileType.File]

    def _http_head(self, url: str) -> FileRef:
        req = urllib.request.Request(url, method="HEAD")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                size = r.headers.get("Content-Length")
                version = r.headers.get("ETag") or r.headers.get("Last-Modified") or ""
        except urllib.error.HTTPError as exc:
            raise (TransientError if exc.code >= 500 else DefiniteError)(
                f"HEAD {url}: HTTP {exc.code}") from None
        except OSError as exc:
            raise TransientError(f"HEAD {url}: {exc}") from None
        if size is None:
            raise DefiniteError(f"{url}: the server gives no Content-Length")
        return FileRef(url, int(size), version)

    # -- reading (executor side) -------------------------------------------------------
    def check(self, f: FileRef) -> None:
        """Raise :class:`FileChanged` unless ``f`` is still as recorded."""
        try:
            now = self.files(f.url)
        except DefiniteError:
            now = []
        if len(now) != 1 or (now[0].size, now[0].version) != (f.size, f.version):
            got = "gone" if not now else f"size {now[0].size}, version {now[0].version}"
            raise FileChanged(
                f"{f.url} changed since the load was requested (size {f.size}, version "
                f"{f.version}; now {got})",
                hint="a load reads its files as they were when it was requested: put them "
                     "back, or (reclock verify) set replayable: false")

    def read_range(self, f: FileRef, lo: int, hi: int) -> bytes:
        """Bytes ``[lo, hi)`` of the file (fewer at its end)."""
        hi = min(hi, f.size)
        if hi <= lo:
            return b""
        scheme = urlsplit(f.url).scheme.lower()
        if scheme in ("http", "https"):
            req = urllib.request.Request(f.url, headers={"Range": f"bytes={lo}-{hi - 1}"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    data: bytes = r.read()
                    if r.status == 200:  # no ranges served: the whole object
                        data = data[lo:hi]
                    return data
            except OSError as exc:
                raise TransientError(f"GET {f.url}: {exc}") from None
        with self.open(f) as fh:
            fh.seek(lo)
            return bytes(fh.read(hi - lo))

    def open(self, f: FileRef) -> Any:
        """A random-access pyarrow file (an HTTP object is read whole)."""
        u = urlsplit(f.url)
        scheme = u.scheme.lower()
        try:
            if scheme in ("s3", "s3a"):
                return self.s3.filesystem().open_input_file(f"{u.netloc}/{u.path.lstrip('/')}")
            if scheme in ("http", "https"):
                return pa.BufferReader(self.read_range(f, 0, f.size))
            return pa.OSFile(f.url, "rb")
        except FileNotFoundError as exc:
            raise FileChanged(f"{f.url} is gone since the load was requested") from exc
        except OSError as exc:
            raise _s3_error(f"opening {f.url}", exc) from exc
