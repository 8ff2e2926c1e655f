"""Quix Streams peer of ``bench/peer_bench.py``; runs inside the Quix Streams virtualenv.

    python quix_app.py --bootstrap HOST:PORT --topic events --out DIR --group G \
        [--commit-interval 1.0] [--state-dir DIR] [--props JSON]

A stateless ``Application`` (consumer group ``--group``,
``auto_offset_reset="earliest"``, at-least-once, a checkpoint every
``--commit-interval`` seconds) that deserializes each value as JSON and writes
it with Quix's own ``LocalFileSink`` (JSON lines, one file per partition and
checkpoint, written at the checkpoint before the offsets are committed).

librdkafka's mock broker does not answer ``DescribeConfigs`` (nor
``CreateTopics``), and ``Application.topic()`` always asks for the topic's
configuration (``TopicAdmin.inspect_topics``), which then fails after
``request_timeout`` with ``KafkaError{code=_TIMED_OUT,val=-185,str="Failed
while waiting for controller: Local: Timed out"}``. This script therefore
replaces ``TopicAdmin.inspect_topics`` with a metadata-only version (partition
count from ``list_topics``, replication 1, no extra configs). It is called
once at start-up and nowhere on the data path. ``auto_create_topics=False``
and ``use_changelog_topics=False`` keep Quix from creating topics.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from quixstreams import Application
from quixstreams.models import TopicConfig
from quixstreams.models.topics import admin as topic_admin
from quixstreams.sinks.community.file.local import LocalFileSink


def inspect_topics(self: Any, topic_names: list[str], timeout: float = 30
                   ) -> dict[str, TopicConfig | None]:
    """Metadata only: the mock broker cannot describe topic configs."""
    topics = self.list_topics(timeout=timeout)
    return {name: (TopicConfig(num_partitions=len(topics[name].partitions),
                               replication_factor=1) if name in topics else None)
            for name in topic_names}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", default="events")
    ap.add_argument("--out", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--commit-interval", type=float, default=1.0)
    ap.add_argument("--state-dir", default=None)
    ap.add_argument("--props", default="{}", help="extra librdkafka consumer settings (JSON)")
    ap.add_argument("--no-shim", action="store_true",
                    help="do not replace inspect_topics (shows the mock broker's error)")
    args = ap.parse_args()
    if not args.no_shim:
        topic_admin.TopicAdmin.inspect_topics = inspect_topics  # type: ignore[method-assign]
    app = Application(
        broker_address=args.bootstrap, consumer_group=args.group,
        auto_offset_reset="earliest", commit_interval=args.commit_interval,
        auto_create_topics=False, use_changelog_topics=False, loglevel="WARNING",
        state_dir=args.state_dir, consumer_extra_config=json.loads(args.props),
        request_timeout=10,
    )
    topic = app.topic(args.topic, value_deserializer="json", key_deserializer="bytes")
    sdf = app.dataframe(topic)
    sdf.sink(LocalFileSink(directory=args.out, format="json"))
    app.run()


if __name__ == "__main__":
    main()
