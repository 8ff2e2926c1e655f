"""PostgreSQL connection strings, shared by the CDC source and the table sink.

A DSN may hold a password: it never appears in a repr, a log line or an
error. :func:`checked_dsn` refuses at load a DSN that parsers would read
differently (a password with an unencoded ``#``, ``/`` or ``@`` in the URL
form); :func:`parse_dsn` parses it once and returns the secrets to scrub;
:func:`server_label` names the server as ``user@host:port/dbname``;
:func:`scrub` removes passwords from any text (driver messages quote parts of
the connection string); :func:`connect_defaults` fills in a connect timeout
and an application name the DSN does not set.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from reclock.core.errors import DefiniteError
from reclock.core.secrets import Secret
from reclock.core.secrets import scrub as _scrub
from reclock.core.urls import check_url, mask_url, url_secrets


def scrub(text: str, secrets: Sequence[str] = ()) -> str:
    """``text`` without the process's registered secrets, without
    ``secrets``, and with URL credentials and ``password=`` values masked
    (:func:`reclock.core.secrets.scrub`)."""
    return _scrub(text, secrets)


#: What a DSN should look like (placeholders only: a message never quotes
#: the DSN it is about).
_DSN_FORMS = "postgresql://user@host:port/dbname or 'host=... dbname=...'"
_URL_SCHEMES = ("postgresql", "postgres")
#: key=value settings whose values are numbers (libpq accepts anything when
#: parsing, and fails only when connecting, quoting the value)
_NUMERIC = ("port", "connect_timeout", "keepalives", "keepalives_idle",
            "keepalives_interval", "keepalives_count", "tcp_user_timeout")


def _problem(dsn: str) -> str | None:
    """What is wrong with ``dsn`` (a message that quotes none of it), or None."""
    if "://" in dsn.split("=", 1)[0] or dsn.lower().startswith(_URL_SCHEMES):
        try:
            check_url(dsn, _URL_SCHEMES, what="the DSN", multi_host=True,
                      host_required=False, path_slashes=False,
                      example="host:5432/dbname")
        except ValueError as exc:
            return str(exc)
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error:
        # (libpq's own message quotes the DSN: never shown)
        return ("libpq cannot parse it; use postgresql://user@host:port/dbname (a password "
                "after the user, percent-encoded), or 'host=... dbname=...' with any value "
                "holding spaces or quotes in single quotes (a quote inside as \\')")
    for key in _NUMERIC:
        value = params.get(key)
        if value is None:
            continue
        parts = str(value).split(",") if key == "port" else [str(value)]
        if not all(p == "" or (p.isascii() and p.isdigit()) for p in parts):
            return (f"the DSN's {key} is not a number (a password holding ':', '/' or '@' "
                    "must be percent-encoded in the URL form)")
    return None


def checked_dsn(dsn: str) -> str:
    """A configuration validator: ``dsn`` parses as a PostgreSQL connection
    string that every parser reads alike, else a ``ValueError`` whose
    message quotes none of it (the loader then names the file and line)."""
    problem = _problem(dsn)
    if problem is not None:
        raise ValueError(f"invalid PostgreSQL DSN: {problem}")
    return dsn


def parse_dsn(dsn: str, owner: str, error: type[DefiniteError] = DefiniteError
              ) -> tuple[dict[str, Any], list[str]]:
    """``(params, secrets)`` of a DSN; ``owner`` names who uses it in errors.
    ``secrets``: the password and SSL key password, as written and decoded."""
    problem = _problem(dsn)
    if problem is not None:
        raise error(f"{owner}: invalid PostgreSQL DSN: {problem}", hint=f"use {_DSN_FORMS}")
    params = conninfo_to_dict(dsn)
    return params, dsn_secrets(dsn, params)


def dsn_secrets(dsn: str, params: dict[str, Any] | None = None) -> list[str]:
    """The secrets a DSN holds (password, SSL key password), as written and
    as libpq reads them; [] for a DSN that does not parse."""
    out = url_secrets(dsn) if "://" in dsn else []
    if params is None:
        try:
            params = conninfo_to_dict(dsn)
        except psycopg.Error:
            return out
    for k in ("password", "sslpassword"):
        v = params.get(k)
        if v:
            out.append(str(v))
    return out


def shown_dsn(dsn: str) -> str:
    """``dsn`` for display: the password (URL or key=value form) as ``***``."""
    return _scrub(mask_url(dsn) if "://" in dsn else dsn, dsn_secrets(dsn))


#: A setting holding a PostgreSQL DSN (its password and SSL key password are secret).
DSN_SECRET = Secret(lambda v: dsn_secrets(v) if isinstance(v, str) else [],
                    lambda v: shown_dsn(v) if isinstance(v, str) else v)


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
