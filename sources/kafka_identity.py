"""The identity of a Kafka source's topics, kept with its bindings.

A topic can be deleted and created again under the same name. Its offsets
start from 0 again, so the bindings and the outputs' progress, which speak
of the old topic's offsets, would skip the new topic's first records (those
below the old end) or read them as if they were the old ones. Names are
not identities: Kafka gives every topic a topic id (a UUID) when it is
created, and a re-created topic gets a new one.

So the source keeps, per topic it has read, a record in its remap facts
(``kafka.topic:<name>``, :class:`reclock.contracts.source.Facts`)::

    {"ids": [the id of each incarnation, oldest first],
     "bases": [one topic: each incarnation's first partition id],
     "accept": id accepted by ``reclock accept-recreated``, "base": its first id}

and compares the id it finds with the last one at every probe (the topic's
metadata is described anyway) and after every job, before its commit
(:meth:`KafkaSource.confirm`: one description of the topics the job read; a
topic replaced between the probe that bound a range and the read would
otherwise hand over the new topic's records at the old positions). A record
is written before any binding names the partitions it identifies.

What a changed id means depends on how the topic was named:

* ``topic`` / ``topics``: a definite error (:class:`IdentityChanged`), of
  the source for one topic and of the topic's output for several, naming
  the topic, both ids and the recovery, ``reclock accept-recreated FILE
  SOURCE TOPIC``, after which the new topic is read from its first record
  as a new incarnation;
* ``topic_pattern``: the new topic is a new member of the pattern, read from
  its first record (that is what "every topic matching" means).

An incarnation's partitions get partition ids of their own, above every id
a binding has named, so frontiers only move forward: a one-topic source's
incarnation ``k`` maps partition ``p`` to ``bases[k] + p``; a several-topic
source names its coordinates ``[topic, p]`` for the first incarnation and
``[topic, p, id]`` for later ones. The ids of earlier incarnations keep
their last offsets; a range of one that was bound and not read before the
topic was deleted is skipped with a warning (its records went with it).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from reclock.core.errors import DefiniteError, IdentityChanged

log = logging.getLogger(__name__)

PREFIX = "kafka.topic:"


@dataclass(frozen=True)
class TopicRecord:
    """What the source knows of one topic's incarnations."""

    ids: tuple[str, ...]
    #: one-topic source: the first partition id of each incarnation
    bases: tuple[int, ...] = (0,)
    #: a re-created topic accepted by the user, not taken up yet, and the
    #: first partition id its partitions get (one topic)
    accept: str | None = None
    accept_base: int | None = None

    @property
    def current(self) -> str:
        return self.ids[-1]

    @property
    def incarnation(self) -> int:
        return len(self.ids) - 1

    def encode(self) -> str:
        doc: dict[str, Any] = {"ids": list(self.ids), "bases": list(self.bases)}
        if self.accept is not None:
            doc["accept"] = self.accept
            doc["base"] = self.accept_base
        return json.dumps(doc, sort_keys=True)

    @staticmethod
    def decode(text: str) -> TopicRecord:
        doc = json.loads(text)
        ids = tuple(str(i) for i in doc["ids"])
        bases = tuple(int(b) for b in doc.get("bases") or [0] * len(ids))
        return TopicRecord(ids, bases, doc.get("accept"), doc.get("base"))

    def advanced(self, new_id: str, base: int) -> TopicRecord:
        """The record with ``new_id`` as the current incarnation."""
        return TopicRecord((*self.ids, new_id), (*self.bases, base))


@dataclass
class TopicIdentities:
    """The topic records of one source, read from and written to its facts."""

    source: str
    facts: Any = None  # reclock.contracts.source.Facts, or None: identities not kept
    records: dict[str, TopicRecord] = field(default_factory=dict)
    loaded: bool = False

    def load(self) -> None:
        if self.facts is None:
            self.loaded = True
            return
        records = {}
        for key, text in self.facts.read().items():
            if key.startswith(PREFIX):
                try:
                    records[key[len(PREFIX):]] = TopicRecord.decode(text)
                except (ValueError, KeyError, TypeError):
                    log.warning("source %s: unreadable topic record %s=%r (ignored)",
                                self.source, key, text)
        self.records = records
        self.loaded = True

    def get(self, topic: str) -> TopicRecord | None:
        if not self.loaded:
            self.load()
        return self.records.get(topic)

    def put(self, topic: str, rec: TopicRecord) -> None:
        if self.facts is not None:
            self.facts.write({PREFIX + topic: rec.encode()})
        self.records[topic] = rec

    def accept(self, topic: str, found: str | None, base: int) -> str:
        """Record the user's acceptance of ``topic`` re-created with id ``found``."""
        self.load()
        rec = self.records.get(topic)
        if rec is None:
            raise DefiniteError(f"source {self.source!r} has no record of topic {topic!r}",
                                hint="name a topic the source has read")
        if found is None:
            raise DefiniteError(f"topic {topic!r} does not exist now",
                                hint="create it first, then accept it")
        if found == rec.current:
            raise DefiniteError(
                f"topic {topic!r} is the one source {self.source!r} reads (topic id "
                f"{found}): there is nothing to accept")
        self.put(topic, replace(rec, accept=found, accept_base=base))
        return (f"topic {topic!r} of source {self.source!r}: the re-created topic (id {found}, "
                f"was {rec.current}) is read from its first record by the next open of the "
                "source; records of the old topic that were not read yet are lost with it")


def recreated(source: str, topic: str, old: str, new: str, *, per_output: bool = False
              ) -> IdentityChanged:
    """The definite error of a named topic that was deleted and re-created."""
    return IdentityChanged(
        f"source {source!r}: topic {topic!r} was deleted and re-created (its topic id was "
        f"{old}, it is {new} now): its offsets started again from 0, so the records of the "
        "new topic cannot be told from the old one's by position"
        + ("; the topic's output holds what was read of the old one" if per_output else ""),
        hint=f"to read the new topic from its first record, after the old one's, run "
             f"`reclock accept-recreated FILE {source} {topic}`; or point the source at "
             "the topic it should read")
