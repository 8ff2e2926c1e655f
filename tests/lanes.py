"""Two lanes for the test run (pytest-xdist, ``-n 2`` in pyproject.toml).

A serial run kept this 2-core machine about 40% idle on average (vmstat
over a whole ``.ci/run``): many tests wait on a driver process, a broker or
a database, and a Python test process uses one core. The tests now run in
two worker processes, split so that the run still starts **one Spark session
and one Kafka broker**:

* the *peer lane* (worker ``gw0``) runs every test that uses the ``spark``
  session or the ``kafka`` broker fixture, in collection order; nothing else
  starts either, and the tests that take the broker down do so while no
  other test uses it;
* every other test is handed out to whichever worker has room (xdist's load
  scheduling): worker ``gw1`` from the start, ``gw0`` once its lane is done.

Each worker starts the databases its own tests use (the PostgreSQL cluster,
MariaDB, the S3 endpoint), so there can be two of those; no test shares
anything with a test of the other worker but the machine.

The workers tell the controller which tests are in the peer lane through a
file (``lanes_dir`` in the worker input): test ids stay as pytest names them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

#: The fixtures whose peer exists once per run: their tests share a worker.
PINNED = frozenset({"spark", "kafka"})

#: The worker that runs the pinned lane.
PEER_WORKER = "gw0"


def pinned(item: pytest.Item) -> bool:
    return bool(PINNED & set(getattr(item, "fixturenames", ())))


def worker_id(config: pytest.Config) -> str | None:
    """``gw0``, ``gw1``, ...; None outside xdist's workers."""
    inp = getattr(config, "workerinput", None)
    return None if inp is None else str(inp["workerid"])


def runs_here(config: pytest.Config, items: Iterable[pytest.Item]) -> list[pytest.Item]:
    """The items this process may run: all of them without xdist; on a
    worker, its lane's (the peer worker also takes others at the end, whose
    peers it then starts on first use)."""
    wid = worker_id(config)
    items = list(items)
    if wid is None:
        return items
    return [i for i in items if pinned(i) == (wid == PEER_WORKER)]


def once_per_run(config: pytest.Config) -> bool:
    """Whether this process does the run's one-off work: outside xdist, or
    on the last worker (the one the peer lane does not keep busy)."""
    inp = getattr(config, "workerinput", None)
    return inp is None or inp["workerid"] == f"gw{int(inp['workercount']) - 1}"


def publish(config: pytest.Config, items: Sequence[pytest.Item]) -> None:
    """A worker writes the ids of the pinned tests for the controller."""
    inp = getattr(config, "workerinput", None)
    if inp is None or "lanes_dir" not in inp:
        return
    path = Path(inp["lanes_dir"]) / f"{inp['workerid']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([i.nodeid for i in items if pinned(i)]))
    tmp.replace(path)


def make_scheduler(config: pytest.Config, log: Any, lanes_dir: Path) -> Any:
    """xdist's load scheduling, with the pinned tests sent to the peer
    worker up front and kept off the others."""
    from xdist.scheduler import LoadScheduling

    class Lanes(LoadScheduling):  # type: ignore[misc]
        def schedule(self) -> None:
            assert self.collection_is_completed
            if self.collection is not None:  # a node was added or replaced
                super().schedule()
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = next(iter(self.node2collection.values()))
            # (every worker collected the same tests: any one's file will do)
            first = next(lanes_dir.glob("gw*.json"), None)
            ids = set() if first is None else set(json.loads(first.read_text()))
            pins = [i for i, nid in enumerate(self.collection) if nid in ids]
            self.pending[:] = [i for i, nid in enumerate(self.collection) if nid not in ids]
            if self.maxschedchunk is None:
                self.maxschedchunk = len(self.collection)
            peer = next((n for n in self.nodes if n.gateway.id == PEER_WORKER), None)
            if peer is None:  # not the expected workers: plain load scheduling
                self.pending[:] = range(len(self.collection))
                self.collection = None
                super().schedule()
                return
            if pins:
                self.node2pending[peer].extend(pins)
                peer.send_runtest_some(pins)
            for node in self.nodes:
                if node is not peer:
                    self.check_schedule(node)
            if not self.pending:  # (the peer stops after its lane: check_schedule)
                for node in self.nodes:
                    if node is not peer or not pins:
                        node.shutdown()

        def check_schedule(self, node: Any, duration: float = 0) -> None:
            # The peer worker takes other tests only near the end of its lane.
            if node.gateway.id == PEER_WORKER and len(self.node2pending[node]) > 2:
                return
            super().check_schedule(node, duration)

    return Lanes(config, log)


def lanes_dir() -> Path:
    """A directory for the workers' lane files, made by the controller."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="reclock-lanes-"))
