"""Pipeline configuration (see :mod:`reclock.config.schema`).

Three rooms: :mod:`~reclock.config.base` (what every model shares: the model
base, durations, names, redaction, located issues), :mod:`~reclock.config.loader`
(YAML, ``${VAR}``, errors mapped back to lines) and
:mod:`~reclock.config.schema` (the pipeline schema, assembled from the models
that connectors and sinks define in their own modules).

The schema's names are served from here lazily: a connector's module imports
``reclock.config.base`` and the schema imports the connector's module, so
loading the schema when this package is first imported would be a circle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reclock.config.schema import *  # noqa: F403


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    schema = importlib.import_module("reclock.config.schema")
    try:
        return getattr(schema, name)
    except AttributeError:
        raise AttributeError(f"module 'reclock.config' has no attribute {name!r}") from None
