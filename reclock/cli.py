"""reclock: changes from Kafka and PostgreSQL, stamped with one system time,
landed exactly once.

    reclock run FILE                      run the pipeline (Ctrl-C / SIGTERM stop cleanly)
    reclock check FILE                    check the pipeline file, starting nothing
    reclock status FILE [--json]          health, frontiers, uppers and lag per source/output
    reclock bindings FILE SOURCE [--at T] the bindings IntoTime -> frontier (or R(T))
    reclock read FILE OUTPUT... [--as-of T] [--sink NAME]   contents as of one IntoTime
    reclock drop FILE SOURCE              stop a source promptly, keep its outputs
    reclock undrop FILE SOURCE            the next run resumes a dropped source
    reclock resnapshot FILE SOURCE OUTPUT read one output's upstream again, correcting it
    reclock accept-recreated FILE SOURCE TOPIC  read a re-created topic from its start
    reclock verify FILE [--sink NAME]     audit every sink of every output against the bindings
    reclock load FILE SOURCE OUTPUT --from PATH_OR_URL   load files once, at one IntoTime

Exit codes:

    0  done; for status: the driver runs and no source is stalled
    1  run: a source was stalled when the run ended; status: a source is
       stalled; verify: an output breaches its bindings
    2  an error (a bad configuration, an unreachable store, ...), on one line;
       run: another driver took the pipeline's lock over while it ran
    3  status: the driver is not running
    130  interrupted before the pipeline started
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as dt
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from reclock.core.errors import ReclockError
from reclock.core.frontier import render as render_frontier
from reclock.core.secrets import install_log_filter, scrub, scrub_data

if TYPE_CHECKING:
    from reclock.runtime.status import PipelineStatus

log = logging.getLogger("reclock")


def parse_time(text: str) -> int:
    """IntoTime from milliseconds or an ISO-8601 timestamp (UTC if naive)."""
    if text.isdigit():
        return int(text)
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ReclockError(
            f"not a time: {text!r} (expected milliseconds since the epoch or ISO-8601)"
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return int(t.timestamp() * 1000)


def fmt_time(ms: int | None) -> str:
    if ms is None:
        return "closed"
    iso = dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="milliseconds")
    return f"{ms} ({iso.replace('+00:00', 'Z')})"


def _load(path: str) -> Any:
    from reclock.config import load_config

    return load_config(path)


# -- commands ----------------------------------------------------------------------------
def cmd_check(args: argparse.Namespace) -> int:
    """The pipeline file checked as ``run`` checks it before it starts
    anything (every problem with its file and line: exit 2), and a summary
    of what it runs."""
    cfg = _load(args.file)
    for src in cfg.sources:
        outs = ", ".join(
            o.name + ("" if o.sinks is None else f" -> {', '.join(n for n, _ in o.named_sinks)}")
            for o in src.outputs)
        print(f"source {src.name} [{src.connector[0]}]: {outs}")
    print(f"{args.file}: ok")
    return 0


def _early_spark(path: str) -> Any:
    """Spark's JVM started now, in the background, as the file's ``spark``
    block asks, while the file is checked and the plug-ins imported
    (:class:`~reclock.runtime.spark.EarlySession`); None when the block
    does not read plainly or ``RECLOCK_EARLY_SPARK=off``."""
    if os.environ.get("RECLOCK_EARLY_SPARK", "on").lower() in ("off", "0", "false", "no"):
        return None
    from reclock.config.loader import spark_view

    view = spark_view(path)
    if view is None:
        return None
    from reclock.runtime.spark import EarlySession

    return EarlySession(*view)


def cmd_run(args: argparse.Namespace) -> int:
    early = _early_spark(args.file)
    from reclock.pipeline import run

    cfg = _load(args.file)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    install_log_filter()
    sys.stderr.write(f"reclock: running {len(cfg.sources)} source(s); state in {cfg.state_dir}\n")
    runners = run(cfg, duration=args.duration, early=early)
    # The run is over and is only shutting down now. Python puts the default
    # handlers back while it finalizes, so a stop request arriving then (a
    # supervisor's SIGTERM racing the pipeline's own end) would kill the
    # process with status -15 instead of letting it exit 0: ignore it.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    for r in runners:
        from reclock.pipeline import progress_line

        sys.stderr.write(scrub(progress_line(r.status())) + "\n")
    if runners.lock_taken is not None:
        sys.stderr.write(scrub(f"reclock: stopped: {runners.lock_taken}") + "\n")
        return 2
    if runners.stalled:
        sys.stderr.write(f"reclock: stopped; stalled at the end: {', '.join(runners.stalled)}\n")
        return 1
    sys.stderr.write("reclock: stopped\n")
    return 0


def _running_driver(state_dir: Path) -> PipelineStatus | None:
    """The document (``status.json``) of the driver running in
    ``state_dir``; ``None``: there is none, its process is gone, or its run
    ended (its process may live on: an embedding app)."""
    from reclock.runtime.status import PipelineStatus

    try:
        doc: dict[str, Any] = json.loads((state_dir / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    pid = doc.get("pid")
    try:
        if pid:
            os.kill(int(pid), 0)
    except OSError:
        return None
    return None if doc.get("stopped") else PipelineStatus.from_json(doc)


def _whole(lv: dict[str, Any] | None) -> bool:
    """Whether a runner's status describes its source whole (it opened)."""
    from reclock.runtime.status import SourceStatus

    return lv is not None and SourceStatus.from_json(lv).whole


def collect_status(file: str, history: int = 0) -> dict[str, Any]:
    """What ``reclock status`` shows: per source, its
    :class:`~reclock.runtime.status.SourceStatus`, live or durable. While
    the driver runs, a running source's is its runner's, read from
    ``status.json`` (also given whole as ``live``): the same one
    ``/status.json`` and ``/metrics`` render, so every view agrees.
    Otherwise it is built from durable state (the remap store and the sinks).
    The pipeline's objects (sources, sinks, the store) are built only for
    what is not running: the status of a running driver needs the file and
    status.json, not the data plane's imports."""
    from reclock.config.loader import drop_marker, quick_view
    from reclock.core.clock import SystemClock
    from reclock.runtime.progress_log import tail
    from reclock.runtime.status import SourceStatus

    # A driver running this very file (its status has the file's fingerprint)
    # validated it, and its runners describe every source whole: then the file
    # is only read, not validated (that builds every model: a second or more).
    cfg: Any = None
    view = quick_view(file)
    live = None if view is None else _running_driver(view.state_dir)
    live_by = {} if live is None else live.by_source()
    if (view is not None and live is not None and live.config == view.fingerprint
            and all(n in live_by and live_by[n].whole for n in view.sources)):
        state_dir, names = view.state_dir, list(view.sources)
    else:
        cfg = _load(file)
        state_dir, names = Path(cfg.state_dir), [s.name for s in cfg.sources]
        if view is None or state_dir != view.state_dir:
            live = _running_driver(state_dir)
            live_by = {} if live is None else live.by_source()
    out: dict[str, Any] = {"state_dir": str(state_dir), "driver_running": live is not None,
                           "sources": []}
    if live is not None:
        out["status_updated_ms"] = live.updated_ms
        out["http"] = live.http
    pipe: Any = None
    try:
        for name in names:
            lv = live_by.get(name)
            st = lv
            if lv is None or not lv.whole:  # read from durable state
                if pipe is None:
                    from reclock.pipeline import Pipeline

                    pipe = Pipeline(cfg)
                    shards = set(pipe.store.shards())
                built = pipe.build_source(cfg.source(name))
                st = SourceStatus.from_durable(
                    name, built.source,
                    lambda: pipe.store.read(name) if name in shards else None,  # noqa: B023
                    [(o.key, o.sink.state) for o in built.outputs], SystemClock().now(),
                    live=lv)
            assert st is not None
            if drop_marker(state_dir, name).exists():
                st = dataclasses.replace(st, health={"status": "dropped"})
            out["sources"].append(st.view_json(
                live=lv, history=(tail(state_dir / "progress.jsonl", history, name)
                                  if history else None)))
    finally:
        if pipe is not None:
            pipe.close()
    return out


def status_exit_code(doc: dict[str, Any]) -> int:
    """``reclock status``'s exit code (the table in the module's docstring):
    3 when the driver is not running, 1 when a source or an output is
    stalled, else 0."""
    if not doc["driver_running"]:
        return 3
    for s in doc["sources"]:
        if s["health"].get("status") == "stalled" or any(
                (o.get("health") or {}).get("status") == "stalled" for o in s["outputs"]):
            return 1
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from reclock.runtime.snapshot_progress import describe as describe_snapshot

    doc = scrub_data(collect_status(args.file, args.history))
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
        return status_exit_code(doc)
    print(f"state: {doc['state_dir']}  driver: {'running' if doc['driver_running'] else 'stopped'}")
    for s in doc["sources"]:
        h = s["health"]
        err = f" -- {h['error']}" if h.get("error") else ""
        hint = f" (hint: {h['hint']})" if h.get("hint") else ""
        print(f"source {s['source']} [{s['kind']}]: {h['status']}{err}{hint}")
        print(f"  from upper:   {render_frontier(s['kind'], s['bound'])}")
        resume = s["resume"]  # a frontier, or why it is unavailable
        print(f"  resume upper: "
              f"{resume if isinstance(resume, str) else render_frontier(s['kind'], resume)}"
              f"  (IntoTime {fmt_time(s['resume_into'])})")
        print(f"  bindings: {s['bindings']}, remap upper {fmt_time(s['remap_upper'])}")
        for o in s["outputs"]:
            what = (f"output {o['name']}" if o.get("sink") is None else
                    f"output {o['name'][:-len(o['sink']) - 1]} sink {o['sink']}")
            if not o["upper"] and o["upper"] is not None:
                print(f"  {what}: nothing committed yet")
            else:
                print(f"  {what}: sink upper {fmt_time(o['upper'])}, "
                      f"lag {o['lag_ms'] if o['lag_ms'] is not None else '-'} ms")
            oh = o.get("health") or {}
            if oh.get("status") == "stalled" and oh.get("error"):
                print(f"    stalled: {oh['error']}"
                      + (f" (hint: {oh['hint']})" if oh.get("hint") else ""))
            snap = describe_snapshot(o["name"], o.get("snapshot"))
            if snap is not None:  # while the output's initial snapshot is read
                print(f"    {snap}")
        for ev in s.get("history", []):
            print(f"    {fmt_time(ev['ts'])} {ev['kind']} "
                  + " ".join(f"{k}={v}" for k, v in ev.items()
                             if k not in ("ts", "kind", "source")))
    return status_exit_code(doc)


def cmd_bindings(args: argparse.Namespace) -> int:
    from reclock.pipeline import Pipeline

    pipe = Pipeline(_load(args.file))
    try:
        pipe.source_config(args.source)
        if args.at is not None:
            b = pipe.store.read(args.source)
        else:  # shown as stored: not decoded (seconds at 2,048 partitions)
            kind, since, upper, encoded = pipe.store.read_encoded(args.source)
        # a multi-topic Kafka source's partition ids: id -> [topic, partition]
        ids = {c: json.loads(n) for n, c in pipe.store.coordinates(args.source).items()}
    finally:
        pipe.close()
    # ([topic, partition, topic id] for a topic's re-created incarnations)
    legend = ("  partition ids: " + ", ".join(
        f"{c} = {n[0]}/{n[1]}" + (f" (topic id {n[2]})" if len(n) > 2 else "")
        for c, n in sorted(ids.items())) if ids else None)
    if args.at is not None:
        t = parse_time(args.at)
        f = b.frontier_at(t)
        enc = None if f is None else f.encode()
        if args.json:
            print(json.dumps({"at": t, "frontier": enc, **_ids_json(ids)}))
        else:
            shown = render_frontier(b.kind, enc) if f is not None else "before the first binding"
            print(f"at {fmt_time(t)}: {shown}")
            if legend:
                print(legend)
        return 0
    if args.json:
        print(json.dumps({
            "source": args.source, "kind": kind, "since": since, "upper": upper,
            "bindings": [{"time": t, "frontier": enc} for t, enc in encoded], **_ids_json(ids),
        }))
        return 0
    print(f"source {args.source} [{kind}] since {fmt_time(since)}, "
          f"upper {fmt_time(upper)}, {len(encoded)} bindings")
    for t, enc in encoded:
        print(f"  {fmt_time(t)} -> {render_frontier(kind, enc)}")
    if legend:
        print(legend)
    return 0


def _ids_json(ids: dict[int, Any]) -> dict[str, Any]:
    return {"partition_ids": {str(c): v for c, v in sorted(ids.items())}} if ids else {}


def cmd_read(args: argparse.Namespace) -> int:
    from reclock.pipeline import Pipeline
    from reclock.runtime.reading import choose_as_of, read_output

    if args.csv and len(args.outputs) > 1:
        raise ReclockError("--csv takes one output (each has its own columns and header); "
                           "run read once per output, or use --json")
    cfg = _load(args.file)
    pipe = Pipeline(cfg)
    try:
        targets = []
        for name in args.outputs:
            targets.append(_find_output(pipe, name, args.sink))
        # every state before any log: the as-of is complete in all of them
        as_of = choose_as_of([(f"{src}.{o.key}", o.sink.state()) for src, o in targets],
                             None if args.as_of is None else parse_time(args.as_of))
        for src, o in targets:
            table = read_output(o, as_of, "errors" if args.errors else "collection")
            _print_table(f"{src}.{o.key}", as_of, table, args)
    finally:
        pipe.close()
    return 0


def _find_output(pipe: Any, name: str, sink: str | None = None) -> tuple[str, Any]:
    """The source and the slot of output ``name`` (``OUTPUT`` or
    ``SOURCE.OUTPUT``) whose sink is ``sink``: required for an output with
    several sinks (an error lists their names), optional for one with one."""
    matches = []
    for src in pipe.cfg.sources:
        for o in src.outputs:
            if name in (o.name, f"{src.name}.{o.name}"):
                matches.append(src)
    if not matches:
        raise ReclockError(f"no output named {name!r} (use SOURCE.OUTPUT)")
    if len(matches) > 1:
        raise ReclockError(f"output name {name!r} is ambiguous; use SOURCE.OUTPUT")
    src = matches[0]
    built = pipe.build_source(src)
    oname = name.split(".", 1)[1] if name.startswith(src.name + ".") else name
    slots = [o for o in built.outputs if o.name == oname]
    names = ", ".join(o.sink_name for o in slots)
    if sink is None:
        if len(slots) > 1:
            raise ReclockError(f"output {src.name}.{oname} has several sinks ({names}): "
                               "say which one to read with --sink NAME")
        return src.name, slots[0]
    found = [o for o in slots if o.sink_name == sink]
    if not found:
        raise ReclockError(f"output {src.name}.{oname} has no sink {sink!r}; its sinks: "
                           f"{names}")
    return src.name, found[0]


def _print_table(label: str, as_of: int | None, table: pa.Table, args: argparse.Namespace) -> None:
    from reclock.contracts.encoding import py_rows

    rows = py_rows(table.slice(0, args.limit) if args.limit else table)
    if args.json:
        for r in rows:
            print(json.dumps({"output": label, "as_of": as_of, **r}, default=str))
        return
    if args.csv:
        w = csv.writer(sys.stdout)
        w.writerow(table.column_names)
        for r in rows:
            w.writerow([r[c] for c in table.column_names])
        return
    print(f"# {label} as of {fmt_time(as_of) if as_of is not None else 'the end'}: "
          f"{table.num_rows} rows")
    for r in rows:
        print("  " + ", ".join(f"{k}={v}" for k, v in r.items()))


def cmd_drop(args: argparse.Namespace) -> int:
    from reclock.pipeline import Pipeline

    pipe = Pipeline(_load(args.file))
    try:
        pipe.request_drop(args.source)
        released = pipe.release_upstream(args.source)
    finally:
        pipe.close()
    print(f"source {args.source} dropped: a running driver stops it within a second; "
          "its outputs are kept" + (f"; {released}" if released else ""))
    return 0


def cmd_undrop(args: argparse.Namespace) -> int:
    from reclock.pipeline import Pipeline

    pipe = Pipeline(_load(args.file))
    try:
        pipe.undrop(args.source)
    finally:
        pipe.close()
    print(f"source {args.source} undropped: the next run resumes it from its outputs' "
          "frontier (a running driver does not restart it)")
    return 0


def cmd_accept_recreated(args: argparse.Namespace) -> int:
    from reclock.pipeline import Pipeline

    pipe = Pipeline(_load(args.file))
    try:
        print(pipe.accept_recreated(args.source, args.topic))
    finally:
        pipe.close()
    return 0


def cmd_resnapshot(args: argparse.Namespace) -> int:
    from reclock.pipeline import Pipeline

    pipe = Pipeline(_load(args.file))
    try:
        pipe.request_resnapshot(args.source, args.output)
    finally:
        pipe.close()
    print(f"output {args.output} of source {args.source}: re-snapshot requested; a running "
          "driver takes it up within a tick (otherwise the next run does): its table is read "
          "under a new snapshot (a topic or generator: its records are read again), and what "
          "the output holds is corrected to match in one commit")
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    from reclock.load import load

    out = load(_load(args.file), args.source, args.output, args.source_url, args.format,
               args.force, True if args.wait else None, args.timeout)
    print(out.line(args.output), flush=True)
    return 0 if out.signal is None else 128 + out.signal  # interrupted: cancelled


def cmd_verify(args: argparse.Namespace) -> int:
    from reclock.verify import verify_pipeline

    reports = verify_pipeline(_load(args.file), sink=args.sink)
    bad = sum(0 if r.ok else 1 for r in reports)
    if args.json:
        print(json.dumps([{
            "source": r.source, "ok": r.ok, "complete_checked": r.complete_checked,
            "notes": r.notes,
            "outputs": [{"output": o.output, "rows": o.rows, "errors": o.errors,
                         "checked": o.checked, "compacted": o.compacted,
                         "breaches": o.breaches, "samples": o.samples,
                         "checks": dict(o.ordered(o.checks)),
                         "unchecked": dict(o.ordered(o.unchecked))} for o in r.outputs],
        } for r in reports], default=str))
        return 1 if bad else 0
    for r in reports:
        checked = sum(o.checked for o in r.outputs)
        if r.ok and not checked and not r.complete_checked:
            print(f"source {r.source}: nothing to audit yet (no output holds a row)")
        else:
            print(f"source {r.source}: {'OK' if r.ok else 'BREACH'}"
                  f" ({r.complete_checked} source records re-read)")
        for n in r.notes:
            print(f"  note: {n}")
        for o in r.outputs:
            status = ", ".join(f"{k}={v}" for k, v in o.breaches.items()) or "ok"
            print(f"  output {o.output}: {o.rows} rows ({o.errors} errors), {o.checked} checked "
                  f"against bindings, {o.compacted} below since: {status}")
            for k, sample in o.samples.items():
                print(f"    {k}: e.g. {sample}")
            if o.checks:
                print("    checked: " + ", ".join(
                    f"{c} ({what})" if what else c for c, what in o.ordered(o.checks)))
            for c, why in o.ordered(o.unchecked):
                print(f"    not checked: {c}: {why}")
    return 1 if bad else 0


def cmd_dev_kafka(args: argparse.Namespace) -> int:
    from reclock.devkafka import serve

    serve(args.brokers, args.topic, args.partitions)
    return 0


def version_line() -> str:
    """``reclock X (PySpark Y, Python Z)``, from the installed distributions."""
    from reclock.metrics import versions

    ours, pyspark, python = versions()
    return f"reclock {ours} (PySpark {pyspark}, Python {python})"


class _VersionAction(argparse.Action):
    """``--version``: the line is made when asked for (it reads installed
    distributions through the metrics module; every other command would pay
    for the Prometheus client's import)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(version_line())  # (on stdout, as argparse's own version action)
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(prog="reclock", description=doc.split("\n\n", 1)[0],
                                epilog=doc.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True)
    file_help = "the pipeline's YAML file"
    ck = sub.add_parser("check", help="check the pipeline file, starting nothing")
    ck.add_argument("file", help=file_help)
    ck.set_defaults(fn=cmd_check)
    r = sub.add_parser("run", help="run the pipeline")
    r.add_argument("file", help=file_help)
    r.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    r.set_defaults(fn=cmd_run)
    s = sub.add_parser("status", help="health, frontiers, uppers and lag")
    s.add_argument("file", help=file_help)
    s.add_argument("--json", action="store_true", help="the whole status document as JSON")
    s.add_argument("--history", type=int, default=0, help="show the last N progress events")
    s.set_defaults(fn=cmd_status)
    b = sub.add_parser("bindings", help="a source's bindings IntoTime -> frontier")
    b.add_argument("file", help=file_help)
    b.add_argument("source", help="the source's name")
    b.add_argument("--json", action="store_true", help="as JSON")
    b.add_argument("--at", default=None, help="the source frontier as of this IntoTime "
                                              "(milliseconds or ISO-8601)")
    b.set_defaults(fn=cmd_bindings)
    rd = sub.add_parser("read", help="consolidated outputs as of one IntoTime")
    rd.add_argument("file", help=file_help)
    rd.add_argument("outputs", nargs="+", help="OUTPUT or SOURCE.OUTPUT, one or more")
    rd.add_argument("--sink", metavar="NAME",
                    help="which sink of an output with several (sinks: [...]) to read; "
                         "required for those")
    rd.add_argument("--as-of", default=None,
                    help="the IntoTime to read as of (milliseconds or ISO-8601; default: "
                         "the latest time every named output holds)")
    rd.add_argument("--errors", action="store_true", help="show the error collection")
    rd.add_argument("--limit", type=int, default=0, help="at most N rows per output (0: all)")
    g = rd.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help="one JSON object per row")
    g.add_argument("--csv", action="store_true", help="CSV with a header (one output only)")
    rd.set_defaults(fn=cmd_read)
    d = sub.add_parser("drop", help="stop a source promptly; keep its outputs")
    d.add_argument("file", help=file_help)
    d.add_argument("source", help="the source's name")
    d.set_defaults(fn=cmd_drop)
    u = sub.add_parser("undrop", help="bring a dropped source back at the next run")
    u.add_argument("file", help=file_help)
    u.add_argument("source", help="the source's name")
    u.set_defaults(fn=cmd_undrop)
    rs = sub.add_parser("resnapshot", help="read one output's upstream again (a table under "
                        "a new snapshot, a topic while retention holds it) and correct the "
                        "output to match (heals a damaged output)")
    rs.add_argument("file", help=file_help)
    rs.add_argument("source", help="the source's name")
    rs.add_argument("output", help="the output's name")
    rs.set_defaults(fn=cmd_resnapshot)
    ac = sub.add_parser("accept-recreated", help="a topic of a source was deleted and "
                        "re-created: read the new topic from its first record (after the old "
                        "one's) from the next open on")
    ac.add_argument("file", help=file_help)
    ac.add_argument("source", help="the source's name")
    ac.add_argument("topic", help="the re-created topic")
    ac.set_defaults(fn=cmd_accept_recreated)
    ld = sub.add_parser("load", help="load CSV, JSON-lines or Parquet files into an output of "
                        "a oneshot source at one IntoTime, once (waits when a driver runs)")
    ld.add_argument("file", help=file_help)
    ld.add_argument("source", help="the oneshot source's name")
    ld.add_argument("output", help="the output's name")
    ld.add_argument("--from", dest="source_url", required=True,
                    help="a file, directory or glob, s3://bucket/key (prefix/ or glob), or an "
                         "http(s) URL")
    ld.add_argument("--format", choices=["csv", "jsonl", "parquet"], default=None,
                    help="the files' format (default: the source's)")
    ld.add_argument("--force", action="store_true", help="load again what was loaded")
    ld.add_argument("--wait", action="store_true",
                    help="wait for the load even when no driver runs yet")
    ld.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait at most")
    ld.set_defaults(fn=cmd_load)
    v = sub.add_parser("verify", help="audit outputs against the bindings")
    v.add_argument("file", help=file_help)
    v.add_argument("--json", action="store_true", help="the reports as JSON")
    v.add_argument("--sink", metavar="NAME",
                   help="only the sinks of this name (default: every sink of every output)")
    v.set_defaults(fn=cmd_verify)
    dev = sub.add_parser("dev", help="development helpers")
    dsub = dev.add_subparsers(dest="dev_command", required=True)
    dk = dsub.add_parser("kafka", help="run a local Kafka-protocol mock broker in the foreground")
    dk.add_argument("--brokers", type=int, default=1)
    dk.add_argument("--topic", action="append", default=[], help="create this topic (repeatable)")
    dk.add_argument("--partitions", type=int, default=4)
    dk.set_defaults(fn=cmd_dev_kafka)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    install_log_filter()  # (cmd_run installs it again on the handler it adds)
    try:
        rc: int = args.fn(args)
        return rc
    except ReclockError as exc:
        sys.stderr.write(f"reclock: {scrub(str(exc))}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
