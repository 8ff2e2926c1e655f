"""One-shot loads (``reclock load``): CSV, JSON-lines and Parquet files from a
local path or glob, S3 or HTTP(S), into an output at one IntoTime, once."""

from reclock.sources.oneshot.source import OneShotConfig, OneShotReader, OneShotSource

__all__ = ["OneShotConfig", "OneShotReader", "OneShotSource"]
