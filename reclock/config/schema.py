"""Pipeline configuration: one YAML file, typed and checked at the edge.

::

    pipeline.yaml --(LineLoader: values + the line of every key and value,
         |            duplicate keys)
         v
    plain data --(${VAR} / ${VAR:-default} substitution, $$ = literal $)
         |
         v
    PipelineConfig.model_validate --(pydantic errors mapped back to key paths
         |                           and lines; every problem reported at once)
         v
    PipelineConfig (frozen; paths absolute; file sink paths and per-source
                    timestamp intervals filled in)

Every problem becomes one line of a :class:`ConfigError`::

    pipeline.yaml:12:5: sources[0].outputs[1].sink: unknown key 'pth' (expected one of: path, type)

Secrets never appear in a message: messages are built from the error kind, the
key path and what was expected, never from the offending value (so a
:class:`~pydantic.SecretStr` field cannot leak). Every DSN and URL is checked
strictly where it is written (:func:`~reclock.core.urls.check_url`: a password
with reserved characters must be percent-encoded). The fields that hold
secrets say so (:class:`~reclock.core.secrets.Secret`), and a validated
configuration hands their values to the process's scrubber, which every text
leaving the process goes through (:mod:`reclock.core.secrets`).

The schema is assembled from the plug-ins the registry found
(:mod:`reclock.registry`): one optional connector block of
:class:`SourceConfig` per connector, and the members of :data:`FormatConfig`,
:data:`EnvelopeConfig` and :data:`SinkConfig`, each a plug-in's model
discriminated on its ``type``. Adding any of them is a module of its own and
an entry point: nothing here changes.
"""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, cast, get_args

from pydantic import (
    BeforeValidator,
    Field,
    PrivateAttr,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails

from reclock.config.loader import DEFAULT_STATE_DIR, absolute_path, drop_marker, parse_model
from reclock.contracts.config import (
    DEFAULT_INTERVAL_MS,
    ConfigError,
    ConfigIssue,
    ConfigModel,
    DurationMs,
    KeyPath,
    Name,
    duplicate_names,
    get_key,
    problem,
    shorthand,
    state_key_problem,
)
from reclock.contracts.envelope import Envelope, EnvelopeModel
from reclock.contracts.remap_store import PATH_SCHEME
from reclock.contracts.sink import SinkConfigBase
from reclock.contracts.source import ConnectorConfig
from reclock.core.urls import URL_SECRET
from reclock.registry import PluginError, registry
from reclock.runtime.settings import (
    DEFAULT_MAX_RETRY_BACKOFF_MS,
    HousekeepingConfig,
    SparkConfig,
)

#: The plug-ins this schema is made of (:mod:`reclock.registry`).
_FOUND = registry()


def _sink_target(sink: Any) -> tuple[type[SinkConfigBase], tuple[str, ...]] | None:
    """The sink kind of a raw sink entry and what it writes to, comparable
    across outputs; ``None`` for sinks whose target is derived from the
    output's own name (each sink kind says, :meth:`SinkConfigBase.target_of`)."""
    kind = _sink_kind(sink)
    if kind is None:
        return None
    target = kind.target_of(sink)
    return None if target is None else (kind, target)


def _sink_kind(sink: Any) -> type[SinkConfigBase] | None:
    """The config model of a raw sink entry's ``type`` (None: not a mapping,
    or a type no sink answers to)."""
    if not isinstance(sink, Mapping) or not isinstance(sink.get("type"), str):
        return None
    plugin = _FOUND.sinks.get(sink["type"])
    return None if plugin is None else plugin.config


def raw_sinks(output: Any) -> list[tuple[KeyPath, Any, str | None]]:
    """The raw sink entries of a raw output: ``(key path within the output,
    entry, its name)``; the name is ``None`` for the one sink of ``sink:``
    (named by its output alone), else the entry's ``name`` or, by default,
    its ``type`` (a string entry is its type)."""
    one = get_key(output, "sink")
    if one is not None:
        return [(("sink",), one, None)]
    many = get_key(output, "sinks")
    if not isinstance(many, Sequence) or isinstance(many, str):
        return []
    found: list[tuple[KeyPath, Any, str | None]] = []
    for k, entry in enumerate(many):
        name = entry if isinstance(entry, str) else get_key(entry, "name") or get_key(
            entry, "type")
        found.append((("sinks", k), entry, name if isinstance(name, str) else None))
    return found


def _shared_targets(sources: Any) -> list[InitErrorDetails]:
    """One problem per sink that writes where an earlier sink (of this output
    or another) does: their rows would mix, and each would read back the
    other's."""
    if not isinstance(sources, Sequence) or isinstance(sources, str):
        return []
    first: dict[tuple[str, ...], tuple[KeyPath, str]] = {}
    out: list[InitErrorDetails] = []
    for i, src in enumerate(sources):
        outputs = get_key(src, "outputs")
        if not isinstance(outputs, Sequence) or isinstance(outputs, str):
            continue
        for j, o in enumerate(outputs):
            for at, sink, name in raw_sinks(o):
                found = _sink_target(sink)
                if found is None:
                    continue
                kind, target = found
                here: KeyPath = ("sources", i, "outputs", j, *at)
                label = f"output {get_key(src, 'name')}.{get_key(o, 'name')}"
                if name is not None:
                    label = f"sink {name!r} of {label}"
                if target in first:
                    loc, other = first[target]
                    what = kind.TARGET
                    out.append(problem(
                        here, f"{label} writes the same {what} as {other} "
                        f"({target[-1]!r}): their rows would mix; give each sink its own "
                        f"{what}", also=loc))
                else:
                    first[target] = (here, label)
    return out


def _state_key_problems(data: Mapping[str, Any], raw_records: bool) -> list[InitErrorDetails]:
    """One problem per output whose sink is a state table that the output's
    upstream key does not bound (:func:`~reclock.contracts.config.state_key_problem`),
    where the file alone decides it: an envelope with a key, or raw records
    (``raw_records``: the source's one connector says its outputs carry them,
    :attr:`~reclock.contracts.source.ConnectorConfig.RAW_RECORDS`) read with
    an append-only envelope. (Typed rows describe their key themselves:
    checked when the source describes its outputs,
    :func:`reclock.runtime.shapes.check_state_key`.)"""
    outputs = data.get("outputs")
    if not isinstance(outputs, Sequence) or isinstance(outputs, str):
        return []
    out: list[InitErrorDetails] = []
    for j, o in enumerate(outputs):
        for at, sink, _ in raw_sinks(o):
            out += _state_key_problem(("outputs", j, *at), o, sink, raw_records)
    return out


def _state_key_problem(here: KeyPath, o: Any, sink: Any, raw_records: bool
                       ) -> list[InitErrorDetails]:
    """:func:`_state_key_problems` for the sink ``sink`` of the raw output ``o``."""
    kind = _sink_kind(sink)
    state_key = None if kind is None else kind.state_key_of(sink)
    if kind is None or not state_key:
        return []
    env = get_key(o, "envelope")
    env_type = env if isinstance(env, str) else (
        env.get("type") if isinstance(env, Mapping) else None)
    envelope = _envelope_kind(env_type)
    if envelope is None:
        return []  # a type no envelope answers to: its own error
    rename = get_key(o, "rename")
    renamed = rename if isinstance(rename, Mapping) else {}
    key = envelope.key_of(env) if isinstance(env, Mapping) else None
    if key:
        upstream: list[str] | None = [str(renamed.get(k, k)) for k in key]
        origin = f"the {env_type} envelope's key"
    elif raw_records and envelope.APPEND_ONLY:
        upstream, origin = None, (f"envelope {envelope.model_fields['type'].default}: "
                                  "every record is an insertion, and none retracts an "
                                  "earlier one")
    else:
        return []  # typed rows (their key is the source's), or a keyless keyed envelope
    why = state_key_problem(state_key, upstream, origin)
    return [] if why is None else [problem((*here, str(sink.get("type")), "key"), why)]


def _envelope_kind(env_type: Any) -> type[EnvelopeModel] | None:
    """The model of the envelope ``env_type`` names (``None``: the default)."""
    plugin = _FOUND.envelopes.get(DEFAULT_ENVELOPE if env_type is None else str(env_type))
    return None if plugin is None else plugin.config


# ---------------------------------------------------------------------------
# Formats, envelopes, sinks: discriminated unions of the plug-ins found
# ---------------------------------------------------------------------------

#: What an output decodes with, and how its rows become updates, when it does
#: not say: one JSON document per record, each an insertion.
DEFAULT_FORMAT = "json"
DEFAULT_ENVELOPE = "none"


def _union(what: str, members: Sequence[type[ConfigModel]]) -> Any:
    """The members as a union discriminated on ``type``, where a string is
    short for ``{type: <string>}``."""
    return Annotated[
        Union[tuple(members)],  # noqa: UP007 (a union built at run time)
        Field(discriminator="type"),
        BeforeValidator(shorthand(what, members)),
    ]


def _default(point: Any, name: str) -> Any:
    """The model of the plug-in ``name`` of ``point``: a default of the schema."""
    plugin = point.get(name)
    if plugin is None:
        raise PluginError(f"no plug-in {name!r} in {point.group}: the schema's default is "
                          "missing", hint="reinstall reclock (pip install -e . in a checkout)")
    return plugin.config


if TYPE_CHECKING:
    #: A record format, discriminated on ``type``; the string ``json`` is
    #: short for ``{type: json}``.
    FormatConfig = ConfigModel
    #: How rows become updates, discriminated on ``type``; ``none`` /
    #: ``debezium`` strings allowed.
    EnvelopeConfig = Envelope
    #: Where an output goes, discriminated on ``type``; ``delta`` / ``file`` /
    #: ``console`` strings allowed.
    SinkConfig = SinkConfigBase
else:
    FormatConfig = _union("format", [p.config for p in _FOUND.formats.plugins()])
    EnvelopeConfig = _union("envelope", [p.config for p in _FOUND.envelopes.plugins()])
    SinkConfig = _union("sink", [p.config for p in _FOUND.sinks.plugins()])

_DEFAULT_FORMAT = _default(_FOUND.formats, DEFAULT_FORMAT)
_DEFAULT_ENVELOPE = _default(_FOUND.envelopes, DEFAULT_ENVELOPE)


# ---------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------


class OutputConfig(ConfigModel):
    """One output of a source: how its records decode and where they go."""

    name: Name
    """Output name, unique within the source (for ``orders`` generators:
    ``customers`` or ``orders``)."""
    format: FormatConfig = Field(default_factory=_DEFAULT_FORMAT)
    """How record values decode (``json``, ``text``, ``bytes``, ``csv``,
    ``avro``, or a format of another installed package); a type name or a
    mapping with ``type``. Ignored for sources that emit typed rows
    (``orders`` generators)."""
    key_format: FormatConfig | None = None
    """How record keys decode, same forms as ``format``; unset: keys are kept
    as raw bytes."""
    envelope: EnvelopeConfig = Field(default_factory=_DEFAULT_ENVELOPE)
    """``none`` (append), ``{type: upsert, key: [cols]}`` or ``debezium``."""
    sink: SinkConfig | None = None
    """Where the output is made durable: ``delta`` (alias ``file``),
    ``console`` or a mapping with ``type``. Exactly one of ``sink`` and
    ``sinks``."""
    sinks: tuple[SinkConfig, ...] | None = Field(default=None, min_length=1, max_length=64)
    """Several sinks, each made durable on its own (its own upper, commits and
    status; the source resumes from the least of them): a list of sinks as
    for ``sink``, each with an optional ``name`` (default: its type; needed
    where two share a type), unique within the output."""
    rename: dict[str, str] = Field(default_factory=dict, max_length=10_000)
    """Columns renamed on their way into the output, ``{upstream name: output
    name}``: for upstream fields that an output cannot hold as they are named
    (two that differ only in case, or one that clashes with reclock's own
    ``_``-columns). Envelope keys name the upstream fields; the sink's
    settings (a state table's ``key``, ``key_columns``) name output columns."""
    schema_change: Literal["evolve", "freeze", "fail"] = "evolve"
    """What happens when upstream changes shape (a registry subject's new
    version, a column added, dropped, renamed or retyped in a CDC table).
    ``evolve``: the output gains new columns (nullable) and widens types
    (int -> long), in the same commit as the first rows that need it.
    ``freeze``: the output keeps today's columns; values of new columns are
    dropped, counted (``reclock_output_dropped_values_total``) and named in
    the progress log. ``fail``: any change stalls the source with a definite
    error naming it. A change no type can hold (a narrowing of the output, a
    type that cannot widen, a new required field without a default) is a
    definite error under every policy. See docs/schema-changes.md."""

    @property
    def named_sinks(self) -> tuple[tuple[str, SinkConfigBase], ...]:
        """``(name, sink)`` of each sink: the one of ``sink:`` is named by its
        type, those of ``sinks:`` by their ``name`` (default: their type)."""
        if self.sinks is None:
            assert self.sink is not None, "a validated output has a sink"
            return ((str(self.sink.type), self.sink),)  # type: ignore[attr-defined]
        return tuple((s.name or str(s.type), s) for s in self.sinks)  # type: ignore[attr-defined]

    def slot(self, sink: str) -> str:
        """The name the state of the sink ``sink`` is kept under (commit
        ledger, key state, the sink's own progress record, a default path):
        the output's name for the one sink of ``sink:`` (as before
        ``sinks:`` existed, so that such outputs resume unchanged), else
        ``<output>.<sink>``."""
        return self.name if self.sinks is None else f"{self.name}.{sink}"

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        given = [k for k in ("sink", "sinks") if data.get(k) is not None]
        if len(given) != 1:
            if given:
                return [problem(("sinks",), "give either sink (the output's one sink) or "
                                "sinks (a list of sinks), not both", on_key=True)]
            return [problem((), "missing required key 'sink' (or 'sinks': a list of sinks)")]
        if given == ["sink"]:
            if isinstance(data["sink"], Mapping) and "name" in data["sink"]:
                return [problem(("sink", "name"), "a sink is named in a list of sinks only "
                                "(sinks: [...]); the one sink of sink: is named by its output",
                                on_key=True)]
            return []
        out: list[InitErrorDetails] = []
        first: dict[str, int] = {}
        for (at, entry, name) in raw_sinks(data):
            if name is None:
                continue
            k = int(at[1])
            named = isinstance(entry, Mapping) and entry.get("name") is not None
            if name in first:
                why = (f"duplicate sink name {name!r}" if named else
                       f"two sinks named {name!r} (a sink is named by its type unless it "
                       "says otherwise): give each a name (name: ...)")
                out.append(problem(("sinks", k) + (("name",) if named else ()), why,
                                   also=("sinks", first[name])))
            else:
                first[name] = k
        return out


class SourceFields(ConfigModel):
    """One upstream system and its outputs: exactly one connector block, one
    optional field per connector found (:class:`SourceConfig` adds them)."""

    name: Name
    """Source name, unique in the pipeline (letters, digits, ``_``, ``-``;
    starts with a letter; at most 63 characters)."""
    timestamp_interval: DurationMs | None = None
    """Overrides the pipeline's ``timestamp_interval`` for this source; after
    loading it always holds the effective value."""
    outputs: tuple[OutputConfig, ...] = Field(min_length=1)
    """The source's outputs (at least one; names unique within the source)."""

    @classmethod
    def connector_keys(cls) -> tuple[str, ...]:
        """The keys of the connector blocks, e.g. ``("generator", ...)``."""
        keys = _CONNECTOR_KEYS.get(cls)
        if keys is None:  # fields are fixed per class: asked per source, twice
            keys = tuple(k for k, f in cls.model_fields.items() if _connector_of(f.annotation))
            _CONNECTOR_KEYS[cls] = keys
        return keys

    @classmethod
    def connector_class(cls, key: str) -> type[ConnectorConfig] | None:
        """The model of the connector block ``key``."""
        f = cls.model_fields.get(key)
        return None if f is None else _connector_of(f.annotation)

    @property
    def connector(self) -> tuple[str, ConnectorConfig]:
        """``(key, block)`` of the one connector block, e.g. ``("generator", cfg)``."""
        for key in self.connector_keys():
            block = getattr(self, key)
            if block is not None:
                return key, cast("ConnectorConfig", block)
        raise AssertionError("a validated SourceConfig has one connector")

    @property
    def interval_ms(self) -> int:
        """The effective timestamp interval in milliseconds."""
        return self.timestamp_interval or DEFAULT_INTERVAL_MS

    def output(self, name: str) -> OutputConfig:
        """The output called ``name`` (KeyError if there is none)."""
        for o in self.outputs:
            if o.name == name:
                return o
        raise KeyError(name)

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        keys = cls.connector_keys()
        given = [k for k in keys if data.get(k) is not None]
        out = duplicate_names(data.get("outputs"), "outputs", "output")
        if not given:
            expected = ", ".join(keys)
            out.append(problem((), f"missing connector block (expected one of: {expected})"))
        elif len(given) > 1:
            out.append(problem((given[1],), f"only one connector block allowed, found: "
                                            f"{', '.join(given)}"))
        connector = cls.connector_class(given[0]) if len(given) == 1 else None
        raw = connector is not None and connector.RAW_RECORDS
        outputs = data.get("outputs")
        block = data.get(given[0]) if len(given) == 1 else None
        if (connector is not None and isinstance(block, Mapping) and not out
                and isinstance(outputs, Sequence) and not isinstance(outputs, str)):
            names = [n for o in outputs if isinstance(n := get_key(o, "name"), str)]
            wrong = connector.output_problem(block, names)
            if wrong is not None:
                why, fix = wrong
                out.append(problem(("outputs",), f"source {data.get('name')!r}: {why}; {fix}"))
        return out + _state_key_problems(data, raw)


_CONNECTOR_KEYS: dict[type, tuple[str, ...]] = {}


def _connector_of(annotation: Any) -> type[ConnectorConfig] | None:
    return next((a for a in get_args(annotation)
                 if isinstance(a, type) and issubclass(a, ConnectorConfig)), None)


if TYPE_CHECKING:
    SourceConfig = SourceFields
else:
    #: A source: :class:`SourceFields` with one optional block per connector
    #: found (``kafka: {...}``), in the connectors' order.
    SourceConfig = create_model(
        "SourceConfig", __base__=SourceFields, __module__=__name__,
        __doc__="One upstream system and its outputs. Exactly one connector block.",
        **{p.name: (p.config | None, None) for p in _FOUND.sources.plugins()},
    )


# ---------------------------------------------------------------------------
# Spark and the pipeline
# ---------------------------------------------------------------------------


class HttpConfig(ConfigModel):
    """The operator's HTTP endpoint, served by ``reclock run`` while it runs:
    ``/metrics`` (Prometheus), ``/status.json``, ``/history.json`` and ``/``
    (a status page with charts). Its address is written into ``status.json``
    as ``http``."""

    host: str = Field(default="127.0.0.1", min_length=1)
    """The address to listen on: ``127.0.0.1`` (this machine only, the
    default) or ``0.0.0.0`` (every interface; the endpoint has no
    authentication)."""
    port: int = Field(default=9464, ge=0, le=65535)
    """The TCP port (default 9464); ``0`` picks a free one (see ``status.json``)."""
    max_connections: int = Field(default=32, ge=1, le=1024)
    """Connections served at once; one more is answered ``503`` at once and
    closed, so that slow or stuck clients cannot pile up threads."""
    ready_max_lag: DurationMs = Field(default=60_000, ge=1000)
    """``/readyz`` answers 503 while an output lags more than this (or has
    committed nothing yet), or a source is not running or finished."""
    request_timeout: DurationMs = Field(default=5000, ge=100, le=600_000)
    """How long a connection may take to send its request and to take the
    answer; a client slower than that is disconnected."""


def _local_dir(value: Any) -> Any:
    """``state_dir`` is a directory of this machine: a URI such as
    ``s3://bucket/state`` would otherwise become a local ``s3:`` directory."""
    if isinstance(value, str) and "://" in value:
        raise ValueError(
            "state_dir must be a local directory (it holds the driver's lock, its status "
            "and, by default, the SQLite bindings); put outputs on object storage with the "
            "file sink's path (s3://...) and share the bindings through a PostgreSQL "
            "remap_store")
    return value


class PipelineConfig(ConfigModel):
    """A pipeline: its sources, their outputs, and where reclock keeps state.

    Any string value may use ``${VAR}`` or ``${VAR:-default}`` (``$$`` is a
    literal ``$``). Top-level keys starting with ``x-`` are ignored, so they
    can hold YAML anchors (``x-sink: &sink {type: file}``, then ``sink: *sink``).
    """

    state_dir: Annotated[Path, BeforeValidator(_local_dir)] = DEFAULT_STATE_DIR
    """Where reclock keeps its state (remap store, outputs, logs). Relative
    paths resolve against the YAML file's directory. A local directory: it
    holds the driver's lock file; outputs may live on ``s3://`` and the
    bindings in a PostgreSQL ``remap_store``."""
    remap_store: Annotated[str | None, URL_SECRET] = None
    """URL of the remap store that holds the bindings: ``sqlite:///path`` or
    ``postgresql://user:password@host/db`` (the password percent-encoded
    where it holds reserved characters). Default:
    ``sqlite:///<state_dir>/remap.db``. The password is never printed."""
    timestamp_interval: DurationMs = DEFAULT_INTERVAL_MS
    """How often bindings are minted (``1s``, ``500ms``, ``2m`` or an int in ms)."""
    spark: SparkConfig = Field(default_factory=SparkConfig)
    """The Spark session settings."""
    progress_log: bool = True
    """Log every frontier change as JSON lines to ``<state_dir>/progress.jsonl``."""
    max_retry_backoff: DurationMs = Field(default=DEFAULT_MAX_RETRY_BACKOFF_MS, ge=500,
                                         le=3600 * 1000)
    """A stalled source retries after 0.5 s, doubling each failure up to this
    (``30s``): lower it to recover sooner from long outages, raise it to
    press a struggling upstream less."""
    housekeeping: HousekeepingConfig = Field(default_factory=HousekeepingConfig)
    """Periodic clean-up: ``{vacuum_every: 1m, orphan_grace: 5m}``."""
    http: HttpConfig | None = None
    """Serve metrics and a status page over HTTP while running, e.g.
    ``http: {host: 127.0.0.1, port: 9464}`` (``http: {}`` for the defaults).
    Default: off."""
    sources: tuple[SourceConfig, ...] = Field(min_length=1)
    """The sources (at least one; names unique)."""
    _fingerprint: str | None = PrivateAttr(default=None)

    @property
    def fingerprint(self) -> str | None:
        """The validated document's fingerprint (``loader.fingerprint``;
        None when built otherwise than from YAML)."""
        return self._fingerprint

    @property
    def remap_store_url(self) -> str:
        """The remap store URL, with the default applied."""
        return self.remap_store or f"{PATH_SCHEME}:///{self.state_dir / 'remap.db'}"

    @property
    def progress_log_path(self) -> Path | None:
        """Where the progress log goes, or None when it is off."""
        return self.state_dir / "progress.jsonl" if self.progress_log else None

    def drop_marker(self, source: str) -> Path:
        """The file ``reclock drop`` makes for ``source``."""
        return drop_marker(self.state_dir, source)

    def source(self, name: str) -> SourceConfig:
        """The source called ``name`` (KeyError if there is none)."""
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(name)

    @field_validator("remap_store")
    @classmethod
    def _remap_scheme(cls, url: str | None) -> str | None:
        if url is None or "://" not in url:
            return url
        head = url.split("://", 1)[0]
        scheme = head.split("+", 1)[0].lower()
        store = _FOUND.remap_store_for(url)
        if store is None:
            shown = f" {scheme!r}" if re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", head) else ""
            examples = [e for p in _FOUND.remap_stores.plugins() for e in p.examples]
            raise ValueError(
                f"unsupported remap store URL scheme{shown} (expected {' or '.join(examples)})")
        return store.check(url)

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        return (duplicate_names(data.get("sources"), "sources", "source")
                + _shared_targets(data.get("sources")))

    @model_validator(mode="after")
    def _resolve(self, info: ValidationInfo) -> PipelineConfig:
        """Make paths absolute (against the YAML file's directory, passed as
        context ``base_dir``; else the working directory), fill in default file
        sink paths and each source's effective timestamp interval."""
        ctx = info.context if isinstance(info.context, Mapping) else {}
        base = Path(ctx.get("base_dir") or Path.cwd())
        state_dir = absolute_path(self.state_dir, base)
        sources = tuple(
            s.model_copy(update={
                "timestamp_interval": s.timestamp_interval or self.timestamp_interval,
                "outputs": tuple(_resolve_output(o, s.name, state_dir, base) for o in s.outputs),
            })
            for s in self.sources
        )
        # The instance is being built by this very validation: setting fields
        # here is initialisation, not mutation of a frozen value.
        object.__setattr__(self, "state_dir", state_dir)
        object.__setattr__(self, "sources", sources)
        if self.remap_store is not None:
            object.__setattr__(self, "remap_store", _resolve_store(self.remap_store, base))
        return self


def _resolve_output(o: OutputConfig, source: str, state_dir: Path, base: Path) -> OutputConfig:
    if o.sinks is None:
        assert o.sink is not None
        sink = o.sink.resolved(state_dir / "outputs" / source / o.name, base)
        return o if sink is o.sink else o.model_copy(update={"sink": sink})
    sinks = tuple(s.resolved(state_dir / "outputs" / source / o.slot(name), base)
                  for name, s in o.named_sinks)
    return o.model_copy(update={"sinks": sinks})


def _resolve_store(url: str, base: Path) -> str:
    """A bare path is a file (``sqlite:///`` the path made absolute against
    ``base``); a URL is as its store resolves it."""
    if "://" not in url:
        return f"{PATH_SCHEME}:///{absolute_path(Path(url), base)}"
    store = _FOUND.remap_store_for(url)
    return url if store is None else store.resolve(url, base)


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> PipelineConfig:
    """Load and validate the pipeline file at ``path``. Relative paths in it
    resolve against its directory. Raises :class:`ConfigError`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError([ConfigIssue(None, None, None, f"cannot read file: {reason}",
                                       str(path))]) from None
    return parse_config(text, str(path), base_dir=Path(os.path.abspath(p.parent)), env=env)


def parse_config(
    text: str,
    filename: str = "<string>",
    base_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> PipelineConfig:
    """Validate pipeline YAML ``text``; ``filename`` is used in messages and
    relative paths resolve against ``base_dir`` (default: the working
    directory). ``env`` defaults to ``os.environ``. Raises :class:`ConfigError`
    listing every problem, ordered by line."""
    with gc_paused():
        return parse_model(PipelineConfig, text, filename, base_dir, env)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cycle collector off while the block allocates and makes no
    cycles to reclaim; as it was again after. Parsing the configuration of a
    thousand sources spent half its time in collections, which scan every
    object the process holds (a driver holds Spark's, pandas' and more)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


__all__ = [
    "DEFAULT_ENVELOPE",
    "DEFAULT_FORMAT",
    "EnvelopeConfig",
    "FormatConfig",
    "HousekeepingConfig",
    "HttpConfig",
    "OutputConfig",
    "PipelineConfig",
    "SinkConfig",
    "SourceConfig",
    "SourceFields",
    "SparkConfig",
    "gc_paused",
    "load_config",
    "parse_config",
]
