"""The operator's HTTP endpoint: metrics, status, history and a status page.

Started by :func:`reclock.pipeline.run` when the configuration has an
``http`` section; a :class:`~http.server.ThreadingHTTPServer` in a daemon
thread, shut down when the run ends. Routes (``GET``):

``/metrics``
    Prometheus text format, rendered at scrape time from the runners' status
    (:mod:`reclock.metrics`).
``/status.json``
    The status document, assembled at request time: the same document the
    pipeline writes to ``state_dir/status.json`` every second.
``/history.json[?since=MS]``
    The recent past kept in memory by the pipeline loop (:class:`History`):
    one point per source per second, the last :data:`HISTORY_POINTS` (fewer
    each when many sources share :data:`HISTORY_BUDGET`); with ``since``,
    only points after that time.
``/healthz``
    Liveness: 200 while the driver loop ticks (it records the history once a
    second), 503 once it has not for 30 s.
``/readyz``
    Readiness: 200 when every source is running or finished and no output
    lags more than ``http.ready_max_lag`` (60 s) or has committed nothing
    yet; else 503. Both answer ``{"ready", "problems": [...]}`` in JSON.
``/``
    An HTML page (``reclock/static/index.html``, no external resources) that
    polls the two JSON routes every second and shows a table of sources and
    outputs and SVG charts drawn in the browser.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import threading
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from reclock.core.errors import DefiniteError
from reclock.core.secrets import scrub
from reclock.metrics import frontier_position, make_registry, render

log = logging.getLogger("reclock.http")

#: Points kept per source (one a second: the last hour).
HISTORY_POINTS = 3600
#: Points kept over all sources (:class:`History`): 37 MB for sources of one output.
HISTORY_BUDGET = 360_000
#: Points a source keeps however many sources there are (a minute).
HISTORY_MIN_POINTS = 60

StatusDocument = Mapping[str, Any]


def _closed(encoded: Any) -> bool:
    """An empty frontier: the source is complete."""
    return isinstance(encoded, list) and not encoded


class History:
    """Per source, a bounded series of points taken from status documents.

    A point: ``t`` (the document's ``updated_ms``, IntoTime ms), the
    positions of the frontiers ``probe``, ``bound``, ``read_from`` and
    ``resume`` (:func:`~reclock.metrics.frontier_position`: the value of a
    totally ordered frontier, the sum of a Kafka frontier's offsets; ``None``
    when unknown or complete, with ``<name>_closed`` true when complete),
    ``remap_upper``, ``sink_upper`` (the least output upper; ``None`` when
    every output is closed), ``uppers`` / ``rows`` / ``errors`` per output,
    ``records`` and ``lag_records``. Thread safe.

    Each source keeps at most ``maxlen`` points, and all sources together
    about ``budget`` (each at least ``min_points``): a thousand
    sources keep six minutes each, not an hour. A point is stored as a row
    of numbers (:class:`_Series`, 8 bytes a value: about 110 bytes for a
    source of one output, where a point of dictionaries took 1.3 KiB) and
    becomes a dictionary only when :meth:`snapshot` hands it out.
    """

    def __init__(self, maxlen: int = HISTORY_POINTS, budget: int = HISTORY_BUDGET,
                 min_points: int = HISTORY_MIN_POINTS) -> None:
        self.maxlen = maxlen
        self.budget = budget
        self.min_points = min_points
        self._lock = threading.Lock()
        self._series: dict[str, _Series] = {}
        #: ``time.monotonic()`` of the last :meth:`record`: the driver loop's
        #: heartbeat (it records once a second), for ``/healthz``.
        self.last_recorded = time.monotonic()

    def capacity(self, sources: int) -> int:
        """Points each of ``sources`` sources keeps."""
        return min(self.maxlen, max(self.min_points, self.budget // max(1, sources)))

    def record(self, doc: StatusDocument) -> None:
        self.last_recorded = time.monotonic()
        t = doc.get("updated_ms")
        if t is None:
            return
        sources = doc.get("sources") or []
        cap = self.capacity(len(sources))
        for st in sources:
            kind = str(st.get("kind", ""))
            outs = st.get("outputs") or []
            names = tuple(str(o["name"]) for o in outs)
            uppers = [o.get("upper") for o in outs]
            finite = [u for u in uppers if u is not None]
            closed = 0
            values = [float(int(t))]
            for bit, f in enumerate(_POSITIONS):
                values.append(_number(frontier_position(kind, st.get(f))))
                if _closed(st.get(f)):
                    closed |= 1 << bit
            values += [float(closed), _number(st.get("remap_upper")),
                       _number(min(finite) if finite else None),
                       _number(st.get("records")), _number(st.get("lag_records"))]
            for o, u in zip(outs, uppers, strict=True):
                values += [_number(u), _number(o.get("rows")), _number(o.get("errors"))]
            name = str(st["source"])
            with self._lock:
                series = self._series.get(name)
                if series is None or series.names != names or series.kind != kind:
                    # (a source's outputs are fixed for a run: a new series
                    # only if the document describes it anew)
                    series = self._series[name] = _Series(kind, names, cap)
                elif series.capacity != cap:
                    series.resize(cap)
                if series.count and series.last_t() >= values[0]:
                    continue  # the clock did not move: keep one point per instant
                series.append(values)

    def snapshot(self, since: int | None = None) -> dict[str, Any]:
        """``{"sources": {name: {"kind", "points": [...]}}}``, points after ``since``."""
        with self._lock:
            rows = {name: (s.kind, s.names, s.rows_after(since))
                    for name, s in self._series.items()}
        return {"sources": {name: {"kind": kind, "points": [_point(names, r) for r in rs]}
                            for name, (kind, names, rs) in rows.items()}}

    def __len__(self) -> int:
        with self._lock:
            return max((s.count for s in self._series.values()), default=0)


#: The frontiers whose positions a point holds, in its row's order.
_POSITIONS = ("probe", "bound", "read_from", "resume")
#: A row: ``t``, the positions, a bit per closed position, ``remap_upper``,
#: ``sink_upper``, ``records``, ``lag_records``; then per output ``upper``,
#: ``rows``, ``errors``.
_FIXED = 1 + len(_POSITIONS) + 5


def _number(v: Any) -> float:
    """A point's value as stored (NaN: none, or not a number)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return math.nan
    return float(v)


def _int_or_none(v: float) -> int | None:
    return None if math.isnan(v) else int(v)


def _point(names: tuple[str, ...], row: Sequence[float]) -> dict[str, Any]:
    """A stored row as the dictionary /history.json serves."""
    point: dict[str, Any] = {"t": int(row[0])}
    closed = int(row[1 + len(_POSITIONS)])
    for bit, f in enumerate(_POSITIONS):
        v = row[1 + bit]
        point[f] = None if math.isnan(v) else v
        if closed & (1 << bit):
            point[f + "_closed"] = True
    k = 2 + len(_POSITIONS)
    point["remap_upper"] = _int_or_none(row[k])
    point["sink_upper"] = _int_or_none(row[k + 1])
    outs = [(n, row[_FIXED + 3 * i:_FIXED + 3 * i + 3]) for i, n in enumerate(names)]
    point["uppers"] = {n: _int_or_none(v[0]) for n, v in outs}
    point["rows"] = {n: _int_or_none(v[1]) for n, v in outs}
    point["errors"] = {n: _int_or_none(v[2]) for n, v in outs}
    point["records"] = _int_or_none(row[k + 2])
    point["lag_records"] = _int_or_none(row[k + 3])
    return point


class _Series:
    """A source's last ``capacity`` points, a ring of rows of doubles,
    allocated whole when the series starts."""

    __slots__ = ("capacity", "count", "data", "first", "kind", "names", "width")

    def __init__(self, kind: str, names: tuple[str, ...], capacity: int) -> None:
        self.kind = kind
        self.names = names
        self.width = _FIXED + 3 * len(names)
        self.capacity = capacity
        # every slot allocated (and touched) now: a long run's memory is
        # held from its first minute, not reached after an hour of points
        self.data = array("d", bytes(8 * self.width * capacity))
        self.first = 0  # the slot of the oldest point
        self.count = 0

    def _row(self, slot: int) -> array[float]:
        at = slot * self.width
        return self.data[at:at + self.width]

    def last_t(self) -> float:
        return self.data[((self.first + self.count - 1) % self.capacity) * self.width]

    def append(self, values: list[float]) -> None:
        if self.count < self.capacity:  # (not yet full: the ring starts at slot 0)
            slot = self.count
            self.count += 1
        else:
            slot = self.first
            self.first = (self.first + 1) % self.capacity
        self.data[slot * self.width:(slot + 1) * self.width] = array("d", values)

    def rows(self) -> list[array[float]]:
        return [self._row((self.first + i) % self.capacity) for i in range(self.count)]

    def rows_after(self, since: int | None) -> list[array[float]]:
        """The rows with ``t`` after ``since``, oldest first (a binary search:
        the status page asks for the newest few every second)."""
        lo, hi = 0, self.count
        if since is not None:
            while lo < hi:
                mid = (lo + hi) // 2
                if self.data[((self.first + mid) % self.capacity) * self.width] > since:
                    hi = mid
                else:
                    lo = mid + 1
        return [self._row((self.first + i) % self.capacity) for i in range(lo, self.count)]

    def resize(self, capacity: int) -> None:
        """Keep the newest ``capacity`` points."""
        kept = self.rows()[-capacity:]
        self.capacity = capacity
        self.data = array("d", bytes(8 * self.width * capacity))
        self.first, self.count = 0, 0
        for r in kept:
            self.append(list(r))


def page() -> bytes:
    """The status page (HTML with inline CSS and JavaScript)."""
    return (resources.files("reclock") / "static" / "index.html").read_bytes()


def _json_default(value: Any) -> Any:
    return str(value)


def _dumps(value: Any) -> bytes:
    return json.dumps(_finite(value), default=_json_default).encode()


def _finite(value: Any) -> Any:
    """Strict JSON: non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


_BUSY_BODY = b"too many connections, retry\n"
#: The whole answer to a connection past the cap.
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
         b"Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n%s"
         % (len(_BUSY_BODY), _BUSY_BODY))
#: Largest ``since`` that /history.json accepts (int64 milliseconds).
_MAX_MS = 2**63 - 1


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``slots`` at once: one more is
    answered 503 from the accepting thread and closed. Accepted connections
    queue in a listen backlog of :attr:`request_queue_size`."""

    daemon_threads = True
    request_queue_size = 128
    app: StatusServer
    slots: threading.BoundedSemaphore
    timeout_s: float

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.settimeout(1.0)
                request.sendall(_BUSY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server_version = "reclock"

    def setup(self) -> None:
        super().setup()
        # Bounds reading the request and writing the answer (a slow client
        # is disconnected: handle_one_request sees the timeout and closes).
        self.connection.settimeout(cast(_Server, self.server).timeout_s)

    def do_GET(self) -> None:
        app = cast(_Server, self.server).app
        url = urlsplit(self.path)
        try:
            if url.path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", page())
            elif url.path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, render(app.registry))
            elif url.path == "/healthz":
                idle = time.monotonic() - app.history.last_recorded
                if idle <= app.live_within_s:
                    self._send(200, "text/plain; charset=utf-8", b"ok\n")
                else:
                    self._send(503, "text/plain; charset=utf-8",
                               f"the driver loop has not ticked for {idle:.0f} s\n".encode())
            elif url.path == "/readyz":
                problems = readiness(app.document(), app.ready_max_lag_ms)
                body = _dumps({"ready": not problems, "problems": problems})
                self._send(503 if problems else 200, "application/json", body)
            elif url.path == "/status.json":
                self._send(200, "application/json", _dumps(app.document()))
            elif url.path == "/history.json":
                try:
                    since = _since(parse_qs(url.query).get("since", [""])[0])
                except ValueError:
                    self._send(400, "text/plain; charset=utf-8",
                               b"since: expected whole milliseconds since the epoch "
                               b"(0 to 9223372036854775807)\n")
                    return
                self._send(200, "application/json", _dumps(app.history.snapshot(since)))
            else:
                self._send(404, "text/plain; charset=utf-8",
                           b"not found; try /, /metrics, /status.json, /history.json, "
                           b"/healthz, /readyz\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:
            log.warning("http %s failed: %s", url.path, exc, exc_info=True)
            with contextlib.suppress(OSError):
                self._send(500, "text/plain; charset=utf-8",
                           scrub(f"{type(exc).__name__}: {exc}\n").encode())

    def _send(self, code: int, ctype: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http %s - " + format, self.address_string(), *args)


def readiness(doc: StatusDocument, max_lag_ms: int) -> list[str]:
    """Why the pipeline is not ready (empty: ready): a source that is not
    running or finished, or an output whose lag exceeds ``max_lag_ms`` or
    that has committed nothing yet. What ``/readyz`` answers."""
    problems = []
    for st in doc.get("sources") or []:
        name = st.get("source")
        status = (st.get("health") or {}).get("status")
        if status not in ("running", "finished"):
            err = (st.get("health") or {}).get("error")
            problems.append(f"source {name} is {status}" + (f": {err}" if err else ""))
            continue
        if status == "finished":
            continue
        for o in st.get("outputs") or []:
            lag = o.get("lag_ms")
            if o.get("upper") == 0:
                problems.append(f"output {name}.{o.get('name')} has committed nothing yet")
            elif lag is not None and lag > max_lag_ms:
                problems.append(f"output {name}.{o.get('name')} lags {lag / 1000:.1f} s "
                                f"(more than {max_lag_ms / 1000:g} s)")
    return problems


def _since(raw: str) -> int | None:
    """``since`` of /history.json: ``None`` when absent, else the
    milliseconds; ``ValueError`` unless it is a whole number of int64
    milliseconds (no floats: ``1e400`` once reached ``int(float(...))`` and
    answered 500)."""
    if raw == "":
        return None
    text = raw.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 19 or int(text) > _MAX_MS:
        raise ValueError(raw)
    return int(text)


class StatusServer:
    """The HTTP endpoint over ``document`` (a function returning the current
    status document) and ``history``. Binds in the constructor (so a port in
    use fails before anything starts); :meth:`start` serves in a daemon
    thread, :meth:`close` stops it."""

    def __init__(self, host: str, port: int, document: Callable[[], StatusDocument],
                 history: History, registry: CollectorRegistry | None = None, *,
                 max_connections: int = 32, timeout_s: float = 5.0,
                 ready_max_lag_ms: int = 60_000, live_within_s: float = 30.0) -> None:
        self.document = document
        self.ready_max_lag_ms = ready_max_lag_ms
        self.live_within_s = live_within_s
        self.history = history
        self.registry = registry if registry is not None else make_registry(document)
        cls = _Server6 if ":" in host else _Server
        try:
            self._httpd = cls((host, port), _Handler)
        except OSError as exc:
            raise DefiniteError(
                f"http: cannot listen on {host}:{port}: {exc.strerror or exc}",
                hint="choose another http.port (0 picks a free one) or stop what uses it",
            ) from None
        self._httpd.app = self
        self._httpd.slots = threading.BoundedSemaphore(max_connections)
        self._httpd.timeout_s = timeout_s
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """Where to reach it: ``http://host:port`` (a wildcard host becomes the
        loopback address)."""
        host = str(self._httpd.server_address[0])
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def start(self) -> StatusServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="reclock-http",
                                        kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()


__all__ = ["HISTORY_POINTS", "History", "StatusServer", "page"]
