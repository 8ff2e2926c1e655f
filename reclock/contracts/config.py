"""The configuration base: what every configuration model shares, the
pipeline's own and every plug-in's.

Issues and :class:`ConfigError` (every problem located by file, line and key
path), secrets (fields marked with :class:`~reclock.core.secrets.Secret`:
:func:`config_secrets` collects their values, :func:`redacted_dump` shows
them masked), durations, sizes, names, and :class:`ConfigModel`, the base of
every model (unknown keys are errors, values frozen, cross-field checks in
:meth:`ConfigModel.check_raw`, each reported with :func:`problem`). A
plug-in defines its models on this base, in its own module (connectors:
:class:`~reclock.contracts.source.ConnectorConfig`, sinks:
:class:`~reclock.contracts.sink.SinkConfigBase`); the pipeline schema
(:mod:`reclock.config.schema`) assembles the ones the registry found.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeAlias, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import InitErrorDetails, PydanticCustomError

from reclock.core.errors import DefiniteError
from reclock.core.secrets import MASK, Secret, scrub

# A key path into the YAML document: mapping keys and sequence indexes.
KeyPath: TypeAlias = tuple[str | int, ...]

#: Names of sources and outputs.
NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,62}$"
#: Column type names accepted in ``schema`` / ``types`` mappings.
COLUMN_TYPES = (
    "int32", "int64", "float64", "bool", "string", "binary", "timestamp", "date",
    "decimal(p,s)", "json",
)
DEFAULT_INTERVAL_MS = 1000


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a configuration file.

    ``line`` and ``column`` are 1-based (``None`` when the file could not be
    read at all); ``path`` is the key path, e.g. ``sources[0].outputs[1].sink``
    (``""`` for the top level, ``None`` when the file is not valid YAML).
    """

    line: int | None
    column: int | None
    path: str | None
    message: str
    file: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}:{self.column}"
        if self.path is None:
            return f"{where}: {self.message}"
        return f"{where}: {self.path or '(top level)'}: {self.message}"


class ConfigError(DefiniteError):
    """A pipeline configuration is invalid: one line per problem, ordered by line.

    ``issues`` holds the problems as :class:`ConfigIssue` values.
    """

    def __init__(self, issues: Sequence[ConfigIssue]) -> None:
        self.issues = tuple(sorted(set(issues), key=_issue_order))
        super().__init__("\n".join(str(i) for i in self.issues))


def _issue_order(i: ConfigIssue) -> tuple[int, int, str, str]:
    return (i.line or 0, i.column or 0, i.path or "", i.message)


def redact_secrets(text: str) -> str:
    """``text`` scrubbed of every secret the process knows (the loaded
    configurations' secrets) and of what looks like one (``scheme://user:***@host``,
    ``password=***``): :func:`reclock.core.secrets.scrub`."""
    return scrub(text)


# ---------------------------------------------------------------------------
# Shared validators and types
# ---------------------------------------------------------------------------


def parse_duration(value: Any) -> int:
    """``"1s"``, ``"500ms"``, ``"2m"``, ``"1h"``, ``"7d"`` or an int (milliseconds) -> ms > 0."""
    expected = (
        "expected a positive duration such as '1s', '500ms', '2m' "
        "or an integer number of milliseconds"
    )
    if isinstance(value, bool):
        raise ValueError(expected)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        ms = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*", value)
        if not m:
            raise ValueError(expected)
        scale = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}[m[2] or "ms"]
        exact = float(m[1]) * scale
        if not exact.is_integer():
            raise ValueError(f"{expected} (not a whole number of milliseconds)")
        ms = int(exact)
    else:
        raise ValueError(expected)
    if ms <= 0:
        raise ValueError(expected)
    if ms > MAX_DURATION_MS:
        raise ValueError(f"{expected}, at most 30 days")
    return ms


#: The longest duration any setting takes (intervals, timeouts, grace periods).
MAX_DURATION_MS = 30 * 24 * 3600 * 1000


#: A duration in milliseconds; YAML may say ``1s``, ``500ms``, ``2m``, ``1h``, ``7d`` or an
#: int (ms).
DurationMs = Annotated[int, BeforeValidator(parse_duration)]

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(value: Any) -> int:
    """``"128MiB"``, ``"64MB"``, ``"512KiB"``, ``"1GiB"`` or an int (bytes) -> int bytes > 0.
    ``KiB``/``MiB``/``GiB`` are powers of 1024, ``KB``/``MB``/``GB`` of 1000 (case
    does not matter)."""
    expected = "expected a positive size such as '128MiB', '64MB', '512KiB' or a number of bytes"
    if isinstance(value, bool):
        raise ValueError(expected)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        scale = _SIZE_UNITS.get(m[2].lower()) if m else None
        if m is None or scale is None:
            raise ValueError(expected)
        exact = float(m[1]) * scale
        if not exact.is_integer():
            raise ValueError(f"{expected} (not a whole number of bytes)")
        size = int(exact)
    else:
        raise ValueError(expected)
    if size <= 0:
        raise ValueError(expected)
    return size


#: A size in bytes; YAML may say ``128MiB``, ``64MB``, ``512KiB`` or an int (bytes).
ByteSize = Annotated[int, BeforeValidator(parse_size)]

_DECIMAL = re.compile(r"decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)")


def check_column_type(name: str) -> str:
    """Validate a column type name (see :data:`COLUMN_TYPES`) and normalize it
    (lower case, ``decimal(p,s)`` without spaces). ``1 <= p <= 38``, ``0 <= s <= p``."""
    norm = name.strip().lower()
    m = _DECIMAL.fullmatch(norm)
    if m:
        p, s = int(m[1]), int(m[2])
        if not (1 <= p <= 38 and 0 <= s <= p):
            raise ValueError("decimal(p,s) needs 1 <= p <= 38 and 0 <= s <= p")
        return f"decimal({p},{s})"
    if norm in COLUMN_TYPES and norm != "decimal(p,s)":
        return norm
    raise ValueError(f"unknown column type (expected one of: {', '.join(COLUMN_TYPES)})")


ColumnType = Annotated[str, AfterValidator(check_column_type)]
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
#: The characters Kafka allows in a topic name.
KAFKA_TOPIC_PATTERN = r"^[A-Za-z0-9._-]+$"
#: The characters PostgreSQL allows in a replication slot name.
SLOT_PATTERN = r"^[a-z0-9_]{1,63}$"


def type_tags(members: Sequence[type[BaseModel]]) -> list[str]:
    """The ``type`` tags of a discriminated union's members, sorted."""
    out: list[str] = []
    for m in members:
        out.extend(str(a) for a in get_args(m.model_fields["type"].annotation))
    return sorted(out)


def shorthand(what: str, members: Sequence[type[BaseModel]]) -> Callable[[Any], Any]:
    """A before-validator accepting ``"json"`` for ``{type: json}``."""
    tags = ", ".join(type_tags(members))

    def expand(value: Any) -> Any:
        if isinstance(value, str):
            return {"type": value}
        if isinstance(value, Mapping | BaseModel):
            return value
        raise ValueError(f"expected a {what} type ({tags}) or a mapping with key 'type'")

    return expand


def get_key(item: Any, key: str) -> Any:
    """``item[key]`` for raw mappings, ``item.key`` for models, else None."""
    if isinstance(item, Mapping):
        return item.get(key)
    if isinstance(item, BaseModel):
        return getattr(item, key, None)
    return None


def problem(
    loc: KeyPath, message: str, also: KeyPath | None = None, on_key: bool = False
) -> InitErrorDetails:
    """A cross-field problem found by :meth:`ConfigModel.check_raw`, at ``loc`` (relative
    to the model being validated); ``also`` points at a second, related place;
    ``on_key``: the problem is the key itself, not its value."""
    ctx: dict[str, Any] = {"message": message, "at": loc, "on_key": on_key}
    if also is not None:
        ctx["also"] = also
    return {
        "type": PydanticCustomError("reclock_config", "{message}", ctx),
        "loc": loc,
        "input": None,
    }


def duplicate_names(items: Any, where: str, what: str) -> list[InitErrorDetails]:
    """One problem per repeated ``name`` in the sequence ``items``."""
    if not isinstance(items, Sequence) or isinstance(items, str):
        return []
    first: dict[str, int] = {}
    out: list[InitErrorDetails] = []
    for i, item in enumerate(items):
        name = get_key(item, "name")
        if not isinstance(name, str):
            continue
        if name in first:
            out.append(problem((where, i, "name"), f"duplicate {what} name {name!r}",
                                also=(where, first[name], "name")))
        else:
            first[name] = i
    return out


class ConfigModel(BaseModel):
    """Base of every configuration model: unknown keys are errors, values are
    frozen, and ``model_dump()`` uses the YAML key names. (Field docstrings
    document the code only: pydantic's ``use_attribute_docstrings`` read the
    source of every model at import, 0.23 s of each command's start.)

    Cross-field checks live in :meth:`check_raw`, which sees the *raw* input, so
    they are reported together with every field error instead of only once
    all fields are valid.
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        serialize_by_alias=True,  # model_dump() speaks YAML: ``schema``, not ``schema_``
    )

    def __repr_args__(self) -> Any:
        # repr() of a configuration may be logged: secrets shown the way
        # redacted_dump shows them.
        fields = type(self).model_fields
        for name, value in super().__repr_args__():
            marker = _secret_of(fields[name]) if name in fields else None
            yield name, marker.shown(value) if marker is not None else _redact_repr(value)

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        """Cross-field problems in the raw input ``data`` (override)."""
        return []

    @model_validator(mode="wrap")
    @classmethod
    def _cross_checks(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        problems = cls.check_raw(data) if isinstance(data, Mapping) else []
        if not problems:
            return handler(data)
        errors: list[InitErrorDetails] = []
        try:
            handler(data)
        except ValidationError as exc:
            for e in exc.errors():
                err: InitErrorDetails = {"type": e["type"], "loc": e["loc"], "input": e["input"]}
                if e["type"] == "reclock_config":
                    err["type"] = PydanticCustomError("reclock_config", "{message}", e["ctx"])
                elif "ctx" in e:
                    err["ctx"] = e["ctx"]
                errors.append(err)
        raise ValidationError.from_exception_data(cls.__name__, errors + problems)


def _secret_of(field: FieldInfo) -> Secret | None:
    """The :class:`~reclock.core.secrets.Secret` marker of a field, if any."""
    return next((m for m in field.metadata if isinstance(m, Secret)), None)


def config_secrets(cfg: BaseModel) -> list[str]:
    """The literal value of every secret ``cfg`` holds, at any depth: fields
    marked with a :class:`~reclock.core.secrets.Secret` (DSN and URL
    passwords, sensitive Kafka properties, Spark's secret settings) and
    :class:`~pydantic.SecretStr` fields (the S3 keys). What the scrubber is
    fed with when a configuration is loaded."""
    out: list[str] = []
    _collect(cfg, None, out)
    return out


def _collect(value: Any, marker: Secret | None, out: list[str]) -> None:
    if marker is not None and value is not None:
        out.extend(str(v) for v in marker.values(value) if v)
    elif isinstance(value, SecretStr):
        out.append(value.get_secret_value())
    elif isinstance(value, BaseModel):
        for name, f in type(value).model_fields.items():
            _collect(getattr(value, name), _secret_of(f), out)
    elif isinstance(value, Mapping):
        for v in value.values():
            _collect(v, None, out)
    elif isinstance(value, list | tuple):
        for v in value:
            _collect(v, None, out)


def redacted_dump(cfg: BaseModel) -> dict[str, Any]:
    """``cfg`` as plain JSON-able data (keys as written in YAML) for display,
    e.g. by ``reclock status``: every secret setting shown masked (its
    :class:`~reclock.core.secrets.Secret` marker says how: ``***`` for a
    URL's password, for a sensitive Kafka property, for a Spark setting Spark
    redacts), :class:`~pydantic.SecretStr` values as ``"***"``, and every
    other string scrubbed of the secrets the process knows."""
    out = _redact(cfg, None)
    assert isinstance(out, dict)
    return out


def _redact_repr(value: Any) -> Any:
    return scrub(value) if isinstance(value, str) else value


def _redact(value: Any, marker: Secret | None) -> Any:
    if marker is not None and value is not None:
        return _redact(marker.shown(value), None)
    if isinstance(value, BaseModel):
        return {
            (f.alias or name): _redact(getattr(value, name), _secret_of(f))
            for name, f in type(value).model_fields.items()
        }
    if isinstance(value, SecretStr):
        return MASK
    if isinstance(value, Mapping):
        return {str(k): _redact(v, None) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact(v, None) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, str):
        return scrub(value)
    return value


#: What to do about an output without an upstream key, read from raw records.
KEYED_ENVELOPE = ("read it with an envelope that has a key ({type: upsert, key: [...]} or "
                  "{type: debezium, key: [...]}) and key the table by it")


def state_key_problem(state_key: Sequence[str], upstream: Sequence[str] | None,
                      origin: str, fix: str = KEYED_ENVELOPE) -> str | None:
    """Why a state table keyed by ``state_key`` cannot hold an output whose
    upstream key is ``upstream`` (``origin`` says where that key comes from,
    or why there is none, and ``fix`` what gives it one); ``None`` when it
    can.

    The rule: the state key must contain the upstream key (an envelope's
    key, or the key a source declares for its typed rows: a CDC table's
    primary key). The output holds one row per upstream key at every
    IntoTime (an upstream key's updates come in its order, and an IntoTime
    holds a prefix of them), hence one row per any key that contains it. A
    key that does not contain it groups rows of several upstream keys, and
    an IntoTime need not hold their updates together: a value moving from
    one upstream key to another can sit in two partitions (or two jobs of
    one binding), so the table would be asked to hold two rows for it, or
    none. An output without an upstream key (``envelope: none`` of raw
    records) promises nothing about any key."""
    state = list(state_key)
    if not upstream:
        return (f"a state table keeps one row per key, and nothing keeps this output at one "
                f"row per {state} ({origin}); {fix}, or keep the update log (mode: log)")
    if set(upstream) <= set(state):
        return None
    better = [*upstream, *(c for c in state if c not in upstream)]
    return (f"a state table's key must contain the output's upstream key {list(upstream)} "
            f"({origin}), and {state} does not: rows of one {state} can belong to several "
            f"upstream keys, whose updates an IntoTime need not hold together (they can sit "
            f"in different partitions, or in different jobs of one binding), so a {state} value "
            f"that moves from one {list(upstream)} to another could leave the table with two "
            f"rows for it or none; key the table by {better}, or keep the update log "
            "(mode: log)")


def table_output_problems(i: int, table: str, output: Any, seen: dict[str, int]
                          ) -> list[InitErrorDetails]:
    """A CDC source's ``tables`` entry ``i``: its output's name (``output``,
    else the table's) must be a usable name, and no other entry's; ``seen``
    (output -> entry) collects the names across the entries."""
    name = output or table
    if output and (not isinstance(name, str) or not re.match(NAME_PATTERN, name)):
        return []  # the field's own validation names it
    if not isinstance(name, str) or not re.match(NAME_PATTERN, name):
        return [problem(("tables", i), f"table {table!r} cannot name its output (letters, "
                         "digits, _ and -, starting with a letter); write it as {table: ..., "
                         "output: a_name}")]
    if name in seen:
        return [problem(("tables", i), f"output {name!r} is fed by two tables (entries "
                         f"{seen[name]} and {i}); give one of them another output: name")]
    seen[name] = i
    return []
