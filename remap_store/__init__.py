"""Durable stores for bindings (the remap collection), behind one interface.

``open_store(url)`` picks the implementation from the URL:

* ``sqlite:///path/to/remap.db`` (or a bare path) -- the embedded default;
* ``postgresql://user@host:port/db`` -- PostgreSQL through psycopg 3.

See :mod:`reclock.remap_store.base` for the contract.
"""

from reclock.remap_store.base import RemapStore
from reclock.remap_store.sql import SqlRemapStore, normalize_url, redact_url


def open_store(url: str, **kwargs: float) -> RemapStore:
    """Open the remap store at ``url`` (SQLite file or PostgreSQL)."""
    return SqlRemapStore(url, **kwargs)  # type: ignore[arg-type]


__all__ = ["RemapStore", "SqlRemapStore", "normalize_url", "open_store", "redact_url"]
