"""The pipeline on a real Spark standalone cluster (a master and a worker from
the installed PySpark, executors in their own JVMs): a generator and a Kafka
source, the driver killed and restarted, an executor killed mid-run. The
outputs equal those of the same pipeline on ``local[2]``, and ``reclock
verify`` is clean."""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from reclock.config import load_config
from reclock.contracts.consolidate import consolidate
from reclock.pipeline import Pipeline
from reclock.verify import verify_pipeline
from tests.running import (
    close_driver,
    counter_source,
    running,
    start_driver,
    stop_driver,
    wait_for,
    wait_running,
)
from tests.sparkcluster import SparkCluster

TOTAL = 120_000
PRODUCED = 20_000

PIPELINE = """
state_dir: {state}
timestamp_interval: 250ms
spark:
  master: {master}
  max_records_per_job: 20000
  max_records_per_task: 5000
  conf:
    spark.executor.memory: 1g
    spark.cores.max: 2
    spark.driver.extraJavaOptions: "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
sources:
{counter}
  - name: events
    kafka: {{bootstrap_servers: "{bootstrap}", topic: {topic}, timeout: 5s}}
    outputs:
      - name: events
        format: {{type: json, schema: {{id: int64}}}}
        sink: file
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[SparkCluster]:
    c = SparkCluster().start()
    try:
        yield c
    finally:
        c.stop()


def _status(state: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((state / "status.json").read_text()))
    except (OSError, ValueError):
        return {"sources": []}


def _events_held(cfg: Any) -> int:
    pipe = Pipeline(cfg)
    src = pipe.source_config("events")
    sink = pipe.sink(src, src.output("events"))
    return int(sink.read_updates().num_rows)


def _done(cfg: Any) -> bool:
    st = _status(Path(cfg.state_dir))
    finished = {s["source"] for s in st["sources"] if s["health"]["status"] == "finished"}
    return "counter" in finished and _events_held(cfg) >= PRODUCED


def _collection(cfg: Any, source: str, output: str, cols: list[str]) -> list[tuple[Any, ...]]:
    pipe = Pipeline(cfg)
    src = pipe.source_config(source)
    t = consolidate(pipe.sink(src, src.output(output)).read_updates(), None, cols)
    return sorted(zip(*(t.column(c).to_pylist() for c in [*cols, "_count"]), strict=True))


@pytest.mark.timeout(600)
def test_standalone_cluster_driver_and_executor_kills(
        tmp_path: Path, cluster: SparkCluster, kafka: Any, spark: Any) -> None:
    topic = f"cluster-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 4)
    p = Producer({"bootstrap.servers": kafka.bootstrap, "linger.ms": 5})
    for i in range(PRODUCED):
        p.produce(topic, key=str(i).encode(), value=json.dumps({"id": i}).encode(),
                  partition=i % 4)
    assert p.flush(30) == 0
    state = tmp_path / "state"
    path = tmp_path / "cluster.yaml"
    path.write_text(PIPELINE.format(state=state, master=cluster.master, total=TOTAL,
                                    bootstrap=kafka.bootstrap, topic=topic,
                                    counter=counter_source(15000, TOTAL, 97)))
    cfg = load_config(path)
    # 1. the driver dies mid-run
    proc = start_driver(path)
    assert wait_running(state, proc, timeout=120)
    wait_for(lambda: any((s.get("records") or 0) > 10_000 for s in _status(state)["sources"]),
             120, "data on the cluster")
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    close_driver(proc)
    # 2. a new driver resumes; one of its executors dies mid-run
    proc = start_driver(path)
    try:
        assert wait_running(state, proc, timeout=120)
        wait_for(lambda: bool(cluster.executor_pids()), 120, "an executor")
        victims = cluster.executor_pids()
        wait_for(lambda: (_status(state)["sources"] or [{}])[0].get("records", 0) > 2_000, 120,
                 "the resumed driver to read")
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: bool(set(cluster.executor_pids()) - set(victims)), 120,
                 "the worker to launch a new executor")
        wait_for(lambda: _done(cfg), 240, "the pipeline to finish on the cluster")
    finally:
        rc, err = stop_driver(proc, timeout=90)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    # the executors ran the driver's shipped copy of reclock (addPyFile)
    shipped = list((cluster.dir / "work").glob("app-*/*/reclock_packages.zip"))
    assert len({p.parent for p in shipped}) >= 2, shipped  # the killed executor and its successor
    reports = verify_pipeline(cfg)
    for r in reports:
        assert r.ok, (r.source, [(o.output, o.breaches, o.samples) for o in r.outputs])
    assert {r.source: r.complete_checked for r in reports} == {"counter": TOTAL,
                                                               "events": PRODUCED}
    # the same pipeline on local[2] gives the same outputs
    local_path = tmp_path / "local.yaml"
    local_path.write_text(PIPELINE.format(state=tmp_path / "local", master="local[2]",
                                          total=TOTAL, bootstrap=kafka.bootstrap, topic=topic,
                                          counter=counter_source(15000, TOTAL, 97)))
    local = load_config(local_path)
    with running(local, spark):
        wait_for(lambda: _done(local), 240, "the local run")
    for source, output, cols in (("counter", "value", ["n", "payload"]),
                                 ("events", "events", ["id"])):
        assert _collection(cfg, source, output, cols) == _collection(local, source, output, cols)
