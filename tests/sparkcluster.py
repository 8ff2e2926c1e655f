"""A real Spark standalone cluster on this machine: one master and one worker
started from the installed PySpark's ``spark-class``, as ``compose.yaml``
starts them, on free ports. Executors run in their own JVMs (launched by the
worker) with their own Python workers."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pyspark

SPARK_HOME = Path(pyspark.__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SparkCluster:
    """``start()``; ``master`` is the ``spark://`` URL; ``executor_pids()``;
    ``stop()``."""

    def __init__(self, cores: int = 2, memory: str = "2g") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="reclock-spark-"))
        self.port, self.ui = _free_port(), _free_port()
        self.worker_ui = _free_port()
        self.cores, self.memory = cores, memory
        self.master = f"spark://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOG_DIR": str(self.dir),
               "SPARK_WORKER_DIR": str(self.dir / "work"), "SPARK_LOCAL_IP": "127.0.0.1",
               "SPARK_CONF_DIR": str(Path(__file__).parents[1] / "reclock" / "conf")}
        log = (self.dir / f"{name}.log").open("wb")
        p = subprocess.Popen([str(SPARK_HOME / "bin" / "spark-class"), *args], env=env,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def start(self) -> SparkCluster:
        self._spawn("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(self.port), "--webui-port", str(self.ui)])
        self._wait(f"http://127.0.0.1:{self.ui}/json/", "ALIVE")
        self._spawn("worker", ["org.apache.spark.deploy.worker.Worker", self.master,
                               "--cores", str(self.cores), "--memory", self.memory,
                               "--webui-port", str(self.worker_ui), "--host", "127.0.0.1",
                               "--work-dir", str(self.dir / "work")])
        self._wait(f"http://127.0.0.1:{self.ui}/json/", '"state" : "ALIVE"', workers=True)
        return self

    def _wait(self, url: str, needle: str, workers: bool = False, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    text = r.read().decode()
                if needle in text and (not workers or '"workers" : [ ]' not in text):
                    return
            except OSError:
                pass
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"spark process exited: see {self.dir}")
            time.sleep(0.3)
        raise RuntimeError(f"spark cluster did not come up: see {self.dir}")

    def executor_pids(self) -> list[int]:
        """PIDs of the executor JVMs the worker launched."""
        out = subprocess.run(["pgrep", "-f", "CoarseGrainedExecutorBackend"],
                             capture_output=True, text=True)
        worker = self.procs[1].pid if len(self.procs) > 1 else -1
        return [p for p in (int(x) for x in out.stdout.split()) if _ppid(p) == worker]

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        for pid in self.executor_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[1])
