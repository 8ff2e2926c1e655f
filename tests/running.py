"""Running a pipeline in a background thread of the test process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from reclock.driver import SourceRunner
from reclock.pipeline import run


@contextmanager
def running(cfg: Any, spark: Any) -> Iterator[list[SourceRunner]]:
    """Run ``cfg`` on ``spark`` until the block ends; yields the runners."""
    stop = threading.Event()
    runners: list[SourceRunner] = []
    t = threading.Thread(target=run, kwargs=dict(
        cfg=cfg, spark=spark, stop=stop, out=None, install_signals=False,
        on_ready=runners.extend))
    t.start()
    try:
        wait_for(lambda: bool(runners), what="the source loops to start")
        yield runners
    finally:
        stop.set()
        t.join(timeout=60)


def wait_for(cond: Callable[[], bool], timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
