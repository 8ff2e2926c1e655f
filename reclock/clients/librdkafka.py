"""Where the librdkafka shared library of the installed confluent-kafka lives.

The confluent-kafka wheel vendors librdkafka next to its package
(``confluent_kafka.libs/librdkafka-<hash>.so.1`` on Linux, ``.dylibs`` on
macOS). Two parts of reclock use it directly: the native Kafka range reader
(``reclock.sources._kafka_native``) and the development broker (``reclock.devkafka``).
Both then run the very library the rest of reclock's Kafka clients run.
"""

from __future__ import annotations

import ctypes.util
import glob
from pathlib import Path

import confluent_kafka


def library_path() -> str:
    """The path of the librdkafka that confluent-kafka loads."""
    base = Path(confluent_kafka.__file__).resolve().parent
    candidates = sorted(glob.glob(str(base.parent / "confluent_kafka.libs" / "librdkafka*.so*")))
    candidates += sorted(glob.glob(str(base / ".dylibs" / "librdkafka*.dylib")))
    if candidates:
        return candidates[0]
    # A confluent-kafka built from source links the system's librdkafka.
    found = ctypes.util.find_library("rdkafka")
    if found:
        return found
    raise RuntimeError(f"librdkafka not found next to {base} nor on the library path")
