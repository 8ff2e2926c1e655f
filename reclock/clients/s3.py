"""S3-compatible object stores, for the plug points that read or write them
(the Delta sink's outputs on S3, one-shot loads from S3): how to reach one
(:class:`S3Access`: each setting from the configuration, else from the
standard ``AWS_*`` environment variables; secrets never in a ``repr``), a
pyarrow filesystem per setting and process, and what an error says.

Like the rest of :mod:`reclock.clients`, it imports nothing of reclock but
the core.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

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


class PutRefused(OSError):
    """A conditional PUT that S3 answered with an error other than 412."""


def signed_put(access: S3Access, bucket: str, key: str, body: bytes,
               now: datetime.datetime | None = None) -> tuple[str, dict[str, str]]:
    """The URL and headers of a PUT of ``body`` as ``key`` of ``bucket``,
    created only if absent (``If-None-Match: *``), signed with AWS Signature
    Version 4 (the standard library's hmac and hashlib; the body's SHA-256
    signed too): path-style at ``access.endpoint``, else the region's
    virtual-hosted endpoint. ``now``: the signing time (default: now)."""
    region = access.region or "us-east-1"
    if access.endpoint:
        base = urlsplit(access.endpoint if "://" in access.endpoint else
                        ("http://" if access.allow_http else "https://") + access.endpoint)
        scheme, host = base.scheme, base.netloc
        path = f"{base.path.rstrip('/')}/{bucket}/{key}"
    else:
        scheme, host = "https", f"{bucket}.s3.{region}.amazonaws.com"
        path = f"/{key}"
    if scheme == "http" and not access.allow_http:
        raise PutRefused(f"S3 endpoint {access.endpoint} is plain http and allow_http is off")
    if not (access.access_key_id and access.secret_access_key):
        raise PutRefused(f"no credentials to write s3://{bucket}/{key}: set access_key_id and "
                         "secret_access_key (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")
    canonical_path = quote(path, safe="/-_.~")
    when = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y%m%dT%H%M%SZ")
    day = when[:8]
    digest = hashlib.sha256(body).hexdigest()
    # (a Content-Type of its own: urllib's default, a form, is parsed and
    # dropped by some servers)
    headers = {"content-type": "application/octet-stream", "host": host,
               "if-none-match": "*", "x-amz-content-sha256": digest, "x-amz-date": when}
    if access.session_token:
        headers["x-amz-security-token"] = access.session_token
    signed = ";".join(sorted(headers))
    canonical = "\n".join(["PUT", canonical_path, "",
                           *(f"{k}:{headers[k]}" for k in sorted(headers)), "", signed, digest])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", when, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    k = hmac.new(f"AWS4{access.secret_access_key}".encode(), day.encode(),
                 hashlib.sha256).digest()
    for part in (region, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access.access_key_id}/"
                                f"{scope}, SignedHeaders={signed}, Signature={signature}")
    return f"{scheme}://{host}{canonical_path}", headers


def put_if_absent(access: S3Access, bucket: str, key: str, body: bytes,
                  timeout: float = 60.0) -> bool:
    """PUT ``body`` as ``key`` of ``bucket`` only if no object has that key
    (S3's conditional write, which pyarrow's filesystem does not send; see
    :func:`signed_put`): True when it was written, False when S3 answered
    412 Precondition Failed (another writer's object is there). Any other
    answer is a :class:`PutRefused` (an OSError) with S3's error text,
    which :func:`is_definite` sorts."""
    url, headers = signed_put(access, bucket, key, body)
    req = urllib.request.Request(url, data=body, method="PUT", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as answer:
            answer.read()
        return True
    except urllib.error.HTTPError as exc:
        if exc.code == 412:
            return False
        text = exc.read().decode("utf-8", "replace")
        raise PutRefused(f"PUT s3://{bucket}/{key}: HTTP {exc.code} {explained(text)}"
                         ) from None


_FS_CACHE: dict[S3Access, pafs.FileSystem] = {}
_FS_LOCK = threading.Lock()
