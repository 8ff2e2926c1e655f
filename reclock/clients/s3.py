"""S3-compatible object stores, for the plug points that read or write them
(the Delta sink's outputs on S3, one-shot loads from S3): how to reach one
(:class:`S3Access`: each setting from the configuration, else from the
standard ``AWS_*`` environment variables; secrets never in a ``repr``), a
pyarrow filesystem per setting and process, and what an error says.

Like the rest of :mod:`reclock.clients`, it imports nothing of reclock but
the core.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from reclock.core.secrets import register

#: What an object store says when only the operator can help: refused
#: access, a missing bucket, bad credentials (anything else is retried).
_DEFINITE = re.compile(
    r"AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|NoSuchBucket|"
    r"\b403\b|Forbidden|InvalidBucketName|missing credentials|no credentials",
    re.IGNORECASE)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_S3_CODE = re.compile(r"<Code>([^<]+)</Code>\s*<Message>([^<]*)</Message>")


def is_definite(exc: BaseException | str) -> bool:
    """Whether an object store failure needs the operator (see ``_DEFINITE``)."""
    return _DEFINITE.search(_ANSI.sub("", str(exc))) is not None


def explained(exc: BaseException | str, limit: int = 300) -> str:
    """The failure in one line: S3's own error code and message when the
    answer has them, else the text (shortened)."""
    full = _ANSI.sub("", str(exc))
    code = _S3_CODE.search(full)
    if code is not None:
        return f"S3 answered {code[1]}: {code[2]}"
    text = " ".join(full.split())
    return text[:limit] + "..." if len(text) > limit else text


@dataclass(frozen=True)
class S3Access:
    """How to reach an S3-compatible store. ``None`` fields fall back to
    what the AWS SDKs read themselves (instance roles and the like)."""

    endpoint: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    allow_http: bool = False

    @classmethod
    def resolve(cls, given: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None) -> S3Access:
        """Settings from ``given`` (the config's ``storage`` block, secrets
        already unwrapped), else from ``env`` (default: the process's)."""
        g = {k: v for k, v in (given or {}).items() if v is not None}
        e = os.environ if env is None else env
        endpoint = g.get("endpoint") or e.get("AWS_ENDPOINT_URL_S3") or e.get("AWS_ENDPOINT_URL")
        allow = g.get("allow_http")
        if allow is None:
            allow = (e.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes")
                     or (endpoint or "").startswith("http://"))
        access = cls(
            endpoint=endpoint,
            region=g.get("region") or e.get("AWS_REGION") or e.get("AWS_DEFAULT_REGION"),
            access_key_id=g.get("access_key_id") or e.get("AWS_ACCESS_KEY_ID"),
            secret_access_key=g.get("secret_access_key") or e.get("AWS_SECRET_ACCESS_KEY"),
            session_token=g.get("session_token") or e.get("AWS_SESSION_TOKEN"),
            allow_http=bool(allow),
        )
        # secrets from the environment are secrets too: scrubbed like the
        # configuration's (reclock.core.secrets)
        register([access.secret_access_key, access.session_token])
        return access

    def delta_options(self) -> dict[str, str]:
        """delta-rs ``storage_options``. Commits use S3's conditional writes
        (``If-None-Match``), so no locking provider is needed."""
        opts = {"AWS_ALLOW_HTTP": "true" if self.allow_http else "false"}
        for key, value in (("AWS_ENDPOINT_URL", self.endpoint), ("AWS_REGION", self.region),
                           ("AWS_ACCESS_KEY_ID", self.access_key_id),
                           ("AWS_SECRET_ACCESS_KEY", self.secret_access_key),
                           ("AWS_SESSION_TOKEN", self.session_token)):
            if value:
                opts[key] = value
        return opts

    def filesystem(self) -> pafs.FileSystem:
        """A pyarrow S3 filesystem, one per process and setting."""
        with _FS_LOCK:
            fs = _FS_CACHE.get(self)
            if fs is None:
                kw: dict[str, Any] = {}
                if self.endpoint:
                    url = urlsplit(self.endpoint)
                    kw["endpoint_override"] = url.netloc or self.endpoint
                    kw["scheme"] = url.scheme or ("http" if self.allow_http else "https")
                if self.region:
                    kw["region"] = self.region
                if self.access_key_id:
                    kw.update(access_key=self.access_key_id, secret_key=self.secret_access_key,
                              session_token=self.session_token)
                fs = _FS_CACHE[self] = pafs.S3FileSystem(
                    **kw, connect_timeout=10, request_timeout=60,
                    retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=3))
            return fs


_FS_CACHE: dict[S3Access, pafs.FileSystem] = {}
_FS_LOCK = threading.Lock()
