"""The plug-ins of this installation: found through entry points, never
imported by name.

Five plug points, one entry point group each; an entry point names the one
value a plug-in's module declares itself with::

    group                 value (reclock.contracts.)   selects
    reclock.sources       source.SourcePlugin          a source's connector block (kafka: ...)
    reclock.sinks         sink.SinkPlugin              an output's sink (type: delta)
    reclock.formats       decode.FormatPlugin          an output's format and key_format
    reclock.envelopes     envelope.EnvelopePlugin      an output's envelope
    reclock.remap_stores  remap_store.RemapStorePlugin the remap_store URL (by its scheme)

A distribution declares them in its metadata (``pyproject.toml``)::

    [project.entry-points."reclock.sinks"]
    jsonl = "my_sink:PLUGIN"

reclock's own plug-ins are declared the same way, so a checkout must be
installed (``pip install -e .``) for them to be found; without them the
registry refuses to start rather than offering a pipeline without formats or
sinks. Two plug-ins of one point that answer to one name (or alias) are
refused, naming both distributions: which one a pipeline gets must not depend
on the order in which Python finds them.

The configuration schema (:mod:`reclock.config.schema`) is built from what is
found here, and so are the decoders (:func:`make_decoder`), the envelopes
sources choose (:func:`envelope_for`) and the remap store
(:func:`open_store`). Order: by name, reclock's own first among equal names
(refused anyway); connectors by their ``rank`` first.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Generic, TypeVar, cast, get_args

from reclock.contracts.config import ConfigModel
from reclock.contracts.decode import Decoder, DecoderOptions, FormatError, FormatPlugin
from reclock.contracts.envelope import Envelope, EnvelopePlugin
from reclock.contracts.remap_store import PATH_SCHEME, RemapStore, RemapStorePlugin
from reclock.contracts.sink import SinkPlugin
from reclock.contracts.source import SourcePlugin
from reclock.core.errors import DefiniteError

P = TypeVar("P", SourcePlugin, SinkPlugin, FormatPlugin, EnvelopePlugin, RemapStorePlugin)

#: The distribution whose plug-ins must be there.
OWN = "reclock"

#: Each plug point's entry point group and the type of value it names.
GROUPS: dict[str, type[Any]] = {
    "reclock.sources": SourcePlugin,
    "reclock.sinks": SinkPlugin,
    "reclock.formats": FormatPlugin,
    "reclock.envelopes": EnvelopePlugin,
    "reclock.remap_stores": RemapStorePlugin,
}


class PluginError(DefiniteError):
    """The installed plug-ins cannot make a registry: one fails to load, does
    not declare what its group expects, or answers to a name another one
    has; or reclock's own are not installed."""


@dataclass(frozen=True)
class Declaration:
    """One entry point of a plug-in group: ``name = "target"`` (``module:attr``),
    declared by the distribution ``dist``."""

    group: str
    name: str
    target: str
    dist: str

    def load(self) -> object:
        """The value the entry point names (its module imported)."""
        module, _, attr = self.target.partition(":")
        try:
            value: object = importlib.import_module(module.strip())
            for part in filter(None, attr.strip().split(".")):
                value = getattr(value, part)
        except Exception as exc:
            raise PluginError(
                f"{self}: cannot load {self.target!r}: {type(exc).__name__}: {exc}",
                hint=f"fix or uninstall the distribution {self.dist!r}") from exc
        return value

    def __str__(self) -> str:
        return f"plug-in {self.name!r} of {self.group} (distribution {self.dist!r})"


def installed() -> list[Declaration]:
    """Every entry point of the plug-in groups that the installed
    distributions declare (:mod:`importlib.metadata`)."""
    out: list[Declaration] = []
    for group in GROUPS:
        for ep in metadata.entry_points(group=group):
            dist = ep.dist.metadata["Name"] if ep.dist is not None else "?"
            out.append(Declaration(group, ep.name, ep.value, str(dist)))
    return out


@dataclass(frozen=True)
class Found(Generic[P]):
    """A loaded plug-in and the distribution that declared it."""

    plugin: P
    dist: str


class PlugPoint(Generic[P]):
    """The plug-ins of one group, by name and alias."""

    def __init__(self, group: str, found: Sequence[Found[P]]) -> None:
        self.group = group
        self.found: tuple[Found[P], ...] = tuple(found)
        self._by: dict[str, Found[P]] = {}
        for f in self.found:
            for n in _answers_to(f.plugin):
                other = self._by.get(n)
                if other is not None:
                    raise PluginError(
                        f"two plug-ins of {group} answer to {n!r}: {_label(other)} and "
                        f"{_label(f)}",
                        hint="uninstall one of the two distributions (or rename its plug-in)")
                self._by[n] = f

    def plugins(self) -> tuple[P, ...]:
        """Every plug-in, in registry order."""
        return tuple(f.plugin for f in self.found)

    def names(self) -> tuple[str, ...]:
        """Every plug-in's name, in registry order."""
        return tuple(f.plugin.name for f in self.found)

    def get(self, name: str) -> P | None:
        """The plug-in that answers to ``name`` (its name or an alias)."""
        f = self._by.get(name)
        return None if f is None else f.plugin

    def dist_of(self, name: str) -> str | None:
        """The distribution that declared the plug-in answering to ``name``."""
        f = self._by.get(name)
        return None if f is None else f.dist


def _answers_to(p: Any) -> tuple[str, ...]:
    return (p.name, *getattr(p, "aliases", ()))


def _label(f: Found[Any]) -> str:
    return f"{f.plugin.name!r} of distribution {f.dist!r}"


def _type_tags(config: type[ConfigModel]) -> tuple[str, ...] | None:
    field = config.model_fields.get("type")
    return None if field is None else tuple(str(a) for a in get_args(field.annotation))


def _check(d: Declaration, value: object) -> None:
    """Refuse a declaration whose value is not what its group expects."""
    kind = GROUPS[d.group]
    if not isinstance(value, kind):
        raise PluginError(f"{d}: {d.target!r} is a {type(value).__name__}, not a "
                          f"{kind.__name__}", hint=f"point the entry point at the module's "
                          f"{kind.__name__} (e.g. its PLUGIN)")
    name = getattr(value, "name", None)
    if name != d.name:
        raise PluginError(f"{d}: the entry point is named {d.name!r}, its plug-in {name!r}",
                          hint="name the entry point as the plug-in")
    config = getattr(value, "config", None)
    if isinstance(value, SourcePlugin | RemapStorePlugin) or config is None:
        return
    tags = _type_tags(config)
    wanted = _answers_to(value)
    if tags is None or set(tags) != set(wanted):
        raise PluginError(
            f"{d}: its config {config.__name__} must have a field type: Literal"
            f"{list(wanted)} (it has {list(tags or [])})",
            hint="the type literal selects the plug-in: list its name and aliases")


@dataclass(frozen=True)
class Registry:
    """Every plug point's plug-ins."""

    sources: PlugPoint[SourcePlugin]
    sinks: PlugPoint[SinkPlugin]
    formats: PlugPoint[FormatPlugin]
    envelopes: PlugPoint[EnvelopePlugin]
    remap_stores: PlugPoint[RemapStorePlugin]

    def config_classes(self) -> dict[str, type[ConfigModel]]:
        """Every plug-in's configuration model, by class name."""
        out: dict[str, type[ConfigModel]] = {}
        for point in (self.sources, self.sinks, self.formats, self.envelopes):
            for p in point.plugins():
                out[p.config.__name__] = p.config
        return out

    def remap_store_for(self, url: str) -> RemapStorePlugin | None:
        """The store that claims ``url``'s scheme (a bare path: :data:`PATH_SCHEME`)."""
        scheme = url.split("://", 1)[0].split("+", 1)[0].lower() if "://" in url else PATH_SCHEME
        return next((p for p in self.remap_stores.plugins() if scheme in p.schemes), None)


def build(declarations: Iterable[Declaration]) -> Registry:
    """The registry of ``declarations`` (each loaded and checked)."""
    decls = list(declarations)
    missing = [g for g in GROUPS if not any(d.group == g and d.dist == OWN for d in decls)]
    if missing:
        raise PluginError(
            f"reclock's own plug-ins are not registered (no entry points of distribution "
            f"{OWN!r} in {', '.join(missing)}): this copy of reclock was never installed, or "
            "was installed before its plug-ins were declared as entry points",
            hint="install it: pip install -e . in the checkout (or pip install reclock)")
    found: dict[str, list[Found[Any]]] = {g: [] for g in GROUPS}
    for d in decls:
        value = d.load()
        _check(d, value)
        found[d.group].append(Found(value, d.dist))
    for group in found.values():
        group.sort(key=lambda f: (getattr(f.plugin, "rank", 0), f.dist != OWN, f.plugin.name,
                                  f.dist))
    schemes: dict[str, Found[Any]] = {}
    for f in found["reclock.remap_stores"]:
        for s in f.plugin.schemes:
            if s in schemes:
                raise PluginError(
                    f"two remap stores claim the URL scheme {s!r}: "
                    f"{_label(schemes[s])} and {_label(f)}",
                    hint="uninstall one of the two distributions")
            schemes[s] = f
    return Registry(
        sources=PlugPoint("reclock.sources", found["reclock.sources"]),
        sinks=PlugPoint("reclock.sinks", found["reclock.sinks"]),
        formats=PlugPoint("reclock.formats", found["reclock.formats"]),
        envelopes=PlugPoint("reclock.envelopes", found["reclock.envelopes"]),
        remap_stores=PlugPoint("reclock.remap_stores", found["reclock.remap_stores"]),
    )


@functools.cache
def registry() -> Registry:
    """The registry of the installed plug-ins (built once per process)."""
    return build(installed())


# ---------------------------------------------------------------------------
# What the pipeline builds through it
# ---------------------------------------------------------------------------


def make_decoder(spec: Mapping[str, Any], *, allow_null: bool = False,
                 policy: str = "evolve", known: Mapping[str, Any] | None = None,
                 seen: Sequence[int] = (), part: str = "value") -> Decoder:
    """Build the decoder a format spec describes (driver side; checks the spec):
    the format plug-in named by its ``type`` builds it (see
    :class:`~reclock.contracts.decode.DecoderOptions` for the rest)."""
    formats = registry().formats
    names = ", ".join(formats.names())
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise FormatError(f"format spec needs a 'type' ({names}), got {spec!r}")
    kind = spec["type"]
    plugin = formats.get(kind) if isinstance(kind, str) else None
    if plugin is None:
        raise FormatError(f"unknown format type {kind!r}; expected one of {names}")
    extra = sorted(set(spec) - plugin.keys)
    if extra:
        raise FormatError(f"{kind} format: unknown keys {extra}; allowed: {sorted(plugin.keys)}")
    return plugin.decoder(spec, DecoderOptions(allow_null=allow_null, policy=policy,
                                               known=known, seen=seen, part=part))


def envelope_for(name: str, key: tuple[str, ...] = ()) -> Envelope:
    """The envelope a source chose for its typed rows (``OutputSpec.envelope``),
    keyed by ``key`` where it has a key."""
    plugin = registry().envelopes.get(name)
    if plugin is None:
        known = sorted(registry().envelopes.names())
        raise ValueError(f"unknown envelope {name!r}; one of {known}")
    cls = plugin.config
    envelope = cls.model_validate({"key": tuple(key)} if key and "key" in cls.model_fields
                                  else {})
    return cast("Envelope", envelope)


def default_envelope() -> Envelope:
    """The envelope of an output that names none: ``none`` (append)."""
    return envelope_for("none")


def open_store(url: str) -> RemapStore:
    """Open the remap store at ``url`` (the store that claims its scheme)."""
    plugin = registry().remap_store_for(url)
    if plugin is None:
        schemes = sorted(s for p in registry().remap_stores.plugins() for s in p.schemes)
        raise DefiniteError(f"no remap store claims the URL scheme of {url.split('://')[0]!r}",
                            hint=f"use one of: {', '.join(schemes)}")
    return plugin.open(url)
