"""PostgreSQL connection strings, shared by the CDC source and the table sink.

A DSN may hold a password: it never appears in a repr, a log line or an
error. :func:`parse_dsn` parses it once and returns the secrets to scrub;
:func:`server_label` names the server as ``user@host:port/dbname``;
:func:`scrub` removes passwords from any text (driver messages quote parts of
the connection string); :func:`connect_defaults` fills in a connect timeout
and an application name the DSN does not set.
"""

from __future__ import annotations

import math
import os
import re
import urllib.parse
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from reclock.core.errors import DefiniteError

_URL_USERINFO = re.compile(r"(?P<pre>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*):(?P<pw>[^/@\s]*)@")
_SECRET_PARAM = re.compile(r"(?P<pre>\b(?:password|sslpassword)\s*=\s*)('[^']*'|[^\s&]*)",
                           re.IGNORECASE)


#: ``user:password@`` without a well-formed ``scheme://`` before it (a DSN
#: that failed to parse, quoted back by the parser).
_LOOSE_USERINFO = re.compile(r"(?P<pre>[^\s:/@\"']+):(?P<pw>[^\s@\"']*)@")


def scrub(text: str, secrets: Sequence[str] = ()) -> str:
    """``text`` without URL credentials, ``password=`` values and ``secrets``."""
    text = _URL_USERINFO.sub(lambda m: f"{m['pre']}:***@", text)
    text = _LOOSE_USERINFO.sub(lambda m: f"{m['pre']}:***@", text)
    text = _SECRET_PARAM.sub(lambda m: f"{m['pre']}***", text)
    for s in secrets:
        if len(s) >= 3:
            text = text.replace(s, "***")
    return text


#: What a DSN that does not parse should look like.
_DSN_FORMS = "postgresql://user@host:port/dbname or 'host=... dbname=...'"


def _unparsed(exc: psycopg.Error) -> str:
    """Why a DSN did not parse. The parser quotes pieces of the DSN: scrubbed."""
    return f"invalid PostgreSQL DSN: {scrub(str(exc).strip())}"


def checked_dsn(dsn: str) -> str:
    """A configuration validator: ``dsn`` parses as a PostgreSQL connection
    string, else a ``ValueError`` whose message quotes no password (the
    loader then names the file and line)."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        raise ValueError(f"{_unparsed(exc)}; use {_DSN_FORMS}") from None
    return dsn


def parse_dsn(dsn: str, owner: str, error: type[DefiniteError] = DefiniteError
              ) -> tuple[dict[str, Any], list[str]]:
    """``(params, secrets)`` of a DSN; ``owner`` names who uses it in errors."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        # not chained: the parser's exception quotes the DSN
        raise error(f"{owner}: {_unparsed(exc)}", hint=f"use {_DSN_FORMS}") from None
    secrets = []
    for k in ("password", "sslpassword"):
        v = params.get(k)
        if v:
            secrets += [str(v), urllib.parse.quote(str(v), safe="")]
    return params, secrets


def server_label(params: dict[str, Any]) -> str:
    """``user@host:port/dbname`` of a parsed DSN (never the password)."""
    user = params.get("user") or os.environ.get("PGUSER") or ""
    host = params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or "localhost"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    db = params.get("dbname") or os.environ.get("PGDATABASE") or user
    return f"{user + '@' if user else ''}{host}:{port}/{db}"


def connect_defaults(params: dict[str, Any], app: str, timeout_s: float) -> dict[str, Any]:
    """``connect_timeout`` and ``application_name`` for ``psycopg.connect``,
    unless the DSN (parsed into ``params``) sets them itself."""
    kwargs: dict[str, Any] = {}
    if "connect_timeout" not in params:
        kwargs["connect_timeout"] = max(1, math.ceil(timeout_s))
    if "application_name" not in params:
        kwargs["application_name"] = app[:63]
    return kwargs
