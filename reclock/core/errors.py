"""The error hierarchy: one root, two tiers.

* :class:`TransientError` -- the world may fix itself (a broker is down, a
  database restarts, another writer moved an upper). Callers stall, report the
  health status, and retry with backoff. Never closes a frontier.
* :class:`DefiniteError` -- retrying cannot help (a record does not decode, a
  topic was recreated, a stream breaks the capture protocol). Recorded against
  the record or the output; the message names the object and says what to do.

Every message names *what* was wrong and *where*; secrets never appear in one.
"""

from __future__ import annotations


class ReclockError(Exception):
    """Root of every error raised on purpose by reclock."""

    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base} (hint: {self.hint})" if self.hint else base


class TransientError(ReclockError):
    """A fault that may go away by itself: stall, report, retry with backoff."""


class DefiniteError(ReclockError):
    """A fault that retrying cannot fix: record it where it belongs and go on."""


class AlreadyRunning(DefiniteError):
    """Another driver holds this pipeline's lock. ``holder`` is what that
    driver recorded about itself (pid, host, since), when it could be read."""

    def __init__(self, holder: dict[str, object] | None, where: str) -> None:
        self.holder = holder
        who = f"as {_who(holder)}" if holder else "(its holder has not recorded itself yet)"
        super().__init__(f"this pipeline is already running {who} ({where})",
                         hint="stop that driver first (Ctrl-C or SIGTERM), or wait for it "
                              "to exit; a driver killed with kill -9 holds no lock")


def _who(holder: dict[str, object] | None) -> str:
    if not holder:
        return "a driver that has not recorded itself yet"
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} "
            f"since {holder.get('since', '?')}")


class LockLost(TransientError):
    """This driver's pipeline lock is not held right now (``where``: which
    lock; ``why``: what happened to it): nothing commits until it is taken
    again."""

    def __init__(self, where: str, why: str) -> None:
        self.where, self.why = where, why
        super().__init__(
            f"the driver lock ({where}) is not held: {why}; nothing commits until it is "
            "taken again",
            hint="reclock takes it again as soon as the store answers; if another driver "
                 "of this pipeline takes it first, this one stops")


class LockTaken(DefiniteError):
    """This driver lost its pipeline lock and another driver took it
    meanwhile: that one carries on, this one stops for good."""

    def __init__(self, holder: dict[str, object] | None, where: str, why: str) -> None:
        self.holder, self.where, self.why = holder, where, why
        super().__init__(
            f"the driver lock ({where}) was lost ({why}) and is now held by {_who(holder)}: "
            "this driver stops and commits nothing more",
            hint="the other driver runs the pipeline now; stop one of the two for good "
                 "(two drivers must not be started for one pipeline)")


class InvalidTimeError(DefiniteError, ValueError):
    """A timestamp or frontier could not be decoded or is out of range."""


class BindingError(DefiniteError):
    """Bindings that would break monotonicity or the half-open interval rules."""


class FrontierRegression(BindingError):
    """A source's probed frontier went backwards (e.g. a recreated Kafka topic)."""


class IdentityChanged(DefiniteError):
    """An object the pipeline depends on was replaced behind its back under the
    same name: a topic deleted and re-created, a sink's progress record removed
    or rolled back. Never skipped or replayed silently: the message names the
    object, what was known and what is found, and the hint the recovery."""


class UpperMismatch(TransientError):
    """``compare_and_append`` found the store's upper elsewhere than expected.

    ``actual`` carries the upper the store really has, so the writer can re-read
    what the other writer appended and carry on from there.
    """

    def __init__(self, shard: str, expected: object, actual: object) -> None:
        self.shard = shard
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"remap shard {shard!r}: expected upper {expected}, found {actual}",
            hint="another writer appended bindings; re-read the store and continue",
        )


class SinceViolation(DefiniteError):
    """A read or compaction asked for history below a shard's ``since``."""


class ShardNotFound(DefiniteError):
    """The remap store holds no shard of that name."""


class Reopen(TransientError):
    """The source must be opened again: durable state re-read, outputs
    described anew (an upstream schema change to evolve into, a lost snapshot
    to take again). The driver re-opens and carries on from durable state."""


class SchemaChanged(Reopen):
    """A record names a writer schema that changes the output's shape, and
    the output evolves (``schema_change: evolve``): the driver re-opens the
    source, and the decoder it builds then takes the schema into its union.
    ``schema_id`` is the writer's registry id (kept as an attribute, so that
    it survives the trip back from a Spark task)."""

    schema_id: int = 0
    #: which decoder of the output met it (``key`` or ``value``)
    part: str = "value"
    #: the output's index (set by the data plane)
    output: int = -1


class ShapeSeen(Reopen):
    """A record was written under an upstream shape that the output's
    description lacks and that upstream no longer shows (a Postgres relation
    message naming a column, a name or a type the output's column history
    never saw: two changes of a column's shape, the records written between
    them read only after both). The driver re-opens the source and first
    hands ``shape`` to it (:meth:`~reclock.contracts.source.Source.shape_seen`), so that
    the describe of the re-open takes it in. Like :class:`SchemaChanged`'s,
    the attributes survive the trip back from a Spark task."""

    #: the output's index
    output: int = -1
    #: the shape, in the source's own (picklable) form
    shape: object = None


# -- classifying what the driver meets ---------------------------------------------------------

#: errno values a retry cannot fix (permissions, a read-only or missing place, a
#: name too long); others (a full disk, an interrupted call, a network error)
#: may pass.
_DEFINITE_ERRNO = frozenset({
    1, 2, 13, 20, 21, 30, 36})  # EPERM ENOENT EACCES ENOTDIR EISDIR EROFS ENAMETOOLONG


#: SQLite's primary result codes for a damaged database file: SQLITE_CORRUPT
#: (a malformed image) and SQLITE_NOTADB (not a database)
SQLITE_DAMAGE = frozenset({11, 26})


def sqlite_damaged(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``sqlite3`` error saying the database file is
    damaged (:data:`SQLITE_DAMAGE`), not busy, locked, full or unreadable
    for a reason outside the file."""
    code = getattr(exc, "sqlite_errorcode", None)
    return (type(exc).__module__ == "sqlite3" and isinstance(code, int)
            and code & 0xFF in SQLITE_DAMAGE)


#: In the message of an exception a Spark task raises to fail its job on
#: purpose (a reclock error would be returned as the task's result while the
#: job goes on): a one-shot load cancelled by ``reclock load``. The job's
#: failure (PySpark's ``PythonException``, holding the message) is transient.
TASK_STOPPED = "[task stopped on purpose]"


def classify(exc: BaseException) -> ReclockError:
    """``exc`` as a :class:`TransientError` or :class:`DefiniteError`.

    reclock's own errors say which they are. Errors that the libraries raise
    past reclock's own handling are classified by what they are:

    * OS errors: definite for permissions, read-only or missing places;
      transient otherwise (a full disk, a network error);
    * psycopg: connection and server-shutdown errors (``OperationalError``)
      are transient, data, integrity and programming errors definite;
    * confluent-kafka: ``KafkaException`` by its error's own flags (fatal or
      not retriable: definite);
    * SQLAlchemy's pool timeout (every connection of the remap store's pool
      busy): transient;
    * a Spark job that failed (``Py4JJavaError``, a lost executor; a task
      that stopped it on purpose: :data:`TASK_STOPPED`) and ``MemoryError``,
      ``TimeoutError``, ``ConnectionError``: transient;
    * ``pyarrow.ArrowInvalid``/``ArrowTypeError``: definite (the data);
    * ``sqlite3`` (the key state's files): a damaged file (SQLITE_CORRUPT, a
      malformed image; SQLITE_NOTADB) is definite, since reading it again
      fails the same way (the driver rebuilds key state that meets it:
      :class:`~reclock.runtime.keystate.KeyStateDamaged`); a busy or
      locked file, an I/O error or a full disk (``OperationalError``)
      transient.

    Anything else is a bug: it is treated as transient (a retry costs nothing
    and loses nothing) and the caller logs it as unclassified with its
    traceback. :func:`classified` says whether this table knew ``exc``.
    """
    if isinstance(exc, ReclockError):
        return exc
    kind = _kind(exc)
    cls = DefiniteError if kind == "definite" else TransientError
    err = cls(f"{type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def classified(exc: BaseException) -> bool:
    """Whether :func:`classify` knows ``exc`` (reclock's own, or a library
    error the table above names)."""
    return isinstance(exc, ReclockError) or _kind(exc) is not None


def _kind(exc: BaseException) -> str | None:
    mod = type(exc).__module__ or ""
    names = {c.__name__ for c in type(exc).__mro__}
    if mod.startswith("psycopg"):
        if names & {"OperationalError", "InterfaceError"}:
            return "transient"
        if names & {"DataError", "IntegrityError", "ProgrammingError", "NotSupportedError"}:
            return "definite"
        return "transient" if "DatabaseError" in names else None
    if mod.startswith("cimpl") or mod.startswith("confluent_kafka"):
        err = exc.args[0] if exc.args else None
        fatal = getattr(err, "fatal", None)
        retriable = getattr(err, "retriable", None)
        if callable(fatal) and fatal():
            return "definite"
        code = getattr(err, "code", None)
        if callable(retriable) and not retriable() and callable(code):
            return "transient" if code() < 0 else "definite"  # negative: client-side
        return "transient"
    if mod.startswith("sqlalchemy") and "TimeoutError" in names:
        return "transient"  # every pooled connection busy for the pool's timeout
    if "Py4JJavaError" in names or "Py4JNetworkError" in names or mod.startswith("py4j"):
        return "transient"
    if "PythonException" in names and TASK_STOPPED in str(exc):
        return "transient"  # a task that failed its job on purpose (TASK_STOPPED)
    if names & {"ArrowInvalid", "ArrowTypeError", "ArrowNotImplementedError"}:
        return "definite"
    if mod == "sqlite3":
        if sqlite_damaged(exc):
            return "definite"
        return "transient" if "OperationalError" in names else None
    if isinstance(exc, MemoryError | TimeoutError | ConnectionError | InterruptedError):
        return "transient"
    if isinstance(exc, OSError):
        return "definite" if exc.errno in _DEFINITE_ERRNO else "transient"
    return None
