"""moto's server with AWS Glue's optimistic lock on ``UpdateTable``, which
moto (5.2.5) lacks.

AWS Glue's ``UpdateTable`` takes a ``VersionId``, "the version ID at which
to update the table contents": when the table is at another version, the
update is refused with ``ConcurrentModificationException``. Iceberg's Glue
catalogs commit with it (pyiceberg's ``GlueCatalog`` sends the version it
read the table at, and turns the refusal into ``CommitFailedException``).
moto 5.2.5 ignores ``VersionId`` and applies every update
(``moto/glue/responses.py``, ``GlueResponse.update_table``), so two
writers that read one version both commit and the later overwrites the
earlier (tests/sinks/test_iceberg.py shows it). Run as ``python -m
tests.gluelock -H 127.0.0.1 -p PORT``, this module adds the check, and
nothing else, under one lock with the update (the server answers requests
in threads); everything else is moto's own. Each refusal is one line on
stderr (:meth:`GlueLockServer.refusals` counts them). Importing the module
changes nothing: the patch is made in the server's process only.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any


def _install() -> None:
    from moto.core.exceptions import JsonRESTError
    from moto.glue.responses import GlueResponse

    lock = threading.Lock()
    original = GlueResponse.update_table

    def update_table(self: Any) -> Any:
        version = self.parameters.get("VersionId")
        with lock:
            if version is not None:
                table = self.glue_backend.get_table(self.parameters.get("DatabaseName"),
                                                    self.parameters["TableInput"]["Name"])
                current = str(table._current_version)
                if current != str(version):
                    print(f"gluelock: UpdateTable refused at version {version} (table at "
                          f"{current})", file=sys.stderr, flush=True)
                    raise JsonRESTError(
                        "ConcurrentModificationException",
                        f"Update table failed due to concurrent modifications: the table is "
                        f"at version {current}, not {version}")
            return original(self)

    GlueResponse.update_table = update_table  # type: ignore[method-assign]


class GlueLockServer:
    """This server on a free loopback port (``endpoint``)."""

    def __init__(self, log: Path) -> None:
        from tests.s3server import _free_port, _wait_port

        self.port = _free_port()
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.gluelock", "-H", "127.0.0.1", "-p",
                 str(self.port)], stdout=subprocess.DEVNULL, stderr=err)
        _wait_port(self.port, self.proc)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def refusals(self) -> int:
        """How many updates it refused so far."""
        return self.log.read_text().count("gluelock: UpdateTable refused")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    from moto.server import main

    _install()
    main()
