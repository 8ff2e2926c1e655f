"""What ``reclock run`` does to reach its first durable data sooner: Spark's
JVM started while the file is checked (reclock.runtime.spark.EarlySession),
used only if the validated configuration asks the same session; and Spark's
Python workers started, with the pipeline's modules imported, before the
first source's job (warm_workers). Each in a process of its own: the test
process's session is shared by the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from reclock.config.loader import spark_view

_SCRIPT = textwrap.dedent("""
    import json, sys
    from reclock.runtime.spark import EarlySession, spark_session, warm_workers

    early = EarlySession("local[2]", "asked-early", {"spark.sql.shuffle.partitions": "3"})
    # the validated configuration asks another session: the early one is stopped
    assert early.take("local[2]", "validated", {"spark.sql.shuffle.partitions": "3"}) is None
    s = spark_session("local[2]", "validated", {"spark.sql.shuffle.partitions": "3"})
    again = EarlySession("local[2]", "validated", {"spark.sql.shuffle.partitions": "3"})
    same = again.take("local[2]", "validated", {"spark.sql.shuffle.partitions": "3"})
    warm_workers(s, ["reclock.runtime.cds"]).wait()
    sc = s.sparkContext
    seen = sc.parallelize(range(4), 2).map(
        lambda _: "reclock.runtime.cds" in sys.modules).collect()
    print(json.dumps({"app": sc.appName, "same": same is s,
                      "shuffle": s.conf.get("spark.sql.shuffle.partitions"), "warm": seen}))
    s.stop()
""")


def test_an_early_session_is_used_only_as_configured_and_workers_start_warm() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RECLOCK_WARM_WORKERS"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"app": "validated", "same": True, "shuffle": "3",
                   "warm": [True, True, True, True]}


def test_the_spark_block_is_read_as_the_validated_configuration_reads_it(
        tmp_path: Path) -> None:
    from reclock.config import load_config

    path = tmp_path / "p.yaml"
    path.write_text(textwrap.dedent("""
        spark:
          master: ${MASTER:-local[2]}
          conf: {spark.sql.shuffle.partitions: 4, spark.sql.adaptive.enabled: false}
        sources:
          - name: counter
            generator: {kind: counter, rate: 10}
            outputs: [{name: counter, format: {type: json, schema: {n: int64}}, sink: console}]
    """))
    cfg = load_config(path, env={})
    assert spark_view(path, env={}) == (cfg.spark.master, cfg.spark.app_name, cfg.spark.conf)
    assert spark_view(path, env={"MASTER": "spark://h:7077"})[0] == "spark://h:7077"  # type: ignore[index]
    path.write_text("spark: [not, a, block]\n")
    assert spark_view(path) is None
