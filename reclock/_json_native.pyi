"""Types of the C extension reclock/_json_native.c."""

from typing import Any

def parse(offsets: Any, data: Any, fields: tuple[tuple[bytes, int], ...]
          ) -> list[tuple[bytes, bytes, bytes, int]] | None: ...
