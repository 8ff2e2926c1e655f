"""Prometheus metrics: the runners' status, rendered at scrape time.

The single source of truth is the status model
(:class:`reclock.runtime.status.PipelineStatus`, one
:class:`~reclock.runtime.status.SourceStatus` per running source, built by
its runner). Serialized, it is the *status document* (``{"pid",
"updated_ms", "http", "config", "sources": [...], "dropped": [...]}``)
that is written to ``state_dir/status.json`` every second, served as
``/status.json``, read back by ``reclock status --json`` and turned into
metrics here. :class:`StatusCollector` calls a function returning that
document on every scrape (no background thread updates gauges), and
:func:`make_registry` registers it on a private
:class:`~prometheus_client.CollectorRegistry` (one per pipeline run, so several
pipelines can share a process).

Metrics (labels in braces), in Prometheus' base units: ``*_timestamp_seconds``
are IntoTimes (seconds since the epoch), ``*_seconds`` durations. An empty
frontier or a closed upper -- the source or output is complete -- is
``+Inf``; unknown values are left out:

===============================================  ==============================================
``reclock_build_info{version,pyspark,python}``   1: the versions running
``reclock_source_info{source,kind}``             1 per source; ``kind`` is its FromTime kind
``reclock_source_health{source,status}``         1 for the current health status, 0 for the
                                                 others
``reclock_source_frontier{source,frontier}``     a totally ordered source's frontier value
                                                 (``counter``: records, ``lsn``: WAL byte
                                                 position); ``frontier`` is ``probe``
                                                 (upstream), ``bound`` (last binding),
                                                 ``read_from`` (read so far) or ``resume``
``reclock_source_partition_offset{source,        a Kafka source's next offset per partition,
frontier,partition}``                            for the same four frontiers; with more than
                                                 :data:`PARTITION_SERIES` partitions, only
                                                 those most behind (probe minus resume)
``reclock_source_offsets{source,frontier}``      Kafka: the sum of a frontier's offsets (every
                                                 partition: what the bounded series leave out)
``reclock_source_partitions{source,frontier}``   Kafka: the partitions a frontier knows
``reclock_source_lag_records{source}``           positions upstream has that were not read yet
``reclock_source_records_total{source}``         records read since the driver started
                                                 (counters restart with the driver; use
                                                 ``rate()``)
``reclock_source_job_seconds_total{source}``     time spent in Spark jobs
``reclock_source_bindings{source}``              bindings held by the remap store
``reclock_source_remap_upper_timestamp_seconds``  the remap collection's upper (IntoTime)
``reclock_output_upper_timestamp_seconds{source,  the sink's upper (IntoTime): complete below
output}``
``reclock_output_lag_seconds{source,output}``    now minus the sink's upper; an output that has
                                                 committed nothing yet lags from the driver's
                                                 start, so the series exists from the start
``reclock_output_rows_total``                    data rows committed (not the error rows)
``reclock_output_errors_total``                  error rows committed
``reclock_output_dropped_values_total``          values of upstream columns a frozen
                                                 output does not take, per column
``reclock_output_health{source,output,status}``  1 for the output's current health status
``reclock_snapshot_rows_read{source,output}``    rows of the output's initial snapshot (a
                                                 Postgres table's existing rows) read so far:
                                                 chunks finished in Spark, all of them once
                                                 committed
``reclock_snapshot_rows{source,output}``         rows that snapshot holds: the exact count
                                                 under it, or the catalog's estimate until that
                                                 count is done (left out while neither is
                                                 known); equal to ``_rows_read`` once done
``reclock_snapshot_rows_exact{source,output}``   1 when ``reclock_snapshot_rows`` is exact, 0
                                                 while it is an estimate
``reclock_snapshot_done{source,output}``         1 once the output holds its whole snapshot
``reclock_status_updated_timestamp_seconds``     when the status document was assembled
``process_*``                                    the driver process: CPU seconds, resident and
                                                 virtual memory, open files, start time
                                                 (``prometheus_client``'s process collector)
===============================================  ==============================================

Rates of records, rows and errors come from the ``_total`` counters
(``rate()`` in PromQL); the status page computes them from ``/history.json``.
The ``reclock_snapshot_*`` series exist for outputs that take a snapshot in
this run of the driver, and stay (at ``_rows_read == _rows``) once it is done;
the progress of one is ``reclock_snapshot_rows_read / reclock_snapshot_rows``.
"""

from __future__ import annotations

import functools
import math
import platform
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from reclock.core.frontier import Antichain, frontier_partitions
from reclock.core.frontier import frontier_position as position_of
from reclock.core.time import encoded_kafka_offsets, is_partitioned
from reclock.runtime.health import HEALTH_STATES

#: The health states a source or output can be in (``reclock.runtime.driver``).
#: The frontiers of a source's status dict exported as metrics.
FRONTIERS = ("probe", "bound", "read_from", "resume")

StatusDocument = Mapping[str, Any]


# -- frontiers as numbers ------------------------------------------------------------------
def _decoded(kind: str, encoded: Any) -> Antichain[Any] | None:
    if encoded is None:
        return None
    try:
        return Antichain.decode(kind, encoded)
    except Exception:
        return None


def frontier_value(kind: str, encoded: Any) -> float | None:
    """A totally ordered frontier (``Antichain.encode()`` form) as a number:
    its single element, ``+inf`` when it is empty (complete), ``None`` when
    unknown or partitioned (Kafka)."""
    f = _decoded(kind, encoded)
    if f is None or frontier_partitions(kind, f) is not None:
        return None
    return math.inf if f.is_empty() else position_of(kind, f)


def partition_offsets(kind: str, encoded: Any) -> tuple[dict[int, int], int | None] | None:
    """A partitioned frontier's next offset per partition and the first
    partition of its "every higher partition" element; ``None`` when unknown
    or totally ordered. An empty frontier (complete) has no partitions."""
    if is_partitioned(kind):  # read off the encoding: no 2,049 objects a second
        return encoded_kafka_offsets(encoded)
    f = _decoded(kind, encoded)
    return None if f is None else frontier_partitions(kind, f)


def frontier_position(kind: str, encoded: Any) -> float | None:
    """One number that grows as the frontier advances, for charts: the value
    of a totally ordered frontier, the sum of a Kafka frontier's offsets.
    ``None`` when unknown or empty (complete)."""
    if is_partitioned(kind):
        parts = encoded_kafka_offsets(encoded)
        return None if parts is None or not encoded else float(sum(parts[0].values()))
    return position_of(kind, _decoded(kind, encoded))


def _upper(value: Any) -> float:
    """An IntoTime upper (ms) from a status dict, in seconds: ``None`` is the
    empty upper (+inf)."""
    return math.inf if value is None else float(value) / 1000.0


#: At most this many partitions of a Kafka source get series of their own
#: (those most behind), so that a scrape's size does not grow with the
#: partitions: 2,048 partitions made 8,220 series, 681 KB a scrape.
PARTITION_SERIES = 32


def _shown_partitions(kind: str, st: Mapping[str, Any]) -> set[int] | None:
    """The partitions of a source that get series: all of them when there are
    at most :data:`PARTITION_SERIES`, else those with the largest lag
    (``probe`` offset minus ``resume`` offset); ``None`` for a totally ordered
    source."""
    probe = partition_offsets(kind, st.get("probe"))
    resume = partition_offsets(kind, st.get("resume"))
    known = {p for f in FRONTIERS if (po := partition_offsets(kind, st.get(f))) is not None
             for p in po[0]}
    if probe is None and resume is None and not known:
        return None
    if len(known) <= PARTITION_SERIES:
        return known
    ahead = probe[0] if probe is not None else {}
    behind = resume[0] if resume is not None else {}
    lag = sorted(known, key=lambda p: (-(ahead.get(p, 0) - behind.get(p, 0)), p))
    return set(lag[:PARTITION_SERIES])


# -- the collector ---------------------------------------------------------------------------
def families(doc: StatusDocument) -> list[Metric]:
    """The metric families for one status document (see the module docstring)."""
    src_l = ["source"]
    out_l = ["source", "output"]
    info = GaugeMetricFamily("reclock_source_info", "One per source; kind is its FromTime kind",
                             labels=["source", "kind"])
    health = GaugeMetricFamily("reclock_source_health",
                               "1 for the source's current health status, 0 for the others",
                               labels=["source", "status"])
    frontier = GaugeMetricFamily(
        "reclock_source_frontier",
        "A totally ordered source's frontier (probe: upstream, bound: last binding, "
        "read_from: read so far, resume: durable in every output); +Inf when complete",
        labels=["source", "frontier"])
    offsets = GaugeMetricFamily("reclock_source_partition_offset",
                                "A Kafka source's next offset per partition, per frontier",
                                labels=["source", "frontier", "partition"])
    sums = GaugeMetricFamily("reclock_source_offsets",
                             "Kafka: the sum of a frontier's next offsets over every partition",
                             labels=["source", "frontier"])
    partitions = GaugeMetricFamily("reclock_source_partitions",
                                   "Kafka: the number of partitions a frontier knows",
                                   labels=["source", "frontier"])
    lag_records = GaugeMetricFamily("reclock_source_lag_records",
                                    "Positions upstream has that were not read yet",
                                    labels=src_l)
    records = CounterMetricFamily("reclock_source_records",
                                  "Records read since the driver started", labels=src_l)
    job_s = CounterMetricFamily("reclock_source_job_seconds",
                                "Seconds spent in Spark jobs", labels=src_l)
    tick_s = GaugeMetricFamily("reclock_source_tick_seconds",
                               "The median time of the source's last 64 ticks (mint, read, "
                               "commit, acknowledge)", labels=src_l)
    bindings = GaugeMetricFamily("reclock_source_bindings", "Bindings in the remap store",
                                 labels=src_l)
    remap_upper = GaugeMetricFamily("reclock_source_remap_upper_timestamp_seconds",
                                    "The remap collection's upper (IntoTime); +Inf: closed",
                                    labels=src_l)
    o_upper = GaugeMetricFamily("reclock_output_upper_timestamp_seconds",
                                "The sink's upper (IntoTime): complete below it; "
                                "+Inf: closed", labels=out_l)
    o_lag = GaugeMetricFamily("reclock_output_lag_seconds",
                              "Now minus the sink's upper (from the driver's start while "
                              "nothing is committed)", labels=out_l)
    o_rows = CounterMetricFamily("reclock_output_rows",
                                 "Data rows committed since the driver started (errors apart)",
                                 labels=out_l)
    o_errors = CounterMetricFamily("reclock_output_errors",
                                   "Error rows committed since the driver started",
                                   labels=out_l)
    o_dropped = CounterMetricFamily("reclock_output_dropped_values",
                                    "Values of upstream columns the output does not take "
                                    "(schema_change: freeze), per column, since the driver "
                                    "started", labels=["source", "output", "column"])
    o_health = GaugeMetricFamily("reclock_output_health",
                                 "1 for the output's current health status, 0 for the others",
                                 labels=["source", "output", "status"])
    snap_read = GaugeMetricFamily("reclock_snapshot_rows_read",
                                  "Rows of the output's initial snapshot read so far",
                                  labels=out_l)
    snap_rows = GaugeMetricFamily("reclock_snapshot_rows",
                                  "Rows the output's initial snapshot holds (an estimate while "
                                  "reclock_snapshot_rows_exact is 0)", labels=out_l)
    snap_exact = GaugeMetricFamily("reclock_snapshot_rows_exact",
                                   "1 when reclock_snapshot_rows is exact, 0 for an estimate",
                                   labels=out_l)
    snap_done = GaugeMetricFamily("reclock_snapshot_done",
                                  "1 once the output holds its whole initial snapshot",
                                  labels=out_l)

    def states(current: str) -> Sequence[str]:
        return HEALTH_STATES if current in HEALTH_STATES else (*HEALTH_STATES, current)

    for st in doc.get("sources") or []:
        name = str(st["source"])
        kind = str(st.get("kind", ""))
        info.add_metric([name, kind], 1)
        status = str((st.get("health") or {}).get("status", "unknown"))
        for s in states(status):
            health.add_metric([name, s], 1.0 if s == status else 0.0)
        shown = _shown_partitions(kind, st)
        for f in FRONTIERS:
            enc = st.get(f)
            parts = partition_offsets(kind, enc)
            if parts is not None:
                for p, off in sorted(parts[0].items()):
                    if shown is None or p in shown:
                        offsets.add_metric([name, f, str(p)], float(off))
                sums.add_metric([name, f], float(sum(parts[0].values())))
                known = parts[1] if parts[1] is not None else len(parts[0])
                partitions.add_metric([name, f], float(known))
            else:
                v = frontier_value(kind, enc)
                if v is not None:
                    frontier.add_metric([name, f], v)
        if st.get("lag_records") is not None:
            lag_records.add_metric([name], float(st["lag_records"]))
        records.add_metric([name], float(st.get("records") or 0))
        job_s.add_metric([name], float(st.get("job_seconds") or 0))
        if st.get("tick_ms") is not None:
            tick_s.add_metric([name], float(st["tick_ms"]) / 1000.0)
        bindings.add_metric([name], float(st.get("bindings") or 0))
        if "remap_upper" in st:
            remap_upper.add_metric([name], _upper(st["remap_upper"]))
        for o in st.get("outputs") or []:
            labels = [name, str(o["name"])]
            o_upper.add_metric(labels, _upper(o.get("upper")))
            if o.get("lag_ms") is not None:
                o_lag.add_metric(labels, float(o["lag_ms"]) / 1000.0)
            o_rows.add_metric(labels, float(o.get("rows") or 0))
            o_errors.add_metric(labels, float(o.get("errors") or 0))
            for col, n in sorted((o.get("dropped_values") or {}).items()):
                o_dropped.add_metric([*labels, str(col)], float(n))
            ostatus = str((o.get("health") or {}).get("status", "unknown"))
            for s in states(ostatus):
                o_health.add_metric([*labels, s], 1.0 if s == ostatus else 0.0)
            snap = o.get("snapshot")
            if snap:
                snap_read.add_metric(labels, float(snap.get("rows_read") or 0))
                if snap.get("rows_total") is not None:
                    snap_rows.add_metric(labels, float(snap["rows_total"]))
                snap_exact.add_metric(labels, 1.0 if snap.get("exact") else 0.0)
                snap_done.add_metric(labels, 1.0 if snap.get("done") else 0.0)
    running = {str(st["source"]) for st in doc.get("sources") or []}
    for name in doc.get("dropped") or []:
        if str(name) in running:
            continue  # dropped while running: its runner reports it
        # dropped before this run started: no runner, only the status
        for s in HEALTH_STATES:
            health.add_metric([str(name), s], 1.0 if s == "dropped" else 0.0)
    build = GaugeMetricFamily("reclock_build_info", "The versions running (value 1)",
                              labels=["version", "pyspark", "python"])
    build.add_metric(list(versions()), 1.0)
    out: list[Metric] = [build, info, health, frontier, offsets, sums, partitions, lag_records,
                         records, job_s, tick_s, bindings, remap_upper, o_upper, o_lag, o_rows,
                         o_errors, o_dropped, o_health, snap_read, snap_rows, snap_exact, snap_done]
    if doc.get("updated_ms") is not None:
        out.append(GaugeMetricFamily("reclock_status_updated_timestamp_seconds",
                                     "When the status was assembled",
                                     value=float(doc["updated_ms"]) / 1000.0))
    return out


@functools.cache
def versions() -> tuple[str, str, str]:
    """(reclock, PySpark, Python) versions, from the installed distributions."""
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "unknown"

    return of("reclock"), of("pyspark"), platform.python_version()


class StatusCollector(Collector):
    """Renders the status document returned by ``document()`` on every scrape."""

    def __init__(self, document: Callable[[], StatusDocument]) -> None:
        self._document = document

    def collect(self) -> Iterator[Metric]:
        return iter(families(self._document()))

    def describe(self) -> Iterable[Metric]:
        return []  # no fixed names: registration must not call collect()


def make_registry(document: Callable[[], StatusDocument]) -> CollectorRegistry:
    """A private registry holding one :class:`StatusCollector` for ``document``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(document))
    ProcessCollector(registry=registry)  # process_cpu_seconds_total, ..._memory_bytes, ...
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of ``registry``."""
    from prometheus_client.exposition import generate_latest

    return generate_latest(registry)
