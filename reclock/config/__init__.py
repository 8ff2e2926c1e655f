"""Pipeline configuration (see :mod:`reclock.config.schema`).

Two rooms here: :mod:`~reclock.config.loader` (YAML, ``${VAR}``, errors
mapped back to lines) and :mod:`~reclock.config.schema` (the pipeline
schema, assembled from the models of the plug-ins the registry found). What
every model shares, the pipeline's and the plug-ins', is
:mod:`reclock.contracts.config`.

The names are served from here lazily, so that the commands that only read a
pipeline's state (``reclock status``: :func:`reclock.config.loader.quick_view`)
import neither the schema nor, with it, every plug-in. Besides the schema's
names, ``reclock.config.<Model>`` is the configuration model of a plug-in by
its class name (``reclock.config.FileSinkConfig``), as the registry found it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reclock.config.loader import LineLoader as LineLoader
    from reclock.config.loader import format_path as format_path
    from reclock.config.loader import parse_model as parse_model
    from reclock.config.schema import *  # noqa: F403
    from reclock.contracts.config import COLUMN_TYPES as COLUMN_TYPES
    from reclock.contracts.config import NAME_PATTERN as NAME_PATTERN
    from reclock.contracts.config import ConfigError as ConfigError
    from reclock.contracts.config import ConfigIssue as ConfigIssue
    from reclock.contracts.config import ConfigModel as ConfigModel
    from reclock.contracts.config import DurationMs as DurationMs
    from reclock.contracts.config import check_column_type as check_column_type
    from reclock.contracts.config import config_secrets as config_secrets
    from reclock.contracts.config import redact_secrets as redact_secrets
    from reclock.contracts.config import redacted_dump as redacted_dump
    from reclock.contracts.source import ConnectorConfig as ConnectorConfig

#: Names served from the modules that define them.
_HOMES = {
    "reclock.config.loader": ("LineLoader", "format_path", "parse_model"),
    "reclock.contracts.config": (
        "COLUMN_TYPES", "NAME_PATTERN", "ConfigError", "ConfigIssue", "ConfigModel",
        "DurationMs", "check_column_type", "config_secrets", "redact_secrets", "redacted_dump"),
    "reclock.contracts.source": ("ConnectorConfig",),
}
#: The name the configuration base had before it was public.
_ALIASES = {"_Model": "ConfigModel"}


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    name = _ALIASES.get(name, name)
    for module, names in _HOMES.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    schema = importlib.import_module("reclock.config.schema")
    if name in schema.__all__:
        return getattr(schema, name)
    from reclock.registry import registry

    found = registry().config_classes().get(name)
    if found is None:
        raise AttributeError(f"module 'reclock.config' has no attribute {name!r}")
    return found
