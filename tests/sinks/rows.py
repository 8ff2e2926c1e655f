"""Row builders and cross-process helpers for the sink tests.

The racing-committer functions live here (not in a test module) so that
``multiprocessing`` with ``spawn`` can import them in a fresh interpreter.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from reclock.contracts.rows import output_schema
from reclock.contracts.sink import SinkFenced, SinkState
from reclock.sinks.delta import DeltaSink

USER = pa.schema([("k", pa.string()), ("v", pa.int64())])
SCHEMA = output_schema(USER)


def updates(
    keys: list[str],
    into_time: int,
    *,
    diff: int = 1,
    offset: int = 0,
    part: int = 0,
    error: str | None = None,
) -> pa.Table:
    """Rows of :data:`SCHEMA`: one per key, at consecutive source offsets."""
    n = len(keys)
    return pa.table(
        {
            "k": keys,
            "v": list(range(offset, offset + n)),
            "_into_time": [into_time] * n,
            "_diff": [diff] * n,
            "_src_part": pa.array([part] * n, pa.int32()),
            "_src_offset": list(range(offset, offset + n)),
            "_src_seq": pa.array([0] * n, pa.int32()),
            "_src_ts": pa.array([None] * n, pa.int64()),
            "_error": pa.array([error] * n, pa.string()),
            "_raw_key": pa.array([None] * n, pa.binary()),
            "_raw_value": pa.array([b"raw"] * n, pa.binary()),
        },
        schema=SCHEMA,
    )


def race_commits(
    path: str, name: str, lock: bool, who: int, rounds: int, barrier: Any, results: Any
) -> None:
    """One racing committer: every round, read the state, stage a row of its
    own, wait for the others, commit with that state as ``expected``.

    The second barrier closes the round, so every racer reads the state only
    after all commits of the previous round are done: all racers of a round
    hold the same ``expected``. ``results`` is a queue (thread or process).
    """
    sink = DeltaSink(name, path, lock=lock)
    for r in range(rounds):
        expected = sink.state()
        staged = sink.stager().stage(f"w{who}-r{r}", 0, updates([f"w{who}r{r}"], r))
        barrier.wait()
        try:
            sink.commit(staged, expected, SinkState(r + 1, f'"w{who}r{r}"'))
            outcome = "ok"
        except SinkFenced:
            outcome = "fenced"
        results.put((r, who, outcome))
        barrier.wait()
