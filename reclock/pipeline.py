"""Assembling a pipeline from its configuration, and running it.

``Pipeline(cfg)`` turns the typed configuration into runtime objects: one
:class:`~reclock.contracts.source.Source` per source with its outputs' sinks and
decoders, the remap store, and (when running) the Spark session.
:func:`run` starts one :class:`~reclock.runtime.driver.SourceRunner` per source,
writes ``state_dir/status.json`` every second, watches for drop requests, and
stops cleanly on SIGINT/SIGTERM. With an ``http`` section it also serves
metrics, the status and its recent history, and a status page
(:mod:`reclock.statuspage`). What it lets out (the status document, the
progress log, the lines on stderr, log records) is scrubbed of the
configuration's secrets (:mod:`reclock.core.secrets`).

State directory layout::

    state_dir/
      remap.db              bindings (default remap store)
      outputs/<source>/<output>/   Delta tables (default file sinks)
      console/<source>.<output>.json   console sinks' state
      dropped/<source>      drop markers (``reclock drop``)
      resnapshot/<source>/  requests of ``reclock resnapshot`` (one file per output)
      progress.jsonl        the progress log
      status.json           the running driver's view, refreshed every second
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from reclock import faults
from reclock.config.schema import DEFAULT_ENVELOPE, OutputConfig, PipelineConfig, SourceConfig
from reclock.contracts.config import config_secrets
from reclock.contracts.envelope import Envelope
from reclock.contracts.remap_store import RemapStore
from reclock.contracts.rows import check_output_names
from reclock.contracts.sink import PersistSink, SinkContext
from reclock.contracts.source import Facts, Source, SourceContext
from reclock.core.bindings import Bindings
from reclock.core.clock import Clock, SystemClock
from reclock.core.columns import rename_columns
from reclock.core.errors import DefiniteError, LockTaken, TransientError
from reclock.core.secrets import install_log_filter, register, scrub, scrub_json
from reclock.registry import envelope_for, open_store
from reclock.runtime.driver import OutputRuntime, Settings, SourceRunner, check_state_key
from reclock.runtime.health import STALLED
from reclock.runtime.keystate import CacheShares
from reclock.runtime.lock import DriverLock, LockWatch, holder_info
from reclock.runtime.progress_log import ProgressLog
from reclock.runtime.resnapshot import Requests
from reclock.runtime.shapes import raw_user_schema
from reclock.runtime.snapshot_progress import describe as describe_snapshot
from reclock.runtime.spark import EarlySession, WarmWorkers
from reclock.runtime.status import PipelineStatus

log = logging.getLogger("reclock")


def sink_names(ocfg: OutputConfig) -> str:
    """The names of ``ocfg``'s sinks, for messages."""
    return ", ".join(n for n, _ in ocfg.named_sinks)


def _ignored(changes: Mapping[str, str | None]) -> None:
    """The facts' writer of a source built for an audit: writes nothing."""


@dataclass
class BuiltSource:
    config: SourceConfig
    source: Source[Any]
    outputs: list[OutputRuntime]


class Pipeline:
    """The runtime objects of one pipeline file."""

    def __init__(self, cfg: PipelineConfig, clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.clock = clock or SystemClock()
        # (a configuration loaded from YAML registered its secrets then; one
        # built in code registers them here)
        register(config_secrets(cfg))
        self.state_dir = Path(cfg.state_dir)
        self._store: RemapStore | None = None
        self._identity: str | None = None
        #: the key-state page cache all keyed outputs share
        self.key_cache = CacheShares(cfg.housekeeping.key_state_cache)

    # -- pieces --------------------------------------------------------------------
    @property
    def store(self) -> RemapStore:
        if self._store is None:
            self._store = open_store(self.cfg.remap_store_url)
        return self._store

    @property
    def identity(self) -> str:
        """The pipeline's identity (see :meth:`RemapStore.identity`)."""
        if self._identity is None:
            self._identity = self.store.identity()
        return self._identity

    def source_config(self, name: str) -> SourceConfig:
        for s in self.cfg.sources:
            if s.name == name:
                return s
        raise DefiniteError(
            f"no source named {name!r}; the pipeline has {[s.name for s in self.cfg.sources]}"
        )

    def build_source(self, src: SourceConfig, audit: bool = False) -> BuiltSource:
        """The source of ``src`` and its outputs. ``audit``: for reading only
        (``reclock verify``): the source records nothing in its facts (a
        topic's identity, an accepted re-created topic taken up), which only
        a running driver decides."""
        source = self._connector(src, audit)
        specs = source.outputs()
        by_name = {o.name: o for o in src.outputs}
        unknown = sorted(set(by_name) - {s.name for s in specs})
        if unknown:
            raise DefiniteError(
                f"source {src.name!r}: outputs {unknown} are not produced by this source; "
                f"it produces {[s.name for s in specs]}"
            )
        outputs = []
        for i, spec in enumerate(specs):
            ocfg = by_name.get(spec.name)
            if ocfg is None:
                raise DefiniteError(
                    f"source {src.name!r}: output {spec.name!r} needs an entry under outputs "
                    "(at least its sink)"
                )
            outputs += self._output(src, i, spec, ocfg)
        for slot, out in enumerate(outputs):
            out.slot = slot
        return BuiltSource(src, source, outputs)

    def _connector(self, src: SourceConfig, audit: bool = False) -> Source[Any]:
        _, block = src.connector
        write = (_ignored if audit else functools.partial(self.store.put_facts, src.name))
        return block.build(src.name, SourceContext(
            self.clock, self.identity, tuple(o.name for o in src.outputs),
            state_dir=self.state_dir,
            coordinates=functools.partial(self.store.coordinates, src.name),
            facts=Facts(functools.partial(self.store.facts, src.name), write),
            schema_change={o.name: o.schema_change for o in src.outputs}))

    def _output(self, src: SourceConfig, index: int, spec: Any, ocfg: OutputConfig
                ) -> list[OutputRuntime]:
        """The output ``ocfg``: one :class:`OutputRuntime` per sink (the
        sink's slot; they share the output's decoders and shape)."""
        what = f"source {src.name!r} output {ocfg.name!r}"
        envelope: Envelope = ocfg.envelope
        if spec.envelope is not None:
            if envelope.type != DEFAULT_ENVELOPE:
                raise DefiniteError(f"{what}: this source chooses the envelope itself "
                                    f"({spec.envelope}); remove the output's envelope")
            envelope = envelope_for(spec.envelope, tuple(spec.key))
        key_dec = value_dec = None
        key_columns: list[str] | None = None
        if spec.typed:
            user_schema = spec.schema
        else:
            from reclock.registry import make_decoder

            # e.g. upsert: a null value is a tombstone, not an error
            value_dec = make_decoder(ocfg.format.model_dump(), allow_null=envelope.allow_null,
                                     policy=ocfg.schema_change)
            key_dec = make_decoder(ocfg.key_format.model_dump(), policy=ocfg.schema_change,
                                   part="key") if ocfg.key_format else None
            if key_dec is not None:
                from reclock.contracts.decode import KeyValueDecoder

                try:
                    KeyValueDecoder(key_dec, value_dec)
                except ValueError as exc:
                    raise DefiniteError(
                        f"{what}: {exc}",
                        hint="give the key format a schema whose columns differ from the "
                        "value's") from None
            user_schema, key_columns = raw_user_schema(
                what, key_dec, value_dec, list(spec.extra) if spec.extra is not None else [],
                envelope.type)
        upsert_key: tuple[str, ...] | None = None
        upstream: tuple[str, ...] = ()
        if user_schema is not None:  # (typed rows described when the source opens: then)
            upsert_key = envelope.resolve(what, list(user_schema.names), key_columns)
            if ocfg.rename:
                user_schema, upstream, upsert_key = rename_columns(
                    what, user_schema, ocfg.rename, upsert_key)
            check_output_names(what, user_schema)
        slots = []
        several = ocfg.sinks is not None
        for sink_name, scfg in ocfg.named_sinks:
            out = OutputRuntime(
                index=index, name=spec.name, spec=spec, sink=self.sink(src, ocfg, sink_name),
                user_schema=user_schema, key_decoder=key_dec, value_decoder=value_dec,
                envelope=envelope, upsert_key=upsert_key, upstream=upstream,
                rename=dict(ocfg.rename), state_key=scfg.state_key,
                policy=ocfg.schema_change,
                formats=(None if ocfg.key_format is None else ocfg.key_format.model_dump(),
                         ocfg.format.model_dump()),
                sink_name=sink_name, key=ocfg.slot(sink_name), several=several,
            )
            if user_schema is not None:
                check_state_key(f"source {src.name!r} {out.label}", out)
            slots.append(out)
        return slots

    def sink(self, src: SourceConfig, ocfg: OutputConfig, name: str | None = None
             ) -> PersistSink:
        """The sink ``name`` of ``ocfg`` (default: its first), built under
        its slot's name (:meth:`~reclock.config.schema.OutputConfig.slot`)."""
        sink_name, scfg = next(((n, s) for n, s in ocfg.named_sinks
                                if name is None or n == name), (None, None))
        if scfg is None or sink_name is None:
            raise DefiniteError(f"source {src.name!r} output {ocfg.name!r} has no sink "
                                f"{name!r}", hint=f"its sinks: {sink_names(ocfg)}")
        return scfg.build(
            SinkContext(src.name, ocfg.slot(sink_name), self.state_dir, self.identity))

    # -- drop markers -----------------------------------------------------------------
    def drop_marker(self, source: str) -> Path:
        return self.cfg.drop_marker(source)

    def is_dropped(self, source: str) -> bool:
        return self.drop_marker(source).exists()

    def request_drop(self, source: str) -> None:
        self.source_config(source)  # must exist
        m = self.drop_marker(source)
        m.parent.mkdir(parents=True, exist_ok=True)
        m.write_text(json.dumps({"dropped_ms": self.clock.now()}))

    def release_upstream(self, source: str) -> str | None:
        """After a drop: release what the source holds upstream when it is
        configured to (a Postgres slot with ``drop_slot: true``): the source's
        optional ``drop()``. Says what was released (None: nothing), and
        records it in the drop marker: such a source cannot be undropped."""
        conn = self._connector(self.source_config(source))
        try:
            released = conn.drop()
        finally:
            conn.close()
        if released:
            mark = self._drop_mark(source) or {}
            self.drop_marker(source).write_text(json.dumps({**mark, "released": released}))
        return released

    def accept_recreated(self, source: str, name: str) -> str:
        """``reclock accept-recreated``: the upstream object ``name`` that
        ``source`` found replaced (a re-created topic) is read as it is now,
        from its start, by the source's next open (the source's
        ``accept_replaced``). Says what was accepted."""
        src = self.source_config(source)
        shards = self.store.shards()
        last = self.store.read(source).last if source in shards else None
        conn = self._connector(src)
        try:
            return conn.accept_replaced(name, None if last is None else last.frontier)
        finally:
            conn.close()

    def _drop_mark(self, source: str) -> dict[str, Any] | None:
        """What the drop marker records (``None``: the source is not dropped;
        an unreadable marker records nothing)."""
        m = self.drop_marker(source)
        if not m.exists():
            return None
        try:
            mark = json.loads(m.read_text())
        except ValueError:
            return {}
        return mark if isinstance(mark, dict) else {}

    def undrop(self, source: str) -> None:
        """Bring a dropped source back: the next run resumes it from its
        outputs' resumption frontier. Refused when the drop released what
        the source held upstream (its slot): resuming would skip the changes
        made since."""
        self.source_config(source)  # must exist
        mark = self._drop_mark(source)
        if mark is None:
            raise DefiniteError(f"source {source!r} is not dropped")
        if mark.get("released"):
            raise DefiniteError(
                f"source {source!r} cannot be undropped: its drop released what it held "
                f"upstream ({mark['released']}), so the changes made since are gone from "
                "the source",
                hint="start the source over under a new name (its outputs then snapshot "
                     "again), or keep it dropped")
        self.drop_marker(source).unlink()

    # -- resnapshot requests ------------------------------------------------------------
    def request_resnapshot(self, source: str, output: str) -> None:
        """Ask for ``output`` to be read again from scratch (see
        :mod:`reclock.runtime.resnapshot`); refused for a source that cannot
        (:attr:`~reclock.contracts.source.Source.can_resnapshot`), an unknown output or a
        dropped source."""
        src = self.source_config(source)
        if output not in {o.name for o in src.outputs}:
            raise DefiniteError(f"source {source!r} has no output {output!r}",
                                hint=f"its outputs: {', '.join(o.name for o in src.outputs)}")
        if self.is_dropped(source):
            raise DefiniteError(f"source {source!r} is dropped",
                                hint="reclock undrop it first")
        conn = self._connector(src)
        try:
            able = conn.can_resnapshot
        finally:
            conn.close()
        if not able:
            raise DefiniteError(
                f"source {source!r} cannot re-snapshot an output: it can neither read "
                "its upstream again nor take a new snapshot of it",
                hint="to rebuild the output of another source, drop it and start the source "
                     "over under a new name")
        Requests(self.state_dir, source).request(output, self.clock.now())

    def open_shards(self, built: list[BuiltSource]) -> dict[str, Bindings[Any]]:
        """Every source's remap shard created if absent and read, in a few
        transactions for all of them (each runner would take three of its
        own): source name -> its bindings, for the runners' first open. Empty
        while the store is unreachable (each runner then retries on its own)."""
        try:
            return self.store.open_shards({b.config.name: b.source.kind for b in built})
        except TransientError:
            return {}

    def settings(self, src: SourceConfig) -> Settings:
        return Settings(spark=self.cfg.spark, housekeeping=self.cfg.housekeeping,
                        timestamp_interval_ms=src.interval_ms,
                        max_retry_backoff_ms=self.cfg.max_retry_backoff,
                        keys_dir=self.state_dir / "keys" / src.name, key_cache=self.key_cache)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def status_document(runners: list[SourceRunner], dropped: list[str], clock: Clock,
                    http: str | None = None, config: str | None = None, *,
                    stopped: bool = False) -> dict[str, Any]:
    """The status document: the :class:`~reclock.runtime.status.PipelineStatus`
    of the running sources, as JSON. Written to ``status.json``, served as
    ``/status.json`` and as ``/metrics`` (:mod:`reclock.metrics`), read by
    ``reclock status``: the single source of truth for what operators see.
    ``config``: the fingerprint of the configuration the driver runs
    (:attr:`~reclock.config.schema.PipelineConfig.fingerprint`); ``stopped``:
    the run ended. Every string in it is scrubbed of secrets
    (:mod:`reclock.core.secrets`)."""
    status = PipelineStatus(tuple(r.observed.model() for r in runners), os.getpid(),
                            clock.now(), http, config, tuple(dropped), stopped)
    doc: dict[str, Any] = scrub_json(status.to_json())
    return doc


def write_status(path: Path, runners: list[SourceRunner], dropped: list[str], clock: Clock,
                 http: str | None = None, *, final: bool = False,
                 config: str | None = None) -> dict[str, Any]:
    """Write the status document to ``path`` (atomically) and return it;
    ``final``: the run ended (``"stopped": true``, so ``reclock status`` knows
    the driver is gone even while its process lives on)."""
    doc = status_document(runners, dropped, clock, http, config, stopped=final)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, default=str))
    os.replace(tmp, path)
    return doc


class Runners(list[SourceRunner]):
    """What :func:`run` returns (and passes to ``on_ready``): the runners, and
    ``http_url``, where the HTTP endpoint listens (``None`` when off)."""

    http_url: str | None = None
    #: Sources that were stalled when the run ended (``reclock run`` exits 1).
    stalled: list[str]
    #: The run ended because another driver took the pipeline's lock
    #: (``reclock run`` exits 2).
    lock_taken: LockTaken | None = None

    def __init__(self) -> None:
        super().__init__()
        self.stalled = []


def run(
    cfg: PipelineConfig,
    *,
    spark: Any | None = None,
    duration: float | None = None,
    stop: threading.Event | None = None,
    out: TextIO | None = sys.stderr,
    clock: Clock | None = None,
    on_ready: Callable[[list[SourceRunner]], None] | None = None,
    use_spark: bool = True,
    install_signals: bool = True,
    early: EarlySession | None = None,
) -> Runners:
    """Run every source until stopped (Ctrl-C, SIGTERM, ``duration``, ``stop``)
    or until every source finished. Returns the runners (for tests), with
    ``http_url`` set when the configuration enables the HTTP endpoint.
    ``early``: a session started while the file was read, used if it was
    started as ``cfg`` asks (:class:`~reclock.runtime.spark.EarlySession`)."""
    pipe = Pipeline(cfg, clock)
    install_log_filter()  # every record a root handler writes is scrubbed of secrets
    stop = stop or threading.Event()
    # Arrow's datasets (and pandas with them: about 1 s) are imported lazily
    # for the CLI; a driver imports them now, not in its first compaction
    # (reclock.sinks._store.Location.dataset), which would stall that tick.
    import pyarrow.dataset  # noqa: F401
    handler: Callable[..., None] | None = None
    if install_signals and threading.current_thread() is threading.main_thread():
        handler = _stop_on(stop)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, handler)
    pipe.state_dir.mkdir(parents=True, exist_ok=True)
    try:
        release, watch = _lock(pipe)
    except BaseException:
        pipe.close()
        raise
    try:
        return _run(pipe, cfg, spark, duration, stop, out, on_ready, use_spark, handler, watch,
                    early)
    finally:
        release()


def _stop_on(stop: threading.Event) -> Callable[..., None]:
    """The SIGINT/SIGTERM handler: ask the loop to stop (it finishes or
    abandons the tick in flight and prints each source's final line)."""

    def handler(*_args: object) -> None:
        stop.set()

    return handler


def _lock(pipe: Pipeline) -> tuple[Callable[[], None], LockWatch | None]:
    """One driver per pipeline (:mod:`reclock.runtime.lock`): the state
    directory's lock, then the remap store's where it has one, re-checked
    for the driver's life by the :class:`LockWatch` returned (started).
    Returns the release of both, and the watch (None: no store lock)."""
    if faults.driver_lock_skipped():
        return (lambda: None), None
    lock = DriverLock.acquire(pipe.state_dir)
    try:
        store_lock = pipe.store.lock_driver(holder_info())
    except BaseException:
        lock.release()
        raise
    watch = None if store_lock is None else LockWatch(store_lock)
    if watch is not None:
        watch.start()

    def release() -> None:
        if watch is not None:
            watch.stop()
        if store_lock is not None:
            store_lock.release()
        lock.release()

    return release, watch


def _run(pipe: Pipeline, cfg: PipelineConfig, spark: Any | None, duration: float | None,
         stop: threading.Event, out: TextIO | None,
         on_ready: Callable[[list[SourceRunner]], None] | None, use_spark: bool,
         handler: Callable[..., None] | None, watch: LockWatch | None,
         early: EarlySession | None = None) -> Runners:
    dropped: list[str] = []
    built: list[BuiltSource] = []
    warm: WarmWorkers | None = None
    # Sources and outputs first: what the configuration refuses once the
    # sources describe their outputs (a state table's key, typed columns)
    # is said before Spark takes its seconds to start.
    for src in cfg.sources:
        if pipe.is_dropped(src.name):
            dropped.append(src.name)
            continue
        built.append(pipe.build_source(src))
    events = ProgressLog(pipe.state_dir / "progress.jsonl" if cfg.progress_log else None,
                         pipe.clock)
    if use_spark and spark is None:
        from reclock.runtime.spark import spark_session, warm_workers

        wanted = (cfg.spark.master, cfg.spark.app_name, cfg.spark.conf)
        spark = early.take(*wanted) if early is not None else None
        if spark is None:
            spark = spark_session(*wanted)
        # (while the sources open and wait for their first binding)
        warm = warm_workers(spark, sorted({"reclock.runtime.dataplane"} | {
            type(x).__module__ for b in built for x in (b.source, *(o.sink for o in b.outputs))}))
        if signal.getsignal(signal.SIGINT) is not handler and handler is not None:
            # PySpark's SparkContext installs its own SIGINT handler (cancel
            # every job, raise KeyboardInterrupt); Ctrl-C stops reclock cleanly.
            signal.signal(signal.SIGINT, handler)
    started = time.monotonic()
    runners = Runners()
    shards = pipe.open_shards(built)
    for b in built:
        src = b.config
        runners.append(SourceRunner(
            b.source, b.outputs, pipe.store, spark if use_spark else None, pipe.clock,
            pipe.settings(src), events, requests=Requests(pipe.state_dir, src.name),
            drop_marker=pipe.drop_marker(src.name), bindings=shards.get(src.name),
            lock=watch,
        ))
    if dropped and out is not None:
        out.write(f"reclock: not running dropped source(s) {', '.join(dropped)} "
                  "(reclock undrop FILE SOURCE brings one back)\n")
    # (here, not at the top: the commands that only read a pipeline's state,
    # `verify` among them, need no status page and no Prometheus client)
    from reclock.statuspage import History, StatusServer

    history = History()
    server: StatusServer | None = None
    status_path = pipe.state_dir / "status.json"
    last_print = 0.0
    try:
        if cfg.http is not None:
            server = StatusServer(
                cfg.http.host, cfg.http.port,
                lambda: status_document(runners, dropped, pipe.clock, runners.http_url,
                                        cfg.fingerprint),
                history, max_connections=cfg.http.max_connections,
                timeout_s=cfg.http.request_timeout / 1000.0,
                ready_max_lag_ms=cfg.http.ready_max_lag)
            runners.http_url = server.url
            server.start()
            log.info("http: serving %s", server.url)
            if out is not None:
                out.write(f"reclock: status page at {server.url}/, "
                          f"metrics at {server.url}/metrics\n")
        for r in runners:
            r.start()
        if on_ready is not None:
            on_ready(runners)
        while not stop.is_set():
            for r in runners:
                if r.name not in dropped and pipe.is_dropped(r.name):
                    r.drop()  # (the runner may have seen the marker first)
                    dropped.append(r.name)
            doc = write_status(status_path, runners, dropped, pipe.clock, runners.http_url,
                               config=cfg.fingerprint)
            if server is not None:  # only the endpoint serves the history
                history.record(doc)
            if out is not None and time.monotonic() - last_print >= 5:
                last_print = time.monotonic()
                for r in runners:
                    out.write(scrub(progress_line(r.status())) + "\n")
                out.flush()
            if duration is not None and time.monotonic() - started >= duration:
                break
            if runners and not any(r.alive for r in runners):
                break
            stop.wait(1.0)
    finally:
        # Another driver took the pipeline's lock: each source stopped at its
        # next mint or commit (LockTaken), and with them the loop.
        runners.lock_taken = None if watch is None else watch.taken
        runners.stalled = [r.name for r in runners if r.health.status == STALLED]
        for r in runners:
            r.stop()
        for r in runners:
            r.join(timeout=60)
        if warm is not None:
            warm.wait()
        write_status(status_path, runners, dropped, pipe.clock, runners.http_url, final=True,
                     config=cfg.fingerprint)
        if server is not None:
            server.close()
        pipe.close()
        events.close()
    return runners


def progress_line(st: dict[str, Any]) -> str:
    outs = st.get("outputs", [])
    uppers = [o["upper"] for o in outs if o["upper"] is not None]
    upper = min(uppers) if uppers else None
    lags = [o["lag_ms"] for o in outs if o.get("lag_ms") is not None]
    health = st["health"]["status"]
    err = f" ({st['health']['error']})" if st["health"].get("error") else ""
    from reclock.core.frontier import render as render_frontier

    lag_ms = f"{max(lags)} ms" if lags else "-"
    lag_rec = st.get("lag_records")
    snaps = [d for o in outs if (d := describe_snapshot(o["name"], o.get("snapshot"))) is not None]
    return (
        f"[{st['source']}] {health}{err}  bound {render_frontier(st['kind'], st.get('bound'))}  "
        f"into upper {upper if upper is not None else '-'}  {st['records']} records  "
        f"{st['records_per_s']:.0f}/s  lag {lag_ms}"
        + (f", {lag_rec} records" if lag_rec is not None else "")
        + "".join(f"; {d}" for d in snaps)
    )
