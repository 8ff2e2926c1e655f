"""Bytewax peer of ``bench/peer_bench.py``; runs inside the Bytewax virtualenv.

    python -m bytewax.run bytewax_flow:flow -r RECOVERY_DIR -s 1 -b 0 [-w N | -i I -a ...]

The Kafka topic (every partition from the beginning, ``tail=True``: it keeps
waiting for more, like the other contenders) -> ``json.loads`` of each value ->
``json.dumps`` of the record -> ``DirSink`` (one line per record in
``PEER_FILES`` files, keyed by the Kafka partition). Recovery is on when
``-r`` is given: the Kafka offsets and the files' lengths are snapshotted every
``-s`` seconds, and a restart truncates the files to the last snapshot, so the
output is exactly once. Settings come from the environment (set by the
benchmark): ``PEER_BOOTSTRAP``, ``PEER_TOPIC``, ``PEER_OUT``, ``PEER_FILES``,
``PEER_BATCH`` (messages per ``consume`` call) and ``PEER_PROPS`` (JSON object
of extra librdkafka settings).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from bytewax import operators as op
from bytewax.connectors.files import DirSink
from bytewax.connectors.kafka import KafkaSource
from bytewax.dataflow import Dataflow

FILES = int(os.environ.get("PEER_FILES", "4"))
PROPS = {k: str(v) for k, v in json.loads(os.environ.get("PEER_PROPS", "{}")).items()}


def to_line(msg: Any) -> tuple[str, str]:
    record = json.loads(msg.value)
    return str(msg.partition % FILES), json.dumps(record)


flow = Dataflow("peer_bench")
source = KafkaSource([os.environ["PEER_BOOTSTRAP"]], [os.environ.get("PEER_TOPIC", "events")],
                     tail=True, batch_size=int(os.environ.get("PEER_BATCH", "10000")),
                     add_config=PROPS)
messages = op.input("kafka", flow, source)
lines = op.map("parse", messages, to_line)
op.output("files", lines, DirSink(Path(os.environ["PEER_OUT"]), FILES,
                                  assign_file=lambda key: int(key)))
