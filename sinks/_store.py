"""Where a file-backed output lives: a local directory or an S3 prefix.

A :class:`Location` names the place (``/abs/dir`` or ``s3://bucket/prefix``)
and does the few file operations the Delta sink needs beside delta-rs itself:
write a staged file whole, look one up, list the direct children, read a log
entry or a data file (compaction), delete. It is picklable, so executors write
their staged files to the same place the driver commits from (the data and its
staging share a bucket).

Atomicity of one file. Locally a write goes to a dot-named temp file, is
``fsync``-ed and renamed (:func:`reclock.sinks._fs.atomic_write`). On S3 an object
appears whole when its upload completes, or not at all, so it is written in
place; an upload cut off by a crash leaves no object (at most an incomplete
multipart upload, which a bucket lifecycle rule aborts).

Credentials. :class:`~reclock.clients.s3.S3Access` takes each setting from the output's
``storage`` block, else from the standard ``AWS_*`` environment variables of
the driver, resolved once on the driver and shipped to the executors with the
stager. Secrets never appear in a ``repr``, a log line or an error message.

Errors. :func:`store_error` sorts an object store failure: refused access, a
missing bucket or a bad key are definite (:class:`~reclock.contracts.sink.SinkError`, the
operator must act); anything else (connection refused, a timeout, a 5xx, a
throttle) is a :class:`~reclock.core.errors.TransientError` the driver retries.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs
from pydantic import SecretStr

from reclock.clients.s3 import S3Access as S3Access  # (its home; re-exported for the sink)
from reclock.clients.s3 import explained, is_definite
from reclock.contracts.config import ConfigModel
from reclock.contracts.sink import SinkError
from reclock.core.errors import ReclockError, TransientError
from reclock.sinks._fs import atomic_write, fsync_dir, sink_os_error

#: URI schemes a file output may use; anything else is a config error.
SCHEMES = ("file", "s3", "s3a")

def split_uri(text: str) -> tuple[str, str]:
    """``(scheme, rest)``: ``("", text)`` for a plain path. Raises ValueError
    naming the schemes that work for any other scheme (``gs://``, ``hdfs://``,
    ``s3:/one-slash``): a URI reclock cannot write must never become a local
    directory named after it."""
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):/", text)
    if m is None:
        return "", text
    scheme = m[1].lower()
    if scheme not in SCHEMES:
        raise ValueError(f"unsupported URI scheme {scheme!r} in {text!r}: use a local path, "
                         "file:///abs/path or s3://bucket/prefix")
    if not text[m.end():].startswith("/"):
        raise ValueError(f"malformed URI {text!r}: expected {scheme}://...")
    if scheme == "file":
        url = urlsplit(text)
        if url.netloc not in ("", "localhost"):
            raise ValueError(f"file URI {text!r} names a host; use file:///abs/path")
        return "", url.path
    url = urlsplit(text)
    if not url.netloc or url.query or url.fragment or url.username or url.password:
        raise ValueError(f"malformed S3 URI {text!r}: expected s3://bucket/prefix (no "
                         "credentials, query or fragment in it)")
    # Empty segments collapse, as delta-rs's object store paths do.
    return "s3", f"{url.netloc}/{re.sub('/+', '/', url.path).strip('/')}".rstrip("/")


@dataclass(frozen=True)
class Location:
    """A directory: ``root`` is an absolute local path, or ``bucket/prefix``
    when ``s3`` is set. ``name`` is the output, for messages."""

    name: str
    root: str
    s3: S3Access | None = None

    @classmethod
    def of(cls, name: str, target: str | Path, s3: S3Access | None = None) -> Location:
        scheme, rest = split_uri(str(target))
        if scheme == "s3":
            return cls(name, rest, s3 or S3Access.resolve())
        return cls(name, os.path.abspath(rest))

    @property
    def local(self) -> bool:
        return self.s3 is None

    @property
    def uri(self) -> str:
        """What delta-rs opens, and what messages show (never a secret)."""
        return self.root if self.s3 is None else f"s3://{self.root}"

    def __str__(self) -> str:
        return self.uri

    def storage_options(self) -> dict[str, str] | None:
        return None if self.s3 is None else self.s3.delta_options()

    def child(self, name: str) -> str:
        return f"{self.uri}/{name}"

    # -- file operations -------------------------------------------------------------------
    def makedirs(self) -> None:
        if self.s3 is None:
            try:
                Path(self.root).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise sink_os_error(self.name, self.root, exc, "create") from exc

    def write(self, name: str, write: Callable[[Any], None]) -> int:
        """Write the file ``name`` whole (``write`` gets a binary file);
        return its size."""
        if self.s3 is None:
            target = os.path.join(self.root, name)  # (a str: see reclock.sinks._fs._temp_of)
            try:
                return atomic_write(target, write)
            except OSError as exc:
                raise sink_os_error(self.name, target, exc) from exc
        fs = self.s3.filesystem()
        key = f"{self.root}/{name}"
        try:
            with fs.open_output_stream(key) as f:
                write(f)
            return int(fs.get_file_info(key).size)
        except OSError as exc:
            raise store_error(self.name, self.child(name), exc, "write") from exc

    def stat(self, name: str) -> tuple[int, int] | None:
        """``(size, mtime in ms)`` of the file ``name``, ``None`` if absent."""
        if self.s3 is None:
            try:
                st = os.stat(os.path.join(self.root, name))
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise sink_os_error(self.name, os.path.join(self.root, name), exc,
                                    "read") from exc
            return st.st_size, st.st_mtime_ns // 1_000_000
        try:
            info = self.s3.filesystem().get_file_info(f"{self.root}/{name}")
        except OSError as exc:
            raise store_error(self.name, self.child(name), exc, "read") from exc
        if info.type != pafs.FileType.File:
            return None
        mtime = info.mtime_ns // 1_000_000 if info.mtime_ns is not None else 0
        return int(info.size), mtime

    def read_text(self, name: str) -> str | None:
        """The text of file ``name`` (a relative path), ``None`` if absent."""
        if self.s3 is None:
            try:
                with open(os.path.join(self.root, name), encoding="utf-8") as f:
                    return f.read()
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise sink_os_error(self.name, os.path.join(self.root, name), exc,
                                    "read") from exc
        try:
            with self.s3.filesystem().open_input_stream(f"{self.root}/{name}") as f:
                return bytes(f.read()).decode("utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise store_error(self.name, self.child(name), exc, "read") from exc

    def dataset(self, names: list[str], schema: pa.Schema) -> Any:
        """The Parquet files ``names`` (relative paths) as one Arrow dataset of
        ``schema``, scanned in the order given (compaction reads many small
        files through it, several at once, without a Python call per file)."""
        import pyarrow.dataset as ds  # (pulls pandas in: not for every command)

        if self.s3 is None:
            paths, fs = [os.path.join(self.root, n) for n in names], None
        else:
            paths, fs = [f"{self.root}/{n}" for n in names], self.s3.filesystem()
        try:
            return ds.dataset(paths, schema=schema, format="parquet", filesystem=fs)
        except OSError as exc:  # FileNotFoundError included: a referenced file is gone
            if self.s3 is None:
                raise sink_os_error(self.name, self.root, exc, "read") from exc
            raise store_error(self.name, self.uri, exc, "read") from exc

    def files(self) -> list[tuple[str, int, float]]:
        """``(name, size, mtime in seconds)`` of the direct children that are
        files (no directories, no symlinks followed)."""
        if self.s3 is None:
            out = []
            try:
                for entry in os.scandir(self.root):
                    if entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        out.append((entry.name, st.st_size, st.st_mtime))
            except FileNotFoundError:
                return []
            except OSError as exc:
                raise sink_os_error(self.name, self.root, exc, "list") from exc
            return out
        try:
            infos = self.s3.filesystem().get_file_info(
                pafs.FileSelector(self.root, recursive=False, allow_not_found=True))
        except OSError as exc:
            raise store_error(self.name, self.uri, exc, "list") from exc
        return [(i.base_name, int(i.size), (i.mtime_ns or 0) / 1e9)
                for i in infos if i.type == pafs.FileType.File]

    def delete(self, name: str) -> None:
        """Delete file ``name``; an absent file is not an error."""
        if self.s3 is None:
            try:
                os.unlink(os.path.join(self.root, name))
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise sink_os_error(self.name, os.path.join(self.root, name), exc,
                                    "delete") from exc
            return
        try:
            self.s3.filesystem().delete_file(f"{self.root}/{name}")
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise store_error(self.name, self.child(name), exc, "delete") from exc

    def sync(self) -> None:
        """Make new entries in a local directory durable (nothing on S3)."""
        if self.s3 is None:
            fsync_dir(self.root)


def store_error(output: str, where: str, exc: BaseException, doing: str) -> ReclockError:
    """A definite :class:`SinkError` for refused access or a missing bucket,
    a :class:`TransientError` for anything else an object store reports."""
    text = explained(exc)
    if is_definite(exc):
        err: ReclockError = SinkError(
            f"output {output!r}: cannot {doing} {where}: {text}",
            hint="check the bucket exists and the credentials (storage: block or AWS_* "
                 "environment variables) may read, write and delete under the prefix")
    else:
        err = TransientError(f"output {output!r}: cannot {doing} {where}: {text}",
                             hint="the object store is unreachable or busy; retrying")
    err.__cause__ = exc
    return err


class AwsAccessConfig(ConfigModel):
    """How to reach an AWS service or an S3-compatible one: endpoint, region
    and credentials. The ``storage`` block of the Delta and Iceberg sinks
    (:class:`S3StorageConfig`) and the Iceberg sink's ``catalog.glue`` block
    (AWS Glue). Write secrets as ``${VAR}`` references: they are never
    printed."""

    endpoint: str | None = None
    """Endpoint URL of an S3-compatible store (MinIO, R2, a local test
    server), e.g. ``http://minio:9000``; AWS itself needs none."""
    region: str | None = None
    """Region of the bucket."""
    access_key_id: str | None = None
    """Access key id."""
    secret_access_key: SecretStr | None = None
    """Secret access key (write ``${AWS_SECRET_ACCESS_KEY}``, never the key)."""
    session_token: SecretStr | None = None
    """Session token of temporary credentials."""

    def given(self) -> dict[str, str]:
        """The settings written (secrets unwrapped), by field name."""
        out = {"endpoint": self.endpoint, "region": self.region,
               "access_key_id": self.access_key_id,
               "secret_access_key": _unwrap(self.secret_access_key),
               "session_token": _unwrap(self.session_token)}
        return {k: v for k, v in out.items() if v}


class S3StorageConfig(AwsAccessConfig):
    """How to reach the S3-compatible store of an ``s3://`` output (a Delta
    table, an Iceberg warehouse: the ``storage`` block of their sinks). Every
    setting left out comes from the driver's standard ``AWS_*`` environment
    variables (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ALLOW_HTTP``); the
    driver ships what it resolved to its executors with the job. Write secrets
    as ``${VAR}`` references: they are never printed."""

    allow_http: bool | None = None
    """Allow plain HTTP (default: only when ``endpoint`` starts with ``http://``)."""

    def access(self) -> S3Access:
        return S3Access.resolve({**self.given(), "allow_http": self.allow_http})


def _unwrap(secret: SecretStr | None) -> str | None:
    return None if secret is None else secret.get_secret_value()
