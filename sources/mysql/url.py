"""A MariaDB URL read into connection settings: what the configuration checks
and the source connects with."""

from __future__ import annotations

import urllib.parse
from typing import Any

from reclock.core.urls import check_url


def parse_url(url: str) -> dict[str, Any]:
    """``mysql://user:password@host:port/database`` -> connection settings
    (``host``, ``port``, ``user``, ``password``, ``database``). A
    ``ValueError`` that never quotes the URL for one that parsers could read
    differently (a password with an unencoded ``#``, ``/`` or ``@``: see
    :func:`~reclock.core.urls.check_url`)."""
    u = check_url(url, ("mysql", "mariadb"), what="the URL", path_slashes=False,
                  example="host:3306/database")
    (host, port), = u.hosts
    return {"host": host, "port": port or 3306, "user": u.user or "root",
            "password": u.password or "", "database": urllib.parse.unquote(u.path[1:]) or None}
