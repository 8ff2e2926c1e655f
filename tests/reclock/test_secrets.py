"""Secrets: which settings hold one (librdkafka's own list, Spark's rule,
reclock's DSNs, URLs and secret fields), DSNs and URLs checked where they are
written, and no secret value in anything the process lets out."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from psycopg.conninfo import conninfo_to_dict

from reclock.config import (
    ConfigError,
    KafkaConfig,
    KafkaSinkConfig,
    config_secrets,
    load_config,
    parse_model,
    redacted_dump,
)
from reclock.core.clock import ManualClock
from reclock.core.secrets import (
    KAFKA_SENSITIVE_PROPERTIES,
    Scrubber,
    ScrubFilter,
    register,
    scrub,
)
from reclock.runtime.health import STALLED, Health
from reclock.runtime.progress_log import ProgressLog
from reclock.sources.kafka import redact_properties
from reclock.sources.mysql.config import parse_url
from tests.running import close_driver, start_driver, wait_exit, wait_for

# The reported password: '#', '/' and '@' in it.
PASSWORD = "S3cr#t/p@ss"
ENCODED = "S3cr%23t%2Fp%40ss"


def write(tmp_path: Path, text: str, name: str = "pipeline.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


# -- which settings are secrets ----------------------------------------------------------


def _redacted_by_librdkafka(props: dict[str, str]) -> set[str]:
    """The properties the installed librdkafka shows as ``[redacted]`` in its
    ``debug=conf`` dump of a client configured with ``props``."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger(f"rdkafka-conf-{id(lines)}")
    logger.addHandler(Keep())
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    p = Producer({"bootstrap.servers": "127.0.0.1:1", "debug": "conf", "logger": logger,
                  **props})
    deadline = time.monotonic() + 10
    while not any(" = [redacted]" in x for x in lines) and time.monotonic() < deadline:
        p.poll(0.1)  # the dump arrives through the log queue
    p.flush(0)
    return {x.split(" = ")[0].split()[-1] for x in lines if x.endswith(" = [redacted]")}


def test_the_kafka_list_is_librdkafkas_own() -> None:
    """Every property of the list (but ``ssl_key``, set only through the C
    API) is one the installed librdkafka redacts itself, and its neighbours
    that merely look secret (a certificate, a client id, a keystore's path)
    are not: the list is librdkafka's, not a guess from names."""
    settable = {p: f"v-{i}-{p}" for i, p in enumerate(sorted(KAFKA_SENSITIVE_PROPERTIES))
                if p != "ssl_key"}
    neighbours = {"ssl.certificate.pem": "CERT", "sasl.oauthbearer.client.id": "cid",
                  "ssl.keystore.location": "/nowhere/ks.p12", "client.id": "c",
                  "sasl.kerberos.keytab": "/nowhere/keytab"}
    assert _redacted_by_librdkafka({**settable, **neighbours}) == set(settable)


def test_repr_of_a_kafka_config_shows_no_sensitive_property() -> None:
    """Reported: ``repr`` of a Kafka config showed ``ssl.key.pem`` and
    ``sasl.oauthbearer.config`` (the name patterns missed them)."""
    props = {"ssl.key.pem": "-----BEGIN PRIVATE KEY-----PEMBODY", "acks": "all",
             "sasl.oauthbearer.config": "principal=alice scope=OAUTHSCOPE",
             "sasl.oauthbearer.client.secret": "CLIENTSECRET", "ssl.ca.pem": "CAPEMBODY"}
    yaml_props = "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in props.items()) + "}"
    source = parse_model(KafkaConfig, f"bootstrap_servers: b:9092\ntopic: t\n"
                                      f"properties: {yaml_props}\n")
    sink = parse_model(KafkaSinkConfig, f"type: kafka\nbootstrap_servers: b:9092\ntopic: t\n"
                                        f"properties: {yaml_props}\n")
    for cfg in (source, sink):
        shown = repr(cfg) + str(cfg) + json.dumps(redacted_dump(cfg))
        for value in ("PEMBODY", "OAUTHSCOPE", "CLIENTSECRET", "CAPEMBODY"):
            assert value not in shown
        assert "'acks': 'all'" in repr(cfg)  # not a secret
    assert redact_properties(props) == {**{k: "***" for k in props}, "acks": "all"}
    assert sorted(config_secrets(source)) == sorted(v for k, v in props.items() if k != "acks")


def test_every_secret_the_configuration_holds_is_known(tmp_path: Path) -> None:
    path = write(tmp_path, f"""
        remap_store: postgresql://reclock:remap-pw-1@db/reclock?sslpassword=remap-ssl-2
        spark:
          conf: {{spark.hadoop.fs.s3a.secret.key: spark-secret-3, spark.executor.memory: 2g}}
        sources:
          - name: pg
            postgres: {{dsn: "host=h user=u password='pg pw 4' dbname=d", tables: [t]}}
            outputs:
              - name: t
                sink: {{type: postgres, dsn: "postgresql://u:{ENCODED}@h/d", table: x}}
          - name: my
            mysql: {{url: "mysql://u:my-pw-5@h/d", tables: [t]}}
            outputs: [{{name: t, sink: file}}]
          - name: k
            kafka:
              bootstrap_servers: b:9092
              topic: t
              properties: {{sasl.password: kafka-pw-6, sasl.username: kafka-user-7}}
            outputs:
              - name: o
                format: {{type: avro, registry_url: "https://u:registry-pw-8@r/", subject: s}}
                sink:
                  type: file
                  path: s3://bkt/o
                  storage: {{access_key_id: AKID, secret_access_key: s3-secret-9}}
        """)
    cfg = load_config(path, env={})
    known = set(config_secrets(cfg))
    for value in ("remap-pw-1", "remap-ssl-2", "spark-secret-3", "pg pw 4", PASSWORD,
                  "my-pw-5", "kafka-pw-6", "kafka-user-7", "registry-pw-8", "s3-secret-9"):
        assert value in known, value
    assert "2g" not in known and "AKID" not in known
    # loading fed them to the process's scrubber
    assert scrub(f"a pg pw 4 b {PASSWORD} c registry-pw-8") == "a *** b *** c ***"


# -- DSNs and URLs checked where they are written ------------------------------------------


BAD_DSN = f"postgresql://app:{PASSWORD}@host/db"  # the reported DSN


@pytest.mark.parametrize(("key", "block"), [
    ("sources[0].outputs[0].sink.dsn", "sink-dsn"),
    ("sources[0].postgres.dsn", "source-dsn"),
    ("sources[0].mysql.url", "mysql-url"),
    ("remap_store", "remap-store"),
    ("sources[0].outputs[0].format.registry_url", "registry-url"),
])
def test_a_password_with_reserved_characters_is_refused_where_it_is_written(
        tmp_path: Path, key: str, block: str) -> None:
    """Reported: a sink DSN whose password holds '#', '/' or '@' passed
    validation, then stalled for good as 'database unreachable' while every
    view printed the password. Every DSN and URL reclock takes is checked at
    load: a located error that quotes no part of it and says to
    percent-encode."""
    scheme = "mysql" if block == "mysql-url" else "http" if block == "registry-url" \
        else "postgresql"
    url = BAD_DSN.replace("postgresql", scheme)
    source = {"mysql-url": f'mysql: {{url: "{url}", tables: [t]}}',
              "source-dsn": f'postgres: {{dsn: "{url}", tables: [t]}}'}.get(
        block, "generator: {kind: counter}")
    fmt = (f'{{type: avro, registry_url: "{url}", subject: s}}' if block == "registry-url"
           else "json")
    sink = (f'{{type: postgres, dsn: "{url}", table: x}}' if block == "sink-dsn" else "file")
    head = f'remap_store: "{url}"\n' if block == "remap-store" else ""
    path = write(tmp_path, head + textwrap.dedent(f"""
        sources:
          - name: s
            {source}
            outputs:
              - name: t
                format: {fmt}
                sink: {sink}
        """).lstrip("\n"))
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    [line] = str(info.value).splitlines()
    lineno = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if url in text)
    column = path.read_text().splitlines()[lineno - 1].index(url)
    assert line.startswith(f"{path}:{lineno}:{column}: {key}: "), line  # (at the quote)
    for piece in (PASSWORD, "S3cr", "p@ss", "#t"):
        assert piece not in line
    assert "percent-encoded" in line and "'@' as %40" in line and "'/' as %2F" in line
    # percent-encoded, the same password is accepted, and reads back whole
    encoded = url.replace(PASSWORD, ENCODED)
    text = path.read_text().replace(url, encoded)
    cfg = load_config(write(tmp_path, text, "encoded.yaml"), env={})
    assert PASSWORD in config_secrets(cfg)


@pytest.mark.parametrize(("dsn", "secret"), [
    ("postgresql://app:Zq@Wx@host/db", "Zq@Wx"),        # two '@'
    ("postgresql://app:91/Qz@host/db", "91/Qz"),        # cut at '/': '@' in the database
    ("postgresql://app:Kj/Vw@host:5432/db", "Kj/Vw"),   # cut at '/': read as a port
    ("postgresql://app:Kj?Vw@host/db", "Kj?Vw"),        # cut at '?'
    ("postgresql://app:Kj Vw@host/db", "Kj Vw"),        # a space
    ("postgresql://app:50%Qff@host/db", "50%Qff"),      # a '%' that is no escape
    ("postgresql://app:pw@host:5432/Dq/Bz", "Dq/Bz"),   # a '/' in the database name
    ("postgres//app:hunter2@host/db", "hunter2"),       # not a URL
    ("host=h port=12ab dbname=d", "12ab"),              # a port that is no number
    ("host=h password=hunter2 x dbname=d", "hunter2"),  # an unquoted space
])
def test_dsns_that_parsers_read_differently_are_refused(dsn: str, secret: str) -> None:
    from reclock.clients.postgres import checked_dsn

    with pytest.raises(ValueError) as info:
        checked_dsn(dsn)
    message = str(info.value)
    assert message.startswith("invalid PostgreSQL DSN: ")
    for piece in {secret, *secret.replace("/", " ").replace("@", " ").split()}:
        if len(piece) > 1:
            assert piece not in message, piece


@pytest.mark.parametrize(("dsn", "password"), [
    (f"postgresql://app:{ENCODED}@h:5432/db", PASSWORD),
    (f"postgres://app:{ENCODED}@h1:5432,h2:5433/db?sslmode=require", PASSWORD),
    ("postgresql://app:pa:ss@[::1]:5432/db", "pa:ss"),
    ("postgresql:///db?host=/var/run/postgresql", None),
    ("host=h user=app password='S3cr#t/p@ss w' dbname=db", "S3cr#t/p@ss w"),
])
def test_well_formed_dsns_are_accepted_and_read_as_libpq_reads_them(
        dsn: str, password: str | None) -> None:
    from reclock.clients.postgres import checked_dsn, dsn_secrets

    assert checked_dsn(dsn) == dsn
    assert conninfo_to_dict(dsn).get("password") == password
    if password:
        assert password in dsn_secrets(dsn)


def test_a_mysql_url_reads_its_password_decoded() -> None:
    got = parse_url(f"mysql://app:{ENCODED}@db:3307/shop")
    assert got == {"host": "db", "port": 3307, "user": "app", "password": PASSWORD,
                   "database": "shop"}
    with pytest.raises(ValueError, match="percent-encoded") as info:
        parse_url("mysql://app:S3cr/t@host/db")
    assert "S3cr" not in str(info.value)


# -- the scrubber -------------------------------------------------------------------------


def test_the_scrubber_removes_every_form_of_a_secret() -> None:
    s = Scrubber()
    s.add([PASSWORD, "ab", None])  # "ab": too short to replace on its own
    for form in (PASSWORD, ENCODED, "S3cr%23t/p%40ss"):
        assert s.scrub(f"x {form} y") == "x *** y"
    assert s.scrub("ab cab") == "ab cab"
    # what looks like a credential is masked even when nobody registered it
    assert s.scrub("see postgresql://u:p@ss@h:5432/db") == "see postgresql://u:***@h:5432/db"
    assert s.scrub("host=h password=hunter2 dbname=d") == "host=h password=*** dbname=d"
    data = {"a": [f"e {PASSWORD}", 1, None], "b": "clean"}
    assert s.scrub_data(data) == {"a": ["e ***", 1, None], "b": "clean"}
    clean = {"b": "clean", "c": [1, "x"]}
    assert s.scrub_data(clean) is clean  # nothing copied when nothing changed
    assert s.scrub_json(clean) is clean
    odd = "pä\"ss\\wörd"  # escaped in JSON text: still found there
    s.add([odd])
    assert s.scrub_json({"e": [f"x {odd}", 2], "p": Path("/p")}) == {"e": ["x ***", 2], "p": "/p"}
    assert s.scrub_json({"e": '"password=hunter2"'}) == {"e": '"password=***"'}


def test_log_records_health_and_progress_events_are_scrubbed(tmp_path: Path) -> None:
    secret = "log-secret-31415"
    register([secret])
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Keep()
    handler.addFilter(ScrubFilter())
    log = logging.getLogger("test-secrets-scrub")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("connect failed: %s", f"password={secret} rejected")
        try:
            raise RuntimeError(f"server said {secret}")
        except RuntimeError:
            log.exception("boom %s", secret)
    finally:
        log.removeHandler(handler)
    assert len(records) == 2 and all(secret not in r for r in records)
    assert "RuntimeError: server said ***" in records[1]

    h = Health(STALLED, f"TransientError: cannot connect as u:{secret}@h", f"try {secret}")
    assert secret not in json.dumps(h.as_dict())
    events = ProgressLog(tmp_path / "progress.jsonl", ManualClock(1))
    events.log("s", "health", status=STALLED, error=f"x {secret}", nested={"e": [secret]})
    events.close()
    assert secret not in (tmp_path / "progress.jsonl").read_text()
    assert secret not in json.dumps(list(events.recent))


# -- end to end: a driver whose sink's password is refused or unreachable -------------------


def _get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return str(resp.read().decode())
    except urllib.error.HTTPError as exc:  # /readyz answers 503 while stalled
        return str(exc.read().decode())


def _pipeline(tmp_path: Path, dsn: str) -> Path:
    return write(tmp_path, f"""
        http: {{port: 0}}
        max_retry_backoff: 1s
        spark: {{master: "local[1]"}}
        sources:
          - name: counter
            generator: {{kind: counter, rate: 5}}
            outputs:
              - name: value
                sink: {{type: postgres, dsn: "{dsn}", table: counted}}
        """)


@pytest.mark.integration
def test_the_reported_dsn_stops_the_driver_at_load_without_printing_it(tmp_path: Path) -> None:
    """Reported: the DSN ``postgresql://app:S3cr#t/p@ss@host/db`` passed
    validation and the driver then printed the whole password every 5 s. Now
    the driver stops before it starts, naming the file and line only."""
    path = _pipeline(tmp_path, f"postgresql://app:{PASSWORD}@127.0.0.1/db")
    proc = start_driver(path)
    try:
        rc = wait_exit(proc, 60)
        err = proc.stderr.read().decode() if proc.stderr else ""
    finally:
        close_driver(proc)
    assert rc == 2, err
    assert f"{path}:9:" in err and "percent-encoded" in err
    for piece in (PASSWORD, "S3cr", "p@ss"):
        assert piece not in err
    assert not (tmp_path / "state").exists()  # nothing started


@pytest.mark.integration
def test_no_view_of_a_stalled_driver_shows_its_sinks_password(tmp_path: Path) -> None:
    """A sink DSN with the password percent-encoded, and a server that cannot
    be reached: the driver stalls, and neither its stderr, its progress log,
    ``status.json``, ``/status.json``, ``/readyz``, ``/history.json`` nor
    ``reclock status`` shows the password in any form."""
    path = _pipeline(tmp_path, f"postgresql://app:{ENCODED}@127.0.0.1:1/db")
    state = tmp_path / "state"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = start_driver(path, env)
    try:
        def stalled() -> dict[str, Any] | None:
            try:
                doc: dict[str, Any] = json.loads((state / "status.json").read_text())
            except (OSError, ValueError):
                return None
            srcs = doc.get("sources") or []
            return doc if srcs and srcs[0]["health"]["status"] == STALLED else None

        wait_for(lambda: stalled() is not None or proc.poll() is not None, timeout=180,
                 what="the source to stall on its unreachable sink")
        doc = stalled()
        assert doc is not None, "the driver exited"
        assert "unreachable" in (doc["sources"][0]["health"]["hint"] or "")
        views = {"status.json": (state / "status.json").read_text()}
        for endpoint in ("/status.json", "/readyz", "/history.json", "/"):
            views[endpoint] = _get(doc["http"] + endpoint)
        assert "stalled" in views["/readyz"]
        for args in (["status", str(path)], ["status", "--json", "--history", "20", str(path)]):
            done = subprocess.run([sys.executable, "-m", "reclock", *args], env=env,
                                  capture_output=True, text=True, timeout=120)
            assert "stalled" in done.stdout, (done.returncode, done.stdout, done.stderr)
            views[" ".join(args[:-1])] = done.stdout + done.stderr
    finally:
        if proc.poll() is None:
            proc.terminate()
        wait_exit(proc, 60)
        views["stderr"] = proc.stderr.read().decode() if proc.stderr else ""
        close_driver(proc)
    views["progress.jsonl"] = (state / "progress.jsonl").read_text()
    assert "cannot connect" in views["stderr"], views["stderr"][-3000:]
    assert "cannot connect" in views["progress.jsonl"]
    for name, text in views.items():
        for form in (PASSWORD, ENCODED, "S3cr"):
            assert form not in text, f"{name} shows {form!r}"
