"""Load requests and the ledger of loads of one ``oneshot`` source.

Under ``<state_dir>/loads/<source>/``::

    requests/<id>.json    a load asked for (``reclock load``), until it is durable
    ledger/<k>.json       load k: the request, given FromTime position k
    skipped/<id>.json     a request the driver found identical to load k (or
                          cancelled before it was given a position)
    cancel/<id>.json      ``reclock load`` was interrupted: cancel the request
    cancelled/<k>.json    the driver found load k cancelled before it committed
                          it: position k holds nothing, for good

A request names its output, its files with their sizes and versions (see
:mod:`reclock.sources.oneshot.files`), its format and options, and their
*fingerprint*: two requests with equal fingerprints load the same data into
the same output. The source's probe takes the oldest request, writes it to
the ledger as the next position (durably: the file is written, synced and
renamed into place before the probe returns it), and only then reports the
position; the driver mints a binding for it. The ledger is never rewritten:
position k always means the same files, so a re-read (a retried task, a
restart, ``reclock verify``) reads the same records. Once the output's
progress is past k, the source is acknowledged past k and removes the
request; a crash in between leaves the request, which the ledger already
names (it is not loaded again).

A cancel (``reclock load`` interrupted) takes effect where the driver
decides what a position holds: a request not yet in the ledger is skipped;
a load in the ledger whose commit has not happened is marked cancelled by
the driver's plan of it (written before the commit that moves past it, so a
re-read by ``reclock verify`` sees the same empty load); a load already
committed stays loaded. A cancelled load never matches a later request.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

#: ``skipped`` of a request cancelled before it had a position.
CANCELLED = -2

def fingerprint(output: str, fmt: str, options: dict[str, Any],
                files: list[dict[str, Any]]) -> str:
    """What makes two loads identical: output, format, options, and every
    file's URL, size and version."""
    doc = {"output": output, "format": fmt, "options": options,
           "files": [[f["url"], f["size"], f["version"]] for f in files]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # half-written or foreign
    return doc if isinstance(doc, dict) else None


class Ledger:
    """Requests and loads of one source (driver and CLI side)."""

    def __init__(self, state_dir: Path, source: str) -> None:
        self.root = Path(state_dir) / "loads" / source
        self._loads: dict[int, dict[str, Any]] = {}

    # -- requests ----------------------------------------------------------------
    def request(self, doc: dict[str, Any], now_ms: int) -> str:
        """Queue a load; returns its id."""
        rid = f"{now_ms:013d}-{uuid.uuid4().hex[:8]}"
        _write(self.root / "requests" / f"{rid}.json", {**doc, "id": rid, "requested_ms": now_ms})
        return rid

    def requests(self) -> list[dict[str, Any]]:
        """Pending requests, oldest first."""
        d = self.root / "requests"
        if not d.is_dir():
            return []
        out = []
        for p in sorted(d.glob("*.json")):
            doc = _read(p)
            if doc is not None and "id" in doc:
                out.append(doc)
        return out

    def remove_request(self, rid: str) -> None:
        (self.root / "requests" / f"{rid}.json").unlink(missing_ok=True)

    # -- the ledger ----------------------------------------------------------------
    def loads(self) -> dict[int, dict[str, Any]]:
        """Position -> load (read from disk for positions not seen yet)."""
        d = self.root / "ledger"
        if d.is_dir():
            for p in d.glob("*.json"):
                if p.stem.isdigit() and int(p.stem) not in self._loads:
                    doc = _read(p)
                    if doc is not None:
                        self._loads[int(p.stem)] = doc
        return self._loads

    def load(self, k: int) -> dict[str, Any] | None:
        if k not in self._loads:
            doc = _read(self.root / "ledger" / f"{k:012d}.json")
            if doc is None:
                return None
            self._loads[k] = doc
        return self._loads[k]

    def assign(self, k: int, request: dict[str, Any], now_ms: int) -> dict[str, Any]:
        doc = {**request, "position": k, "assigned_ms": now_ms}
        _write(self.root / "ledger" / f"{k:012d}.json", doc)
        self._loads[k] = doc
        return doc

    def skip(self, request: dict[str, Any], duplicate_of: int) -> None:
        _write(self.root / "skipped" / f"{request['id']}.json",
               {"id": request["id"], "duplicate_of": duplicate_of})
        self.remove_request(str(request["id"]))

    def skipped(self, rid: str) -> int | None:
        """The load a skipped request duplicates (:data:`CANCELLED`: it was
        cancelled; -1: its output is gone); None: not skipped."""
        doc = _read(self.root / "skipped" / f"{rid}.json")
        return None if doc is None else int(doc["duplicate_of"])

    def same_as(self, fp: str) -> int | None:
        """The latest load with this fingerprint that was not cancelled (None: none)."""
        hits = [k for k, d in self.loads().items()
                if d.get("fingerprint") == fp and not self.cancelled(k)]
        return max(hits) if hits else None

    # -- cancelling ------------------------------------------------------------------
    def cancel(self, rid: str, now_ms: int) -> None:
        """Ask for request ``rid`` to be cancelled (see the module docstring)."""
        _write(self.cancel_path(rid), {"id": rid, "requested_ms": now_ms})

    def cancel_path(self, rid: str) -> Path:
        return self.root / "cancel" / f"{rid}.json"

    def cancel_requested(self, rid: str) -> bool:
        return self.cancel_path(rid).exists()

    def mark_cancelled(self, k: int) -> None:
        """Position ``k`` holds nothing, for good (the driver, before it
        commits past ``k``)."""
        _write(self.root / "cancelled" / f"{k:012d}.json", {"position": k})

    def cancelled(self, k: int) -> bool:
        return (self.root / "cancelled" / f"{k:012d}.json").exists()

    def forget_cancel(self, rid: str) -> None:
        self.cancel_path(rid).unlink(missing_ok=True)

    def position_of(self, rid: str) -> int | None:
        for k, d in self.loads().items():
            if d.get("id") == rid:
                return k
        return None
