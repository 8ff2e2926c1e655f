"""Raw confluent-kafka consumer of ``bench/peer_bench.py``: the Python floor.

    python raw_consumer.py --bootstrap HOST:PORT --topic events --partitions 32 \
        --records N [--json] [--props JSON] [--steady-from 0.25]

Assigns every partition from offset 0 (no consumer group coordination, no
commits, no output) and calls ``Consumer.consume(num_messages=10000)`` until
``--records`` messages arrived; with ``--json`` it also ``json.loads`` each
value. Prints one JSON line: the wall time (``time.time()``) of the first
message, of the first batch that brings the count to ``--steady-from`` of
the records (with that count), and of the last, so the benchmark can compute
the start-up and the steady-state rate like it does for the other contenders.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from confluent_kafka import Consumer, TopicPartition


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", default="events")
    ap.add_argument("--partitions", type=int, required=True)
    ap.add_argument("--records", type=int, required=True)
    ap.add_argument("--json", action="store_true", help="json.loads every value")
    ap.add_argument("--props", default="{}", help="extra librdkafka settings (JSON)")
    ap.add_argument("--steady-from", type=float, default=0.25,
                    help="the steady phase starts at this share of the records")
    args = ap.parse_args()
    conf = {"bootstrap.servers": args.bootstrap, "group.id": "raw-peer",
            "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "enable.partition.eof": False, **json.loads(args.props)}
    c = Consumer(conf)
    c.assign([TopicPartition(args.topic, p, 0) for p in range(args.partitions)])
    loads = json.loads
    n = 0
    first = mark = mark_n = None
    ids = 0
    while n < args.records:
        msgs = c.consume(num_messages=10_000, timeout=1.0)
        good = 0
        for m in msgs:
            if m.error() is not None:
                continue
            good += 1
            if args.json:
                ids += loads(m.value())["id"]
        if good and first is None:
            first = time.time()
        n += good
        if good and mark is None and n >= args.steady_from * args.records:
            mark, mark_n = time.time(), n
    done = time.time()
    c.close()
    json.dump({"first": first, "mark": mark, "mark_n": mark_n, "done": done, "n": n,
               "ids": ids}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
