"""The settings a source's runtime runs by, declared once: the ``spark``
and ``housekeeping`` blocks of the pipeline file (each field with its
default and its documentation; durations in milliseconds, sizes in bytes,
as everywhere in reclock), and :class:`Settings`, what one source's runner
is handed: those models as the file gives them, and what the pipeline
derives for the source (its interval, its key-state directory). The
configuration schema (:mod:`reclock.config.schema`) takes the blocks from
here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from reclock.contracts.config import DEFAULT_INTERVAL_MS, ByteSize, ConfigModel, DurationMs
from reclock.core.secrets import SPARK_CONF
from reclock.runtime.keystate import CacheShares

#: The longest wait between retries of a stalled source when the file names none.
DEFAULT_MAX_RETRY_BACKOFF_MS = 30_000


def _conf_value(value: Any) -> Any:
    """Spark settings are strings; YAML scalars are accepted (``true`` -> ``"true"``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return value


class SparkConfig(ConfigModel):
    """The Spark session that runs the data plane."""

    master: str = "local[*]"
    """Spark master URL: ``local[*]`` (embedded) or ``spark://host:7077``."""
    app_name: str = "reclock"
    """The Spark application name."""
    conf: Annotated[dict[str, Annotated[str, BeforeValidator(_conf_value)]], SPARK_CONF] = Field(
        default_factory=dict)
    """Extra Spark settings passed straight to ``SparkSession.builder.config``
    (the escape hatch), e.g. ``spark.executor.memory: 2g``; the values of
    those Spark itself redacts (``spark.redaction.regex``: secret, password,
    token, access key, credential) are never printed."""
    max_records_per_job: int = Field(default=1_000_000, gt=0, le=1_000_000_000)
    """Records read by one Spark job at most (a binding's data may take several)."""
    jobs_in_flight: int = Field(default=2, ge=1, le=16)
    """Jobs of one source that read at once when it is far behind: job k+1
    reads while job k finishes and commits, which hides each Spark job's fixed
    cost. Commits stay one job at a time, in order. A Postgres source reads
    one job at a time whatever this says (its slot serves one reader)."""
    max_records_per_task: int = Field(default=200_000, gt=0, le=1_000_000_000)
    """Records read by one Spark task at most. A job is split into at least one
    task per core (so tasks of a full job read at most ``max_records_per_job``
    / cores), and a Kafka task reads several partitions when they are small."""
    job_timeout: DurationMs = Field(default=600_000, ge=1000, le=7 * 24 * 3600 * 1000)
    """A Spark job running longer (``10m``) is cancelled, the source reports
    a stall naming it (``status`` exits non-zero, ``/readyz`` answers 503) and
    reads the range again. A job that never finishes usually means the
    driver ran out of memory taking in a task's result."""
    max_bytes_per_task: ByteSize = Field(default=64 * 2**20, ge=2**20, le=2**40)
    """Bytes of records read by one Spark task at most (``64MiB``), by the
    bytes per record the source's tasks read so far; a task reads one record
    at least. Until a Kafka source's first tasks have reported, they read 4
    records each (a record may be as large as the broker allows). See
    ``bench/big_records_bench.py``."""
    max_bytes_per_stage: ByteSize = Field(default=64 * 2**20, ge=2**20, le=2**40)
    """Bytes of decoded rows staged in one piece at most (``64MiB``): a task
    writes what it decoded out in pieces of this size, and the driver stages
    a keyed output's transaction that spans several jobs in pieces of this
    size, so neither holds more of it in memory at once."""
    shared_jobs_max_records: int = Field(default=20_000, ge=0, le=1_000_000_000)
    """A job of at most this many records (``20000``; 0: never) runs in one
    Spark job with the small jobs of other sources that are waiting at the
    same moment, instead of a Spark job of its own: an empty Spark job costs
    about 0.1 s on two cores, so a hundred sources at a one-second interval
    would queue for Spark. Each source still commits its own outputs, in
    order. The progress log's ``read`` event says how many sources shared the
    job (``shared``)."""
    max_bytes_per_settle: ByteSize = Field(default=32 * 2**20, ge=1, le=2**40)
    """Keyed outputs (upsert, keyed CDC): bytes of decoded intents the driver
    settles against the key state at once (``32MiB``). A job's intents are
    split by a hash of the key, and large ones are written to files under
    ``state_dir/keys/`` by the tasks, so a transaction of millions of rows
    is settled a few key buckets at a time. The key state itself is a SQLite
    file there, reused while it matches the output (see
    :mod:`reclock.runtime.keystate`). Tasks write intents to files only
    with a ``local`` master; on a cluster they travel in the task results
    (through the driver's JVM heap: size ``spark.driver.memory`` for the
    largest job)."""


class HousekeepingConfig(ConfigModel):
    """Periodic clean-up by the driver."""

    vacuum_every: DurationMs = Field(default=60_000, ge=1000, le=24 * 3600 * 1000)
    """How often each source's outputs are checked for orphaned staged files
    (left by failed commits and discarded jobs)."""
    orphan_grace: DurationMs = Field(default=300_000, ge=10_000, le=7 * 24 * 3600 * 1000)
    """A staged file that no commit references is deleted once it is this old
    (the source has no job in flight when the check runs)."""
    remap_retention: DurationMs = Field(default=24 * 3600 * 1000, ge=0, le=30 * 24 * 3600 * 1000)
    """How much binding history the remap store keeps behind where the outputs
    resume, for ``reclock verify`` and ``reclock bindings``: older bindings
    are consolidated into one (0: keep only what resuming needs). The driver
    holds in memory only the bindings from where the outputs resume on."""
    key_state_cache: ByteSize = Field(default=256 * 2**20, ge=2**20)
    """The page cache of the key state of every keyed output (upsert, keyed
    CDC) together (default ``256MiB``): a keyed output keeps the current row
    of each key in a SQLite file under ``state_dir``, and caches its pages
    in memory. The outputs open at a time share it evenly, each at most
    64 MiB and at least 1 MiB, so the driver's memory stays bounded however
    many keys or keyed outputs there are; a smaller cache means more reads
    of the file when large transactions are settled."""
    release_memory: bool = True
    """After an output's maintenance pass (a compaction, expired files), and
    otherwise once a minute, hand the memory the allocators hold free back to
    the system (glibc's ``malloc_trim``, Arrow's pool) instead of keeping it."""



@dataclass(frozen=True)
class Settings:
    """What one source's runner runs by."""

    spark: SparkConfig = field(default_factory=SparkConfig)
    housekeeping: HousekeepingConfig = field(default_factory=HousekeepingConfig)
    #: the source's ``timestamp_interval`` (its own, or the pipeline's)
    timestamp_interval_ms: int = DEFAULT_INTERVAL_MS
    #: the pipeline's ``max_retry_backoff``
    max_retry_backoff_ms: int = DEFAULT_MAX_RETRY_BACKOFF_MS
    #: where keyed outputs keep their key state (SQLite files) and tasks
    #: write large intents; None: the key state lives in memory, rebuilt
    #: from the output at every open
    keys_dir: Path | None = None
    #: the page-cache budget the key stores of the pipeline share (None: a
    #: cache of its own each)
    key_cache: CacheShares | None = None

    @property
    def spill_intents(self) -> bool:
        """Whether tasks write large intents to files under ``keys_dir``:
        only with a ``local`` master, whose tasks run on the driver's machine."""
        return self.spark.master.startswith("local")
